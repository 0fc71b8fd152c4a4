"""The ``rl_run`` asset (one RL run) and the ``checkpoints`` asset (one partition per saved step).

``rl_run`` turns each step the trainer reports through Dagster Pipes into an observation of the asset
while the run goes (its numbers are the asset's plots in the UI), with a PNG of the curves at every
checkpoint; the trainer writes the same series as TensorBoard event files in the run directory.
``checkpoints`` carries two checks: the folder is complete and its adapter loads.
"""

import json
import threading
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
from dagster._core.events import DagsterEvent
from tabulate import tabulate

from assets.checks import ADAPTER_CHECK, COMPLETE_CHECK, check_adapter_loads, check_checkpoint_complete
from assets.curriculum import difficulty_curriculum
from assets.metadata import png_markdown, rounded
from assets.partitions import checkpoints_partitions, parse_checkpoint_partition_key
from assets.resources import PosttrainStorage, WorkloadLauncher
from assets.run_files import EMBEDDED_MODEL_NAME, ensure_embedded_base, hand_to_workloads, on_run_volume, run_file_dict
from training.checkpoint import list_checkpoints, metrics_dir, read_metadata
from training.curriculum import CURRICULUM_FILE
from training.planner import resolve, write_resolved_plan
from training.progress import plot_curves, rows_from_steps_parquet, tensorboard_dir
from viewer import links
from training.planner.k8s import EVAL_POD_FILE, eval_pod

TRAIN_POOL = "train"  # the instance limits this pool to one op at a time (dagster_project/instance.py)
CURVES_PNG = "curves.png"  # under the run's metrics folder


class RLRunConfig(dg.Config):
    """``run_file``: the run TOML (default ``examples/embedded.toml``), resolved by the run planner
    exactly as ``posttrain plan|run`` does. ``run_name`` replaces the file's ``[run] name``;
    ``overrides`` replaces keys per section, e.g. ``{"trainer": {"steps": 4}, "async": {"collection_size": 16}}``."""

    run_file: str = ""
    run_name: str = ""
    overrides: dict[str, Any] = {}


def per_step_table(frame: Any) -> str:
    """The per-step numbers as a Markdown table: counts as integers, the rest to 3 decimals."""
    columns = ["step", "loss", "reward_mean", "solve_rate", "groups", "zero_variance_groups", "discarded_samples",
               "integrity_gated", "policy_age_mean", "policy_age_max", "wait_s", "train_s"]
    records = frame[[c for c in columns if c in frame.columns]].to_dict("records")
    return tabulate(records, headers="keys", tablefmt="pipe", floatfmt=".3f")


def run_totals(frame: Any) -> dict[str, float | int]:
    """The whole run's numbers from its step rows, each under a ``run_`` name of its own: a step
    observation's key (``discarded_samples``, ``policy_age_max``...) means one step, and reusing it for
    a sum or a mean over the run drew a false last point on that key's plot."""
    first, last = frame.head(5), frame.tail(5)
    return {
        "run_solve_rate_first5": float(first["solve_rate"].mean()),
        "run_solve_rate_last5": float(last["solve_rate"].mean()),
        "run_zero_variance_groups": int(frame["zero_variance_groups"].sum()),
        "run_discarded_samples": int(frame["discarded_samples"].sum()),
        # attempts a cheating signal flagged, zeroed or dropped by the trainer's integrity gate
        "run_integrity_gated": int(frame["integrity_gated"].fillna(0).sum()) if "integrity_gated" in frame else 0,
        "run_discarded_token_fraction": float(frame["discarded_tokens"].sum()
                                              / max(frame["discarded_tokens"].sum() + frame["consumed_tokens"].sum(), 1)),
        "run_policy_age_mean": float(frame["policy_age_mean"].mean()),
        "run_policy_age_max": int(frame["policy_age_max"].max()),
        "run_wait_s": float(frame["wait_s"].sum()),
        "run_train_s": float(frame["train_s"].sum()),
        "run_useful_tokens_per_s": float(frame["useful_tokens"].sum()
                                         / max((frame["wait_s"] + frame["train_s"]).sum(), 1e-9)),
    }


