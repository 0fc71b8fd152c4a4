"""Does RL teach the embedded base model to test and retry, and does that lift held-out pass@1?

A proxy study, not a measure of the product: a multi-turn GPU proxy of ``posttrain demo``.
:class:`TaskCopy` stands in for the harness's action executor (``evals.harness.execute``, each action in
a sandbox) and ``rl_transfer.run_tests`` for the grader (``evals.grading``). The bundled suite's compact actions (``replace``,
``test``, ``reset``, ``commit``) run against an in-process copy of each task: the module text is
edited in memory and the task's tests run in this process, formatted as the sandboxed harness
formats them. So an episode of several turns costs no sandbox, and a sweep takes minutes on one GPU.
What differs from the real loop: no sandbox or engine, on-policy sampling with ``generate`` (no lag),
and pytest's long-list abbreviations are not reproduced in the failing asserts.

Base models come from ``training.base_model`` (one per entry of ``bases``: ``BaseModelSpec`` fields,
e.g. ``verify_share``, ``retry_share``, ``seed``); each run (``base``, ``lr``, ``turns``, ``groups``,
``group_size``, ``steps``, ``fresh``: draw from that many freshly generated tasks instead of
the training split) takes GRPO steps with the project's ``TorchPeftBackend`` and
``training.grpo.batch_from_groups`` on the suite's RL tasks (``std``: ``LossConfig.scale_advantages_by_std``;
``per_sequence``: ``LossConfig.weighting = "sequence"``; ``positive_only`` as in ``rl_transfer.grpo_step``). Printed per run, before and after the steps: held-out
pass@1 over ``--samples`` episodes a task, the share of episodes that ran ``test``, and the pass rate
of episodes that tested and of those that committed without testing.

    python bench/rl_multiturn.py --suite posttrain-data/datasets/bundled --plan plan.json --device cuda
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from evals.actions import (ActionParseError, apply_edits, compact_observation, parse_compact,  # noqa: E402
                           render_compact_prompt)
from evals.bundled import TASKS_PER_LEVEL, generate, load_suite  # noqa: E402
from evals.harness import replace_once  # noqa: E402
from evals.tasks import demonstration_tasks, rl_tasks  # noqa: E402
from rl_transfer import fresh_generated, grpo_step, plan_arguments, run_tests  # noqa: E402  (the sibling sweep's pieces)
from training.backends.torch_peft import TorchPeftBackend  # noqa: E402
from training.base_model import BaseModelSpec, build_base_model  # noqa: E402
from training.grpo import LossConfig  # noqa: E402


class TaskCopy:
    """One episode's in-memory copy of a bundled task: its module text, tests and prompt.

    Not ``evals.harness.run_episode``: the harness runs each action in a sandbox (bwrap or gVisor,
    a work tree and a pytest run per ``test``), which the multi-turn sweep cannot afford per turn of
    every episode on the GPU machine; the actions' semantics are the harness's own functions
    (``parse_compact``, ``replace_once``, ``apply_edits``, ``compact_observation``), only the file and
    the test run are in memory (``rl_transfer.run_tests``).
    """

    def __init__(self, task, tests: str):
        self.task, self.module, self.tests = task, task.metadata["module_file"], tests
        self.base = self.text = task.metadata["source_text"]
        self.prompt = render_compact_prompt(task)
        self.done, self.reward, self.tested = False, 0.0, False

    def step(self, answer: str) -> str | None:
        """Run a turn's actions; the observation, or ``None`` once the agent committed."""
        try:
            actions, error = parse_compact(answer), None
        except ActionParseError as exc:
            actions, error = list(getattr(exc, "actions", [])), str(exc)
        results = []
        for action in actions:
            if action.tool == "str_replace":
                try:
                    self.text = replace_once(self.text, action.args["old"], action.args["new"], self.module)
                    results.append("ok")
                except ValueError as exc:
                    results.append(f"error: {exc}")
            elif action.tool == "replace_line":
                if action.args["path"] != self.module:
                    results.append(f"error: {action.args['path']}")
                    continue
                try:
                    self.text = apply_edits(self.text, [(action.args["line"], action.args["text"])])
                    results.append("ok")
                except ValueError as exc:
                    results.append(f"error: {exc}")
            elif action.tool == "reset":
                self.text = self.base
                results.append("ok")
            elif action.tool == "test":
                self.tested = True
                fails = run_tests(self.module, self.text, self.tests)
                results.append("\n".join(fails[:6]) if fails else "all tests pass")
            elif action.tool == "commit":
                self.done, self.reward = True, float(not run_tests(self.module, self.text, self.tests))
                return None
        if error:
            results.append(f"error: {error}")
        return compact_observation(results)


