"""The fleet: replicas that join, die and scale behind a router.

    router = Router("kv_headroom", adapters_volume=run_dir / "adapters")
    fleet = LocalFleet(model_dir, router, mode="process")   # or mode="thread" (in this process)
    fleet.scale_up(2)                          # one call: start 2 replicas, load the newest adapter, route to them
    fleet.scale_up(1, pool="reserved", size_gpus=8)
    fleet.kill(url)                            # a replica dying: its sessions move on their next call

On Kubernetes the replicas are SGLang pods (``serving.sglang.sglang_launch_spec``) and scale-up is
the launcher's; the router side (``Router.add_replica``) is the same.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from serving.router import Router


class LocalFleet:
    def __init__(self, model_path: str | Path, router: Router, *, mode: str = "thread",
                 engine_kwargs: dict[str, Any] | None = None, host: str = "127.0.0.1"):
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        self.model_path = str(model_path)
        self.router = router
        self.mode = mode
        self.engine_kwargs = dict(engine_kwargs or {})
        self.host = host
        self.members: dict[str, Any] = {}  # url -> server (thread) or Popen (process)
        self._lock = threading.Lock()

    def _start_thread(self):
        from serving.engine import LocalEngine
        from serving.http import serve

        server = serve(LocalEngine(self.model_path, **self.engine_kwargs), host=self.host, port=0)
        return server.url, server

    def _start_process(self):
        cmd = [sys.executable, "-m", "serving.engine", "--model", self.model_path, "--host", self.host, "--port", "0"]
        flags = {"max_total_tokens": "--max-total-tokens", "max_running_requests": "--max-running-requests",
                 "block_size": "--block-size", "torch_threads": "--torch-threads"}
        for key, value in self.engine_kwargs.items():
            if key not in flags:
                raise ValueError(f"engine_kwargs.{key} cannot be passed to a replica process (known: {sorted(flags)})")
            cmd += [flags[key], str(value)]
        if self.router.adapters_volume:
            cmd += ["--adapters-dir", str(self.router.adapters_volume)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = proc.stdout.readline()
        if " on http" not in line:
            proc.kill()
            raise RuntimeError(f"replica process did not start: {line!r} (exit {proc.poll()})")
        return line.rsplit(" on ", 1)[1].strip(), proc

    def scale_up(self, n: int = 1, pool: str = "on_demand", size_gpus: int = 1) -> list[str]:
        """Start ``n`` replicas; each loads the newest adapter before the router sends it traffic."""
        urls = []
        for _ in range(n):
            url, handle = self._start_thread() if self.mode == "thread" else self._start_process()
            with self._lock:
                self.members[url] = handle
            self.router.add_replica(url, pool, size_gpus)
            urls.append(url)
        return urls

    def kill(self, url: str) -> None:
        """Stop a replica abruptly, without telling the router (as a crash would)."""
        with self._lock:
            handle = self.members.pop(url)
        if self.mode == "thread":
            handle.shutdown()
        else:
            handle.kill()
            handle.wait()

    def scale_down(self, url: str) -> None:
        """Take a replica out of rotation, then stop it."""
        self.router.remove_replica(url)
        self.kill(url)

    def shutdown(self) -> None:
        for url in list(self.members):
            self.kill(url)
