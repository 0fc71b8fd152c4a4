"""The reward audit: every rewarded rollout of a run graded again against hidden inputs it never met.

    posttrain audit RUN [--home HOME] [--seed 1] [--workers 2] [--json]

A run's reward is graded with the hidden inputs of seed 0 (:func:`evals.call_checks.graded_checks`).
A policy that learned to pass those and not the task (a special case that happens to cover them, a
table wider than the visible tests) would keep its reward there. The audit takes every rollout the
run rewarded (score above 0; its committed patch is in the rollout's ``info``), grades the patch again
in fresh sandboxes with a fresh draw of hidden inputs (``--seed``, not 0), and counts per training
step the **wrong fixes that earned reward**: attempts whose score falls under the fresh draw. The
canaries of the task stream (impossible variants, never trained on: :mod:`training.curriculum`)
are counted beside it: their pass rate per step is the policy's measured cheating rate.

It writes ``runs/<run>/audit.json`` (one row per step; the viewer draws it as a curve) and prints a
table. Exit 0 when the audit ran (whatever it found), 1 when some rollout could not be graded again
(infrastructure; listed), 2 on bad input (no such run, no rollout store).

Only bundled-format tasks have hidden inputs; a rewarded rollout of another task format is graded
again as it was and counted as re-graded, never as a wrong fix unless its score falls.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from evals.attempts import INFRA_ERROR
from evals.grading import grade_patch
from evals.sandbox import platform_sandbox_factory
from evals.tasks import task_from_json
from sandboxes.home import default_home
from training.checkpoint import store_path
from training.config import TrainConfig
from training.curriculum import STREAM_DIR

AUDIT_FILE = "audit.json"
DEFAULT_SEED = 1


class AuditError(ValueError):
    """The run cannot be audited; the message names the file or run."""


@dataclass
class StepAudit:
    """One training step's rewarded rollouts, graded again (``step`` None: not trained on yet)."""

    step: int | None
    rewarded: int = 0
    regraded: int = 0
    wrong_fixes: int = 0  # rewarded under seed 0, scored lower under the fresh hidden inputs
    unavailable: int = 0  # no stored patch, an unknown task, or an infrastructure failure
    canaries: int = 0
    canaries_passed: int = 0
    wrong_fix_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rewarded": self.rewarded, "regraded": self.regraded,
                "wrong_fixes": self.wrong_fixes, "unavailable": self.unavailable, "canaries": self.canaries,
                "canaries_passed": self.canaries_passed, "wrong_fix_rollouts": self.wrong_fix_ids[:50]}


def run_tasks(run_dir: Path, cfg: TrainConfig) -> dict[str, Any]:
    """Every task the run could have served: its training tasks and the tasks its stream wrote."""
    # heavy: training.episodes loads torch and pandas; only auditing rollouts needs it
    from training.episodes import training_tasks

    tasks: dict[str, Any] = {}
    try:
        tasks.update(training_tasks(cfg.tasks))
    except (FileNotFoundError, ValueError):
        pass  # a stream-only run: its tasks are below
    for path in sorted((run_dir / STREAM_DIR / "tasks").glob("*/task.json")):
        task = task_from_json(json.loads(path.read_text()), path.parent, str(path))
        tasks[task.id] = task
    return tasks


def rewarded_rollouts(run_dir: Path) -> list[dict[str, Any]]:
    """The run's rollouts with a score above 0 (or canaries, whatever their score), with the step that
    trained on them (None when not taken yet)."""
    path = store_path(run_dir)
    if not path.is_file():
        raise AuditError(f"{run_dir}: no rollout store at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT rollout_id, task_id, reward, info, status, status_step FROM rollouts "
                            "ORDER BY rollout_id").fetchall()
    finally:
        conn.close()
    out = []
    for rollout_id, task_id, reward, info_text, status, status_step in rows:
        info = json.loads(info_text or "{}")
        score = float(info.get("score", reward) or 0.0)
        if score > 0 or info.get("canary"):
            out.append({"rollout_id": rollout_id, "task_id": task_id, "score": score, "info": info,
                        "step": status_step if status == "consumed" else None})
    return out


