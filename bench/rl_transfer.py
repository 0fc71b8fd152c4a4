"""Does RL on the training split move held-out accuracy? A fast proxy of ``posttrain demo``.

A proxy study, not a measure of the product: :func:`run_tests` stands in for the product's grader
(``evals.grading``, pytest or call checks in a fresh sandbox) and ``Sampler`` for the engine and the
harness, so a sweep of learning runs takes minutes on one GPU. The model, the base-model build, the
batching (``training.grpo.batch_from_groups``), the loss (``training.grpo.LossConfig``) and the step
(``TorchPeftBackend.train_step``) are the product's own. Its figures say what the model learns, never
how fast or how strictly the product grades.

Builds embedded base models (``training.base_model`` settings, one per entry of ``bases``), then runs
GRPO on each with the project's own ``TorchPeftBackend`` and ``group_advantages`` (one entry of
``runs`` each), all in parallel processes. What differs from the real loop, to make a sweep take
minutes on one GPU: the reward is the exact match of the compact answer with the task's reference
actions (no sandbox; a correct answer written differently scores 0, so it under-counts), sampling is
``generate`` on the trained model itself (on-policy, no engine, no lag) and episodes are one turn.

Printed per base: held-out exact match sampled at temperature 1 (mean over ``--samples``), greedy, and
the share of tasks solved by any sample; per run: the held-out sampled accuracy before and after the
steps, with the training reward of the first and last 10 steps.

    python bench/rl_transfer.py --suite posttrain-data/datasets/bundled --plan plan.json --device cuda

``plan.json``: ``{"bases": [{BaseModelSpec fields}...], "runs": [{"base": 0, "lr": 0.002, ...}]}``;
run keys: ``lr``, ``rank``, ``kl`` (``LossConfig.kl_coef``), ``std`` (``LossConfig.scale_advantages_by_std``),
``positive`` (negative advantages dropped: only the better-than-average episodes of a group are pushed
up; a variant the trainer does not have), ``groups``,
``group_size``, ``steps``, ``vary`` (each sampled prompt is a fresh renamed variant of the task),
``uniform`` (draw from every training task, not only those the base solves sometimes), ``fresh``
(draw from that many freshly generated tasks instead of the training split).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from evals.actions import Action, ActionParseError, content_edits, demonstration, numbered, parse_compact  # noqa: E402
from evals.bundled import generate, load_suite  # noqa: E402
from evals.tasks import demonstration_tasks, rl_tasks  # noqa: E402
from training.backends import pad_rows  # noqa: E402
from training.backends.torch_peft import TorchPeftBackend  # noqa: E402
from training.base_model import BaseModelSpec, build_base_model  # noqa: E402
from training.demonstrations import augment  # noqa: E402
from training.grpo import DEFAULT_LOSS, LossConfig, batch_from_groups  # noqa: E402
from training.rollout import Rollout  # noqa: E402
from training.store import Group  # noqa: E402


def _answer_key(text: str):
    try:
        actions = parse_compact(text)
    except ActionParseError:
        return None
    if not actions or actions[-1].tool != "commit":
        return None
    return sorted(tuple(sorted(a.args.items())) for a in actions if a.tool in ("str_replace", "replace_line"))


class Sampler:
    """Batched sampling of compact answers and their exact-match reward."""

    def __init__(self, model, tokenizer, device: str, max_new_tokens: int = 48):
        self.model, self.tok, self.device, self.max_new_tokens = model, tokenizer, device, max_new_tokens
        self.tok.padding_side = "left"

    def sample(self, demos: list[tuple[str, str]], n: int, greedy: bool = False) -> list[tuple[list[int], list[int], float]]:
        out_rows = []
        self.model.eval()
        eos = self.tok.eos_token_id
        for i in range(0, len(demos), 16):
            chunk = demos[i:i + 16]
            enc = self.tok([p for p, _ in chunk], return_tensors="pt", padding=True).to(self.device)
            kw = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
            with torch.no_grad():
                out = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, num_return_sequences=n,
                                          pad_token_id=eos, **kw)
            width = enc.input_ids.shape[1]
            for j, (prompt, reference) in enumerate(chunk):
                want = _answer_key(reference)
                prompt_ids = self.tok(prompt).input_ids
                for r in range(n):
                    gen = out[j * n + r][width:].tolist()
                    if eos in gen:
                        gen = gen[:gen.index(eos) + 1]
                    ok = _answer_key(self.tok.decode(gen, skip_special_tokens=True)) == want
                    out_rows.append((prompt_ids, gen, float(ok)))
        return out_rows


def accuracy(sampler: Sampler, demos: list[tuple[str, str]], n: int, greedy: bool = False) -> tuple[float, float]:
    """(mean exact match, share of tasks with any exact match) over ``n`` samples per task."""
    rows = sampler.sample(demos, n, greedy)
    solved = sum(1 for i in range(0, len(rows), n) if any(r[2] for r in rows[i:i + n]))
    return round(sum(r[2] for r in rows) / len(rows), 4), round(solved / len(demos), 3)


def run_tests(module: str, source: str, tests: str) -> list[str]:
    """The first failing assert of each test function of a bundled task, run in this process
    (``assert CALL == WANT -> assert GOT == WANT``), or the error that stopped the module from
    loading; empty when every test passes.

    Not ``evals.grading``: the product grades a committed patch by running pytest in a fresh sandbox
    (bwrap or gVisor) per attempt, a sandbox start and a pytest process each, and these sweeps grade
    every episode of every step on a GPU machine whose point is the model's learning, not its isolation.
    Bundled tests are ``assert CALL == WANT`` lines, so evaluating them here is the same verdict for
    honest code (a proxy: nothing here defends against code that games it)."""
    namespace: dict = {}
    try:
        exec(compile(source, f"/workspace/{module}", "exec"), namespace)
    except Exception as exc:  # what pytest's E lines would show
        return [f"{type(exc).__name__}: {exc}"]
    fails = []
    for block in tests.split("\n\ndef ")[1:]:
        for line in block.splitlines()[1:]:
            m = re.match(r"\s+assert (.*) == (.*)$", line)
            if not m:
                continue
            try:
                got, want = eval(m.group(1), namespace), eval(m.group(2))
            except Exception as exc:
                fails.append(f"{type(exc).__name__}: {exc}")
                break
            if got != want:
                fails.append(f"assert {m.group(1)} == {m.group(2)} -> assert {got!r} == {want!r}")
                break
    return fails


def fresh_generated(count: int, exclude: set[str]) -> list[tuple[int, object, list[str]]]:
    """``count`` freshly generated tasks (``evals.bundled.generate``, seeds 1 and up, 60 a level) whose
    module text is in no task of ``exclude`` nor repeated, as ``(seed, GeneratedTask, failing asserts)``;
    the asserts come from :func:`run_tests`, so no sandbox validated them. Training tasks the base
    model never saw in SFT, for both sweeps' ``fresh`` runs."""
    seen, out, seed = set(exclude), [], 1
    while len(out) < count:
        for gen in generate(seed, 60):
            source = gen.files[f"{gen.module}.py"]
            if source in seen or len(out) >= count:
                continue
            seen.add(source)
            out.append((seed, gen, run_tests(f"{gen.module}.py", source, gen.files[f"tests/test_{gen.module}.py"])))
        seed += 1
    return out