class StepObserver:
    """Turns the trainer's per-step Pipes messages into observations of ``rl_run`` as they arrive.

    Each observation carries the step's series (rounded), ``of_steps`` and ``rollouts``, a link to
    the step's groups and rollouts in the trajectory viewer; at a step that saved a checkpoint it
    also carries the curves so far as a PNG (``curves``), also written to ``RUN_DIR/metrics/curves.png``."""

    def __init__(self, context: dg.AssetExecutionContext, run_dir: Path, run_name: str, of_steps: int) -> None:
        self.context, self.run_dir, self.run_name, self.of_steps = context, run_dir, run_name, of_steps
        self.rows: list[dict[str, Any]] = []
        self.plotted: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, payload: Any) -> None:
        if not isinstance(payload, dict) or not isinstance(payload.get("series"), dict):
            return  # another kind of custom message
        step = int(payload["step"]["step"])
        with self._lock:
            self.rows.append({"step": step, **payload["series"]})
            metadata: dict[str, Any] = {"step": step, "of_steps": self.of_steps,
                                        "adapter_version": str(payload.get("adapter_version") or "")}
            metadata.update({name: rounded(value) for name, value in payload["series"].items()})
            metadata["rollouts"] = dg.MetadataValue.url(links.url(links.step_path(self.run_name, step)))
            saved = {c.step for c in list_checkpoints(self.run_dir)} - self.plotted
            if step in saved or step == self.of_steps:
                self.plotted |= saved | {step}
                png = plot_curves({self.run_name: self.rows}, metrics_dir(self.run_dir) / CURVES_PNG,
                                  title=f"{self.run_name}: steps 1-{step} of {self.of_steps}")
                metadata["curves"] = dg.MetadataValue.md(png_markdown(png, f"{self.run_name} curves"))
                metadata["checkpoint"] = step
        # Logged from the Pipes reader's thread straight into the run's event log, so the UI shows
        # the step now rather than when the asset returns.
        DagsterEvent.asset_observation(
            self.context.get_step_execution_context(),
            dg.AssetObservation(asset_key=self.context.asset_key, metadata=metadata,
                                description=f"step {step} of {self.of_steps}"),
        )