def audit_run(run_dir: Path, *, seed: int = DEFAULT_SEED, workers: int = 2, sandbox_factory=None,
              progress=print) -> tuple[list[StepAudit], list[str]]:
    """The audit of the run in ``run_dir``: per step, rewarded rollouts, wrong fixes among them and the
    canaries' passes; and the rollouts that could not be graded again (why, one line each)."""
    if seed == 0:
        raise AuditError("--seed 0 is the hidden inputs the run was graded with; the audit needs a fresh draw")
    config = run_dir / "trainer-config.json"
    if not config.is_file():
        raise AuditError(f"{run_dir}: no trainer-config.json (is it a run folder?)")
    cfg = TrainConfig.load(config)
    tasks = run_tasks(run_dir, cfg)
    rollouts = rewarded_rollouts(run_dir)
    factory = sandbox_factory or platform_sandbox_factory(cfg.sandbox_runtime)
    steps: dict[int | None, StepAudit] = {}
    problems: list[str] = []
    started = time.monotonic()

    graded: dict[tuple[str, str], Any] = {}  # an identical patch of a task is graded once (grading is deterministic)
    lock = threading.Lock()

    def regrade(rollout: Mapping[str, Any]):
        task = tasks.get(rollout["task_id"])
        patch = rollout["info"].get("patch")
        if task is None:
            return rollout, None, f"{rollout['rollout_id']}: task {rollout['task_id']} is not among the run's tasks"
        if not patch:
            return rollout, None, f"{rollout['rollout_id']}: no committed patch stored with the rollout"
        key = (task.id, hashlib.sha256(patch.encode()).hexdigest())
        with lock:
            future = graded.get(key)
            if future is None:
                future = graded[key] = Future()
                mine = True
            else:
                mine = False
        if mine:
            try:
                future.set_result(grade_patch(task, patch, factory, hidden_seed=seed))
            except BaseException as exc:  # noqa: BLE001 - handed to every rollout of the patch
                future.set_exception(exc)
        result = future.result()
        if result.status == INFRA_ERROR or result.scores is None:
            return rollout, None, f"{rollout['rollout_id']}: grading failed again: {result.detail[:200]}"
        return rollout, result, ""

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for done, (rollout, result, problem) in enumerate(pool.map(regrade, rollouts), 1):
            row = steps.setdefault(rollout["step"], StepAudit(rollout["step"]))
            canary = bool(rollout["info"].get("canary"))
            if canary:
                row.canaries += 1
                row.canaries_passed += rollout["score"] >= 1.0
            elif problem:
                row.rewarded += 1
                row.unavailable += 1
                problems.append(problem)
            else:
                row.rewarded += 1
                row.regraded += 1
                fresh = float(getattr(result.scores, cfg.reward, result.scores.reward))
                if fresh < rollout["score"]:
                    row.wrong_fixes += 1
                    row.wrong_fix_ids.append(rollout["rollout_id"])
            if done % 25 == 0 or done == len(rollouts):
                progress(f"audit: {done}/{len(rollouts)} rollouts graded again, {len(graded)} distinct patches "
                         f"({time.monotonic() - started:.0f} s)")
    order = sorted(steps.values(), key=lambda r: (r.step is None, r.step or 0))
    return order, problems


def write_audit(run_dir: Path, rows: list[StepAudit], seed: int) -> Path:
    """``runs/<run>/audit.json``, written aside and renamed (a reader never sees half of it)."""
    path = run_dir / AUDIT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"seed": seed, "written_s": time.time(), "steps": [r.to_dict() for r in rows]}, indent=1))
    tmp.replace(path)
    return path


def print_table(rows: list[StepAudit]) -> None:
    print("| step | rewarded | graded again | wrong fixes that earned reward | unavailable | canaries passed |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        canary = f"{r.canaries_passed}/{r.canaries}" if r.canaries else "–"
        print(f"| {'not yet trained' if r.step is None else r.step} | {r.rewarded} | {r.regraded} | {r.wrong_fixes} | "
              f"{r.unavailable} | {canary} |")
    total = sum(r.regraded for r in rows)
    wrong = sum(r.wrong_fixes for r in rows)
    canaries = sum(r.canaries for r in rows)
    passed = sum(r.canaries_passed for r in rows)
    print(f"total: {wrong} wrong fix(es) among {total} rewarded rollouts graded again"
          + (f" ({wrong / total:.1%})" if total else "")
          + (f"; canaries passed {passed}/{canaries} ({passed / canaries:.1%}: the measured cheating rate)"
             if canaries else "; no canary served"))


def cmd_audit(args: argparse.Namespace) -> int:
    home = Path(args.home).expanduser().resolve() if args.home else default_home()
    run_dir = Path(args.run)
    if not (run_dir / "trainer-config.json").is_file():
        run_dir = home / "runs" / args.run
    try:
        rows, problems = audit_run(run_dir, seed=args.seed, workers=args.workers,
                                   progress=(lambda line: print(line, file=sys.stderr, flush=True)))
    except AuditError as exc:
        print(f"posttrain audit: {exc}", file=sys.stderr)
        return 2
    path = write_audit(run_dir, rows, args.seed)
    if args.json:
        print(json.dumps({"run": str(run_dir), "seed": args.seed, "steps": [r.to_dict() for r in rows],
                          "problems": problems}, indent=1))
    else:
        print(f"reward audit of {run_dir} with hidden inputs of seed {args.seed} (the run's reward used seed 0)")
        print_table(rows)
        print(f"written to {path}")
        for line in problems:
            print(f"not graded again: {line}")
    return 1 if problems else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``audit`` to the ``posttrain`` parser."""
    audit = sub.add_parser(
        "audit",
        help="grade every rewarded rollout of a run again against fresh hidden inputs; wrong fixes per step",
        description="Grade every rollout a run rewarded again, in fresh sandboxes, with a fresh draw of hidden "
        "inputs (--seed), and print per training step how many were wrong fixes that earned reward, and how "
        "many of the task stream's canaries (impossible variants) the policy passed. Writes runs/RUN/audit.json. "
        "Exit 0 when the audit ran, 1 when a rollout could not be graded again, 2 on bad input.")
    audit.add_argument("run", help="the run's name under HOME/runs, or a run folder")
    audit.add_argument("--home", help="root folder of the runs (default: $POSTTRAIN_HOME, else ./posttrain-data)")
    audit.add_argument("--seed", type=int, default=DEFAULT_SEED,
                       help=f"the draw of hidden inputs, not 0 (the run's own; default: {DEFAULT_SEED})")
    audit.add_argument("--workers", type=int, default=2, help="rollouts graded at once (default: 2)")
    audit.add_argument("--json", action="store_true", help="print the audit as JSON")
    audit.set_defaults(func=cmd_audit)
