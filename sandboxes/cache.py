"""The node-local cache of unpacked layers, shared by every sandbox on the node.

``<root>/layers/<diff_id hex>/`` holds one unpacked layer (read-only to sandboxes: they see it as a
lower layer under their own writable layer). A sandbox holds a shared ``flock`` on each of its
layers' lock files while it runs, so eviction never removes a layer in use, across processes.
The cache keeps its size under ``budget_bytes`` by evicting the least recently used layers that
no sandbox holds; a layer's last use is the modification time of its ``meta.json``. Measuring the
cache reads every layer's ``meta.json``: a process measures a cache once, then adds what it unpacks
to that total and measures again (evicting) only when the total passes the budget. Layers that other
processes unpack are not in its total; each process evicts for what it adds.

A node has one cache, decided here: ``HOME/sandboxes/cache`` (:func:`node_cache`), with the budget
given by ``$POSTTRAIN_SANDBOX_CACHE_GIB``, else :data:`DEFAULT_BUDGET_GIB` (:func:`cache_budget_bytes`);
the ``image_cache`` asset, the eval assets and the sandbox runtimes all open it through these.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from typing import Mapping

from sandboxes.home import default_home
from sandboxes.images import Image, ImageError, ImageStore, Layer, build_images, image_name, unpack_layer


# A cache's bytes as this process last measured them (evict), plus what it has unpacked since.
_usage: dict[Path, int] = {}
_usage_lock = threading.Lock()


def _hex(diff_id: str) -> str:
    return diff_id.split(":", 1)[1]


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + dirnames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass
class Lease:
    """The unpacked layers of one image, held against eviction until :meth:`release`."""

    image: Image
    layer_dirs: list[Path]  # base first
    hits: int
    misses: int
    _fds: list[int]

    @property
    def hit(self) -> bool:
        return self.misses == 0

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


BUDGET_VARIABLE = "POSTTRAIN_SANDBOX_CACHE_GIB"
DEFAULT_BUDGET_GIB = 20.0


def cache_budget_bytes(gib: float | None = None) -> int:
    """The cache's disk budget: ``gib`` GiB when given, else ``$POSTTRAIN_SANDBOX_CACHE_GIB``, else
    :data:`DEFAULT_BUDGET_GIB`."""
    if gib is None:
        gib = float(os.environ.get(BUDGET_VARIABLE) or DEFAULT_BUDGET_GIB)
    return int(gib * 1024**3)


def node_cache_dir(home: str | Path | None = None) -> Path:
    """Where the node's cache of unpacked layers lives: ``HOME/sandboxes/cache`` (``home``, default
    ``$POSTTRAIN_HOME``)."""
    return Path(home if home is not None else default_home()) / "sandboxes" / "cache"


def node_cache(home: str | Path | None = None, budget_gib: float | None = None) -> "LayerCache":
    """The node's :class:`LayerCache` under ``home`` (:func:`node_cache_dir`), its budget from
    :func:`cache_budget_bytes`."""
    return LayerCache(node_cache_dir(home), cache_budget_bytes(budget_gib))


class LayerCache:
    def __init__(self, root: Path | str, budget_bytes: int = int(DEFAULT_BUDGET_GIB * 1024**3)):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        for sub in ("layers", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def layer_dir(self, diff_id: str) -> Path:
        return self.root / "layers" / _hex(diff_id)

    def _lock(self, diff_id: str) -> int:
        fd = os.open(self.root / "locks" / (_hex(diff_id) + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def has(self, layer: Layer) -> bool:
        return (self.layer_dir(layer.diff_id) / "meta.json").exists()

    def acquire(self, image: Image, store: ImageStore) -> Lease:
        """Unpack what is missing, mark every layer used, and hold them until the lease is released."""
        fds, dirs, hits, misses, added = [], [], 0, 0, 0
        try:
            for layer in image.layers:
                fds.append(self._lock(layer.diff_id))
                d = self.layer_dir(layer.diff_id)
                meta = d / "meta.json"
                if meta.exists():
                    hits += 1
                    os.utime(meta)
                else:
                    misses += 1
                    added += self._unpack(layer, store)
                dirs.append(d / "root")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        lease = Lease(image=image, layer_dirs=dirs, hits=hits, misses=misses, _fds=fds)
        if misses and self._over_budget(added):
            self.evict()
        return lease

    def _over_budget(self, added: int) -> bool:
        """Whether the cache may be over budget once ``added`` bytes were unpacked: True when this
        process has not measured it yet, or its total passes the budget (see the module docstring)."""
        with _usage_lock:
            known = _usage.get(self.root)
            if known is None:
                return True
            _usage[self.root] = known + added
            return known + added > self.budget_bytes

    def _unpack(self, layer: Layer, store: ImageStore) -> int:
        """Unpack ``layer`` into the cache; returns the bytes it added (0 where another process
        unpacked it first)."""
        blob = store.blob_path(layer)
        if not blob.exists():
            raise ImageError(f"layer {layer.digest} is not in the store {store.root}")
        tmp = self.root / "tmp" / f"{_hex(layer.diff_id)[:16]}-{uuid.uuid4().hex[:8]}"
        try:
            unpack_layer(blob, layer.compression, tmp / "root")
            size = _tree_bytes(tmp / "root")
            (tmp / "meta.json").write_text(json.dumps({"diff_id": layer.diff_id, "digest": layer.digest,
                                                       "size_bytes": size, "unpacked_at": time.time()}))
            try:
                os.rename(tmp, self.layer_dir(layer.diff_id))
            except OSError:
                if not self.has(layer):  # not a lost race with another process: a real failure
                    raise
                return 0
            return size
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def contents(self) -> list[dict]:
        """Every cached layer with its size and last use, most recent first."""
        out = []
        for d in (self.root / "layers").iterdir():
            meta = d / "meta.json"
            try:
                info = json.loads(meta.read_text())
                info["last_used"] = meta.stat().st_mtime
            except (OSError, ValueError):
                continue
            out.append(info)
        return sorted(out, key=lambda i: -i["last_used"])

    def usage_bytes(self) -> int:
        return sum(i["size_bytes"] for i in self.contents())

    def evict(self, budget_bytes: int | None = None) -> list[str]:
        """Remove least recently used layers no sandbox holds until the cache fits; returns their diff_ids."""
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        entries = self.contents()
        used = sum(i["size_bytes"] for i in entries)
        evicted = []
        for info in reversed(entries):  # least recently used first
            if used <= budget:
                break
            fd = os.open(self.root / "locks" / (_hex(info["diff_id"]) + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a sandbox is using it
                victim = self.root / "tmp" / f"evict-{uuid.uuid4().hex[:8]}"
                os.rename(self.layer_dir(info["diff_id"]), victim)
                shutil.rmtree(victim, ignore_errors=True)
                used -= info["size_bytes"]
                evicted.append(info["diff_id"])
            finally:
                os.close(fd)
        with _usage_lock:
            _usage[self.root] = used
        return evicted


def build_image_cache(repos: Mapping[str, str | Path], store: ImageStore, cache: LayerCache | None = None,
                      compression: str = "zstd") -> dict:
    """Build the image of every task (``task id -> repository folder``) and, with a ``cache``, unpack
    the layers into it (then evict to its budget). Returns the report the ``image_cache`` asset shows:
    counts, sizes, failures by task, and the cache's contents. Writes ``images/index.json``
    (task id -> image name) atomically."""
    names = {task_id: image_name(task_id) for task_id in repos}
    report = build_images({names[t]: p for t, p in repos.items()}, store, compression)
    by_name = {v: k for k, v in names.items()}
    warmed_hits = warmed_misses = 0
    if cache is not None:
        for image in report.images:
            lease = cache.acquire(image, store)
            warmed_hits += lease.hits
            warmed_misses += lease.misses
            lease.release()
        cache.evict()
    index = {by_name[i.name]: i.name for i in report.images}
    tmp = store.root / f".index.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
    os.replace(tmp, store.root / "index.json")
    contents = cache.contents() if cache is not None else []
    largest = sorted(report.images, key=lambda i: -i.size_bytes)[:10]
    return {
        "tasks": len(repos),
        "images": len(report.images),
        "failures": {by_name[n]: why for n, why in report.failures.items()},
        "compression": compression,
        "store_bytes": report.store_bytes,
        "tar_bytes": report.tar_bytes,
        "compression_ratio": round(report.tar_bytes / report.store_bytes, 2) if report.store_bytes else None,
        "distinct_layers": len({l.digest for i in report.images for l in i.layers}),
        "largest_images": [{"task": by_name[i.name], "image": i.name, "size_bytes": i.size_bytes} for i in largest],
        "cache_dir": str(cache.root) if cache is not None else None,
        "cache_budget_bytes": cache.budget_bytes if cache is not None else None,
        "cache_bytes": sum(c["size_bytes"] for c in contents),
        "cached_layers": len(contents),
        "cache_hits_while_warming": warmed_hits,
        "cache_misses_while_warming": warmed_misses,
        "index": str(store.root / "index.json"),
    }