def suite_tests(suite: str) -> tuple[list, dict[str, str]]:
    """The suite's tasks and each one's test file, from the generator that built it."""
    tasks = list(load_suite(suite))
    generated = {g.id: g for g in generate(0, TASKS_PER_LEVEL)}
    tests = {}
    for task in tasks:
        g = generated.get(task.id)
        if g is None or g.files[task.metadata["module_file"]] != task.metadata["source_text"]:
            raise SystemExit(f"{suite}: task {task.id} is not the generator's (seed 0); rebuild the suite")
        tests[task.id] = g.files[f"tests/test_{g.module}.py"]
    return tasks, tests


def fresh_tasks(count: int, suite_tasks) -> tuple[list, dict[str, str]]:
    """``count`` freshly generated tasks whose module is in no suite task (``rl_transfer.fresh_generated``),
    as in-process tasks with their tests: training tasks the base model never saw in SFT."""
    tasks, tests = [], {}
    for seed, gen, fails in fresh_generated(count, {t.metadata["source_text"] for t in suite_tasks}):
        task_id = f"fresh-{seed}-{gen.id}"
        tasks.append(SimpleNamespace(id=task_id, split="train", instruction=gen.instruction_head, metadata={
            "module_file": f"{gen.module}.py", "source_text": gen.files[f"{gen.module}.py"],
            "failing_output": "\n".join(fails)}))
        tests[task_id] = gen.files[f"tests/test_{gen.module}.py"]
    return tasks, tests


def episodes(model, tokenizer, tasks, tests, n: int, turns: int, device: str, max_new_tokens: int = 48):
    """``n`` episodes of each task, all turns batched; rows of (task copy, token ids, loss mask)."""
    copies = [TaskCopy(t, tests[t.id]) for t in tasks for _ in range(n)]
    ids = [tokenizer(c.prompt).input_ids for c in copies]
    masks = [[0] * len(x) for x in ids]
    eos = tokenizer.eos_token_id
    model.eval()
    for _ in range(turns):
        live = [i for i, c in enumerate(copies) if not c.done]
        for start in range(0, len(live), 256):
            chunk = live[start:start + 256]
            width = max(len(ids[i]) for i in chunk)
            batch = torch.tensor([[eos] * (width - len(ids[i])) + ids[i] for i in chunk], device=device)
            attention = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk], device=device)
            with torch.no_grad():
                out = model.generate(input_ids=batch, attention_mask=attention, max_new_tokens=max_new_tokens,
                                     do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=eos)
            for j, i in enumerate(chunk):
                gen = out[j][width:].tolist()
                gen = gen[:gen.index(eos) + 1] if eos in gen else gen
                observation = copies[i].step(tokenizer.decode(gen, skip_special_tokens=True))
                ids[i] = ids[i] + gen
                masks[i] = masks[i] + [1] * len(gen)
                if observation is not None:
                    obs = tokenizer(observation, add_special_tokens=False).input_ids
                    ids[i], masks[i] = ids[i] + obs, masks[i] + [0] * len(obs)
    return list(zip(copies, ids, masks))


