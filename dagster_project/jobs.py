"""Asset jobs: what the sensor requests and what backfills run."""

from __future__ import annotations

import dagster as dg

from assets.partitions import checkpoints_partitions

# Record a checkpoint and evaluate it: one run per checkpoint partition.
checkpoint_eval_job = dg.define_asset_job(
    "checkpoint_eval",
    selection=dg.AssetSelection.assets("checkpoints", "deepswe_eval"),
    partitions_def=checkpoints_partitions,
    description="Record one checkpoint and run its DeepSWE-style evaluation.",
)

# The unpartitioned head of the graph: tasks, images, curriculum, and the RL run itself.
rl_pipeline_job = dg.define_asset_job(
    "rl_pipeline",
    selection=dg.AssetSelection.assets("task_dataset", "image_cache", "difficulty_curriculum", "rl_run"),
    description="Build the task dataset, sandbox images and curriculum, then run RL training.",
)

report_job = dg.define_asset_job(
    "eval_report_job",
    selection=dg.AssetSelection.assets("eval_report"),
    description="Rebuild the eval report from every evaluated checkpoint.",
)

jobs = [checkpoint_eval_job, rl_pipeline_job, report_job]
