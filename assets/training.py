"""The ``rl_run`` asset (one RL run) and the ``checkpoints`` asset (one partition per saved step)."""


from typing import Any

import dagster as dg

from assets.curriculum import difficulty_curriculum
from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage, WorkloadLauncher
from assets.run_files import ensure_embedded_base, run_file_dict
from training.checkpoint import list_checkpoints, metrics_dir, read_metadata
from training.curriculum import CURRICULUM_FILE


class RLRunConfig(dg.Config):
    """``run_file``: the run TOML (default ``examples/embedded.toml``), resolved by the run planner
    exactly as ``posttrain plan|run`` does. ``run_name`` replaces the file's ``[run] name``;
    ``overrides`` replaces keys per section, e.g. ``{"trainer": {"steps": 4}, "async": {"collection_size": 16}}``."""

    run_file: str = ""
    run_name: str = ""
    overrides: dict[str, Any] = {}


@dg.asset(group_name="training", deps=[difficulty_curriculum])
def rl_run(
    context: dg.AssetExecutionContext, config: RLRunConfig, storage: PosttrainStorage, launcher: WorkloadLauncher
) -> dg.MaterializeResult:
    """An asynchronous GRPO run on LoRA adapters: the trainer, the engine fleet, the router and the
    sandbox pool, launched as local processes or Kubernetes pods. Each saved checkpoint becomes a
    partition of ``checkpoints``."""
    import pandas as pd

    from training.planner import TRAINER_MODULE, resolve, trainer_args, write_resolved_plan

    data, source = run_file_dict(storage, config.run_file)
    if config.run_name:
        data.setdefault("run", {})["name"] = config.run_name
    for section, values in config.overrides.items():
        if not isinstance(values, dict):
            raise ValueError(f"rl_run config key overrides.{section}: expected a table of keys, got {values!r}")
        data.setdefault(section, {}).update(values)
    curriculum_file = storage.curriculum_dir() / CURRICULUM_FILE
    if curriculum_file.is_file():
        data["curriculum"]["curriculum_file"] = str(curriculum_file)
    ensure_embedded_base(context, data, reuse_any=True)
    plan = resolve(data, source=source)
    run_dir = storage.run_dir(plan.run_name)
    plan_path = write_resolved_plan(plan, run_dir)
    context.log.info(f"run {plan.run_name}: plan {plan_path}")
    launcher.run(context, TRAINER_MODULE, trainer_args(plan_path, run_dir))

    steps_path = metrics_dir(run_dir) / "steps.parquet"
    frame = pd.read_parquet(steps_path) if steps_path.is_file() else pd.DataFrame()
    metadata: dict[str, Any] = {
        "run_dir": dg.MetadataValue.path(str(run_dir)),
        "plan": dg.MetadataValue.path(str(plan_path)),
        "checkpoints": dg.MetadataValue.json([saved.path.name for saved in list_checkpoints(run_dir)]),
        "steps": int(frame["step"].max()) if len(frame) else 0,
    }
    if len(frame):
        first, last = frame.head(5), frame.tail(5)
        metadata.update({
            "solve_rate_first5": float(first["solve_rate"].mean()),
            "solve_rate_last5": float(last["solve_rate"].mean()),
            "zero_variance_groups": int(frame["zero_variance_groups"].sum()),
            "discarded_samples": int(frame["discarded_samples"].sum()),
            "discarded_token_fraction": float(frame["discarded_tokens"].sum()
                                              / max(frame["discarded_tokens"].sum() + frame["consumed_tokens"].sum(), 1)),
            "policy_age_mean": float(frame["policy_age_mean"].mean()),
            "policy_age_max": int(frame["policy_age_max"].max()),
            "wait_s_total": float(frame["wait_s"].sum()),
            "useful_tokens_per_s": float(frame["useful_tokens"].sum() / max((frame["wait_s"] + frame["train_s"]).sum(), 1e-9)),
            "metrics": dg.MetadataValue.path(str(steps_path)),
            "per_step": dg.MetadataValue.md(frame[["step", "loss", "solve_rate", "groups", "zero_variance_groups",
                                                   "discarded_samples", "policy_age_mean", "wait_s", "train_s"]]
                                            .to_markdown(index=False, floatfmt=".3f")),
        })
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(group_name="training", deps=[rl_run], partitions_def=checkpoints_partitions)
def checkpoints(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """One saved checkpoint of a run (adapter, optimizer, RNG, curriculum state, rollout store
    snapshot). Partition ``<run>-step_000000`` is the run's base model."""
    ckpt = storage.checkpoint_dir(context.partition_key)
    meta = read_metadata(ckpt, name=context.partition_key)
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
