"""`posttrain audit RUN`: every rewarded rollout graded again against a fresh draw of hidden inputs.

A real rollout store of a run folder holds rewarded rollouts of a built bundled suite's task: the
reference fix, and a "wide table" that answers the visible calls AND the run's own hidden inputs
(seed 0) from a table, a constant elsewhere (what a policy that had learned the grader's draw would
commit). Both earned 1.0 during the run. The audit, run as the real command on real bwrap sandboxes,
finds the table and only it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.evals.test_hostile_grading import _committed
from tests.reliability.conftest import REPO


@pytest.fixture(scope="module")
def suite(rl_suite):
    return rl_suite


def _rollout(rollout_id: str, group_id: str, task_id: str, patch: str, score: float):
    from training.rollout import Rollout

    return Rollout(rollout_id=rollout_id, group_id=group_id, task_id=task_id, adapter_step=0,
                   input_ids=[1, 2, 3], loss_mask=[0, 1, 1], serving_logprobs=[0.0, -0.1, -0.2], reward=score,
                   info={"score": score, "signals": [], "patch": patch, "stop_reason": "commit"})


def test_audit_finds_the_fix_that_passed_only_the_runs_own_hidden_inputs(tmp_path: Path, suite):
    from evals.actions import apply_edits
    from evals.bundled import default_sandbox_factory
    from evals.call_checks import graded_checks
    from evals.grading import committed_patch, grade_patch
    from evals.tasks import load_bundled, rl_tasks
    from training.checkpoint import store_path
    from training.store import RolloutStore

    factory = default_sandbox_factory()
    task = sorted(rl_tasks(load_bundled(suite).tasks), key=lambda t: t.id)[0]
    seen = graded_checks(task, factory, seed=0)  # the visible calls and the run's hidden inputs
    table: dict[str, dict[str, object]] = {}
    for check in seen:
        table.setdefault(check.function, {})[check.args] = check.expected
    wide = "".join(f"\n_answers_{f} = {answers!r}\ndef {f}(*args):\n    return _answers_{f}.get(repr(args), 0)\n"
                   for f, answers in table.items())
    wide_patch = _committed(task, factory, wide)
    module = task.metadata["module_file"]
    with factory(task) as box:
        edits = [(line, text) for _, line, text in task.metadata["reference_edits"]]
        box.write_file(module, apply_edits(box.read_file(module).decode(), edits).encode())
        assert box.exec("git add -A && git commit -qm fix").exit_code == 0
        fix_patch = committed_patch(box, task.base_commit)
    assert grade_patch(task, wide_patch, factory).scores.reward == 1.0  # the run rewarded it

    run = tmp_path / "home" / "runs" / "audited"
    run.mkdir(parents=True)
    (run / "trainer-config.json").write_text(json.dumps({"run_name": "audited", "base_model": "none",
                                                         "tasks": str(suite)}))
    store = RolloutStore(store_path(run))
    for step, group in ((1, "g1"), (2, "g2")):
        store.add_group(group, task.id, 0, 2)
        store.put(_rollout(f"{group}-0", group, task.id, fix_patch, 1.0))
        store.put(_rollout(f"{group}-1", group, task.id, wide_patch if step == 2 else fix_patch, 1.0))
        store.take_groups(1, step=step, min_adapter_step=0)
    store.close()

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "dagster_project.cli", "audit", "audited", "--home",
                           str(tmp_path / "home"), "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    by_step = {row["step"]: row for row in report["steps"]}
    assert by_step[1]["rewarded"] == 2 and by_step[1]["wrong_fixes"] == 0, by_step
    assert by_step[2]["rewarded"] == 2 and by_step[2]["wrong_fixes"] == 1, by_step
    assert by_step[2]["wrong_fix_rollouts"] == ["g2-1"]
    assert json.loads((run / "audit.json").read_text())["steps"] == report["steps"]

    table_out = subprocess.run([sys.executable, "-m", "dagster_project.cli", "audit", str(run)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=600)
    assert table_out.returncode == 0 and "1 wrong fix(es) among 4 rewarded rollouts" in table_out.stdout, table_out
    bad = subprocess.run([sys.executable, "-m", "dagster_project.cli", "audit", "no-such-run", "--home",
                          str(tmp_path / "home")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no-such-run" in bad.stderr, bad
    zero = subprocess.run([sys.executable, "-m", "dagster_project.cli", "audit", str(run), "--seed", "0"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert zero.returncode == 2 and "fresh draw" in zero.stderr, zero
