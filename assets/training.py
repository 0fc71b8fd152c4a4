"""The ``rl_run`` asset (one RL run) and the ``checkpoints`` asset (one partition per saved step)."""


import json

import dagster as dg

from assets._missing import not_built
from assets.curriculum import difficulty_curriculum
from dagster_project.partitions import checkpoints_partitions
from dagster_project.resources import PosttrainStorage, WorkloadLauncher


@dg.asset(group_name="training", deps=[difficulty_curriculum])
def rl_run(
    context: dg.AssetExecutionContext, storage: PosttrainStorage, launcher: WorkloadLauncher
) -> dg.MaterializeResult:
    """An asynchronous GRPO run on LoRA adapters: the trainer, the engine fleet, the router and the
    sandbox pool, launched as local processes or Kubernetes pods. Each saved checkpoint becomes a
    partition of ``checkpoints``."""
    raise not_built("rl_run", "the trainer in training/")


@dg.asset(group_name="training", deps=[rl_run], partitions_def=checkpoints_partitions)
def checkpoints(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """One saved checkpoint of a run (adapter, optimizer, RNG, curriculum state, rollout store
    snapshot). Partition ``<run>-step_000000`` is the run's base model."""
    ckpt = storage.checkpoint_dir(context.partition_key)
    meta_path = ckpt / "metadata.json"
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"checkpoint {context.partition_key}: {meta_path} is missing; a checkpoint is complete "
            "only once its metadata.json is written"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint {context.partition_key}: {meta_path} is not valid JSON: {exc}") from exc
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    metadata: dict[str, dg.RawMetadataValue] = {
        "path": dg.MetadataValue.path(str(ckpt)),
        "size_mib": round(size / 2**20, 3),
    }
    for key, value in meta.items():
        if isinstance(value, (int, float, str, bool)):
            metadata[key] = value
    return dg.MaterializeResult(metadata=metadata)


defs = dg.Definitions(assets=[rl_run, checkpoints])