def _generated_demos(count: int, exclude: set[str]) -> list[tuple[str, str]]:
    """Compact demonstrations of :func:`fresh_generated` tasks, the failing asserts formatted as the
    suite's validation records them."""
    out = []
    for _, gen, fails in fresh_generated(count, exclude):
        source = gen.files[f"{gen.module}.py"]
        prompt = (f"{gen.instruction_head}\n{gen.module}.py:\n{numbered(source)}\n"
                  + "\n".join(f"fail: {f}" for f in fails) + "\n>")
        edits = content_edits(source, [(n, t) for _, n, t in gen.reference_edits])  # the demonstrations' form
        answer = "".join(Action("str_replace", {"old": o, "new": t}).to_compact() + "\n" for o, t in edits) + "commit\n"
        out.append((prompt, answer))
    return out


def _all_tasks(path: str):
    return list(load_suite(path))


def _suite(path: str, rl: bool = False):
    """The suite's demonstration tasks (with ``rl``, its RL tasks instead) and its held-out demonstrations."""
    tasks = list(load_suite(path))
    train = rl_tasks(tasks) if rl else demonstration_tasks(tasks)
    held = [demonstration(t) for t in tasks if t.split == "eval"]
    return train, held


def build(job: tuple[int, dict, argparse.Namespace]) -> dict:
    index, spec, args = job
    torch.set_num_threads(1)
    train, held = _suite(args.suite)
    # One-turn episodes: bases that answer and commit at once (no test-and-retry demonstrations)
    spec = {"verify_share": 0.0, "retry_share": 0.0, **spec}
    path = build_base_model(Path(args.out) / f"base-{index}", train, BaseModelSpec(**spec), device=args.device)
    model = AutoModelForCausalLM.from_pretrained(path).to(args.device)
    sampler = Sampler(model, AutoTokenizer.from_pretrained(path), args.device)
    return {"base": index, "spec": spec, "held_sampled": accuracy(sampler, held, args.samples),
            "held_greedy": accuracy(sampler, held, 1, greedy=True)[0]}


