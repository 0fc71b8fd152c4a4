"""Checks of finished demos' RL data and evaluations, side by side: is what the trainer learned from
what the episodes did, and does the evaluation grade as it should?

    .venv/bin/python bench/demo_checks.py HOME [HOME ...] [--logprobs 6] [--regrade 300]
    .venv/bin/python bench/demo_checks.py HOME --eval-rows-of OTHER_HOME      # grade OTHER's final eval here

For each demo home (``bash scripts/demo.sh --home HOME``, finished), from its run ``demo``:

- the schedule: rollouts consumed and discarded, the policy age of the groups trained on;
- how the training episodes ended, by quarter of the run (committed or out of turns) and solved;
- how many distinct rollouts a group of 8 holds (the sampling seeds at work);
- ``--logprobs N``: for N rollouts of at least 4 turns sampled late in the run, the serving
  log-probabilities against the same tokens scored by the base model with that rollout's adapter
  (a mix-up of turns, sessions or adapter versions shows as a difference);
- ``--regrade N``: the committed patches of up to N distinct consumed rollouts graded again, here, in
  fresh sandboxes, against the score the run stored;
- ``--eval-rows-of OTHER``: OTHER's final checkpoint's evaluation rows graded again with this code
  (run with ``PYTHONPATH`` set to another checkout to grade with that code's grader).

Runs no engine; the grading starts sandboxes (bwrap), two at a time.
"""

from __future__ import annotations

import argparse
import array
import collections
import glob
import json
import sqlite3
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RUN = "demo"


def _store(home: Path) -> sqlite3.Connection:
    path = home / "runs" / RUN / "store" / "rollouts.sqlite"
    if not path.is_file():
        raise SystemExit(f"{home}: no rollout store at {path} (a finished demo's home is expected)")
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def _column(blob: bytes, code: str) -> list:
    values = array.array(code)
    values.frombytes(blob)
    return list(values)