def summary(rows) -> dict[str, float]:
    copies = [c for c, _, _ in rows]
    tested = [c for c in copies if c.tested]
    direct = [c for c in copies if not c.tested]
    return {"pass@1": round(sum(c.reward for c in copies) / len(copies), 4),
            "tested": round(len(tested) / len(copies), 3),
            "pass_tested": round(sum(c.reward for c in tested) / max(1, len(tested)), 3),
            "pass_direct": round(sum(c.reward for c in direct) / max(1, len(direct)), 3)}


def build(job) -> str:
    index, spec, args = job
    torch.set_num_threads(1)
    tasks, _ = suite_tests(args.suite)
    return str(build_base_model(Path(args.out) / f"base-{index}", demonstration_tasks(tasks),
                                BaseModelSpec(**spec), device=args.device))


def train_run(job) -> dict:
    index, run, args = job
    torch.set_num_threads(1)
    path = Path(args.out) / f"base-{run['base']}"
    tokenizer = AutoTokenizer.from_pretrained(path)
    backend = TorchPeftBackend(path, lora_rank=run.get("rank", 16), learning_rate=run.get("lr", 1e-3),
                               device=args.device, seed=0)
    loss = LossConfig(scale_advantages_by_std=run.get("std", False),
                      weighting="sequence" if run.get("per_sequence") else "token")
    tasks, tests = suite_tests(args.suite)
    train, held = rl_tasks(tasks), [t for t in tasks if t.split == "eval"]
    if run.get("fresh"):  # RL on generated tasks the base never saw, instead of its SFT tasks
        train, fresh_tests = fresh_tasks(run["fresh"], tasks)
        tests = {**tests, **fresh_tests}
    turns, groups, size = run.get("turns", 4), run.get("groups", 4), run.get("group_size", 8)
    before = summary(episodes(backend.model, tokenizer, held, tests, args.samples, turns, args.device))
    rng, log = random.Random(0), []
    for _ in range(run.get("steps", 44)):
        rows = episodes(backend.model, tokenizer, rng.sample(train, groups), tests, size, turns, args.device)
        log.append(summary(rows))
        grpo_step(backend, [(x, m, c.reward) for c, x, m in rows], groups, size, args.device, loss,
                  positive_only=run.get("positive_only", False))
    after = summary(episodes(backend.model, tokenizer, held, tests, args.samples, turns, args.device))

    def mean(part, key):
        return round(sum(x[key] for x in part) / len(part), 3)

    return {"run": index, **run, "before": before, "after": after,
            "train_first10": {k: mean(log[:10], k) for k in ("pass@1", "tested")},
            "train_last10": {k: mean(log[-10:], k) for k in ("pass@1", "tested")}}


def main(argv: list[str] | None = None) -> int:
    args, plan = plan_arguments(argv, __doc__.split("\n\n")[0], 8, "/tmp/rl-multiturn")
    mp.set_start_method("spawn", force=True)
    with mp.Pool(len(plan["bases"])) as pool:
        pool.map(build, [(i, spec, args) for i, spec in enumerate(plan["bases"])])
    with mp.Pool(len(plan["runs"])) as pool:
        runs = pool.map(train_run, [(i, run, args) for i, run in enumerate(plan["runs"])])
    print(f"held-out pass@1 over {args.samples} in-process episodes a task (proxy, see the docstring)")
    for r in runs:
        settings = {k: r[k] for k in ("base", "lr", "turns", "groups", "group_size", "steps", "std", "per_sequence",
                                      "positive_only", "rank", "fresh") if k in r}
        b, a = r["before"], r["after"]
        print(f"run {r['run']} {json.dumps(settings)} base {json.dumps(plan['bases'][r['base']])}: "
              f"pass@1 {b['pass@1']:.3f} -> {a['pass@1']:.3f} ({100 * (a['pass@1'] - b['pass@1']):+.1f} points); "
              f"tested {b['tested']:.2f} -> {a['tested']:.2f}; pass when tested {b['pass_tested']:.3f} -> "
              f"{a['pass_tested']:.3f}, when not {b['pass_direct']:.3f} -> {a['pass_direct']:.3f}; train pass@1 "
              f"{r['train_first10']['pass@1']:.3f} -> {r['train_last10']['pass@1']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
