"""How a finished demo's attempts ended, per level, base model against the final checkpoint: pass@1,
how the attempts ended (``bench.recipe_trial.endings``), output tokens, and how many attempts ran out
of turns uncommitted after a test run had passed (work the turn limit lost). Reads the home's
evaluation rows only (``evals/deepswe/<checkpoint>/*.parquet``); runs nothing.

    .venv/bin/python bench/policy_endings.py --home /tmp/demoNh [--by-kind]

``--by-kind`` adds pass@1 per bug kind of the single-bug tasks (levels 1 and 2), base against final,
with the kinds of each held-out task from the bundled suite's generator (``GeneratedTask.bug_kinds``;
the demo's suite is the generator's default seed, and each task's module text is checked against it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from bench.recipe_trial import endings  # noqa: E402
from evals.bundled import generate  # noqa: E402

PASSED = "all tests pass"  # the harness's observation of a test run with nothing failing


def passed_then_stopped(transcript: str) -> bool:
    return any(t["role"] == "action" and t["action"]["tool"] == "test" and t["observation"].startswith(PASSED)
               for t in json.loads(transcript))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, type=Path, help="a finished demo's home")
    parser.add_argument("--by-kind", action="store_true", help="also pass@1 per bug kind (levels 1 and 2)")
    args = parser.parse_args()
    folder = args.home / "evals" / "deepswe"
    checkpoints = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    if len(checkpoints) < 2:
        raise SystemExit(f"{folder}: expected the evaluation rows of two checkpoints or more, found {checkpoints}")
    for checkpoint in (checkpoints[0], checkpoints[-1]):
        rows = pd.concat([pd.read_parquet(p) for p in sorted((folder / checkpoint).glob("*.parquet"))])
        for level, g in rows.groupby("difficulty"):
            lost = sum(passed_then_stopped(t) for t in g[g["stop_reason"] == "max_turns"]["transcript"])
            print(f"{checkpoint} level {level}: pass@1 {100 * g['reward'].mean():.1f}%  ({endings(g)}), "
                  f"output tokens {g['output_tokens'].mean():.0f}, out of turns after a passing test run {lost}")
    if args.by_kind:
        by_kind(args.home, folder, checkpoints[0], checkpoints[-1])
    return 0


def by_kind(home: Path, folder: Path, base: str, final: str) -> None:
    """pass@1 per bug kind of the single-bug held-out tasks, base against final."""
    kinds = {}
    for gen in generate():
        task_json = home / "datasets" / "bundled" / "tasks" / gen.id / "task.json"
        if gen.split == "eval" and task_json.is_file():
            if json.loads(task_json.read_text())["metadata"]["source_text"] != gen.files[f"{gen.module}.py"]:
                raise SystemExit(f"{task_json}: not the task the default generator makes; --by-kind needs the default suite")
            kinds[gen.id] = gen.bug_kinds
    rows = {c: pd.concat([pd.read_parquet(p) for p in sorted((folder / c).glob("*.parquet"))]) for c in (base, final)}
    table = {}
    for c, r in rows.items():
        r = r[r["difficulty"] < 3]
        table[c] = r.groupby(r["task_id"].map(lambda t: kinds[t][0]))["reward"].agg(["mean", "size"])
    both = table[base].add_suffix("_base").join(table[final].add_suffix("_final")).sort_values("mean_base")
    for kind, row in both.iterrows():
        print(f"kind {kind:11s} {int(row['size_base']):3d} attempts: pass@1 {100 * row['mean_base']:5.1f}% -> "
              f"{100 * row['mean_final']:5.1f}% ({100 * (row['mean_final'] - row['mean_base']):+.1f})")


if __name__ == "__main__":
    raise SystemExit(main())