@dg.asset(group_name="training", deps=[difficulty_curriculum], pool=TRAIN_POOL)
def rl_run(
    context: dg.AssetExecutionContext, config: RLRunConfig, storage: PosttrainStorage, launcher: WorkloadLauncher
) -> dg.MaterializeResult:
    """An asynchronous GRPO run on LoRA adapters: the trainer, the engine fleet, the router and the
    sandbox pool, launched as local processes or Kubernetes pods. Each saved checkpoint becomes a
    partition of ``checkpoints`` (and is evaluated while the run goes on).

    While the run goes, every step is an observation of this asset (loss, reward, solve rate, policy
    age, zero-variance groups, tokens/s, wait and train time, discarded tokens, and the attempts the
    integrity gate caught for cheating, in all and per signal: the Events tab),
    and each checkpoint adds a PNG of the curves; TensorBoard event files are in
    ``RUN_DIR/metrics/tensorboard`` (``posttrain ui --tensorboard`` serves them)."""
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
    # the embedded base is built under the storage root: on k8s that is the run volume's mount, and
    # the plan then names it (and the tasks) as the pods see them
    if launcher.target == "local" or data["model"].get("name") == EMBEDDED_MODEL_NAME:
        ensure_embedded_base(context, data, reuse_any=True)
    read_by_pods = on_run_volume(data, storage) if launcher.target == "k8s" else []
    plan = resolve(data, source=source)
    run_dir = storage.run_dir(plan.run_name)
    plan_path = write_resolved_plan(plan, run_dir)
    if launcher.target == "k8s":  # the pod its checkpoints' evaluations run in (deepswe_eval)

        (run_dir / EVAL_POD_FILE).write_text(json.dumps(eval_pod(plan), indent=2) + "\n")
        # what was made here (as root, atomic writes private) the pods read and write as their own user:
        # seen, an engine refused model.safetensors and a trainer the suite's suite.json
        hand_to_workloads(run_dir, storage.evals_dir(), *read_by_pods)
    context.log.info(f"run {plan.run_name}: plan {plan_path}")
    of_steps = int((data.get("trainer") or {}).get("steps") or 0)
    observer = StepObserver(context, run_dir, plan.run_name, of_steps)
    launcher.run_trainer(context, plan, plan_path, run_dir, on_message=observer)

    steps_path = metrics_dir(run_dir) / "steps.parquet"
    frame = pd.read_parquet(steps_path) if steps_path.is_file() else pd.DataFrame()
    metadata: dict[str, Any] = {
        "run_dir": dg.MetadataValue.path(str(run_dir)),
        "plan": dg.MetadataValue.path(str(plan_path)),
        "checkpoints": dg.MetadataValue.json([saved.path.name for saved in list_checkpoints(run_dir)]),
        "steps": int(frame["step"].max()) if len(frame) else 0,
        "tensorboard_logdir": dg.MetadataValue.path(str(tensorboard_dir(run_dir))),
        # the viewer redirects to the TensorBoard `posttrain ui --tensorboard` serves, on whatever port
        "tensorboard": dg.MetadataValue.url(links.url("/tensorboard")),
        "viewer": dg.MetadataValue.url(links.url(links.run_path(plan.run_name))),
    }
    rows = rows_from_steps_parquet(steps_path)
    if rows:
        png = plot_curves({plan.run_name: rows}, metrics_dir(run_dir) / CURVES_PNG, title=f"{plan.run_name}: {len(rows)} steps")
        metadata["curves"] = dg.MetadataValue.md(png_markdown(png, f"{plan.run_name} curves"))
    if len(frame):
        metadata.update(run_totals(frame))
        metadata.update({
            "metrics": dg.MetadataValue.path(str(steps_path)),
            "per_step": dg.MetadataValue.md(per_step_table(frame)),
        })
    return dg.MaterializeResult(metadata={key: rounded(value) for key, value in metadata.items()})


@dg.asset(
    group_name="training", deps=[rl_run], partitions_def=checkpoints_partitions,
    check_specs=[
        dg.AssetCheckSpec(COMPLETE_CHECK, asset="checkpoints", description=(
            "The checkpoint folder is complete: metadata.json and the curriculum state, and past step 0 the "
            "adapter, optimizer state, RNG state and rollout-store snapshot, each readable.")),
        dg.AssetCheckSpec(ADAPTER_CHECK, asset="checkpoints", description=(
            "The LoRA adapter loads: adapter_config.json parses and the safetensors hold LoRA tensors of the "
            "configured rank (step 0, the base model, has no adapter and passes).")),
    ],
)
def checkpoints(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """One saved checkpoint of a run (adapter, optimizer, RNG, curriculum state, rollout store
    snapshot). Partition ``<run>-step_000000`` is the run's base model."""
    ckpt = storage.checkpoint_dir(context.partition_key)
    meta = read_metadata(ckpt, name=context.partition_key)
    step = parse_checkpoint_partition_key(context.partition_key)[1]
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    metadata: dict[str, dg.RawMetadataValue] = {
        "path": dg.MetadataValue.path(str(ckpt)),
        "size_mib": round(size / 2**20, 3),
    }
    for key, value in meta.items():
        if key == "created_s" and isinstance(value, (int, float)):
            metadata["created"] = dg.MetadataValue.timestamp(float(value))  # shown as a date, not epoch seconds
        elif isinstance(value, (int, float, str, bool)):
            metadata[key] = rounded(value)
    return dg.MaterializeResult(metadata=metadata,
                                check_results=[check_checkpoint_complete(ckpt, step), check_adapter_loads(ckpt, step)])


defs = dg.Definitions(assets=[rl_run, checkpoints])
