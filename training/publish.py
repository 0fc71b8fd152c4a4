"""Weight publication: after each step, the new adapter version to every live replica and to the volume.

:class:`AdapterPublisher` sends the adapter to all replicas at once, each over ``streams`` parallel
HTTP requests (the serving side's sharded upload, :func:`serving.adapters.push_adapter`: tensors split
into balanced safetensors shards, ``PUT /lora_shards/...`` then ``POST /commit_lora_adapter``; the
replica assembles, checks and loads the version), and copies it to ``<run>/adapters/<version>/``
(temporary name, then rename) for replicas that join later (they load the newest complete one,
:func:`serving.adapters.newest_adapter`). Versions are named by step (``step_000012``); each replica
keeps the newest ``keep_versions`` and unloads older ones, except those that ``in_use`` names (the
versions of the trainer's groups in flight: an episode between two turns has no request running, and
vLLM unloads an adapter whatever is running) and those the replica refuses to unload while its running
requests use them: rollouts in flight finish on the version they started with, and a version kept so is
unloaded after a later publication.

The replicas are a list of URLs, or a function that returns the live ones at each publication (a
fleet whose members die and are replaced: ``LocalFleet.live_urls``). With a function, a replica that
fails its push and has left the fleet by then is skipped: it is gone, and its replacement loads the
version from the volume.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from serving.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, publish_to_volume, push_adapter
from serving.capture_store import trainer_headers
from serving.client import EngineError, HttpPool


def version_name(step: int) -> str:
    return f"step_{step:06d}"


@dataclass(frozen=True)
class PublishResult:
    version: str
    bytes: int
    replicas: int
    http_s: float
    volume_s: float


class AdapterPublisher:
    def __init__(self, adapters_dir: str | Path | None, replicas: Sequence[str] | Callable[[], Sequence[str]] = (), *,
                 streams: int = 4, keep_versions: int = 3, gone_wait_s: float = 2.0,
                 in_use: Callable[[], set[str]] | None = None) -> None:
        self.adapters_dir = Path(adapters_dir) if adapters_dir is not None else None
        self._live_replicas = replicas if callable(replicas) else None
        self.replicas = [] if callable(replicas) else [u.rstrip("/") for u in replicas]
        self.gone_wait_s = gone_wait_s
        self.streams = streams
        self.keep_versions = keep_versions
        self._in_use = in_use or set
        self._pool = HttpPool()
        self._live: dict[str, list[str]] = {u: [] for u in self.replicas}

    def publish(self, step: int, adapter_dir: str | Path) -> PublishResult:
        adapter_dir = Path(adapter_dir)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            if not (adapter_dir / name).is_file():
                raise FileNotFoundError(f"adapter {adapter_dir}: {name} is missing")
        version = version_name(step)
        started = time.perf_counter()
        if self._live_replicas is not None:
            self.replicas = [u.rstrip("/") for u in self._live_replicas()]
        pushed = self.replicas
        if self.replicas:
            with ThreadPoolExecutor(max_workers=len(self.replicas)) as pool:
                done = list(pool.map(lambda url: self._push_or_gone(url, version, adapter_dir), self.replicas))
            pushed = [url for url, ok in zip(self.replicas, done) if ok]
        http_s = time.perf_counter() - started
        started = time.perf_counter()
        if self.adapters_dir is not None and not (self.adapters_dir / version).exists():
            publish_to_volume(adapter_dir, self.adapters_dir, version)
        volume_s = time.perf_counter() - started
        size = (adapter_dir / ADAPTER_WEIGHTS).stat().st_size
        return PublishResult(version, size, len(pushed), http_s, volume_s)

    def _push_or_gone(self, url: str, version: str, adapter_dir: Path) -> bool:
        """Push; False when the push failed because the replica left a live fleet meanwhile."""
        try:
            self._push(url, version, adapter_dir)
            return True
        except (OSError, RuntimeError):  # RuntimeError: EngineError, a refused shard
            if self._live_replicas is None:
                raise
            deadline = time.monotonic() + self.gone_wait_s  # a killed process is seen dead a moment after its sockets close
            while time.monotonic() < deadline:
                if url not in {u.rstrip("/") for u in self._live_replicas()}:
                    self._live.pop(url, None)
                    return False
                time.sleep(0.05)
            raise

    def _push(self, url: str, version: str, adapter_dir: Path) -> None:
        push_adapter(url, version, adapter_dir, num_shards=self.streams, pool=self._pool)
        live = self._live.setdefault(url, [])
        live.append(version)
        in_use = self._in_use()
        for old in live[:-self.keep_versions] if len(live) > self.keep_versions else []:
            if old in in_use:
                continue  # a group in flight samples it: kept, and tried again after the next version
            try:
                self._pool.json("POST", f"{url}/unload_lora_adapter", {"lora_name": old}, trainer_headers())
            except EngineError:
                continue  # still used by running requests: tried again after the next version
            live.remove(old)
