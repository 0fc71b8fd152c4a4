"""A backfill of ``deepswe_eval`` under a real daemon keeps the earlier run's attempt rows beside the
new run's, and the daemon's automation sensor refreshes ``eval_report`` after each, without being asked,
also when the second eval lands just after the refresh that followed the first.
(``deepswe_eval`` here is the stand-in of ``tests/dagster_project/concurrency_location.py``; it keeps
its rows where the real asset does, ``eval_rows_path``.)"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from assets.partitions import checkpoints_partitions
from dagster_project.backfill import launch_backfill
from dagster_project.instance import ensure_dagster_home
from tests.dagster_project.helpers import write_full_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KEY = "r1-step_000004"


def wait_for(what: str, done, timeout_s: float = 420, explain=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        assert time.monotonic() < deadline, f"{what} did not happen{explain()}"
        time.sleep(2)
    return value


def _subset_size(subset) -> int | str:
    value = subset.value
    if isinstance(value, bool):
        return int(value)
    return len(value.subset) if hasattr(value, "subset") else type(value).__name__


def _tree(node, depth=0) -> list[str]:
    snap = node.condition_snapshot
    line = f"{'  ' * depth}{snap.label or snap.name or snap.class_name}: {_subset_size(node.true_subset)}"
    return [line] + [l for child in node.child_evaluations for l in _tree(child, depth + 1)]


def automation_history(instance) -> str:
    """The automation sensor's stored evaluations of eval_report (each node's true-subset size) and
    the materializations of both assets, in time order: what the daemon saw on each tick."""
    events = []
    for key in ("deepswe_eval", "eval_report"):
        for record in instance.fetch_materializations(dg.AssetKey(key), limit=50).records:
            events.append((record.timestamp, f"materialized {key} (storage id {record.storage_id}, run {record.run_id[:8]})"))
    stored = instance.schedule_storage.get_auto_materialize_asset_evaluations(dg.AssetKey("eval_report"), limit=100)
    for record in stored:
        with_runs = record.get_evaluation_with_run_ids()
        tree = "\n      ".join(_tree(with_runs.evaluation))
        events.append((record.timestamp, f"evaluation {record.evaluation_id} requested runs {sorted(r[:8] for r in with_runs.run_ids)}"
                                         f"\n      {tree}"))
    return "\n" + "\n".join(f"  {ts:.1f} {what}" for ts, what in sorted(events))


@contextlib.contextmanager
def daemon_with_two_checkpoints(home: Path, tmp_path: Path):
    """A real ``dagster-daemon`` on the test code location, with checkpoints 0 and 4 of run r1 saved
    and known as partitions (so the checkpoint sensor asks for no eval); yields the workspace file."""
    ensure_dagster_home(str(home))
    for step in (0, 4):
        write_full_checkpoint(home, "r1", step)
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - python_module:\n      module_name: tests.dagster_project.concurrency_location\n"
                         f"      working_directory: {ROOT}\n      location_name: concurrency\n")
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, ["r1-step_000000", KEY])
    daemon = subprocess.Popen([str(BIN / "dagster-daemon"), "run", "-w", str(workspace)], cwd=ROOT,
                              stdout=open(tmp_path / "daemon.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield workspace
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=60)


def reports(instance) -> list:
    """eval_report's materializations, newest first."""
    return instance.fetch_materializations(dg.AssetKey("eval_report"), limit=20).records


def backfill(instance, workspace: Path, what: str) -> None:
    backfill_id = launch_backfill(workspace, "deepswe_eval", [KEY])
    wait_for(what, lambda: (b := instance.get_backfill(backfill_id)) and b.status.value == "COMPLETED_SUCCESS")


def assert_both_runs_kept_and_reported(instance, folder: Path) -> None:
    newest = reports(instance)[0].asset_materialization.metadata
    assert newest["eval_runs"].value == 2
    assert f"| {KEY} | 2 |" in newest["repeats"].value
    run_ids = {p.stem for p in folder.glob("*.parquet")}
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": KEY}))
    assert len(run_ids) == 2 and run_ids == {r.run_id for r in runs}


@pytest.mark.slow
def test_a_backfill_keeps_earlier_rows_and_refreshes_the_report(posttrain_home, tmp_path):
    folder = posttrain_home / "evals" / "deepswe" / KEY
    with daemon_with_two_checkpoints(posttrain_home, tmp_path) as workspace, dg.DagsterInstance.get() as instance:
        for repeat in (1, 2):
            before = len(reports(instance))
            backfill(instance, workspace, f"backfill {repeat}")
            assert len(list(folder.glob("*.parquet"))) == repeat  # the earlier run's file is still there
            wait_for(f"eval_report after backfill {repeat}", lambda: len(reports(instance)) > before,
                     explain=lambda: automation_history(instance))
        assert_both_runs_kept_and_reported(instance, folder)


@pytest.mark.slow
def test_an_eval_landing_just_after_a_refresh_is_reported(posttrain_home, tmp_path, monkeypatch):
    """Two backfills of one partition run side by side; the second eval is held at a gate until the
    refresh after the first has materialized, then lands at once: most often before the automation
    sensor's next tick, so that tick sees the report's own update and the new eval together. The
    report must still be refreshed with both runs' rows."""
    gates = tmp_path / "eval-gates"
    gates.mkdir()
    monkeypatch.setenv("POSTTRAIN_TEST_EVAL_GATE", str(gates))  # the daemon and its runs inherit it
    folder = posttrain_home / "evals" / "deepswe" / KEY
    with daemon_with_two_checkpoints(posttrain_home, tmp_path) as workspace, dg.DagsterInstance.get() as instance:
        first = launch_backfill(workspace, "deepswe_eval", [KEY])
        (gates / first).touch()
        second = launch_backfill(workspace, "deepswe_eval", [KEY])
        wait_for("backfill 1", lambda: (b := instance.get_backfill(first)) and b.status.value == "COMPLETED_SUCCESS")
        wait_for("the refresh after backfill 1", lambda: reports(instance), explain=lambda: automation_history(instance))
        assert reports(instance)[0].asset_materialization.metadata["eval_runs"].value == 1
        (gates / second).touch()
        wait_for("backfill 2", lambda: (b := instance.get_backfill(second)) and b.status.value == "COMPLETED_SUCCESS")
        assert len(list(folder.glob("*.parquet"))) == 2
        wait_for("a report with both eval runs", lambda: any(
            r.asset_materialization.metadata["eval_runs"].value == 2 for r in reports(instance)),
            explain=lambda: automation_history(instance))
        print(automation_history(instance))
        assert_both_runs_kept_and_reported(instance, folder)
