"""Weight publication: after each step, the new adapter version to every live replica and to the volume.

:class:`AdapterPublisher` sends the adapter to all replicas at once, each over ``streams`` parallel
HTTP requests (the serving side's sharded upload, :func:`serving.adapters.push_adapter`: tensors split
into balanced safetensors shards, ``PUT /lora_shards/...`` then ``POST /commit_lora_adapter``; the
replica assembles, checks and loads the version), and copies it to ``<run>/adapters/<version>/``
(temporary name, then rename) for replicas that join later. Versions are named by step
(``step_000012``); each replica keeps the newest ``keep_versions`` and unloads older ones that no
running request uses (rollouts in flight finish on the version they started with).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from serving.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, newest_adapter, publish_to_volume, push_adapter
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
    def __init__(self, adapters_dir: str | Path | None, replicas: Sequence[str] = (), *, streams: int = 4,
                 keep_versions: int = 3) -> None:
        self.adapters_dir = Path(adapters_dir) if adapters_dir is not None else None
        self.replicas = [u.rstrip("/") for u in replicas]
        self.streams = streams
        self.keep_versions = keep_versions
        self._pool = HttpPool()
        self._live: dict[str, list[str]] = {u: [] for u in self.replicas}

    def publish(self, step: int, adapter_dir: str | Path) -> PublishResult:
        adapter_dir = Path(adapter_dir)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            if not (adapter_dir / name).is_file():
                raise FileNotFoundError(f"adapter {adapter_dir}: {name} is missing")
        version = version_name(step)
        started = time.perf_counter()
        if self.replicas:
            with ThreadPoolExecutor(max_workers=len(self.replicas)) as pool:
                list(pool.map(lambda url: self._push(url, version, adapter_dir), self.replicas))
        http_s = time.perf_counter() - started
        started = time.perf_counter()
        if self.adapters_dir is not None and not (self.adapters_dir / version).exists():
            publish_to_volume(adapter_dir, self.adapters_dir, version)
        volume_s = time.perf_counter() - started
        size = (adapter_dir / ADAPTER_WEIGHTS).stat().st_size
        return PublishResult(version, size, len(self.replicas), http_s, volume_s)

    def _push(self, url: str, version: str, adapter_dir: Path) -> None:
        push_adapter(url, version, adapter_dir, num_shards=self.streams, pool=self._pool)
        live = self._live.setdefault(url, [])
        live.append(version)
        while len(live) > self.keep_versions:
            try:
                self._pool.json("POST", f"{url}/unload_lora_adapter", {"lora_name": live[0]})
            except EngineError:
                break  # still used by running requests: retried after the next version
            live.pop(0)


def newest_version(adapters_dir: str | Path) -> tuple[str, str] | None:
    """(version, path) of the newest complete version on the volume, for a replica joining late."""
    return newest_adapter(adapters_dir)
