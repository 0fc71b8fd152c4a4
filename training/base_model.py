"""The embedded default's base model, built here: no download is possible or needed.

``build_base_model(OUT, tasks)``:

1. trains a byte-level BPE tokenizer on the demonstrations (:mod:`training.demonstrations`): the
   demonstration tasks of the training split (:func:`evals.tasks.demonstration_tasks`), as compact prompts of :mod:`evals.actions` and
   their reference actions. Held-out tasks are never read, and neither are the bundled suite's RL
   tasks, so RL trains on tasks the base model has not seen solved;
2. builds a small Qwen2-style causal LM (``transformers.Qwen2Config``; ~0.4M parameters by default);
3. trains it briefly (supervised, full weights) on those demonstrations: the loss is on the action
   tokens and the end-of-text token only, so the model learns to answer a prompt with compact
   actions ending in ``commit``;
4. saves model, tokenizer and ``build.json`` (settings, data fingerprint, loss curve) with
   ``save_pretrained``, under a temporary name renamed into place.

A folder whose ``build.json`` matches the requested settings and data is reused. SFT is kept short on
purpose: the base model should solve some held-out tasks but far from all, so RL has room to improve.

    python -m training.base_model --tasks posttrain-data/datasets/bundled --out posttrain-data/models/base
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from training.backends.batch import micro_batches, pad_rows
from training.demonstrations import ANSWER, OBSERVATION, augment, demonstrations, segments, styled
from evals.bundled import read_suite
from evals.tasks import demonstration_tasks
from serving.chat_template import encode_text
from serving.chat_template import install_chat_template

# End of text, and ChatML's turn markers: the model folder carries a chat template
# (serving.chat_template) so chat scaffolds reach it through the engine's chat API.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ANSWER_FORMS = ("edit", "replace")


@dataclass(frozen=True)
class BaseModelSpec:
    vocab_size: int = 768
    hidden_size: int = 96
    num_layers: int = 3
    # head_dim = hidden_size / num_heads = 32: vLLM's CPU attention takes head sizes of 32, 64, 80,
    # 96, 112, 128, ... (it refuses 24 and 16), and its Qwen2 reads head_dim as hidden / heads.
    num_heads: int = 3
    num_kv_heads: int = 3
    intermediate_size: int = 256
    max_position_embeddings: int = 2048
    sft_steps: int = 400
    batch_size: int = 16
    # Each batch cut from a pool of this many batches' worth of shuffled examples sorted by length, the
    # batches then taken in random order; 1 draws every batch at random. Random batches of these
    # demonstrations are half padding, and a pool of 8 builds in 40% less time, but that base solved
    # 32.8% of 180 held-out tasks against 37.5% for random batches (docs/benchmarks.md, "Base model:
    # length-bucketed SFT batches"), so the default stays random.
    length_pool: int = 1
    # Each batch's examples computed in micro-batches of similar length, at most this many padded
    # positions each (the trainer's rule, :func:`training.backends.batch.micro_batches`), their
    # gradients summed into the batch's: the same step as the padded batch (to float rounding), with
    # fewer padded positions computed. 0: the batch padded whole. Random batches of 16 are half
    # padding; the build took 0.54x as long in micro-batches (docs/benchmarks.md, "Base model:
    # length-bucketed SFT batches").
    micro_batch_tokens: int = 1024
    augment_copies: int = 4  # renamed variants per demonstration
    # Variants also rename the module file, so file names must be copied from the prompt rather than
    # recalled: better held-out accuracy, but only with far more SFT than the CPU demo affords
    # (docs/benchmarks.md, "Base model and RL transfer").
    rename_modules: bool = False
    # How demonstrations name a fix: ``edit`` (the code it changes) or ``replace`` (file and line
    # number). A base trained on ``replace`` answers copies names and numbers badly: 6.9-7.5% of its
    # held-out answers are right, against 21.9-31.4% for ``edit`` (bench/answer_forms.py;
    # docs/benchmarks.md, "Edit by content").
    answer_form: str = "edit"
    # Shares of the demonstrations told as test-then-commit and as failed attempts, their failing
    # asserts, reset and the fix (``transcript``); the rest commit straight away. Episodes then need
    # 4 turns. With edit-by-content answers this base is the stronger one (held-out pass@1 29.2%
    # against 25.0% for direct answers) and RL gains more on it (docs/benchmarks.md, "`posttrain
    # demo`"); ``--verify-share 0 --retry-share 0`` builds a direct-answer base.
    verify_share: float = 0.15
    retry_share: float = 0.35
    retry_failures: int = 2  # a retry demonstration shows one to this many failed attempts
    learning_rate: float = 3e-3
    seed: int = 0


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    # heavy: tokenizers and transformers load only when a tokenizer is trained
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[1:]))


def _fingerprint(demos: Sequence[tuple[str, Any]], spec: BaseModelSpec) -> str:
    h = hashlib.sha256(json.dumps({**asdict(spec), "special_tokens": SPECIAL_TOKENS}, sort_keys=True).encode())
    for prompt, actions in demos:
        h.update(prompt.encode())
        for text, role in segments(actions):
            h.update(f"{role}:{text}".encode())
    return h.hexdigest()[:16]


def sft_examples(tokenizer, demos: Sequence[tuple[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """Token ids and loss mask of each demonstration, tokenized the way the harness builds a context:
    the prompt, then each model turn (ending with the end-of-text token) and each observation, each
    piece on its own, as text (:func:`serving.chat_template.encode_text`: a special token's string is
    never its id). The loss is on the ``ANSWER`` turns only."""
    out = []
    for prompt, actions in demos:
        ids = encode_text(tokenizer, prompt)
        mask = [0] * len(ids)
        for text, role in segments(actions):
            piece = encode_text(tokenizer, text)
            if role != OBSERVATION:
                piece.append(tokenizer.eos_token_id)
            ids += piece
            mask += [1 if role == ANSWER else 0] * len(piece)
        out.append((ids, mask))
    return out


def masked_lm_loss(model, ids, mask, denominator=None):
    """Mean next-token loss of a right-padded batch on the positions ``mask`` marks (the sum of their
    losses divided by ``denominator`` where given: a micro-batch's share of its batch's mean).

    No attention mask is passed: the padding is on the right, so under the causal mask no real
    position sees it, and the loss mask drops the padded positions. Loss and gradients are those of
    the padded attention mask (tests/training/test_base_model.py), and attention takes its causal
    kernel, 1.5-2x faster a step on the CPU (docs/benchmarks.md, "Base model").
    """
    logits = model(input_ids=ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    return (nll * mask[:, 1:].reshape(-1)).sum() / (mask[:, 1:].sum() if denominator is None else denominator)


def length_bucketed_batches(examples: list[tuple[list[int], list[int]]], spec: BaseModelSpec,
                            rng: random.Random) -> Iterator[list[int]]:
    """Endless batches of example indices: the examples shuffled epoch after epoch and cut into pools
    of ``spec.length_pool`` batches, each pool sorted by length, cut into batches and those taken in
    random order. A pool of one batch is the random batch as drawn."""
    size, pool = spec.batch_size, max(1, spec.length_pool) * spec.batch_size
    order: list[int] = []
    while True:
        if len(order) < pool:
            order += rng.sample(range(len(examples)), len(examples))
        chunk, order = order[:pool], order[pool:]
        if pool > size:
            chunk.sort(key=lambda i: len(examples[i][0]))
        cut = [chunk[i:i + size] for i in range(0, len(chunk), size)]
        rng.shuffle(cut)
        yield from cut


def batch_backward(model, batch: Sequence[tuple[list[int], list[int]]], micro_batch_tokens: int) -> float:
    """Adds to ``model``'s gradients those of ``batch``'s mean loss over its action tokens, computed in
    micro-batches of at most ``micro_batch_tokens`` padded positions (0: the batch padded whole);
    returns that loss."""
    parts = (micro_batches([ids for ids, _ in batch], micro_batch_tokens) if micro_batch_tokens > 0
             else [list(range(len(batch)))])
    tokens = sum(sum(mask[1:]) for _, mask in batch)
    loss = 0.0
    for part in parts:
        ids = pad_rows([batch[i][0] for i in part], 0, torch.long, model.device)
        mask = pad_rows([batch[i][1] for i in part], 0, torch.float32, model.device)
        share = masked_lm_loss(model, ids, mask, denominator=tokens)  # this micro-batch's share of the mean
        share.backward()
        loss += float(share.detach())
    return loss


def sft(model, examples: list[tuple[list[int], list[int]]], spec: BaseModelSpec, log_every: int = 25) -> list[dict]:
    """Supervised steps on the action tokens; returns the loss curve."""
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    warmup = max(1, spec.sft_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, spec.sft_steps) / spec.sft_steps)))
    curve = []
    model.train()
    batches = length_bucketed_batches(examples, spec, rng)
    for step in range(1, spec.sft_steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = batch_backward(model, [examples[i] for i in next(batches)], spec.micro_batch_tokens)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == spec.sft_steps:
            curve.append({"step": step, "loss": loss})
            print(f"sft step {step}/{spec.sft_steps} loss {loss:.4f}", flush=True)
    model.eval()
    return curve


@torch.no_grad()
def demonstration_loss(model_dir: Path, demos: list[tuple[str, str]]) -> float:
    """Mean per-token loss on the action tokens of ``demos`` of the model saved at ``model_dir``."""
    # heavy: transformers (and torch through it)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    for ids, mask in sft_examples(tokenizer, demos):
        x = torch.tensor([ids])
        nll = torch.nn.functional.cross_entropy(model(input_ids=x).logits[0, :-1], x[0, 1:], reduction="none")
        m = torch.tensor(mask[1:], dtype=torch.float32)
        total += float((nll * m).sum())
        count += int(m.sum())
    return total / max(count, 1)


def build_base_model(out: str | Path, tasks: Sequence[Any], spec: BaseModelSpec = BaseModelSpec(),
                     device: str = "cpu") -> Path:
    """Build (or reuse) the base model at ``out`` from the demonstrations of ``tasks``; the SFT steps
    run on ``device`` (the model is saved from the CPU either way)."""
    # heavy: transformers (and torch through it)
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    out = Path(out)
    if spec.answer_form not in ANSWER_FORMS:
        raise ValueError(f"answer_form {spec.answer_form!r}: expected one of {', '.join(ANSWER_FORMS)}")
    micro = spec.micro_batch_tokens
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 0:
        raise ValueError(f"micro_batch_tokens {micro!r}: expected a whole number of padded positions, 0 for batches "
                         "padded whole")
    started = time.perf_counter()
    demos = demonstrations(tasks, by_line=spec.answer_form == "replace")
    augmented = styled(augment(demos, spec.augment_copies, spec.seed, spec.rename_modules),
                       spec.verify_share, spec.retry_share, spec.seed, spec.retry_failures)
    # The transcripts as trained on, observations included: a change in what the harness says
    # (an error's wording) is a different base model.
    fingerprint = _fingerprint(augmented, spec)
    info = out / "build.json"
    if info.is_file() and json.loads(info.read_text()).get("fingerprint") == fingerprint:
        return out
    # heavy: serving.replica loads the HTTP layer (uvicorn); only checking vLLM's CPU head sizes needs it
    from serving.replica import CPU_HEAD_DIMS as VLLM_CPU_HEAD_DIMS

    head_dim, rest = divmod(spec.hidden_size, spec.num_heads)
    if rest or head_dim not in VLLM_CPU_HEAD_DIMS or spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"BaseModelSpec: hidden_size {spec.hidden_size} / num_heads {spec.num_heads} must be a head size "
                         f"vLLM's CPU attention serves ({', '.join(map(str, VLLM_CPU_HEAD_DIMS))}), and num_heads a "
                         f"multiple of num_kv_heads ({spec.num_kv_heads})")
    torch.manual_seed(spec.seed)
    tokenizer = train_tokenizer([p + "".join(text for text, _ in segments(a)) for p, a in augmented], spec.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # Every reader (engine, harness, trainer) loads the tokenizer with AutoTokenizer from the model
    # folder, where the model's config picks the tokenizer class and its pre-tokenizer; train on
    # exactly the ids that load gives.
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_config(config).to(device)
    examples = sft_examples(tokenizer, augmented)
    curve = sft(model, examples, spec)
    model = model.cpu()
    model.save_pretrained(tmp, safe_serialization=True)

    install_chat_template(tmp)
    reload_loss = demonstration_loss(tmp, demos)  # what was saved, reloaded, on the original demonstrations
    (tmp / "build.json").write_text(json.dumps({
        "fingerprint": fingerprint, "spec": asdict(spec), "demonstrations": len(demos),
        "sft_examples": len(examples), "parameters": sum(p.numel() for p in model.parameters()), "sft_curve": curve,
        "build_s": time.perf_counter() - started,
        "max_demo_tokens": max(len(e[0]) for e in examples),
        "reload_demo_loss": reload_loss,
    }, indent=1))
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.base_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=None, help="bundled suite folder (built at the default sizes if missing)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sft-steps", type=int, default=BaseModelSpec.sft_steps)
    parser.add_argument("--batch-size", type=int, default=BaseModelSpec.batch_size)
    parser.add_argument("--length-pool", type=int, default=BaseModelSpec.length_pool,
                        help="batches are cut from this many batches' worth of examples sorted by length; 1: random "
                             "batches (default %(default)s)")
    parser.add_argument("--micro-batch-tokens", type=int, default=BaseModelSpec.micro_batch_tokens,
                        help="each batch computed in micro-batches of similar length, at most this many padded "
                             "positions each; 0: the batch padded whole (default %(default)s)")
    parser.add_argument("--augment-copies", type=int, default=BaseModelSpec.augment_copies,
                        help="renamed variants per demonstration (default %(default)s)")
    parser.add_argument("--rename-modules", action="store_true", help="variants rename the module file too")
    parser.add_argument("--seed", type=int, default=BaseModelSpec.seed)
    parser.add_argument("--verify-share", type=float, default=BaseModelSpec.verify_share,
                        help="share of demonstrations that test, then commit (default %(default)s)")
    parser.add_argument("--retry-share", type=float, default=BaseModelSpec.retry_share,
                        help="share of demonstrations that fail, reset and fix before committing (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="where the SFT steps run (cpu, cuda)")
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    tasks = demonstration_tasks(read_suite(args.tasks))
    spec = BaseModelSpec(sft_steps=args.sft_steps, batch_size=args.batch_size, length_pool=args.length_pool,
                         micro_batch_tokens=args.micro_batch_tokens, augment_copies=args.augment_copies,
                         rename_modules=args.rename_modules, seed=args.seed, verify_share=args.verify_share, retry_share=args.retry_share)
    path = build_base_model(args.out, tasks, spec, device=args.device)
    print(json.dumps({k: v for k, v in json.loads((path / "build.json").read_text()).items() if k != "sft_curve"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
