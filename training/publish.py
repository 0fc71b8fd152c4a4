"""Weight publication: a new adapter version to every live replica over HTTP, and to the volume.

After each step the trainer writes the adapter as a peft folder and :class:`AdapterPublisher`:

1. splits ``adapter_model.safetensors`` into ``streams`` byte ranges and sends them to every replica's
   adapter receiver in parallel (one HTTP request per shard and replica, each with its SHA-256);
2. commits the version on each receiver, which checks the whole file's hash, assembles the folder under
   a temporary name, renames it into place and asks its engine to load it (SGLang's
   ``POST /load_lora_adapter``), unloading versions older than ``keep_versions``;
3. copies the folder to ``<run>/adapters/<version>/`` (temporary name, then rename) so a replica that
   joins later loads the newest version from the volume.

Versions are named by step: ``step_000012``. The receiver (:class:`AdapterReceiver`) is a sidecar on
localhost beside each replica (the same pod on Kubernetes); it speaks only SGLang's API to the engine,
so it works with the local engine and with SGLang alike. Run one with
``python -m training.publish --engine-url http://127.0.0.1:30000 --dir /tmp/adapters --port 31000``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

import requests

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def version_name(step: int) -> str:
    return f"step_{step:06d}"


@dataclass(frozen=True)
class PublishResult:
    version: str
    bytes: int
    replicas: int
    http_s: float
    volume_s: float


def _shards(data: bytes, streams: int) -> list[tuple[int, bytes]]:
    size = max(1, -(-len(data) // max(streams, 1)))
    return [(offset, data[offset:offset + size]) for offset in range(0, max(len(data), 1), size)]


class AdapterPublisher:
    def __init__(self, adapters_dir: str | Path | None, receivers: Sequence[str] = (), *, streams: int = 4,
                 timeout_s: float = 300.0) -> None:
        self.adapters_dir = Path(adapters_dir) if adapters_dir is not None else None
        self.receivers = list(receivers)
        self.streams = streams
        self.timeout_s = timeout_s
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=8, pool_maxsize=max(8, streams * 4))
        self._session.mount("http://", adapter)

    def publish(self, step: int, adapter_dir: str | Path) -> PublishResult:
        adapter_dir = Path(adapter_dir)
        for name in (WEIGHTS, CONFIG):
            if not (adapter_dir / name).is_file():
                raise FileNotFoundError(f"adapter {adapter_dir}: {name} is missing")
        version = version_name(step)
        data = (adapter_dir / WEIGHTS).read_bytes()
        config = (adapter_dir / CONFIG).read_text()
        started = time.perf_counter()
        if self.receivers:
            self.send(version, data, config)
        http_s = time.perf_counter() - started
        started = time.perf_counter()
        if self.adapters_dir is not None:
            copy_atomically(adapter_dir, self.adapters_dir / version)
        return PublishResult(version, len(data), len(self.receivers), http_s, time.perf_counter() - started)

    def send(self, version: str, data: bytes, config: str) -> None:
        """Shards to every receiver in parallel, then one commit per receiver."""
        shards = _shards(data, self.streams)
        digest = hashlib.sha256(data).hexdigest()

        def put(url: str, offset: int, chunk: bytes) -> None:
            resp = self._session.put(
                f"{url}/adapters/{version}/shards/{offset}", data=chunk, timeout=self.timeout_s,
                headers={"X-Sha256": hashlib.sha256(chunk).hexdigest(), "Content-Type": "application/octet-stream"},
            )
            _check(resp, url)

        def commit(url: str) -> None:
            body = {"size": len(data), "sha256": digest, "adapter_config": json.loads(config)}
            _check(self._session.post(f"{url}/adapters/{version}/commit", json=body, timeout=self.timeout_s), url)

        workers = max(1, len(shards) * len(self.receivers))
        with ThreadPoolExecutor(max_workers=min(workers, 64)) as pool:
            list(pool.map(lambda job: put(*job), [(u, o, c) for u in self.receivers for o, c in shards]))
            list(pool.map(commit, self.receivers))

    def close(self) -> None:
        self._session.close()


def _check(resp: requests.Response, url: str) -> None:
    if resp.status_code >= 400:
        raise RuntimeError(f"adapter receiver {url}: HTTP {resp.status_code}: {resp.text[:300]}")


def copy_atomically(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}-{threading.get_ident()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    for path in tmp.iterdir():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def newest_version(adapters_dir: str | Path) -> tuple[str, Path] | None:
    """The newest complete version on the volume (for a replica that joins late)."""
    root = Path(adapters_dir)
    versions = sorted(p for p in root.glob("step_*") if (p / WEIGHTS).is_file() and (p / CONFIG).is_file())
    return (versions[-1].name, versions[-1]) if versions else None


class AdapterReceiver:
    """The replica side: assembles shards under ``directory`` and loads each version into the engine
    at ``engine_url`` (``None``: only assemble, e.g. in a benchmark)."""

    def __init__(self, directory: str | Path, engine_url: str | None = None, *, keep_versions: int = 3,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.engine_url = engine_url.rstrip("/") if engine_url else None
        self.keep_versions = keep_versions
        self.loaded: list[str] = []
        self._lock = threading.Lock()
        self._parts: dict[str, dict[int, bytes]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", "0")))

            def do_PUT(self) -> None:
                parts = urlparse(self.path).path.strip("/").split("/")
                body = self._body()
                if len(parts) != 4 or parts[0] != "adapters" or parts[2] != "shards" or not parts[3].isdigit():
                    return self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route PUT {self.path}"})
                if hashlib.sha256(body).hexdigest() != self.headers.get("X-Sha256"):
                    return self._reply(HTTPStatus.BAD_REQUEST, {"error": f"shard {parts[3]} of {parts[1]}: bad X-Sha256"})
                with receiver._lock:
                    receiver._parts.setdefault(parts[1], {})[int(parts[3])] = body
                self._reply(HTTPStatus.OK, {"ok": True})

            def do_POST(self) -> None:
                parts = urlparse(self.path).path.strip("/").split("/")
                body = self._body()
                if len(parts) != 3 or parts[0] != "adapters" or parts[2] != "commit":
                    return self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route POST {self.path}"})
                try:
                    receiver.commit(parts[1], json.loads(body))
                except (ValueError, KeyError, RuntimeError) as exc:
                    return self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                self._reply(HTTPStatus.OK, {"ok": True, "version": parts[1]})

            def do_GET(self) -> None:
                self._reply(HTTPStatus.OK, {"loaded": list(receiver.loaded)})

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="adapter-receiver", daemon=True)
        self._thread.start()

    def commit(self, version: str, body: dict) -> None:
        with self._lock:
            parts = self._parts.pop(version, {})
        data = b"".join(parts[o] for o in sorted(parts))
        if len(data) != body["size"] or hashlib.sha256(data).hexdigest() != body["sha256"]:
            raise ValueError(f"version {version}: assembled {len(data)} bytes do not match size/sha256 of the commit")
        dest = self.directory / version
        tmp = dest.with_name(f".tmp-{version}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        (tmp / WEIGHTS).write_bytes(data)
        (tmp / CONFIG).write_text(json.dumps(body["adapter_config"]))
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        if self.engine_url:
            resp = requests.post(f"{self.engine_url}/load_lora_adapter",
                                 json={"lora_name": version, "lora_path": str(dest)}, timeout=300)
            if resp.status_code >= 400:
                raise RuntimeError(f"engine {self.engine_url} refused {version}: {resp.text[:300]}")
        self.loaded.append(version)
        while self.engine_url and len(self.loaded) > self.keep_versions:
            old = self.loaded[0]
            resp = requests.post(f"{self.engine_url}/unload_lora_adapter", json={"lora_name": old}, timeout=60)
            if resp.status_code >= 400:
                break  # still in use by running requests: try again after the next version
            self.loaded.pop(0)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.publish", description="adapter receiver sidecar")
    parser.add_argument("--engine-url", default=None)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=31000)
    args = parser.parse_args(argv)
    receiver = AdapterReceiver(args.dir, args.engine_url, host=args.host, port=args.port)
    print(f"adapter receiver on {receiver.url} -> {args.engine_url}", flush=True)
    receiver._thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