def schedule(home: Path) -> None:
    conn = _store(home)
    counts = dict(conn.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status").fetchall())
    ages = collections.Counter(step - 1 - version for step, version in conn.execute(
        "SELECT MIN(status_step), MIN(adapter_version) FROM rollouts WHERE status='consumed' GROUP BY group_id"))
    by_group = collections.defaultdict(list)
    for group_id, ids in conn.execute("SELECT group_id, input_ids FROM rollouts WHERE status='consumed'"):
        by_group[group_id].append(ids)
    distinct = [len(set(v)) for v in by_group.values()]
    print(f"{home}: rollouts {counts}; groups trained on by policy age {dict(sorted(ages.items()))}; "
          f"distinct rollouts a group {sum(distinct) / max(len(distinct), 1):.2f}")
    steps = conn.execute("SELECT MAX(status_step) FROM rollouts").fetchone()[0] or 1
    quarter = max(1, -(-steps // 4))
    per = collections.defaultdict(collections.Counter)
    for step, reward, info in conn.execute("SELECT status_step, reward, info FROM rollouts WHERE status='consumed'"):
        row = per[(step - 1) // quarter]
        row[json.loads(info).get("stop_reason", "?")] += 1
        row["solved"] += reward >= 1.0
        row["n"] += 1
    for q in sorted(per):
        row = per[q]
        ends = ", ".join(f"{k} {v / row['n']:.2f}" for k, v in sorted(row.items()) if k not in ("n", "solved"))
        print(f"  steps {q * quarter + 1}-{min((q + 1) * quarter, steps)}: {row['n']} rollouts, solved "
              f"{row['solved'] / row['n']:.2f}, ended: {ends}")


def logprobs(home: Path, n: int) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    conn = _store(home)
    last = conn.execute("SELECT MAX(adapter_version) FROM rollouts").fetchone()[0] or 0
    rows = [r for r in conn.execute(
        "SELECT rollout_id, adapter_version, input_ids, loss_mask, serving_logprobs, info FROM rollouts "
        "WHERE status='consumed' AND adapter_version >= ? ORDER BY rollout_id", (last * 2 // 3,))
        if int(json.loads(r[5]).get("turns", 0)) >= 4][:n]
    base = home / "models" / "base"
    for rollout_id, version, ids, mask, served, _ in rows:
        ids, mask, served = _column(ids, "i"), _column(mask, "b"), _column(served, "f")
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if version:
            model = PeftModel.from_pretrained(model, home / "runs" / RUN / "adapters" / f"step_{version:06d}")
        model.eval()
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        diffs = [abs(scores[i - 1, ids[i]].item() - served[i]) for i in range(1, len(ids)) if mask[i]]
        print(f"  {rollout_id} (adapter {version}, {len(ids)} tokens, {len(diffs)} sampled): serving against the "
              f"adapter's log-probabilities, mean |difference| {sum(diffs) / len(diffs):.5f}, max {max(diffs):.5f}")


def regrade_rollouts(home: Path, n: int) -> None:
    from evals.grading import grade_patch
    from evals.sandbox import platform_sandbox_factory
    from training.audit import run_tasks
    from training.config import TrainConfig

    run = home / "runs" / RUN
    cfg = TrainConfig.load(run / "trainer-config.json")
    tasks = run_tasks(run, cfg)
    patches: dict[tuple[str, str], list[float]] = {}
    for task_id, reward, info in _store(home).execute(
            "SELECT task_id, reward, info FROM rollouts WHERE status='consumed' ORDER BY rollout_id"):
        info = json.loads(info)
        if info.get("patch"):
            patches.setdefault((task_id, info["patch"]), []).append(float(info.get("score", reward)))
    keys = list(patches)[:n]
    factory = platform_sandbox_factory("bwrap")
    same, differ = 0, collections.Counter()
    with ThreadPoolExecutor(2) as pool:
        for key, grade in zip(keys, pool.map(lambda k: grade_patch(tasks[k[0]], k[1], factory), keys)):
            now = float(getattr(grade.scores, cfg.reward)) if grade.scores is not None else 0.0  # the run's reward
            for stored in patches[key]:
                if abs(now - stored) < 1e-9:
                    same += 1
                else:
                    differ[(stored, now)] += 1
    print(f"  {len(keys)} distinct committed patches of consumed rollouts graded again: {same} rollouts score as "
          f"stored, {sum(differ.values())} differ {dict(differ)}")


def regrade_eval(other: Path) -> None:
    import pandas as pd

    from evals.evaluate import load_eval_tasks
    from evals.grading import grade_patch
    from evals.sandbox import platform_sandbox_factory

    final = sorted(glob.glob(str(other / "evals" / "deepswe" / f"{RUN}-step_*" / "*.parquet")))[-1]
    rows = pd.read_parquet(final)
    tasks = {t.id: t for t in load_eval_tasks("bundled", rows["split"].iloc[0],
                                              bundled_dir=other / "datasets" / "bundled")}
    todo = rows[(rows["committed"] == True) & (rows["diff"].str.len() > 0)]  # noqa: E712 (a pandas mask)
    patches: dict[tuple[str, str], list[float]] = {}
    for row in todo.itertuples():
        patches.setdefault((row.task_id, row.diff), []).append(float(row.reward))
    factory = platform_sandbox_factory("bwrap")
    keys = list(patches)
    differ = 0
    with ThreadPoolExecutor(2) as pool:
        for key, grade in zip(keys, pool.map(lambda k: grade_patch(tasks[k[0]], k[1], factory), keys)):
            now = float(grade.scores.reward) if grade.scores is not None else 0.0
            differ += sum(abs(now - stored) > 1e-9 for stored in patches[key])
    print(f"{final}: {len(todo)} committed attempts ({len(keys)} distinct patches) graded again by this code: "
          f"{differ} score differently")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("homes", nargs="+", type=Path, help="finished demo homes")
    parser.add_argument("--logprobs", type=int, default=0, metavar="N", help="rollouts whose log-probabilities are checked")
    parser.add_argument("--regrade", type=int, default=0, metavar="N", help="distinct patches graded again")
    parser.add_argument("--eval-rows-of", type=Path, metavar="OTHER", help="grade OTHER's final evaluation rows again")
    args = parser.parse_args(argv)
    for home in args.homes:
        schedule(home)
        if args.logprobs:
            logprobs(home, args.logprobs)
        if args.regrade:
            regrade_rollouts(home, args.regrade)
    if args.eval_rows_of:
        regrade_eval(args.eval_rows_of)
    return 0


if __name__ == "__main__":
    sys.exit(main())
