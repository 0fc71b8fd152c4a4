"""One SFT step of the base model with the padding masked out of attention (before) against no
attention mask and the causal kernel (``training.base_model.masked_lm_loss``, after), on the demo's
own batches: the demonstrations of a built suite, tokenized with a built base model's tokenizer.

    .venv/bin/python bench/sft_step.py --home /tmp/demoRh [--steps 10] [--rounds 2]

``--home`` is a demo home (``posttrain demo --home DIR``): its ``datasets/`` suite and
``models/base`` tokenizer are read, and a fresh model of the same geometry is trained. Rounds
alternate the two ways on the same batches, so load from elsewhere falls on both.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from evals.bundled import read_suite  # noqa: E402
from evals.tasks import demonstration_tasks  # noqa: E402
from training.base_model import BaseModelSpec, masked_lm_loss, sft_examples  # noqa: E402
from training.demonstrations import augment, demonstrations, styled  # noqa: E402


def padded_mask_loss(model, ids, mask, attn):
    """The loss as SFT computed it before: the padding masked out of attention."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    return (nll * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, help="a demo home with datasets/ and models/base built")
    parser.add_argument("--steps", type=int, default=10, help="SFT steps per way per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    home = Path(args.home)
    suites = sorted((home / "datasets").glob("*/suite.json"))
    if not suites:
        raise SystemExit(f"{home}/datasets: no built suite (suite.json) found; run posttrain demo --home {home} first")
    spec = BaseModelSpec()
    tasks = demonstration_tasks(read_suite(suites[0].parent))
    demos = demonstrations(tasks, by_line=spec.answer_form == "replace")
    augmented = styled(augment(demos, spec.augment_copies, spec.seed, spec.rename_modules),
                       spec.verify_share, spec.retry_share, spec.seed, spec.retry_failures)
    tokenizer = AutoTokenizer.from_pretrained(home / "models" / "base")
    examples = sft_examples(tokenizer, augmented)
    rng = random.Random(0)
    batches = []
    for _ in range(args.steps):
        idx = rng.sample(range(len(examples)), spec.batch_size)
        width = max(len(examples[i][0]) for i in idx)
        batches.append((torch.tensor([examples[i][0] + [0] * (width - len(examples[i][0])) for i in idx]),
                        torch.tensor([examples[i][1] + [0] * (width - len(examples[i][1])) for i in idx],
                                     dtype=torch.float32),
                        torch.tensor([[1] * len(examples[i][0]) + [0] * (width - len(examples[i][0])) for i in idx])))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(home / "models" / "base"))
    model.train()
    ways = {"padding masked in attention (before)": padded_mask_loss, "no attention mask (after)": lambda model, ids, mask, _attn: masked_lm_loss(model, ids, mask)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for name, fn in ways.items():  # the same loss both ways, on the first batch
        model.zero_grad()
        print(f"{name}: loss on batch 0 {float(fn(model, *batches[0]).detach()):.6f}")
    for _ in range(args.rounds):
        for name, fn in ways.items():
            started = time.perf_counter()
            for batch in batches:
                model.zero_grad(set_to_none=True)
                fn(model, *batch).backward()
            times[name].append((time.perf_counter() - started) / len(batches))
    tokens = statistics.mean(int(batch[0].numel()) for batch in batches)
    print(f"{len(examples)} SFT examples, batches of {spec.batch_size} ({tokens:.0f} padded tokens on average), "
          f"torch threads {torch.get_num_threads()}, best of {args.rounds} rounds of {args.steps} steps")
    print("| loss | forward + backward a step | ratio |")
    print("| --- | --- | --- |")
    base = min(times["padding masked in attention (before)"])
    for name, runs in times.items():
        print(f"| {name} | {min(runs):.3f} s | {min(runs) / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
