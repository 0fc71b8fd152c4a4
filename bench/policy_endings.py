"""How a finished demo's attempts ended, per level, base model against the final checkpoint: pass@1,
how the attempts ended (``bench.recipe_trial.endings``), output tokens, and how many attempts ran out
of turns uncommitted after a test run had passed (work the turn limit lost). Reads the home's
evaluation rows only (``evals/deepswe/<checkpoint>/*.parquet``); runs nothing.

    .venv/bin/python bench/policy_endings.py --home /tmp/demoNh
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from bench.recipe_trial import endings  # noqa: E402

PASSED = "all tests pass"  # the harness's observation of a test run with nothing failing


def passed_then_stopped(transcript: str) -> bool:
    return any(t["role"] == "action" and t["action"]["tool"] == "test" and t["observation"].startswith(PASSED)
               for t in json.loads(transcript))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, type=Path, help="a finished demo's home")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