def grpo_step(backend, rows: list[tuple[list[int], list[int], float]], groups: int, size: int, device: str,
              loss: LossConfig = DEFAULT_LOSS, positive_only: bool = False) -> int:
    """One GRPO step of the project's backend on ``groups`` x ``size`` rows of ``(token ids, loss mask,
    reward)``, in group order, batched as the trainer batches a step (``training.grpo.batch_from_groups``
    on the store's ``Group``/``Rollout``, under ``loss``: its ``scale_advantages_by_std`` and
    ``weighting``, ``sequence`` for every episode alike); on-policy, so the sampling logprobs are the
    model's own. Returns the number of zero-variance groups dropped. ``positive_only`` drops the
    negative advantages: the one variant here that the trainer does not have (a proxy study's knob)."""
    def group_rows(g: int) -> list[tuple[list[int], list[int], float]]:
        return rows[g * size:(g + 1) * size]

    # Only a group whose rewards differ reaches the batch: the others get no forward pass here.
    varied = [g for g in range(groups) if len({r[2] for r in group_rows(g)}) > 1]
    logprobs: dict[tuple[int, int], list[float]] = {}
    if varied:
        ids = [r[0] for g in varied for r in group_rows(g)]
        with torch.no_grad():
            backend.model.eval()
            lp = backend.token_logprobs(pad_rows(ids, 0, torch.long, device),
                                        pad_rows([[1] * len(x) for x in ids], 0, torch.long, device))
        keys = [(g, s) for g in varied for s in range(size)]
        logprobs = {key: lp[i, :len(x)].tolist() for i, (key, x) in enumerate(zip(keys, ids))}
    batch, dropped = batch_from_groups([
        Group(f"g{g}", f"g{g}", 0, [
            Rollout(f"g{g}-{s}", f"g{g}", f"g{g}", 0, ids, mask, logprobs.get((g, s), [0.0] * len(ids)), reward)
            for s, (ids, mask, reward) in enumerate(group_rows(g))])
        for g in range(groups)], loss)
    if batch is not None:
        if positive_only:
            batch = dataclasses.replace(batch, advantages=[max(a, 0.0) for a in batch.advantages])
        backend.train_step(batch, loss)
    return dropped


