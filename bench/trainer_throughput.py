"""Tokens/s, MFU and peak memory of the shipped torch/peft trainer step, every recompute mode, on one GPU.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/trainer_throughput.py --contexts 8192,32768

A Hugging Face Qwen3-8B (built from a ``Qwen3Config`` with random bf16 weights: no download) with a
rank-32 LoRA on the seven projections of every layer goes through
``TorchPeftBackend.train_step`` (forward, chunked token log-probabilities, the GRPO loss, backward,
AdamW on float32 masters of the bf16 adapter) on one packed sequence per context length, for each
``recompute`` mode: ``none``, ``full`` (Hugging Face activation checkpointing over stock SDPA, whose
kernels on Hopper are cuDNN's) and ``attention_output`` (``training.recompute`` on the kernels that
``chosen_attention_kernels`` picks and checks). Beside each backend row, in the same run, the
benchmark decoder of ``bench/recompute.py`` (``training.reference_decoder.Qwen3Decoder``, same shape, same
kernels) takes the same step, so the cost of the Hugging Face model around the scheme shows.

Every figure is printed next to its baseline as a ratio: step time against ``full`` of the same
model in this run, and tokens/s against the backend's figures before the bf16 adapter, fused LoRA
epilogue, fused RMSNorm, chunked log-probabilities and checked kernels (measured on one H200 with
the code as it was; constants below). MFU is model FLOPs (recomputation is not useful work) per
second over the GPU's datasheet dense bf16 peak, as ``bench/mfu.py`` defines it for every GPU
benchmark, printed beside the share of the bf16 matmul rate measured in the run (the larger of the
rates measured before and after the steps); the FLOPs formula is printed.
``--device cpu`` runs the same code paths on a tiny model, as a smoke test without a GPU.

``--compare-with TREE`` times today's step against this tree's, side by side in one run: TREE is a
checkout of the baseline (a git worktree of 1ec7686 inside this checkout, carried to the device),
whose ``training`` package the baseline's processes import; each (tree, context) runs in a process
of its own (``--mode``, ``attention_output`` by default), and the run prints step time, tokens/s,
MFU and peak memory with the ratios to the baseline, every step's loss and gradient norm, and how
far the adapter's change after three steps differs:

    git worktree add --detach .wt54-base 1ec7686
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/trainer_throughput.py --compare-with .wt54-base

``--fp8`` adds this tree's step with FP8 products for the frozen layer weights (``training.fp8``,
opt-in) at every context, its losses against the baseline's, and bf16 against FP8 products on the
layer's shapes; ``--loss-curve 50`` then runs this tree's bf16 and FP8 steps for 50 steps on the same
batches (``--curve-batches`` of them in turn, ``--curve-lr``) and prints the two loss curves:

    python bench/trainer_throughput.py --compare-with .wt54-base --contexts 8192,32768 --fp8 --loss-curve 50

``--ablate no-fused-layer,no-fused-head,eager-kernels`` adds runs of this tree with one fused piece
(``training.fused_step``) left out, at ``--ablate-contexts``. ``--precision-check --layers 2`` puts
today's bf16 arithmetic and the fused step beside a float32 step of the same weights and adapter.

``--ranks N`` measures data-parallel scaling instead (``training.backends.parallel``):

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/trainer_throughput.py --ranks 2 --contexts 8192 --mode attention_output
    python bench/trainer_throughput.py --ranks 2 --device cpu     # gloo, the tiny model: a smoke run

The same backend step runs under torchrun on 1 process, then on N (one per GPU, NCCL; gloo on the CPU),
each rank with ``--sequences-per-rank`` sequences of the context length (weak scaling: the N-rank
batch is N times the 1-rank one, and each rank's shard is what the single rank trains), the LoRA
gradients summed in one all-reduce per step. It prints the step time, tokens/s in all and per GPU, the
scaling efficiency (per-GPU tokens/s at N over tokens/s at 1, in this run) against the 90% target, and
what the gradient all-reduce alone takes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

# --code-tree TREE (a worker of --compare-with) imports the trainer from another checkout, e.g. a git
# worktree of an earlier commit; everything else here (batch, timing, MFU) stays this file's
_CODE_TREE = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--code-tree"), None)
sys.path.insert(0, str(Path(_CODE_TREE).resolve() if _CODE_TREE else Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if _CODE_TREE is None:
    import recompute as rb  # noqa: E402  (bench/recompute.py: the benchmark decoder's step; it puts this tree first on sys.path)
from mfu import describe, device_peak_tflops, matmul_tflops, mfu, mfu_header, percent  # noqa: E402  (bench/mfu.py)
from training.backends.torch_peft import TorchPeftBackend  # noqa: E402
from training.attention import chosen_attention_kernels  # noqa: E402
from training.backends.parallel import DataParallel  # noqa: E402
from training.grpo import DEFAULT_LOSS, TrainBatch  # noqa: E402
from training.recompute import RECOMPUTE_MODES  # noqa: E402
from training.reference_decoder import DecoderShape, Qwen3Decoder  # noqa: E402

GIB = 1024**3

# TorchPeftBackend.train_step on one H200 before this benchmark's changes (fp32 peft adapter,
# unchunked fp32 logits, HF RMSNorm, PyTorch-flash kernels in attention_output), tokens/s.
BEFORE_TOKENS_PER_S = {
    (8192, "none"): 7318, (8192, "full"): 5334, (8192, "attention_output"): 5261,
    (32768, "full"): 4177, (32768, "attention_output"): 3840,
}


def log(msg: str) -> None:
    print(msg, flush=True)


def qwen3_config(size: str, layers: int | None):
    shape = DecoderShape.qwen3(size, lora_rank=32, lora_alpha=64, **({"num_layers": layers} if layers else {}))
    config = Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, rope_theta=shape.rope_theta, max_position_embeddings=131072,
        tie_word_embeddings=False, rms_norm_eps=shape.rms_eps,
    )
    return shape, config


def tiny_shape() -> DecoderShape:
    return DecoderShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, lora_rank=8, lora_alpha=16)


def build_backend(config, device: str, dtype: torch.dtype, recompute: str, seq_len: int, lora_rank: int,
                  data_parallel=None, learning_rate: float = 1e-5) -> TorchPeftBackend:
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            base = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    base.config.use_cache = False
    return TorchPeftBackend.from_model(
        base, lora_rank=lora_rank, lora_alpha=2 * lora_rank, recompute=recompute, device=device,
        micro_batch_tokens=seq_len, max_grad_norm=1e9, learning_rate=learning_rate, data_parallel=data_parallel,
    )


def batch_of(seq_len: int, vocab: int, seed: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    prompt = seq_len // 8
    return TrainBatch(
        input_ids=[torch.randint(0, vocab, (seq_len,), generator=gen).tolist()],
        loss_mask=[[0] * prompt + [1] * (seq_len - prompt)],
        serving_logprobs=[(-torch.rand(seq_len, generator=gen) * 3).tolist()],
        advantages=[0.5],
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step, device: str, warmup: int, steps: int) -> dict:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for i in range(warmup + steps):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        return {"oom": True}
    times.sort()
    return {"oom": False, "step_s": times[len(times) // 2], "step_s_all": times,
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan")}


def check_backend_modes(device: str, dtype: torch.dtype) -> None:
    """The three modes give the step of ``none`` on a small random Qwen3 on the device (bf16)."""
    config = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=2, head_dim=128,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    batch = batch_of(1024 if device == "cuda" else 48, config.vocab_size, seed=3)
    results = {}
    for mode in RECOMPUTE_MODES:
        backend = build_backend(config, device, dtype, mode, 4096, 16)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in backend.params:
                if p.abs().sum() == 0:  # a fresh adapter's B is zero, which would hide A's gradient
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        backend.refresh_masters()
        step = backend.train_step(batch, DEFAULT_LOSS)
        results[mode] = (step.loss, torch.cat([m.grad.flatten() for m in backend.masters]))
        del backend
    errs = {m: (abs(results[m][0] - results["none"][0]),
                float((results[m][1] - results["none"][1]).norm() / results["none"][1].norm()))
            for m in ("full", "attention_output")}
    log("backend check, recompute vs none on a small random Qwen3 "
        f"({dtype}, loss absolute / LoRA gradients relative): "
        + ", ".join(f"{m} {a:.1e} / {r:.1e}" for m, (a, r) in errs.items()))
    if not all(r < 5e-2 and a < 2e-2 for a, r in errs.values()):
        raise SystemExit(f"the backend's recompute modes disagree: {errs}")


# -- data-parallel scaling (--ranks) ---------------------------------------------------------------

SCALING_TARGET = 0.9  # N ranks at >= 90% of N times one rank's tokens/s


def scaling_config(args):
    if args.device == "cpu":
        shape = tiny_shape()
        return shape, Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                                  intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                                  head_dim=shape.head_dim, tie_word_embeddings=False)
    return qwen3_config(args.model, args.layers)


def scaling_worker(args) -> None:
    """One rank under torchrun: the backend step on this rank's shard of a batch of ``ranks x
    sequences_per_rank`` sequences, timed from a barrier to the end of the step on every rank."""
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    shape, config = scaling_config(args)
    dtype = torch.bfloat16
    results = []
    for seq_len in [int(c) for c in args.contexts.split(",") if c]:
        backend = build_backend(config, device, dtype, args.mode, seq_len, shape.lora_rank,
                                data_parallel=DataParallel.of_world())
        sequences = [batch_of(seq_len, shape.vocab_size, seed=seq_len + i) for i in range(ranks * args.sequences_per_rank)]
        batch = TrainBatch(*(sum((getattr(b, f) for b in sequences), []) for f in
                             ("input_ids", "loss_mask", "serving_logprobs", "advantages")))
        on = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        times = []
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            backend.train_step(batch, DEFAULT_LOSS)
            sync(device)
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=on)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            if i >= args.warmup:
                times.append(float(took))
        # the gradient all-reduce alone: the same float32 numbers, summed the same way
        flat = torch.zeros(sum(m.numel() for m in backend.masters), dtype=torch.float32, device=on)
        reduce_s = []
        for _ in range(5):
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            if ranks > 1:
                dist.all_reduce(flat)
            sync(device)
            reduce_s.append(time.perf_counter() - t0)
        times.sort()
        step_s = times[len(times) // 2]
        results.append({
            "seq_len": seq_len, "ranks": ranks, "sequences": len(batch.input_ids), "step_s": step_s,
            "step_s_all": times, "tokens_per_s": len(batch.input_ids) * seq_len / step_s,
            "tokens_per_s_per_gpu": len(batch.input_ids) * seq_len / step_s / ranks,
            "allreduce_s": sorted(reduce_s)[2], "allreduce_mib": flat.numel() * 4 / 2**20,
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan"),
        })
        del backend
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        args.json.write_text(json.dumps(results))
    dist.destroy_process_group()


def scaling(args) -> None:
    """Run :func:`scaling_worker` on 1 rank, then on ``args.ranks``, and compare them."""
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"--ranks {args.ranks}: this machine has {torch.cuda.device_count()} CUDA devices")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           # NVLink multicast stays off (the shared hosts' rule): NCCL, PyTorch and NVSHMEM
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
           "NVSHMEM_DISABLE_NVLS": os.environ.get("NVSHMEM_DISABLE_NVLS", "1")}
    shape, _ = scaling_config(args)
    log(f"data-parallel scaling of TorchPeftBackend.train_step: Qwen3-{args.model if args.device == 'cuda' else 'tiny'} "
        f"shape ({shape.num_layers} layers, hidden {shape.hidden_size}), LoRA rank {shape.lora_rank}, bf16, "
        f"recompute {args.mode}, {args.sequences_per_rank} sequence(s) per rank per step, {args.device}")
    rows = []
    for ranks in sorted({1, args.ranks}):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "scaling.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   str(Path(__file__).resolve()), "--scaling-worker", "--json", str(out), "--device", args.device,
                   "--model", args.model, "--contexts", args.contexts, "--mode", args.mode,
                   "--sequences-per-rank", str(args.sequences_per_rank), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), *(["--layers", str(args.layers)] if args.layers else [])]
            log(f"$ {' '.join(cmd[1:])}")
            started = time.perf_counter()
            subprocess.run(cmd, env=env, check=True)
            rows += json.loads(out.read_text())
            log(f"{ranks} rank(s): {time.perf_counter() - started:.0f} s with start-up")
    one = {r["seq_len"]: r for r in rows if r["ranks"] == 1}
    log("")
    log("| context | ranks | sequences/step | step s (all) | tokens/s | tokens/s per GPU | efficiency vs 1 GPU "
        "| gradient all-reduce | peak GiB |")
    log("| ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |")
    verdicts = []
    for r in rows:
        eff = r["tokens_per_s_per_gpu"] / one[r["seq_len"]]["tokens_per_s"]
        reduce = (f"{r['allreduce_s'] * 1e3:.1f} ms of {r['allreduce_mib']:.1f} MiB ({r['allreduce_s'] / r['step_s']:.1%} of the step)"
                  if r["ranks"] > 1 else "none")
        log(f"| {r['seq_len']} | {r['ranks']} | {r['sequences']} | {r['step_s']:.3f} ({', '.join(f'{t:.3f}' for t in r['step_s_all'])}) "
            f"| {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_gpu']:.0f} | {eff:.1%} | {reduce} | {r['peak_gib']:.1f} |")
        if r["ranks"] > 1:
            verdicts.append(f"{r['seq_len']}: {r['ranks']} ranks at {eff:.1%} of {r['ranks']} x one rank's "
                            f"{one[r['seq_len']]['tokens_per_s']:.0f} tokens/s (target {SCALING_TARGET:.0%}): "
                            + ("met" if eff >= SCALING_TARGET else "NOT met"))
    for v in verdicts:
        log(v)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"scaling": rows}, indent=1))

# -- today's step against this tree's, side by side (--compare-with) --------------------------------


def step_worker(args) -> None:
    """One process: the backend of ``--code-tree`` (or this tree) takes ``--warmup`` + ``--steps``
    steps of one context length in ``--mode``; writes the timings, peak memory, every step's loss and
    gradient norm, and the adapter's change after the third step (float32 masters, to ``--save-adapter``)."""
    device = args.device
    shape, config = (tiny_shape(), None) if device == "cpu" else qwen3_config(args.model, args.layers)
    if config is None:
        config = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                             intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                             num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                             head_dim=shape.head_dim, tie_word_embeddings=False)
    seq_len = int(args.contexts)
    if args.variant:
        _apply_variant(args.variant)
    backend = build_backend(config, device, torch.bfloat16, args.mode, seq_len, shape.lora_rank,
                            learning_rate=args.lr)
    fp8_layers = 0
    if args.variant == "fp8":
        from training.fused_step import use_fp8_base_weights

        fp8_layers = use_fp8_base_weights(backend.model)
    initial = [m.detach().cpu().clone() for m in backend.masters]
    # --batches N: step i trains batch i mod N (the same N batches in every process that is given N)
    batches = [batch_of(seq_len, shape.vocab_size, seed=seq_len + i) for i in range(args.batches)]
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses, norms = [], [], []
    started = time.perf_counter()
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        result = backend.train_step(batches[i % len(batches)], DEFAULT_LOSS)
        sync(device)
        took = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(took)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if i == 2 and args.save_adapter:  # outside the timed window
            torch.save(torch.cat([(m.detach().cpu() - m0).flatten() for m, m0 in zip(backend.masters, initial)]),
                       args.save_adapter)
    code = sys.modules[TorchPeftBackend.__module__].__file__
    if args.code_tree and not Path(code).resolve().is_relative_to(Path(args.code_tree).resolve()):
        raise SystemExit(f"--code-tree {args.code_tree}: the backend came from {code}")
    kernels = ""
    try:
        from training.fused_step import chosen_step_kernels  # this tree's fused kernels, where it has them

        c = chosen_step_kernels(device, torch.bfloat16)  # chosen in the steps above (once per process)
        kernels = (f"{c.kernels.name} (vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in c.errors.items())
                   + ")" + (f"; passed over: {c.rejected}" if c.rejected else ""))
    except ImportError:
        pass
    if args.variant == "fp8":
        from training import fused_step
        from training.fp8 import chosen_quantize

        parts = [c.cell_contents for m in backend.model.modules() if type(m).__name__ in ("Qwen3DecoderLayer",)
                 for c in (m.forward.__closure__ or ()) if isinstance(c.cell_contents, dict)]
        parts = [v for d in parts for v in d.values() if isinstance(v, fused_step.FusedLayerParts)]
        q = chosen_quantize(device, torch.bfloat16)
        kernels += (f"; FP8 base weights in {fp8_layers} layers, {sum(p.fp8_calls for p in parts)} layer calls in FP8"
                    + (f" (bf16 instead: {parts[0].fp8_skipped})" if parts and parts[0].fp8_skipped else "")
                    + f"; row quantization {q.name} (error {q.error:.1e})" + (f", passed over {q.rejected}" if q.rejected else ""))
    times_sorted = sorted(times)
    args.json.write_text(json.dumps({
        "seq_len": seq_len, "mode": args.mode, "step_s": times_sorted[len(times) // 2], "step_s_all": times,
        "first_steps_s": time.perf_counter() - started - sum(times),
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan"),
        "losses": losses, "grad_norms": norms, "step_kernels": kernels, "backend_file": code,
    }))


def precision_check(args) -> None:
    """The bf16 step of today's arithmetic (``fused_kernels=False``: the autograd scheme and the
    chunked log-probabilities, what 1ec7686 runs) and of the fused one, each against a float32 step
    (``recompute="none"``, the same weights and adapter before rounding) on a model of the benchmark's
    shape cut to ``--layers``: the loss, and the LoRA gradients (float32 masters) after one step."""
    import copy

    device, seq_len = args.device, int(args.contexts.split(",")[0])
    shape, config = (tiny_shape(), None) if device == "cpu" else qwen3_config(args.model, args.layers)
    if config is None:
        config = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                             intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                             num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                             head_dim=shape.head_dim, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        base = Qwen3ForCausalLM(config)
    base.config.use_cache = False
    common = dict(lora_rank=shape.lora_rank, lora_alpha=2 * shape.lora_rank, device=device,
                  micro_batch_tokens=seq_len, max_grad_norm=1e9, learning_rate=1e-5)
    runs = {"float32, none": (torch.float32, "none", False),
            "bf16, attention_output, today's arithmetic": (torch.bfloat16, "attention_output", False),
            "bf16, attention_output, fused": (torch.bfloat16, "attention_output", True)}
    batch = batch_of(seq_len, shape.vocab_size, seed=seq_len)
    gen = torch.Generator().manual_seed(7)
    reference_lora = None
    results = {}
    for name, (dtype, mode, fused) in runs.items():
        backend = TorchPeftBackend.from_model(copy.deepcopy(base).to(dtype), recompute=mode, fused_kernels=fused, **common)
        lora = [p for n, p in backend.model.named_parameters() if p.requires_grad]
        with torch.no_grad():
            if reference_lora is None:  # the float32 run's adapter, B made non-zero, is every run's
                for p in lora:
                    if p.abs().sum() == 0:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
                reference_lora = [p.detach().float().clone() for p in lora]
            for p, ref in zip(lora, reference_lora):
                p.copy_(ref)
        backend.refresh_masters()
        result = backend.train_step(batch, DEFAULT_LOSS)
        results[name] = (result.loss, torch.cat([m.grad.flatten().double() for m in backend.masters]))
        del backend, lora
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    ref_loss, ref_grad = results["float32, none"]
    log(f"precision check: Qwen3-{args.model} shape cut to {shape.num_layers} layers, {seq_len} tokens, one step; "
        f"float32 loss {ref_loss:.6e}, LoRA gradient norm {float(ref_grad.norm()):.4e}")
    log("| step | loss rel. error vs float32 | LoRA gradients rel. error vs float32 | vs today's arithmetic: loss / gradients |")
    log("| --- | ---: | ---: | ---: |")
    _, today = results["bf16, attention_output, today's arithmetic"]
    for name, (loss, grad) in results.items():
        if name == "float32, none":
            continue
        vs = (f"{abs(loss - results[list(runs)[1]][0]) / abs(results[list(runs)[1]][0]):.1e} / "
              f"{float((grad - today).norm() / today.norm()):.1e}")
        log(f"| {name} | {abs(loss - ref_loss) / abs(ref_loss):.1e} | {float((grad - ref_grad).norm() / ref_grad.norm()):.1e} | {vs} |")


# this tree's step with one of its fused pieces left out (--ablate), to measure each alone
VARIANTS = {
    "no-fused-layer": "the layers on training.recompute.KeepAttentionOutput (autograd), the head fused",
    "no-fused-head": "the head on training.logprobs.token_logprobs, the layers fused",
    "eager-kernels": "both fused, the elementwise kernels eager (not compiled)",
    "fp8": "FP8 products for the frozen layer weights (training.fp8, opt-in), the adapter in bf16",
}


def _apply_variant(name: str) -> None:
    from training import fused_step
    from training.backends import torch_peft
    from training.logprobs import token_logprobs

    if name == "no-fused-layer":
        fused_step.fused_layer_parts = lambda layer: (None, "left out (--ablate no-fused-layer)")
    elif name == "no-fused-head":
        torch_peft.frozen_head_token_logprobs = lambda hidden, weight, targets, chunk, kernels: token_logprobs(
            hidden, weight, targets, chunk)
    elif name == "eager-kernels":
        eager = fused_step.StepKernelChoice(fused_step.EAGER_KERNELS, {}, {"torch.compile": "left out (--ablate eager-kernels)"})
        fused_step.chosen_step_kernels = torch_peft.chosen_step_kernels = lambda device, dtype: eager
    elif name == "fp8":
        pass  # step_worker opts the model in once it is built
    else:
        raise SystemExit(f"--variant {name!r}: expected one of {', '.join(VARIANTS)}")


def compare(args) -> None:
    """Today's step (``--compare-with``, a worktree of the baseline commit) and this tree's, each
    context in a process of its own (so each peak is its own), one after the other on this GPU."""
    device = args.device
    started = time.perf_counter()
    here = Path(__file__).resolve()
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        log(f"device {props.name}, {props.total_memory / GIB:.0f} GiB; torch {torch.__version__}; "
            f"cuDNN {torch.backends.cudnn.version()}")
    matmul = matmul_tflops(n=512 if device == "cpu" else 8192, reps=3 if device == "cpu" else 20, device=device)
    gpu_name, peak = device_peak_tflops(device)
    log(describe(gpu_name, peak, matmul))
    shape = tiny_shape() if device == "cpu" else qwen3_config(args.model, args.layers)[0]
    trees = [(args.baseline_label, Path(args.compare_with).resolve(), ""), ("this tree", here.parents[1], "")]
    ablate = [v for v in args.ablate.split(",") if v]
    for v in ablate:
        if v not in VARIANTS:
            raise SystemExit(f"--ablate {v!r}: expected names among {', '.join(VARIANTS)}")
    ablate_contexts = {int(c) for c in args.ablate_contexts.split(",") if c}
    results: dict[tuple[int, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in [int(c) for c in args.contexts.split(",") if c]:
            runs = trees + ([("this tree, fp8", here.parents[1], "fp8")] if args.fp8 else []) \
                + ([(f"this tree, {v}", here.parents[1], v) for v in ablate] if seq_len in ablate_contexts else [])
            for label, tree, variant in runs:
                out, adapter = Path(tmp) / "step.json", Path(tmp) / f"adapter-{seq_len}-{len(results)}.pt"
                cmd = [sys.executable, str(here), "--step-worker", "--code-tree", str(tree), "--device", device,
                       "--model", args.model, "--contexts", str(seq_len), "--mode", args.mode, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--json", str(out), "--save-adapter", str(adapter),
                       "--lr", str(args.lr), "--batches", str(args.batches),
                       *(["--variant", variant] if variant else []),
                       *(["--layers", str(args.layers)] if args.layers else [])]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
                if proc.returncode != 0:
                    log(proc.stdout[-3000:] + proc.stderr[-6000:])
                    raise SystemExit(f"{label} at {seq_len}: the step worker failed ({proc.returncode})")
                r = json.loads(out.read_text())
                r.update(label=label, tree=str(tree), adapter=str(adapter), process_s=time.perf_counter() - t0)
                r["tokens_per_s"] = seq_len / r["step_s"]
                r["model_tflops"] = seq_len * shape.train_flops_per_token(seq_len) / r["step_s"] / 1e12
                results[(seq_len, label)] = r
                log(f"{seq_len:>6} {label:>16} {args.mode}: step {r['step_s']:.3f} s (all "
                    f"{', '.join(f'{t:.3f}' for t in r['step_s_all'])}), peak {r['peak_gib']:.1f} GiB, "
                    f"{r['tokens_per_s']:.0f} tok/s, MFU {percent(mfu(r['model_tflops'], peak))}; "
                    f"losses {', '.join(f'{x:.6f}' for x in r['losses'])}; process {r['process_s']:.0f} s; "
                    f"backend {r['backend_file']}"
                    + (f"; step kernels {r['step_kernels']}" if r["step_kernels"] else ""))
        matmul = max(matmul, matmul_tflops(n=512 if device == "cpu" else 8192, reps=3 if device == "cpu" else 20, device=device))
        log(f"bf16 matmul, the larger of before and after the steps: {matmul:.3g} TFLOP/s")
        log("")
        for v in ablate:
            log(f"this tree, {v}: {VARIANTS[v]}")
        base, new = args.baseline_label, "this tree"
        log(f"| context | code | step s (all) | tokens/s | vs {base} | {mfu_header(peak)} | of measured matmul "
            f"({matmul:.3g} TFLOP/s) | peak GiB | peak vs {base} |")
        log("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        rows = []
        for (seq_len, label), r in results.items():
            b = results[(seq_len, base)]
            if label.startswith("this tree, ") and label != "this tree, fp8":
                label = f"{label} (this tree is {results[(seq_len, 'this tree')]['tokens_per_s'] / r['tokens_per_s']:.2f}x of it)"
            log(f"| {seq_len} | {label} | {r['step_s']:.3f} ({', '.join(f'{t:.3f}' for t in r['step_s_all'])}) | "
                f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
                f"{percent(mfu(r['model_tflops'], peak))} | {r['model_tflops'] / matmul:.1%} | {r['peak_gib']:.1f} | "
                f"{r['peak_gib'] / b['peak_gib']:.2f}x |")
        log("")
        for new in [new] + (["this tree, fp8"] if args.fp8 else []):
            rows += _loss_table(results, base, new)
        if args.fp8:
            fp8_matmul_table(device)
        if args.loss_curve:
            rows.append(loss_curve(args, here, tmp))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"datasheet_peak_tflops": peak, "matmul_tflops": matmul,
                                         "steps": list(results.values()), "adapter": rows}, indent=1))
    log(f"total {time.perf_counter() - started:.0f} s")


def _loss_table(results: dict, base: str, new: str) -> list[dict]:
    """Every step's loss and gradient norm of ``new`` beside ``base``'s, and the adapter's change after
    three steps, at each context both ran."""
    rows = []
    log("")
    log(f"losses and adapter, {new} against {base} (the same initial weights, adapter and batch):")
    log(f"| context | step | loss, {base} | loss, {new} | loss rel. diff | grad norm rel. diff |")
    log("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for seq_len in sorted({k[0] for k in results if k[1] == new}):
        b, n = results[(seq_len, base)], results[(seq_len, new)]
        for i, (lb, ln) in enumerate(zip(b["losses"], n["losses"])):
            log(f"| {seq_len} | {i + 1} | {lb:.6f} | {ln:.6f} | {abs(ln - lb) / max(abs(lb), 1e-30):.1e} | "
                f"{abs(n['grad_norms'][i] - b['grad_norms'][i]) / b['grad_norms'][i]:.1e} |")
        db, dn = torch.load(b["adapter"]).double(), torch.load(n["adapter"]).double()
        rows.append({"seq_len": seq_len, "adapter_update_rel_diff": float((dn - db).norm() / db.norm()),
                     "adapter_update_cosine": float(torch.nn.functional.cosine_similarity(dn, db, dim=0))})
        rows[-1]["code"] = new
        log(f"{seq_len}: adapter change after 3 steps (float32 masters), {new} against {base}: relative difference "
            f"{rows[-1]['adapter_update_rel_diff']:.2e}, cosine {rows[-1]['adapter_update_cosine']:.6f}")
    return rows


def fp8_matmul_table(device: str) -> None:
    """bf16 ``mm`` against FP8 ``torch._scaled_mm`` (row-wise scales, bf16 out) on the layer's product
    shapes at 8192 tokens, and the row quantization of the input alone, each the median of 20."""
    if device != "cuda":
        return
    from training.fp8 import Fp8Weight, chosen_quantize

    quantize = chosen_quantize(device, torch.bfloat16).quantize_rows

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(20):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[10]

    log("")
    log("| product (tokens x in -> out) | bf16 mm TFLOP/s | FP8 _scaled_mm TFLOP/s | row quantization of the input, ms | FP8 with it, speed-up |")
    log("| --- | ---: | ---: | ---: | ---: |")
    for name, (m, k, n) in {"q/k/v stacked": (8192, 4096, 6144), "o": (8192, 4096, 4096),
                            "gate/up stacked": (8192, 4096, 24576), "down": (8192, 12288, 4096),
                            "down input gradient": (8192, 4096, 12288)}.items():
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        f = Fp8Weight.of(w)
        xq, xs = quantize(x)
        t_bf16 = timed(lambda: x @ w.t())
        t_fp8 = timed(lambda: f.forward(xq, xs, torch.bfloat16))
        t_q = timed(lambda: quantize(x))
        flop = 2 * m * k * n
        log(f"| {name} ({m} x {k} -> {n}) | {flop / t_bf16 / 1e12:.0f} | {flop / t_fp8 / 1e12:.0f} | {t_q * 1e3:.3f} | "
            f"{t_bf16 / (t_fp8 + t_q):.2f}x |")
        del x, w, f, xq, xs


def loss_curve(args, here: Path, tmp: str) -> dict:
    """This tree's step in bf16 and in FP8 mode for ``--loss-curve`` steps on the same batches (``--batches``
    of them in turn) at the first context, each in a process of its own; prints the two loss curves side
    by side."""
    seq_len = int(args.contexts.split(",")[0])
    curves = {}
    for label, variant in (("bf16", ""), ("fp8", "fp8")):
        out = Path(tmp) / f"curve-{label}.json"
        cmd = [sys.executable, str(here), "--step-worker", "--code-tree", str(here.parents[1]), "--device", args.device,
               "--model", args.model, "--contexts", str(seq_len), "--mode", args.mode, "--steps", str(args.loss_curve),
               "--warmup", "0", "--json", str(out), "--lr", str(args.curve_lr), "--batches", str(args.curve_batches),
               *(["--variant", variant] if variant else []), *(["--layers", str(args.layers)] if args.layers else [])]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            log(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"loss curve, {label}: the step worker failed ({proc.returncode})")
        curves[label] = json.loads(out.read_text())
        log(f"loss curve {label}: {args.loss_curve} steps at {seq_len} in {time.perf_counter() - t0:.0f} s "
            f"(median step {curves[label]['step_s']:.3f} s); {curves[label]['step_kernels'][-200:]}")
    bf, f8 = curves["bf16"]["losses"], curves["fp8"]["losses"]
    diffs = [abs(b - f) / max(abs(b), 1e-30) for b, f in zip(bf, f8)]
    log("")
    log(f"loss curve at {seq_len} tokens, lr {args.curve_lr:g}, {args.curve_batches} batches in turn, the same in both runs:")
    log("| step | loss, bf16 | loss, FP8 base weights | rel. diff | grad norm, bf16 | grad norm, FP8 |")
    log("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, (b, f) in enumerate(zip(bf, f8)):
        log(f"| {i + 1} | {b:.6e} | {f:.6e} | {diffs[i]:.1e} | {curves['bf16']['grad_norms'][i]:.4e} | "
            f"{curves['fp8']['grad_norms'][i]:.4e} |")
    summary = {"loss_curve_steps": len(bf), "max_rel_diff": max(diffs), "mean_rel_diff": sum(diffs) / len(diffs),
               "first_loss": [bf[0], f8[0]], "last_loss": [bf[-1], f8[-1]], "bf16": bf, "fp8": f8}
    log(f"loss curve: FP8 against bf16, largest rel. diff {summary['max_rel_diff']:.1e}, mean {summary['mean_rel_diff']:.1e}; "
        f"first loss {bf[0]:.6e} / {f8[0]:.6e}, last {bf[-1]:.6e} / {f8[-1]:.6e}")
    return summary



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8b")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-decoder", action="store_true", help="skip the benchmark decoder's rows")
    parser.add_argument("--budget-s", type=float, default=540, help="skip what would start after this")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--ranks", type=int, default=0, help="measure data-parallel scaling on 1 and on this many ranks")
    parser.add_argument("--mode", default="attention_output", choices=RECOMPUTE_MODES, help="recompute mode (--ranks)")
    parser.add_argument("--sequences-per-rank", type=int, default=2, help="sequences each rank trains per step (--ranks)")
    parser.add_argument("--scaling-worker", action="store_true", help=argparse.SUPPRESS)  # one rank of --ranks
    parser.add_argument("--compare-with", default=None, metavar="TREE",
                        help="time today's step from TREE (a git worktree of the baseline commit) and this tree's, "
                             "--mode only, each context in its own process, side by side")
    parser.add_argument("--baseline-label", default="1ec7686", help="what --compare-with's tree is called in the tables")
    parser.add_argument("--step-worker", action="store_true", help=argparse.SUPPRESS)  # one run of --compare-with
    parser.add_argument("--code-tree", default=None, help=argparse.SUPPRESS)  # read before the imports, above
    parser.add_argument("--save-adapter", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ablate", default="", help="with --compare-with: also run this tree with each named piece "
                        f"left out ({', '.join(VARIANTS)})")
    parser.add_argument("--ablate-contexts", default="8192", help="the contexts --ablate runs at")
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)  # one --ablate run
    parser.add_argument("--fp8", action="store_true", help="with --compare-with: also run this tree with FP8 "
                        "products for the frozen weights (training.fp8) at every context")
    parser.add_argument("--lr", type=float, default=1e-5, help="the adapter's learning rate in the compared steps")
    parser.add_argument("--batches", type=int, default=1, help="step i trains batch i mod this (compared steps)")
    parser.add_argument("--loss-curve", type=int, default=0, metavar="STEPS",
                        help="with --compare-with: this tree's bf16 and FP8 steps for STEPS steps on the same batches "
                             "at the first context, the loss curves side by side")
    parser.add_argument("--curve-lr", type=float, default=1e-3, help="the learning rate of --loss-curve")
    parser.add_argument("--curve-batches", type=int, default=1, help="how many batches --loss-curve cycles through")
    parser.add_argument("--precision-check", action="store_true",
                        help="the bf16 step, today's arithmetic and the fused one, against float32 (use --layers)")
    args = parser.parse_args()
    if args.scaling_worker:
        return scaling_worker(args)
    if args.step_worker:
        return step_worker(args)
    if args.precision_check:
        return precision_check(args)
    if args.compare_with:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("bench/trainer_throughput.py --compare-with needs a CUDA device (or --device cpu for a smoke run)")
        return compare(args)
    if args.ranks:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("bench/trainer_throughput.py --ranks needs CUDA devices (or --device cpu for a smoke run)")
        return scaling(args)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/trainer_throughput.py needs a CUDA device (or --device cpu for a smoke run)")
    started = time.perf_counter()
    rb.DEVICE = device
    dtype = torch.bfloat16
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        try:
            import flash_attn  # noqa: F401

            fa = f"flash-attn {flash_attn.__version__}"
        except ImportError:
            fa = "no flash-attn"
        log(f"device {props.name}, {props.total_memory / GIB:.0f} GiB; torch {torch.__version__}; "
            f"cuDNN {torch.backends.cudnn.version()}; {fa}")
    choice = chosen_attention_kernels(device, dtype)
    log(f"attention kernels chosen: {choice.kernels.name} (vs float32 reference: "
        + ", ".join(f"{k} {v:.1e}" for k, v in choice.errors.items()) + ")"
        + ("; passed over: " + "; ".join(f"{k}: {v}" for k, v in choice.rejected.items()) if choice.rejected else ""))
    check_backend_modes(device, dtype)
    matmul = matmul_tflops(n=512 if device == "cpu" else 8192, reps=3 if device == "cpu" else 20, device=device)
    gpu_name, peak = device_peak_tflops(device)
    log(f"measured bf16 matmul (8192^3, 2 s warm-up, median of 20 samples of 5): {matmul:.3g} TFLOP/s")
    log(describe(gpu_name, peak, matmul))

    if device == "cpu":
        shape = tiny_shape()
        config = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                             intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                             num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                             head_dim=shape.head_dim, tie_word_embeddings=False)
    else:
        shape, config = qwen3_config(args.model, args.layers)
    h, layers = shape.hidden_size, shape.num_layers
    log(f"model FLOPs per token = {layers}*(4*P_frozen + 6*P_LoRA + 6*S*{shape.q_size}) + 4*{h}*{shape.vocab_size}, "
        f"P_frozen = {shape.base_params_per_layer():,} and P_LoRA = {shape.lora_params_per_layer():,} per layer "
        f"(rank {shape.lora_rank}); S = context")

    contexts = [int(s) for s in args.contexts.split(",") if s]
    rows = []
    for seq_len in contexts:
        flops_per_token = shape.train_flops_per_token(seq_len)
        batch = batch_of(seq_len, shape.vocab_size, seed=seq_len)
        for mode in RECOMPUTE_MODES:
            for model_kind in ("backend",) + (() if args.no_decoder else ("decoder",)):
                if time.perf_counter() - started > args.budget_s:
                    log(f"{seq_len:>6} {model_kind:>7} {mode:>16}: skipped (time budget {args.budget_s:.0f} s spent)")
                    rows.append({"seq_len": seq_len, "model": model_kind, "mode": mode, "skipped": True})
                    continue
                if model_kind == "backend":
                    try:
                        backend = build_backend(config, device, dtype, mode, seq_len, shape.lora_rank)
                    except torch.cuda.OutOfMemoryError:
                        rows.append({"seq_len": seq_len, "model": model_kind, "mode": mode, "oom": True})
                        log(f"{seq_len:>6} {model_kind:>7} {mode:>16}: out of memory building the model")
                        continue

                    def step():
                        backend.train_step(batch, DEFAULT_LOSS)
                else:
                    torch.manual_seed(0)
                    decoder = Qwen3Decoder(shape, dtype=dtype, device=device, kernels=choice.kernels)
                    optimizer = torch.optim.AdamW(decoder.lora_parameters(), lr=1e-5)
                    gen = torch.Generator(device=device).manual_seed(seq_len)
                    ids = torch.randint(0, shape.vocab_size, (1, seq_len + 1), device=device, generator=gen)
                    serving = -torch.rand(1, seq_len, device=device, generator=gen) * 3
                    mask = torch.ones(1, seq_len, device=device)
                    mask[:, : seq_len // 8] = 0
                    adv = torch.tensor([0.5], device=device)

                    def step():
                        rb.train_step(decoder, optimizer, ids, serving, mask, adv, mode)
                r = time_steps(step, device, args.warmup, args.steps)
                r.update(seq_len=seq_len, model=model_kind, mode=mode)
                if not r["oom"]:
                    r["tokens_per_s"] = seq_len / r["step_s"]
                    r["model_tflops"] = seq_len * flops_per_token / r["step_s"] / 1e12
                    r["mfu"] = mfu(r["model_tflops"], peak)
                    log(f"{seq_len:>6} {model_kind:>7} {mode:>16}: step {r['step_s']:.3f} s "
                        f"(all {', '.join(f'{t:.3f}' for t in r['step_s_all'])}), peak {r['peak_gib']:.1f} GiB, "
                        f"{r['tokens_per_s']:.0f} tok/s, MFU {percent(r['mfu'])}, "
                        f"{r['model_tflops'] / matmul:.1%} of the measured matmul")
                else:
                    log(f"{seq_len:>6} {model_kind:>7} {mode:>16}: out of memory")
                rows.append(r)
                if model_kind == "backend":
                    del backend
                else:
                    del decoder, optimizer
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()

    matmul_end = matmul_tflops(n=512 if device == "cpu" else 8192, reps=3 if device == "cpu" else 20, device=device)
    log(f"bf16 matmul measured again after the steps: {matmul_end:.3g} TFLOP/s; the share of the measured matmul "
        f"below is of the larger, {max(matmul, matmul_end):.3g}")
    matmul = max(matmul, matmul_end)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"datasheet_peak_tflops": peak, "matmul_tflops": matmul,
                                         "kernels": choice.kernels.name, "rows": rows}, indent=1))
    log("")
    log(f"| context | model | mode | step s | step vs full | tokens/s | vs before | vs decoder | {mfu_header(peak)}"
        f" | of measured matmul ({matmul:.3g} TFLOP/s) | peak GiB | peak vs full |")
    log("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    by_key = {(r["seq_len"], r["model"], r["mode"]): r for r in rows}

    def ok(r):
        return r is not None and not r.get("oom") and not r.get("skipped")

    for r in rows:
        if not ok(r):
            log(f"| {r['seq_len']} | {r['model']} | {r['mode']} | {'skipped' if r.get('skipped') else 'out of memory'} "
                "| | | | | | | | |")
            continue
        full = by_key.get((r["seq_len"], r["model"], "full"))
        vs_full = (f"{r['step_s'] / full['step_s'] - 1:+.1%}", f"{r['peak_gib'] / full['peak_gib']:.2f}x") if ok(full) else ("", "")
        before = BEFORE_TOKENS_PER_S.get((r["seq_len"], r["mode"])) if r["model"] == "backend" and device == "cuda" else None
        vs_before = f"{r['tokens_per_s'] / before:.2f}x of {before}" if before else ""
        dec = by_key.get((r["seq_len"], "decoder", r["mode"])) if r["model"] == "backend" else None
        vs_dec = f"{r['tokens_per_s'] / dec['tokens_per_s']:.2f}x" if ok(dec) else ""
        log(f"| {r['seq_len']} | {r['model']} | {r['mode']} | {r['step_s']:.3f} | {vs_full[0]} | {r['tokens_per_s']:.0f} | "
            f"{vs_before} | {vs_dec} | {percent(r['mfu'])} | {r['model_tflops'] / matmul:.1%} | {r['peak_gib']:.1f} | "
            f"{vs_full[1]} |")
    log(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
