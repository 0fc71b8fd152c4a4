"""A code location for the tests that need a real daemon (concurrency, backfills, automation).

The platform's own pieces: the instance rules (``dagster_project.instance``), the checkpoint sensor
and the ``checkpoint_eval`` job, the ``checkpoints`` asset, the launcher and its per-step Pipes
observer. Two stand-ins, said here because they are not the real thing: ``rl_run`` launches the
steps workload (a trainer that reports steps and writes checkpoints exactly as the trainer does, but
trains nothing), and ``deepswe_eval`` writes graded attempt rows without a model, as no engine and
sandbox fleet can be started for every eval within this test; with ``POSTTRAIN_TEST_EVAL_GATE`` set
to a folder, an eval run of a backfill waits until a file named after the backfill's id is there
before it records its rows, so a test can choose when an eval lands. ``eval_report`` and the
automation sensor are the real ones. The stand-ins keep the real assets' keys, partitions, pools,
retry policy and job tags, which is what the concurrency rule acts on.
"""

import os
import time
from pathlib import Path

import dagster as dg

from assets.evals import EVAL_POOL, eval_report, eval_rows_path
from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage, WorkloadLauncher
from assets.training import TRAIN_POOL, StepObserver, checkpoints
from dagster_project.jobs import TRAIN_TAGS, checkpoint_eval_job
from dagster_project.automation import report_automation_sensor
from dagster_project.sensors import new_checkpoint_sensor
from evals.evaluate import ROW_COLUMNS, write_rows

RUN_NAME = "r1"
STEPS = 3


@dg.asset(group_name="training", pool=TRAIN_POOL)
def rl_run(context: dg.AssetExecutionContext, storage: PosttrainStorage, launcher: WorkloadLauncher):
    run_dir = storage.run_dir(RUN_NAME)
    observer = StepObserver(context, run_dir, RUN_NAME, STEPS)
    launcher.run(context, "tests.dagster_project.steps_workload",
                 ["--run-dir", str(run_dir), "--steps", str(STEPS), "--checkpoint-every", "1",
                  "--wait-for", f"{RUN_NAME}-step_000001/*.parquet", "--wait-root", str(storage.evals_dir() / "deepswe"),
                  "--wait-s", os.environ.get("POSTTRAIN_TEST_EVAL_WAIT_S", "400")],
                 extras={"run_dir": str(run_dir)}, on_message=observer)
    return dg.MaterializeResult(metadata={"steps": len(observer.rows)})


@dg.asset(group_name="evals", deps=[checkpoints], partitions_def=checkpoints_partitions, pool=EVAL_POOL,
          retry_policy=dg.RetryPolicy(max_retries=2, delay=30, backoff=dg.Backoff.EXPONENTIAL))
def deepswe_eval(context: dg.AssetExecutionContext, storage: PosttrainStorage):
    gate = os.environ.get("POSTTRAIN_TEST_EVAL_GATE")
    opened = Path(gate or ".") / context.run.tags.get("dagster/backfill", "")
    deadline = time.monotonic() + 400
    while gate and not opened.is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    rows = [{c: None for c in ROW_COLUMNS} | {"checkpoint": context.partition_key, "task_id": "t0", "attempt": a,
                                               "status": "graded", "reward": 1.0, "partial": 1.0, "target_score": 1.0,
                                               "strict_target_score": 1.0, "signals": "", "committed": True}
            for a in range(2)]
    path = write_rows(rows, eval_rows_path(storage, context.partition_key, context.run_id))
    return dg.MaterializeResult(metadata={"path": str(path)})


defs = dg.Definitions(
    assets=[rl_run, checkpoints, deepswe_eval, eval_report],
    jobs=[checkpoint_eval_job, dg.define_asset_job("rl_pipeline", selection=["rl_run"], tags=TRAIN_TAGS)],
    sensors=[new_checkpoint_sensor, report_automation_sensor],
    resources={"storage": PosttrainStorage(), "launcher": WorkloadLauncher()},
)
