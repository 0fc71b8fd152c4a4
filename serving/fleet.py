"""The fleet: replicas that join, die and scale behind a router.

    router = Router("kv_headroom", adapters_volume=run_dir / "adapters")
    fleet = LocalFleet(model_dir, router, mode="process")   # or mode="thread" (in this process)
    fleet.scale_up(2)                          # one call: start 2 replicas, load the newest adapter, route to them
    fleet.scale_up(1, pool="reserved", size_gpus=8)
    fleet.kill(url)                            # a replica dying: its sessions move on their next call
    fleet.replace_exited()                     # replicas whose process died: out of the router, fresh ones in

One engine process on its own (a trainer with one replica, the curriculum and eval assets):

    proc, url = start_engine(model_dir, run_dir / "logs" / "engine-0.log", max_total_tokens=65536)

Both start ``python -m serving.replica --engine vllm ... --exit-with-parent``
(:func:`serving.replica.replica_command`: vLLM's server as its child, the capture front in front),
so a replica never outlives the process that started it. ``POSTTRAIN_ENGINE=local`` (or
``engine="local"``) runs the project's transformers engine (:mod:`serving.local_engine`) instead;
``mode="thread"`` runs that engine in this process (router tests).

Replicas get the trainer credential through their environment, never their command line
(:mod:`serving.capture_store`), passed explicitly at their start: a fleet's replica processes get
the router's, a replica from :func:`start_engine` the ``credential`` it is given (default: this
process's). A replica started without one refuses to start (``--exit-with-parent``).

On Kubernetes the replicas are SGLang pods (``serving.sglang.sglang_launch_spec``) and scale-up is
the launcher's; the router side (``Router.add_replica``) is the same.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.replica import free_port  # noqa: F401 (callers take it from here)
from serving.router.core import Router
from serving.capture_store import Credential, environment_with
from serving.client import EngineClient
from serving.http import serve
from serving.local_engine import LocalEngine
from serving.replica import ENGINE_KINDS
from serving.replica import replica_command




DEFAULT_ENGINE = "vllm"


def default_engine() -> str:
    """The engine local replicas run: ``$POSTTRAIN_ENGINE`` (``vllm`` or ``local``), else vLLM."""
    engine = os.environ.get("POSTTRAIN_ENGINE", DEFAULT_ENGINE)
    if engine not in ENGINE_KINDS:
        raise ValueError(f"POSTTRAIN_ENGINE must be one of {', '.join(ENGINE_KINDS)}, got {engine!r}")
    return engine


def start_engine(model: str, log_path: Path, timeout_s: float = 600.0, *, engine: str | None = None,
                 adapters_dir: str | Path | None = None, credential: Credential | str | None = None,
                 **settings: Any) -> tuple[subprocess.Popen, str]:
    """One replica (:mod:`serving.replica`: the engine server and the capture front) as a local
    process on loopback; returns it and its URL once it answers /health. ``engine`` is ``vllm``
    (the default, :func:`default_engine`) or ``local``; ``settings`` are replica settings among
    :data:`serving.replica.REPLICA_FLAGS`; its output goes to ``log_path``. It is given
    ``credential`` (default: this process's) in its environment, and this process's clients call it
    with the same one by default.

    It starts on the base model (and the newest version of ``adapters_dir``, if given): a trainer
    pushes the adapter version it resumes from."""
    port = free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = replica_command(model, engine=engine or default_engine(), port=port,
                          adapters_dir=str(adapters_dir) if adapters_dir else None, **settings)
    with open(log_path, "ab") as log:  # the child keeps its own copy
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environment_with(credential))
    url = f"http://127.0.0.1:{port}"
    client = EngineClient(url, timeout_s=5, credential=credential)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine replica exited with {proc.returncode}; see {log_path}")
        if client.health():
            return proc, url
        time.sleep(0.3)
    stop_replica(proc)
    raise RuntimeError(f"engine replica on {url} did not become healthy in {timeout_s:.0f}s; see {log_path}")


def stop_replica(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop a replica process and wait for it (it stops its engine server first)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class Replacement:
    """A replica process that exited (``returncode``, -9 for SIGKILL) and the replica started in its place."""

    dead_url: str
    returncode: int | None
    url: str


class LocalFleet:
    def __init__(self, model_path: str | Path, router: Router, *, mode: str = "thread",
                 engine_kwargs: dict[str, Any] | None = None, host: str = "127.0.0.1",
                 log_dir: str | Path | None = None, engine: str | None = None):
        if mode not in ("thread", "process"):
            raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
        self.model_path = str(model_path)
        self.router = router
        self.mode = mode
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine = engine or (default_engine() if mode == "process" else "local")
        self.host = host
        self.log_dir = Path(log_dir) if log_dir is not None else None  # replica processes' stderr, one file each
        self.members: dict[str, Any] = {}  # url -> server (thread) or Popen (process)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._unreplaced: list[tuple[str, int | None, tuple[str, int]]] = []  # (url, exit status, (pool, size))

    def _start_thread(self):
        server = serve(LocalEngine(self.model_path, **self.engine_kwargs), host=self.host, port=0)
        return server.url, server

    def _spawn_process(self) -> subprocess.Popen:
        seq = next(self._seq)
        settings = dict(self.engine_kwargs)
        if self.engine == "vllm" and "cpu_cores" not in settings:
            settings["cpu_cores"] = str(seq % (os.cpu_count() or 1))  # replicas side by side, not on one core
        cmd = replica_command(self.model_path, engine=self.engine, host=self.host,
                              adapters_dir=self.router.adapters_volume, **settings)
        stderr: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.log_dir / f"replica-{seq:03d}.log", "ab")
        try:
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                    env=environment_with(self.router.credential))
        finally:
            if stderr is not subprocess.DEVNULL:
                stderr.close()  # the child has its own copy

    @staticmethod
    def _process_url(proc: subprocess.Popen) -> str:
        line = proc.stdout.readline()
        if " on http" not in line:
            proc.kill()
            raise RuntimeError(f"replica process did not start: {line!r} (exit {proc.poll()})")
        return line.rsplit(" on ", 1)[1].strip()

    def scale_up(self, n: int = 1, pool: str = "on_demand", size_gpus: int = 1) -> list[str]:
        """Start ``n`` replicas; each loads the newest adapter before the router sends it traffic.
        Replica processes start side by side (model loading overlaps) and join as each comes up."""
        if self.mode == "thread":
            started = [self._start_thread() for _ in range(n)]
        else:
            procs = [self._spawn_process() for _ in range(n)]
            started = []
            try:
                for proc in procs:
                    started.append((self._process_url(proc), proc))
            except BaseException:
                for proc in procs:
                    proc.kill()
                raise
        urls = []
        for url, handle in started:
            with self._lock:
                self.members[url] = handle
            self.router.add_replica(url, pool, size_gpus)
            urls.append(url)
        return urls

    def live_urls(self) -> list[str]:
        """The members still running (a replica process that died and is not replaced yet is left out)."""
        with self._lock:
            return [url for url, handle in self.members.items() if self.mode == "thread" or handle.poll() is None]

    def replace_exited(self) -> list[Replacement]:
        """Process mode: each member whose process has exited (crashed, SIGKILLed) leaves the router and
        the fleet, and a fresh replica joins in its pool, loading the newest adapter before traffic.
        A replacement that fails to start raises; the next call tries it again."""
        if self.mode != "process":
            return []
        with self._lock:
            dead = {url: proc.returncode for url, proc in self.members.items() if proc.poll() is not None}
            for url in dead:
                del self.members[url]
        for url, returncode in dead.items():
            replica = self.router.replicas.get(url)
            key = (replica.pool, replica.size_gpus) if replica is not None else ("on_demand", 1)
            self._unreplaced.append((url, returncode, key))
            if replica is not None:
                self.router.remove_replica(url)
        replacements = []
        for key in dict.fromkeys(k for _, _, k in self._unreplaced):  # one pool's replacements start side by side
            waiting = [(url, rc) for url, rc, k in self._unreplaced if k == key]
            new_urls = self.scale_up(len(waiting), *key)
            self._unreplaced = [entry for entry in self._unreplaced if entry[2] != key]
            replacements += [Replacement(url, rc, new) for (url, rc), new in zip(waiting, new_urls)]
        return replacements

    def kill(self, url: str) -> None:
        """Stop a replica abruptly, without telling the router (as a crash would)."""
        with self._lock:
            handle = self.members.pop(url)
        if self.mode == "thread":
            handle.shutdown()
        else:
            handle.kill()  # a crash: the replica's engine server gets its parent-death signal
            handle.wait()

    def scale_down(self, url: str) -> None:
        """Take a replica out of rotation, then stop it."""
        self.router.remove_replica(url)
        self.kill(url)

    def shutdown(self) -> None:
        """Stop every member: process replicas are asked to stop (each stops its engine), side by side."""
        if self.mode == "thread":
            for url in list(self.members):
                self.kill(url)
            return
        with self._lock:
            procs = list(self.members.values())
            self.members.clear()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            stop_replica(proc)
