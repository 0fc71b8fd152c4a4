"""The Megatron-core backend with tensor parallelism: checks against Hugging Face/peft, then throughput.

    torchrun --nproc-per-node 2 bench/megatron_tp.py --device cuda --throughput 1.7b
    python -m torch.distributed.run --nproc-per-node 2 bench/megatron_tp.py --device cpu   # checks only
    python -m torch.distributed.run --nproc-per-node 2 bench/megatron_tp.py --device cpu --tensor-parallel-size 1

With ``--tensor-parallel-size`` below the number of processes the ranks form data-parallel replicas
(two replicas of one rank each above), and the same checks hold: each replica steps on its shard of the
batch, and the summed step is the torch/peft backend's on the whole batch in one process.

Checks (a tiny random Qwen3 saved as a Hugging Face folder, float32):

1. token log-probabilities of the tensor-parallel model match the Hugging Face model's;
2. with the same random peft adapter loaded into both, one GRPO step of this backend and of the
   torch/peft backend on the same batch give the same loss and the same updated adapter;
3. the adapter this backend saves loads into peft on the Hugging Face model and gives this
   backend's log-probabilities;
4. ``save_state`` then ``load_state`` restores the adapter after a further step.

``--throughput SIZE`` then times GRPO steps of a Qwen3-SIZE-shaped model with random bf16 weights
(rank-32 LoRA) and prints step time, tokens/s and model FLOPs utilisation as ``bench/mfu.py`` defines
it (over the GPUs' datasheet dense bf16 peak), beside the share of the bf16 matmul rates measured in
the same run on each GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mfu import describe, device_peak_tflops, matmul_tflops, mfu, mfu_header, percent  # noqa: E402  (bench/mfu.py)
from training.backends.torch_peft import TorchPeftBackend  # noqa: E402
from training.grpo import DEFAULT_LOSS, TrainBatch  # noqa: E402
from training.reference_decoder import DecoderShape  # noqa: E402


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def shared_tmpdir() -> Path:
    holder = [tempfile.mkdtemp(prefix="megatron-tp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def save_tiny_qwen3(path: Path) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)


def save_random_adapter(model_dir: Path, adapter_dir: Path, rank: int, alpha: int) -> None:
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                        "gate_proj", "up_proj", "down_proj"], lora_dropout=0.0, init_lora_weights=False,
                        task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(adapter_dir)


def hf_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_batch(vocab: int, lengths: list[int], seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    mask = [[0] * (n // 3) + [1] * (n - n // 3) for n in lengths]
    serving = [(-torch.rand(n, generator=g) * 4).tolist() for n in lengths]
    adv = torch.linspace(-1, 1, len(lengths)).tolist()
    return TrainBatch(input_ids=ids, loss_mask=mask, serving_logprobs=serving, advantages=adv)


def checks(device: str, tmp: Path, tensor_parallel_size: int | None = None) -> dict:
    from training.backends.megatron import MegatronBackend  # megatron-core is the optional gpu extra

    model_dir, adapter_dir = tmp / "tiny-qwen3", tmp / "adapter0"
    if dist.get_rank() == 0:
        save_tiny_qwen3(model_dir)
        save_random_adapter(model_dir, adapter_dir, rank=4, alpha=8)
    dist.barrier()
    results = {}
    backend = MegatronBackend(model_dir, lora_rank=4, lora_alpha=8, learning_rate=1e-2, device=device,
                              dtype="float32", micro_batch_tokens=64, max_grad_norm=0.5,
                              tensor_parallel_size=tensor_parallel_size)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        backend._set_lora(False)
        mine = backend.token_logprobs(ids.to(backend.device))
        backend._set_lora(True)
        results["base logprobs vs HF (rel)"] = rel(mine, hf_logprobs(hf, ids))

    backend.load_adapter(adapter_dir)
    peft_model = PeftModel.from_pretrained(hf, adapter_dir)
    with torch.no_grad():
        results["adapter logprobs vs peft (rel)"] = rel(backend.token_logprobs(ids.to(backend.device)), hf_logprobs(peft_model, ids))

    batch = make_batch(128, [17, 30, 41, 9, 26], seed=7)
    step = backend.train_step(batch, DEFAULT_LOSS)
    mine_after = backend.adapter_state_dict()
    if dist.get_rank() == 0:
        torch_backend = TorchPeftBackend(model_dir, lora_rank=4, lora_alpha=8, learning_rate=1e-2,
                                         micro_batch_tokens=64, max_grad_norm=0.5)
        set_peft_model_state_dict(torch_backend.model, load_file(str(adapter_dir / "adapter_model.safetensors")))
        ref_step = torch_backend.train_step(batch, DEFAULT_LOSS)
        ref_after = torch_backend.adapter_state_dict()
        results["GRPO loss vs torch/peft backend (abs)"] = abs(step.loss - ref_step.loss)
        results["grad norm vs torch/peft backend (rel)"] = abs(step.grad_norm - ref_step.grad_norm) / ref_step.grad_norm
        keys = sorted(ref_after)
        if sorted(mine_after) != keys:
            raise SystemExit(f"adapter keys differ: {sorted(set(mine_after) ^ set(keys))[:4]}")
        results["adapter after one step vs torch/peft backend (max rel)"] = max(rel(mine_after[k], ref_after[k]) for k in keys)

    ckpt = tmp / "step_000001"
    backend.save_state(ckpt)
    saved = backend.adapter_state_dict()
    if dist.get_rank() == 0:
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ckpt / "adapter")
        with torch.no_grad():
            results["saved adapter in peft vs backend logprobs (rel)"] = rel(
                hf_logprobs(reloaded, ids), backend.token_logprobs(ids.to(backend.device)))
    else:
        with torch.no_grad():
            backend.token_logprobs(ids.to(backend.device))  # the vocabulary-parallel collectives need every rank
    backend.train_step(make_batch(128, [12, 33], seed=8), DEFAULT_LOSS)
    backend.load_state(ckpt)
    restored = backend.adapter_state_dict()
    results["load_state restores adapter (max abs)"] = max(float((restored[k] - saved[k]).abs().max()) for k in saved)
    return results


def save_random_qwen3(path: Path, size: str) -> None:
    """A Qwen3-shaped Hugging Face folder with random bf16 weights (256 random rows per matrix, tiled)."""
    s = DecoderShape.qwen3(size)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)

    def w(o, i):
        # 256 random rows tiled to o: drawing billions of normals on the CPU takes minutes, and
        # repeated rows time the same as independent ones (only all-zero data runs faster).
        block = (torch.randn(min(o, 256), i, generator=g) * i**-0.5).to(torch.bfloat16)
        return block.repeat(-(-o // block.shape[0]), 1)[:o].contiguous()

    h = s.hidden_size
    tensors = {"model.embed_tokens.weight": w(s.vocab_size, h), "lm_head.weight": w(s.vocab_size, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        tensors.update({
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.self_attn.q_norm.weight": torch.ones(s.head_dim, dtype=torch.bfloat16),
            f"{p}.self_attn.k_norm.weight": torch.ones(s.head_dim, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": w(s.q_size, h), f"{p}.self_attn.k_proj.weight": w(s.kv_size, h),
            f"{p}.self_attn.v_proj.weight": w(s.kv_size, h), f"{p}.self_attn.o_proj.weight": w(h, s.q_size),
            f"{p}.mlp.gate_proj.weight": w(s.intermediate_size, h), f"{p}.mlp.up_proj.weight": w(s.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": w(h, s.intermediate_size),
        })
    save_file(tensors, str(path / "model.safetensors"))


def throughput(size: str, model_dir: Path, seq_len: int, sequences: int, steps: int) -> None:
    from training.backends.megatron import MegatronBackend  # megatron-core is the optional gpu extra

    if dist.get_rank() == 0 and not (model_dir / "model.safetensors").is_file():
        t0 = time.perf_counter()
        save_random_qwen3(model_dir, size)
        log(f"wrote random Qwen3-{size} folder in {time.perf_counter() - t0:.0f} s")
    dist.barrier()
    matmuls = [None] * dist.get_world_size()
    dist.all_gather_object(matmuls, matmul_tflops())
    gpu_name, peak = device_peak_tflops("cuda")
    log(f"bf16 matmul 8192^3 per GPU: {', '.join(f'{m:.0f}' for m in matmuls)} TFLOP/s")
    log(describe(gpu_name, peak, min(matmuls)))
    backend = MegatronBackend(model_dir, lora_rank=32, lora_alpha=64, learning_rate=1e-5, device="cuda",
                              dtype="bfloat16", micro_batch_tokens=seq_len)
    log(f"Qwen3-{size} shape, TP={backend.tp}: weights per GPU {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    shape = DecoderShape.qwen3(size, lora_rank=32)
    batch = make_batch(shape.vocab_size, [seq_len] * sequences, seed=11)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = backend.train_step(batch, DEFAULT_LOSS)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        log(f"step {i}: {time.perf_counter() - t0:.3f} s, loss {result.loss:.4f}, grad norm {result.grad_norm:.3e}")
    times.sort()
    step_s = times[len(times) // 2]
    tokens = seq_len * sequences
    flops = tokens * shape.train_flops_per_token(seq_len)
    model_tflops = flops / step_s / 1e12
    gpus = dist.get_world_size()
    log(f"| model | TP | GPUs | tokens/step | step s (median of {steps}) | tokens/s | tokens/s/GPU | {mfu_header(peak)} "
        f"| of measured matmul ({sum(matmuls):.0f} TFLOP/s in all) | peak GiB (rank 0) |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    log(f"| Qwen3-{size} shape, random bf16, LoRA r32 | {backend.tp} | {gpus} | {tokens} | {step_s:.3f} | "
        f"{tokens / step_s:.0f} | {tokens / step_s / gpus:.0f} | {percent(mfu(model_tflops, peak, gpus))} | "
        f"{model_tflops / sum(matmuls):.1%} | {torch.cuda.max_memory_allocated() / 2**30:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--throughput", default="", help="Qwen3 size to time (cuda only), e.g. 1.7b or 8b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="ranks per model replica in the checks (default: all; fewer: data parallel replicas)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the random model for --throughput is written (kept; reused if there)")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    tmp = shared_tmpdir()
    try:
        if not args.skip_checks:
            results = checks(args.device, tmp, args.tensor_parallel_size)
            if dist.get_rank() == 0:
                for k, v in results.items():
                    print(f"check: {k}: {v:.2e}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
        if args.throughput:
            model_dir = args.model_dir or tmp / f"qwen3-{args.throughput}-random"
            throughput(args.throughput, model_dir, args.seq_len, args.sequences, args.steps)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
