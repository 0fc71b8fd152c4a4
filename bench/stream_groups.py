"""Which RL groups of a finished demo could teach: per level and bug kind, how many of the run's
groups had all attempts score alike (all failed, all solved: GRPO learns nothing from them) and how
many held both outcomes, for one home beside a baseline home, with the ratio of the teaching shares.
Reads the run's rollout store and its task stream's task files; runs nothing.

    .venv/bin/python bench/stream_groups.py --home NEW_HOME --baseline-home OLD_HOME

A task's bug kinds come from its target tests' names (``test_<kind>_<qualifier>``, as
:mod:`evals.bundled` names them), so homes of any version of the stream can be compared.
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evals.bundled import KINDS  # noqa: E402
from training.checkpoint import store_path  # noqa: E402
from training.curriculum import STREAM_DIR, StreamTasks  # noqa: E402

STEMS = {kind.stem for kind in KINDS}


def task_kinds(task) -> tuple[int, tuple[str, ...]]:
    """(level, bug kinds) of a stream task (:class:`evals.tasks.Task`)."""
    kinds = []
    for test in task.target_tests:
        stem = test.rsplit(".", 1)[-1].removeprefix("test_").rsplit("_", 1)[0]
        if stem not in STEMS:
            raise SystemExit(f"task {task.id}: target test {test!r} names no bug kind of evals.bundled.KINDS")
        kinds.append(stem)
    return int(task.difficulty), tuple(kinds)


def groups(home: Path, run: str) -> list[tuple[int, tuple[str, ...], str]]:
    """(level, kinds, outcome) of every whole group the run's store holds: outcome ``all_failed``,
    ``all_solved``, ``all_alike`` (partial credit, every attempt the same) or ``teaches``."""
    run_dir = home / "runs" / run
    store = store_path(run_dir)
    if not store.is_file():
        raise SystemExit(f"{store}: no rollout store (is {home} a finished demo's home?)")
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    rows = db.execute("select g.task_id, g.group_size, count(*), min(r.reward), max(r.reward) from groups g "
                      "join rollouts r on r.group_id = g.group_id group by g.group_id").fetchall()
    db.close()
    tasks = StreamTasks(run_dir / STREAM_DIR / "tasks")
    out = []
    for task_id, size, n, low, high in rows:
        if n < size:
            continue
        level, kinds = task_kinds(tasks[task_id])
        outcome = ("teaches" if low != high else "all_failed" if high == 0 else "all_solved" if low >= 1.0
                   else "all_alike")
        out.append((level, kinds, outcome))
    return out


def report(name: str, rows: list[tuple[int, tuple[str, ...], str]]) -> float:
    teach = sum(o == "teaches" for _, _, o in rows) / max(len(rows), 1)
    counts = collections.Counter(o for _, _, o in rows)
    print(f"{name}: {len(rows)} groups, {100 * teach:.0f}% teach (all failed {counts['all_failed']}, "
          f"all solved {counts['all_solved']}, all alike otherwise {counts['all_alike']})")
    for level in (1, 2, 3):
        lv = [o for lvl, _, o in rows if lvl == level]
        if lv:
            print(f"  level {level}: {len(lv)} groups, {100 * lv.count('teaches') / len(lv):.0f}% teach")
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for level, kinds, outcome in rows:
        if level < 3:
            by_kind[kinds[0]][outcome] += 1
    print("  levels 1-2 by kind (groups: teach / all failed / all solved): " + ", ".join(
        f"{k} {c['teaches']}/{c['all_failed']}/{c['all_solved']}"
        for k, c in sorted(by_kind.items(), key=lambda kc: -sum(kc[1].values()))))
    return teach


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, type=Path, help="a finished demo's home")
    parser.add_argument("--baseline-home", required=True, type=Path, help="another finished demo's home")
    parser.add_argument("--run", default="demo", help="the run's name in both homes (default: demo)")
    args = parser.parse_args()
    base = report(f"baseline {args.baseline_home}", groups(args.baseline_home, args.run))
    new = report(f"current {args.home}", groups(args.home, args.run))
    print(f"groups that teach: {100 * new:.0f}% against {100 * base:.0f}%, ratio {new / base:.2f}x" if base else
          "groups that teach: the baseline has none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
