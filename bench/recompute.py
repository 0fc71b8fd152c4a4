"""Step time and peak memory of long-context LoRA training under three recomputation modes.

    python bench/recompute.py --model 8b --contexts 8192,32768,65536 --probe 131072

On one GPU, a Qwen3-shaped decoder with random bf16 weights and rank-32 LoRA on the seven
projections of every layer takes GRPO steps (forward, chunked token log-probabilities, the GRPO
loss of ``training.grpo``, backward, AdamW on the adapter) on one packed sequence per context
length, once for each mode, side by side in this one run:

- ``none``: every activation kept;
- ``full``: each layer under ``torch.utils.checkpoint`` (only its input kept; backward repeats the
  whole layer, attention included);
- ``attention_output``: ``training.recompute`` (layer input, attention output and log-sum-exp kept;
  backward repeats norms, projections and MLP but not the frozen down product, whose result it never
  reads, and feeds the attention backward kernel with the saved output and log-sum-exp).

At the ``--ablate`` contexts it also times variants that undo this module's two speed-ups, so each
is measured in the same run: ``+down-replayed`` (ours replays the down projection's frozen product
too, as a full recomputation does) and ``+unfused-lora`` (the LoRA update scaled and added in
separate passes instead of in the frozen GEMM's epilogue; it applies to every mode).
``attention_output+unfused-lora+down-replayed`` is the scheme as it was before both.

Attention runs on ``training.attention.chosen_attention_kernels`` (``--kernels auto``: cuDNN on
Hopper, flash-attn where installed), the same kernels in every mode. Before timing it checks on the
device that the attention kernels match a float32 reference, that
the three modes give the same adapter gradients on a small model, and that the torch/peft trainer
backend's ``recompute`` option gives the step of ``recompute="none"`` on a small random Hugging
Face Qwen3 (bf16, right-padded rows in two micro-batches). It reports model FLOPs utilisation as
``bench/mfu.py`` defines it (model FLOPs as ``DecoderShape.train_flops_per_token`` counts them, over the
GPU's datasheet dense bf16 peak), beside the share of a large random bf16 matmul measured in the run.
``--probe`` runs one untimed-warmup-free step at a longer context for the recomputing modes to show
what fits. Results go to stdout (a table last) and, with ``--json``, to a file.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mfu import describe, device_peak_tflops, matmul_tflops, mfu, mfu_header, percent  # noqa: E402  (bench/mfu.py)

from training.grpo import DEFAULT_LOSS, TrainBatch, grpo_loss  # noqa: E402
from training.attention import chosen_attention_kernels  # noqa: E402
from training.backends.torch_peft import TorchPeftBackend  # noqa: E402
from training.recompute import RECOMPUTE_MODES  # noqa: E402
from training.reference_decoder import DecoderShape, LoRALinear, Qwen3Decoder  # noqa: E402

GIB = 1024**3
DEVICE = "cuda"  # --device cpu runs the same code paths on tiny shapes, for a smoke test without a GPU


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_kernels(kernels, s: int = 1000) -> bool:
    """The attention kernels (grouped-query k/v, causal) against a float32 reference, on random data."""
    torch.manual_seed(1)
    b, h, hk, d = 2, 8, 2, 128
    q = torch.randn(b, h, s, d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(b, hk, s, d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(b, hk, s, d, device=DEVICE, dtype=torch.bfloat16)
    scale = d**-0.5
    out, lse, state = kernels.forward(q, k, v, scale)
    grad = torch.randn_like(out)
    dq, dk, dv = kernels.backward(grad, q, k, v, out, lse, state, scale)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    scores = (qf @ kf.repeat_interleave(h // hk, 1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    ref = torch.softmax(scores, -1) @ vf.repeat_interleave(h // hk, 1)
    ref_lse = torch.logsumexp(scores, -1)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    errs = {"out": _rel(out, ref), "lse": _rel(lse.reshape(b, h, -1)[..., :s], ref_lse), "dq": _rel(dq, rq), "dk": _rel(dk, rk), "dv": _rel(dv, rv)}
    log(f"kernel check {kernels.name} vs float32 reference (relative error): "
        + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    return all(e < 2e-2 for e in errs.values())


def checked_kernels(small: bool, prefer: str = "auto"):
    """The attention kernels ``training.attention.chosen_attention_kernels`` picks (fastest first,
    checked against a float32 reference, grouped-query k/v or else expanded), checked here again."""
    choice = chosen_attention_kernels(DEVICE, torch.bfloat16, prefer)
    for name, why in choice.rejected.items():
        log(f"kernel check {name}: passed over ({why})")
    if not check_kernels(choice.kernels, 64 if small else 1000):
        raise SystemExit("attention kernels disagree with the reference")
    return choice.kernels


def check_modes(kernels, seq_len: int = 2048) -> None:
    """The three modes give the same adapter gradients on a small bf16 model on the device."""
    shape = DecoderShape(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                         intermediate_size=1536, vocab_size=4096, lora_rank=16, lora_alpha=32)
    torch.manual_seed(2)
    model = Qwen3Decoder(shape, dtype=torch.float32, device=DEVICE, kernels=kernels)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(std=0.05)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, shape.vocab_size, (1, seq_len + 1), device=DEVICE)
    grads = {}
    for mode in RECOMPUTE_MODES:
        model.zero_grad(set_to_none=True)
        hidden = model(ids[:, :-1], recompute=mode)
        model.token_logprobs(hidden, ids[:, 1:]).mean().backward()
        grads[mode] = torch.cat([p.grad.float().flatten() for p in model.lora_parameters()])
    errs = {m: _rel(grads[m], grads["none"]) for m in ("full", "attention_output")}
    log("mode check, adapter gradients vs no recomputation (relative error, bf16): "
        + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    if not all(e < 2e-2 for e in errs.values()):
        raise SystemExit(f"recomputation modes disagree: {errs}")


def check_backend(small: bool) -> None:
    """The torch/peft trainer backend's ``recompute`` modes give the same step on a small random HF Qwen3."""
    config = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=2, head_dim=128,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    lengths = [20, 40, 30] if small else [700, 1500, 1100]
    gen = torch.Generator().manual_seed(5)
    batch = TrainBatch(
        input_ids=[torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths],
        loss_mask=[[0] * (n // 4) + [1] * (n - n // 4) for n in lengths],
        serving_logprobs=[[-3.0] * n for n in lengths],
        advantages=[0.5, -0.25, 1.0],
    )
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(4)
        Qwen3ForCausalLM(config).save_pretrained(folder)
        for mode in RECOMPUTE_MODES:
            backend = TorchPeftBackend(folder, lora_rank=16, lora_alpha=32, seed=6, device=DEVICE, recompute=mode,
                                       dtype="float32" if small else "bfloat16", micro_batch_tokens=2 * max(lengths),
                                       max_grad_norm=1e9)
            b_gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for name, p in backend.model.named_parameters():
                    if "lora_B" in name:  # a fresh adapter's B is zero, which would hide A's gradient
                        p.copy_(torch.randn(p.shape, generator=b_gen) * 0.05)
            backend.refresh_masters()
            step = backend.train_step(batch, DEFAULT_LOSS)
            grads = torch.cat([m.grad.float().flatten() for m in backend.masters])  # float32 masters of a bf16 adapter
            results[mode] = (step.loss, grads)
            del backend
    errs = {m: (abs(results[m][0] - results["none"][0]), _rel(results[m][1], results["none"][1]))
            for m in ("full", "attention_output")}
    log("backend check, torch/peft recompute vs none on a random HF Qwen3 (loss absolute, LoRA gradients relative): "
        + ", ".join(f"{m} {a:.1e} / {r:.1e}" for m, (a, r) in errs.items()))
    if not all(r < 3e-2 and a < 1e-2 for a, r in errs.values()):
        raise SystemExit(f"the backend's recompute modes disagree: {errs}")


def _unfused_lora_forward(self, x):
    return F.linear(x, self.weight) + self.lora_delta(x)


@contextmanager
def variant(model: Qwen3Decoder, label: str):
    """Run ``label``'s ablations: ``+unfused-lora`` and ``+down-replayed`` (see the module docstring)."""
    fused = LoRALinear.forward
    try:
        if "+unfused-lora" in label:
            LoRALinear.forward = _unfused_lora_forward
        if "+down-replayed" in label:
            for layer in model.layers:
                layer.mlp_input = None  # an instance attribute: backward replays the whole half
        yield
    finally:
        LoRALinear.forward = fused
        for layer in model.layers:
            layer.__dict__.pop("mlp_input", None)


def train_step(model: Qwen3Decoder, optimizer, ids, serving_logprobs, loss_mask, advantages, mode: str) -> float:
    hidden = model(ids[:, :-1], recompute=mode)
    logprobs = model.token_logprobs(hidden, ids[:, 1:])
    del hidden
    loss, _ = grpo_loss(logprobs, serving_logprobs, loss_mask, advantages)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure(model, optimizer, seq_len: int, label: str, warmup: int, steps: int) -> dict:
    """Median step time and peak memory of ``steps`` steps after ``warmup`` steps; OOM is a result.
    ``label`` is a mode, possibly with ablations (``attention_output+down-replayed``)."""
    mode = label.split("+")[0]
    gen = torch.Generator(device=DEVICE).manual_seed(seq_len)
    ids = torch.randint(0, model.shape.vocab_size, (1, seq_len + 1), device=DEVICE, generator=gen)
    serving = -torch.rand(1, seq_len, device=DEVICE, generator=gen) * 3
    mask = torch.ones(1, seq_len, device=DEVICE)
    mask[:, : seq_len // 8] = 0  # the prompt
    adv = torch.tensor([0.5], device=DEVICE)
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            with variant(model, label):
                train_step(model, optimizer, ids, serving, mask, adv, mode)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return {"seq_len": seq_len, "mode": label, "oom": True}
    times.sort()
    step_s = times[len(times) // 2]
    return {
        "seq_len": seq_len, "mode": label, "oom": False, "steps": steps, "step_s": step_s,
        "step_s_all": times, "peak_gib": torch.cuda.max_memory_allocated() / GIB if DEVICE == "cuda" else float("nan"),
        "tokens_per_s": seq_len / step_s,
        "model_tflops": seq_len * model.shape.train_flops_per_token(seq_len) / step_s / 1e12,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8b", help="Qwen3 shape: 0.6b, 1.7b, 4b, 8b, 14b")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--contexts", default="8192,32768,65536")
    parser.add_argument("--probe", default="131072", help="longer contexts to try once (comma list, or empty)")
    parser.add_argument("--ablate", default="8192", help="contexts (of --contexts) that also time the ablations")
    parser.add_argument("--no-backend-check", action="store_true", help="skip the torch/peft backend check")
    parser.add_argument("--kernels", default="auto",
                        help="attention kernels: auto (fastest checked), cudnn, torch-flash-cuda, torch-efficient-cuda, flash-attn")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=480, help="skip what would start after this")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the code paths")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/recompute.py needs a CUDA device (or --device cpu for a smoke run)")
    started = time.perf_counter()
    small = DEVICE == "cpu"
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name = f"{props.name}, {props.total_memory / GIB:.0f} GiB"
    else:
        device_name = "cpu"
    log(f"device {device_name}; torch {torch.__version__}")

    kernels = checked_kernels(small, args.kernels)
    check_modes(kernels, seq_len=64 if small else 2048)
    if not args.no_backend_check:
        try:  # a failure here is reported and does not cost the timings below
            check_backend(small)
        except (Exception, SystemExit) as e:  # noqa: BLE001
            log(f"backend check FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    matmul = matmul_tflops(n=512 if small else 8192, reps=3 if small else 20, device=DEVICE)
    gpu_name, peak = device_peak_tflops(DEVICE)
    log(f"measured bf16 matmul (8192^3, 2 s warm-up, median of 20 samples of 5): {matmul:.3g} TFLOP/s")
    log(describe(gpu_name, peak, matmul))

    overrides = {"num_layers": args.layers} if args.layers else {}
    shape = DecoderShape.qwen3(args.model, **overrides)
    torch.manual_seed(0)
    model = Qwen3Decoder(shape, dtype=torch.bfloat16, device=DEVICE, kernels=kernels)
    params = sum(p.numel() for p in model.parameters())
    lora = sum(p.numel() for p in model.lora_parameters())
    optimizer = torch.optim.AdamW(model.lora_parameters(), lr=1e-5)
    log(f"model Qwen3-{args.model} shape{' ' + str(overrides) if overrides else ''}: {params / 1e9:.2f}B params "
        f"(bf16, random), LoRA rank {shape.lora_rank}: {lora / 1e6:.1f}M trainable; "
        f"weights {torch.cuda.memory_allocated() / GIB if DEVICE == 'cuda' else float('nan'):.1f} GiB")

    results = []
    ablations = ("full+unfused-lora", "attention_output+down-replayed", "attention_output+unfused-lora+down-replayed")
    ablate = {int(s) for s in args.ablate.split(",") if s}
    plan = [(int(s), args.warmup, args.steps, RECOMPUTE_MODES + (ablations if int(s) in ablate else ()))
            for s in args.contexts.split(",") if s]
    plan += [(int(s), 0, 1, ("full", "attention_output")) for s in args.probe.split(",") if s]
    none_oom_at = None
    for seq_len, warmup, steps, modes in plan:
        for mode in modes:
            if time.perf_counter() - started > args.budget_s:
                log(f"{seq_len:>7} {mode:>16}: skipped (time budget {args.budget_s:.0f} s spent)")
                results.append({"seq_len": seq_len, "mode": mode, "skipped": True})
                continue
            if mode == "none" and none_oom_at is not None and seq_len > none_oom_at:
                log(f"{seq_len:>7} {mode:>16}: skipped (out of memory at {none_oom_at})")
                results.append({"seq_len": seq_len, "mode": mode, "oom": True, "skipped": True})
                continue
            r = measure(model, optimizer, seq_len, mode, warmup, steps)
            results.append(r)
            if r["oom"]:
                none_oom_at = seq_len if mode == "none" else none_oom_at
                log(f"{seq_len:>7} {mode:>16}: out of memory")
            else:
                log(f"{seq_len:>7} {mode:>16}: step {r['step_s']:.3f} s (all {', '.join(f'{t:.3f}' for t in r['step_s_all'])}), "
                    f"peak {r['peak_gib']:.1f} GiB, {r['tokens_per_s']:.0f} tok/s, MFU {percent(mfu(r['model_tflops'], peak))}, "
                    f"{r['model_tflops'] / matmul:.1%} of the measured matmul")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "shape": shape.__dict__, "datasheet_peak_tflops": peak,
                                         "matmul_tflops": matmul,
                                         "kernels": kernels.name, "device": device_name, "results": results}, indent=1))
    log("")
    log(f"| context | mode | step s | peak GiB | tokens/s | {mfu_header(peak)} "
        f"| of measured matmul ({matmul:.3g} TFLOP/s) | step vs full | peak vs full |")
    log("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    by_key = {(r["seq_len"], r["mode"]): r for r in results}
    for r in results:
        if r.get("skipped") and not r.get("oom"):
            log(f"| {r['seq_len']} | {r['mode']} | skipped | | | | | | |")
            continue
        if r.get("oom"):
            log(f"| {r['seq_len']} | {r['mode']} | out of memory | | | | | | |")
            continue
        # an ablation of the LoRA path is compared with full recomputation on the same path
        full = by_key.get((r["seq_len"], "full+unfused-lora" if "+unfused-lora" in r["mode"] else "full"))
        vs = ("", "")
        if full and not full.get("oom") and not full.get("skipped"):
            vs = (f"{r['step_s'] / full['step_s'] - 1:+.1%}", f"{r['peak_gib'] / full['peak_gib']:.2f}x")
        log(f"| {r['seq_len']} | {r['mode']} | {r['step_s']:.3f} | {r['peak_gib']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{percent(mfu(r['model_tflops'], peak))} | {r['model_tflops'] / matmul:.1%} | {vs[0]} | {vs[1]} |")
    log(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