def train_run(job: tuple[int, dict, argparse.Namespace]) -> dict:
    index, run, args = job
    torch.set_num_threads(1)
    path = Path(args.out) / f"base-{run['base']}"
    backend = TorchPeftBackend(path, lora_rank=run.get("rank", 16), learning_rate=run.get("lr", 2e-3),
                               device=args.device, seed=0)
    loss = LossConfig(kl_coef=run.get("kl", 0.0), scale_advantages_by_std=run.get("std", False))
    sampler = Sampler(backend.model, AutoTokenizer.from_pretrained(path), args.device)
    train, held = _suite(args.suite, rl=True)
    before = accuracy(sampler, held, args.samples)
    rng, vary_rng = random.Random(0), random.Random(1)
    if run.get("fresh"):  # RL on freshly generated tasks the base never saw, not on its SFT tasks
        candidates = _generated_demos(run["fresh"], {t.metadata["source_text"] for t in _all_tasks(args.suite)})
    else:
        candidates = [demonstration(t) for t in train]
    solved = [ok for _, _, ok in sampler.sample(candidates, 2)]
    pool = candidates if run.get("uniform") else [d for i, d in enumerate(candidates) if 0 < sum(solved[2 * i:2 * i + 2]) < 2] or candidates
    groups, size, rewards_log, dropped = run.get("groups", 4), run.get("group_size", 8), [], 0
    for _ in range(run.get("steps", 44)):
        demos = rng.sample(pool, groups) if len(pool) >= groups else rng.choices(pool, k=groups)
        if run.get("vary"):
            demos = [augment([d], 1, vary_rng.randrange(10**9))[-1] for d in demos]
        rows = sampler.sample(demos, size)
        rewards_log.append(sum(r[2] for r in rows) / len(rows))
        dropped += grpo_step(backend, [(p + g, [0] * len(p) + [1] * len(g), ok) for p, g, ok in rows], groups, size,
                             args.device, loss, positive_only=run.get("positive", False))
    after = accuracy(sampler, held, args.samples)
    first, last = rewards_log[:10], rewards_log[-10:]
    return {"run": index, **run, "pool": len(pool), "zero_variance_groups": dropped,
            "train_reward_first10": round(sum(first) / len(first), 3), "train_reward_last10": round(sum(last) / len(last), 3),
            "held_before": before, "held_after": after}


def plan_arguments(argv: list[str] | None, description: str, samples: int, out: str) -> tuple[argparse.Namespace, dict]:
    """The command line of a base-and-RL sweep and its plan file (``bases`` and ``runs``, non-empty lists)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--suite", required=True, help="a built bundled suite folder")
    parser.add_argument("--plan", required=True, help="JSON file with 'bases' and 'runs'")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=samples, help="episodes per held-out task (default %(default)s)")
    parser.add_argument("--out", default=out, help="where the base models are built")
    args = parser.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    for key in ("bases", "runs"):
        if not isinstance(plan.get(key), list) or not plan[key]:
            raise SystemExit(f"{args.plan}: expected a non-empty list under key {key!r}")
    return args, plan


def main(argv: list[str] | None = None) -> int:
    args, plan = plan_arguments(argv, __doc__.split("\n\n")[0], 12, "/tmp/rl-transfer")
    mp.set_start_method("spawn", force=True)
    with mp.Pool(len(plan["bases"])) as pool:
        bases = pool.map(build, [(i, spec, args) for i, spec in enumerate(plan["bases"])])
    with mp.Pool(max(1, len(plan["runs"]))) as pool:
        runs = pool.map(train_run, [(i, run, args) for i, run in enumerate(plan["runs"])])
    print("held-out exact match (bundled eval split; proxy reward, see the docstring)")
    for b in bases:
        print(f"base {b['base']} {json.dumps(b['spec'])}: sampled {b['held_sampled'][0]:.3f} "
              f"(any of {args.samples}: {b['held_sampled'][1]:.3f}), greedy {b['held_greedy']:.3f}")
    for r in runs:
        settings = {k: v for k, v in r.items() if k in ("base", "lr", "rank", "kl", "std", "groups", "group_size", "steps", "vary", "uniform", "fresh", "positive")}
        print(f"run {r['run']} {json.dumps(settings)}: held-out {r['held_before'][0]:.3f} -> {r['held_after'][0]:.3f} "
              f"({100 * (r['held_after'][0] - r['held_before'][0]):+.1f} points); train reward "
              f"{r['train_reward_first10']:.3f} -> {r['train_reward_last10']:.3f}; pool {r['pool']}, "
              f"zero-variance groups {r['zero_variance_groups']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
