"""How the base model's answers name a fix decides how often it is right: ``replace FILE:LINE TEXT``
against ``edit OLD => NEW``, same SFT budget, side by side in one run.

Builds two direct-answer base models with ``training.base_model`` that differ only in
``answer_form`` (the demonstrations' form), samples ``--samples`` one-turn answers per held-out task
from each at temperature 1, and runs each answer against an in-process copy of its task (the edited
module and the task's own tests, as ``bench/rl_multiturn.py`` does: a proxy study, which grades in
this process instead of the product's sandboxed grader, see that file). Printed per form: the share of
answers whose committed module passes the tests, and where the others went wrong: an answer that is
not an action, one that names another file, a ``replace`` of a line other than the buggy one, an
``edit`` whose old text is not in the module exactly once, a fix on the right spot that is wrong.

    .venv/bin/python bench/answer_forms.py --suite posttrain-data/datasets/bundled     # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from evals.actions import ActionParseError, parse_compact  # noqa: E402
from evals.harness import replace_once  # noqa: E402
from evals.tasks import demonstration_tasks  # noqa: E402
from rl_multiturn import episodes, suite_tests  # noqa: E402  (the sibling sweep's in-process tasks)
from training.base_model import ANSWER_FORMS, BaseModelSpec, build_base_model  # noqa: E402


def failure(copy, answer: str) -> str:
    """Where a wrong answer went wrong (the first mistake that explains it)."""
    try:
        actions = parse_compact(answer)
    except ActionParseError:
        return "not an action"
    refs = {int(n) for _, n, _ in copy.task.metadata["reference_edits"]}
    text = copy.base
    for action in actions:
        if action.tool == "replace_line":
            if action.args["path"] != copy.module:
                return "another file"
            if action.args["line"] not in refs:
                return "another line"
        elif action.tool == "str_replace":
            try:
                text = replace_once(text, action.args["old"], action.args["new"])
            except ValueError:
                return "old text not found once"
    if not actions or actions[-1].tool != "commit":
        return "no commit"
    return "wrong fix"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, help="a built bundled suite folder")
    parser.add_argument("--samples", type=int, default=8, help="answers per held-out task (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/answer-forms", help="where the base models are built")
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    tasks, tests = suite_tests(args.suite)
    train, held = demonstration_tasks(tasks), [t for t in tasks if t.split == "eval"]
    results = {}
    for form in ANSWER_FORMS:
        spec = BaseModelSpec(answer_form=form, verify_share=0.0, retry_share=0.0, seed=args.seed)
        path = build_base_model(Path(args.out) / form, train, spec)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        torch.manual_seed(args.seed)
        rows = episodes(model, tokenizer, held, tests, args.samples, 1, "cpu")
        counts = collections.Counter()
        for copy, ids, _ in rows:
            if copy.reward == 1.0:
                counts["correct"] += 1
            else:
                prompt = len(tokenizer(copy.prompt).input_ids)
                counts[failure(copy, tokenizer.decode(ids[prompt:], skip_special_tokens=True))] += 1
        results[form] = counts
        print(f"{form}: built in {json.loads((path / 'build.json').read_text())['build_s']:.0f} s; "
              f"{len(rows)} held-out answers", flush=True)
    kinds = ["correct", "not an action", "another file", "another line", "old text not found once", "wrong fix", "no commit"]
    print(f"\nheld-out answers ({len(held)} tasks x {args.samples}, temperature 1, one turn; SFT {BaseModelSpec.sft_steps} "
          f"x {BaseModelSpec.batch_size}, seed {args.seed})")
    print("| form | " + " | ".join(kinds) + " |")
    print("| --- |" + " ---: |" * len(kinds))
    for form, counts in results.items():
        total = sum(counts.values())
        print(f"| `{form}` | " + " | ".join(f"{100 * counts[k] / total:.1f}%" for k in kinds) + " |")
    base, ours = (results[f]["correct"] / sum(results[f].values()) for f in ("replace", "edit"))
    print(f"correct: edit {100 * ours:.1f}% vs replace {100 * base:.1f}% (ratio {ours / base if base else float('inf'):.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
