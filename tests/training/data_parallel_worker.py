"""One rank of ``test_data_parallel.py``'s step check, started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/training/data_parallel_worker.py MODEL OUT

Each rank builds the torch/peft backend on the tiny model (data parallel over the gloo world), gives
it the adapter :func:`perturb` makes, takes the steps of :func:`step_batches` and saves, after each
step, its result, the summed float32 gradients and the adapter to ``OUT/rank{R}-step{S}.pt``. The
test takes the same steps in one process and compares.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from training.backends.parallel import DataParallel  # noqa: E402
from training.backends.torch_peft import TorchPeftBackend  # noqa: E402
from training.grpo import LossConfig, TrainBatch  # noqa: E402

BACKEND_ARGS = {"lora_rank": 4, "lora_alpha": 8, "seed": 3, "micro_batch_tokens": 40,
                "max_grad_norm": 0.05, "learning_rate": 1e-2}
LOSS = LossConfig(kl_coef=0.1)


def step_batches(vocab_size: int) -> list[TrainBatch]:
    """Two steps: seven sequences of mixed lengths (three groups' worth, split 4 + 3 across two
    ranks), then a single sequence (the second rank's shard is empty)."""
    gen = torch.Generator().manual_seed(5)
    batches = []
    for lengths in ([9, 23, 14, 31, 6, 17, 12], [19]):
        ids, masks, lps, advs = [], [], [], []
        for n in lengths:
            prompt = max(2, n // 4)
            ids.append(torch.randint(0, vocab_size, (n,), generator=gen).tolist())
            masks.append([0] * prompt + [1] * (n - prompt))
            lps.append([0.0] * prompt + (-torch.rand(n - prompt, generator=gen) * 3).tolist())
            advs.append(float(torch.randn((), generator=gen)))
        batches.append(TrainBatch(ids, masks, lps, advs))
    return batches


def perturb(backend: TorchPeftBackend) -> None:
    """A random adapter (a fresh one's B is zero, which would hide A's gradient), the same everywhere."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in backend.params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    backend.refresh_masters()


def run_steps(backend: TorchPeftBackend, save) -> None:
    vocab = backend.model.get_base_model().config.vocab_size
    perturb(backend)
    for step, batch in enumerate(step_batches(vocab), start=1):
        result = backend.train_step(batch, LOSS)
        save(step, {"result": dataclasses.asdict(result),
                    "grads": [m.grad.detach().clone() for m in backend.masters],
                    "adapter": {k: v.clone() for k, v in backend.adapter_state_dict().items()}})


def main() -> None:
    import torch.distributed as dist

    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend = TorchPeftBackend(model, **BACKEND_ARGS, data_parallel=DataParallel.of_world())
    assert backend.data_parallel.size == dist.get_world_size()
    run_steps(backend, lambda step, data: torch.save(data, out / f"rank{rank}-step{step}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
