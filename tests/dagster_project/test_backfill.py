"""``posttrain backfill`` creates a real backfill in the instance, and the daemon runs it to the end."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from dagster_project.instance import ensure_dagster_home
from assets.partitions import checkpoints_partitions
from tests.dagster_project.helpers import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def posttrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "posttrain"), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.slow
def test_backfill_runs_complete_under_the_daemon(posttrain_home):
    ensure_dagster_home(str(posttrain_home))
    keys = [f"r1-step_{s:06d}" for s in (0, 4, 8)]
    for step in (0, 4, 8):
        write_checkpoint(posttrain_home, "r1", step, loss=1.0 / (step + 1))
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions(checkpoints_partitions.name, keys)

    daemon = subprocess.Popen(
        [str(BIN / "dagster-daemon"), "run", "-w", str(ROOT / "workspace.yaml")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        done = posttrain("backfill", "checkpoints", "--from", keys[1], "--to", keys[2], "--wait", "--timeout", "240")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"over 2 partitions: {keys[1]}, {keys[2]}" in done.stdout
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=30)

    with dg.DagsterInstance.get() as instance:
        [backfill] = instance.get_backfills()
        assert backfill.status.value == "COMPLETED_SUCCESS"
        runs = instance.get_runs()
        assert sorted(r.tags["dagster/partition"] for r in runs) == keys[1:]
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
        for key in keys[1:]:
            event = instance.get_latest_materialization_event(dg.AssetKey("checkpoints"))
            assert event is not None
        materialized = instance.get_materialized_partitions(dg.AssetKey("checkpoints"))
        assert materialized == set(keys[1:])


def test_backfill_names_an_unknown_partition(posttrain_home):
    ensure_dagster_home(str(posttrain_home))
    done = posttrain("backfill", "checkpoints", "--partitions", "r9-step_000001")
    assert done.returncode == 2
    assert "no partition r9-step_000001" in done.stderr


def test_backfill_refuses_an_unpartitioned_asset(posttrain_home):
    done = posttrain("backfill", "task_dataset", "--partitions", "x")
    assert done.returncode == 2
    assert "'task_dataset' is not partitioned" in done.stderr


@pytest.mark.parametrize("command", [[], ["demo"], ["backfill"], ["ui"]])
def test_help_answers(command):
    done = posttrain(*command, "--help", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: posttrain" in done.stdout
