"""The ``deepswe_eval`` asset (per checkpoint) and the ``eval_report`` asset (all checkpoints).

Every eval run keeps its own attempt rows, ``evals/deepswe/<checkpoint>/<run_id>.parquet``: a backfill
or a retry adds a file and never overwrites an earlier run's. ``eval_report`` scores each
checkpoint's newest run and shows the spread between repeats; it refreshes on its own after any
``deepswe_eval`` partition is materialized (declarative automation, run by the daemon).
"""

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import pydantic

from assets.checks import (
    ATTEMPTS_CHECK, DUPLICATES_CHECK, INFRA_CHECK, REPORT_CHECK, check_attempts_recorded, check_infra_share,
    check_no_duplicates, check_report_complete,
)
from assets.harbor_eval import harbor_eval_rows
from assets.metadata import per_task_table, png_markdown, rounded
from assets.partitions import checkpoints_partitions, parse_checkpoint_partition_key
from assets.resources import PosttrainStorage, WorkloadLauncher
from assets.run_files import hand_to_workloads
from assets.training import checkpoints
from evals.evaluate import eval_tasks, evaluate_checkpoint
from evals.flawed import ensure_flawed_lists, load_flawed_lists
from evals.attempts import write_rows
from evals.harbor import is_harbor_dataset
from evals.report import (
    build_report, flagged_mask, flip_counts, graded_rows, headline_markdown, headlines, load_attempt_rows,
    markdown_tables, newest_runs, parse_key, plot_pass_at_1, plot_pass_at_k, plot_target_scores, repeat_spread,
    report_rows, run_summary, signal_counts, spread_markdown,
)
from evals.sandbox import platform_sandbox_factory
from evals.settings import EVAL_DEFAULTS, POD_KEYS, EvalSection, parse_eval_table, validated_eval_table
from sandboxes.k8s import LABEL_PREFIX, label_value
from sandboxes.settings import SettingsError, as_table, key_name
from training.checkpoint import checkpoint_policy, metrics_dir
from training.planner.runner import PLAN_FILENAME
from training.progress import plot_curves, rows_from_steps_parquet
from viewer import links
from viewer.data import checkpoint_tasks

EVAL_POOL = "eval"  # the instance lets two ops of this pool run at once (dagster_project/instance.py)


def dagster_config(section: type, name: str, doc: str) -> type[dg.Config]:
    """A Dagster config class with the keys, types, defaults and meanings of a run-file section (a
    frozen dataclass of ``sandboxes.settings`` fields): the launchpad shows each key's meaning, and
    the section stays the one place the keys are declared. A list of names is a list here (Dagster
    config has no tuples); the constraints are the section's, checked when the asset reads the config."""
    hints = typing.get_type_hints(section)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        hint, default = hints[f.name], f.default
        if typing.get_origin(hint) is tuple:
            hint, default = list[str], list(default)
        fields[key_name(f)] = (hint, pydantic.Field(default=default, description=f.metadata.get("doc") or None))
    config = pydantic.create_model(name, __base__=dg.Config, **fields)
    config.__doc__, config.__module__ = doc, __name__
    return config


DeepSWEEvalConfig = dagster_config(EvalSection, "DeepSWEEvalConfig", """How a checkpoint is evaluated: the run file's
``[eval]`` table (``evals.settings.EvalSection``, which declares and documents each key). The
checkpoint sensor, the demo and ``posttrain backfill`` fill it from the run's ``[eval]``
(:func:`checkpoint_eval_run_config`, :func:`eval_run_config`); ``deepswe_eval`` reads it back into
an ``EvalSection`` once.

``dataset``: ``bundled`` (the suite under the datasets folder), a task source (a SWE-bench file,
a built suite folder), or a Harbor dataset folder (DeepSWE v1.1's ``tasks/``, or ``posttrain
tasks export-harbor`` output), whose images are built from the repository sources in
``sources`` and whose attempts run DeepSWE v1.1's verifier flow (``assets.harbor_eval``).
``task_ids``: the tasks to evaluate (empty: all of ``split``; ``all``: every split).""")


def eval_config(section: EvalSection) -> dict[str, Any]:
    """``deepswe_eval``'s config (:data:`DeepSWEEvalConfig`) from a validated ``[eval]`` table."""
    return as_table(section)


def eval_run_config(section: EvalSection) -> dict[str, Any]:
    """The run config of a ``checkpoint_eval`` run (or a ``deepswe_eval`` backfill) that evaluates as
    ``section`` says: its table (:func:`eval_config`) as ``deepswe_eval``'s config."""
    return _deepswe_eval_run_config(eval_config(section))


def _deepswe_eval_run_config(table: dict[str, Any]) -> dict[str, Any]:
    """A Dagster run config that hands ``table`` (an ``[eval]`` table written whole) to ``deepswe_eval``."""
    return {"ops": {"deepswe_eval": {"config": table}}}


EVAL_SETTINGS_FILE = "eval.json"  # a model registered by `posttrain eval --model`: the [eval] it was evaluated with


def run_eval_table(storage: PosttrainStorage, run_name: str) -> tuple[Any, str] | None:
    """The ``[eval]`` table of run ``run_name`` as written, and the file it is read from: its
    ``resolved-plan.json``'s (the run file's, as planned), else the ``eval.json`` that ``posttrain
    eval --model`` wrote for a model it registered; ``None`` when neither has one (the defaults).
    A file that is not a JSON object raises ``SettingsError`` naming it."""
    run_dir = storage.run_dir(run_name)
    for path in (run_dir / PLAN_FILENAME, run_dir / EVAL_SETTINGS_FILE):
        if path.is_file():
            try:
                table = json.loads(path.read_text()).get("eval")
            except (OSError, ValueError, AttributeError) as exc:
                raise SettingsError([f"{path}: not a JSON object ({exc})"]) from None
            if table is not None:
                return table, str(path)
    return None


def run_eval_section(storage: PosttrainStorage, run_name: str) -> EvalSection:
    """The ``[eval]`` of run ``run_name`` (:func:`run_eval_table`), validated, else the defaults. A
    table that does not validate raises ``SettingsError`` (the planner's ``PlanError``) naming the
    file and the key."""
    found = run_eval_table(storage, run_name)
    return parse_eval_table(*found) if found else EVAL_DEFAULTS


def checkpoint_eval_run_config(storage: PosttrainStorage, checkpoint: str) -> dict[str, Any]:
    """The run config that evaluates ``checkpoint`` (a partition key) as its run's ``[eval]`` says,
    from the partition key to ``deepswe_eval``'s config in one call: what the checkpoint sensor
    requests. The run's table (:func:`run_eval_table`) is validated and written whole once
    (``evals.settings.validated_eval_table``; the defaults where the run has none); ``SettingsError`` (the
    planner's ``PlanError``) naming the file and the key when the run's table does not validate."""
    found = run_eval_table(storage, parse_checkpoint_partition_key(checkpoint)[0])
    table, source = found or ({}, "the defaults")
    return _deepswe_eval_run_config(validated_eval_table(table, source))


def eval_rows_path(storage: PosttrainStorage, checkpoint: str, run_id: str) -> Path:
    """Where one eval run of ``checkpoint`` keeps its attempt rows."""
    return storage.evals_dir() / "deepswe" / checkpoint / f"{run_id}.parquet"


@dg.asset(
    group_name="evals", deps=[checkpoints], partitions_def=checkpoints_partitions, kinds={"parquet"}, pool=EVAL_POOL,
    retry_policy=dg.RetryPolicy(max_retries=2, delay=30, backoff=dg.Backoff.EXPONENTIAL),
    check_specs=[
        dg.AssetCheckSpec(ATTEMPTS_CHECK, asset="deepswe_eval", description=(
            "Every attempt of every task has a row that is graded (or apply_failed / agent_fault, scored 0) or "
            "recorded as an infra error saying what failed; none is missing or silently unscored.")),
        dg.AssetCheckSpec(INFRA_CHECK, asset="deepswe_eval", description=(
            "At most max_infra_error_share (default 10%) of the attempts were lost to the infrastructure; more "
            "means the sandboxes or the engine were failing, and the scores stand on fewer attempts.")),
        dg.AssetCheckSpec(DUPLICATES_CHECK, asset="deepswe_eval", description=(
            "No task attempt is recorded twice in the run's rows (a retried attempt replaces its row).")),
    ],
)
def deepswe_eval(
    context: dg.AssetExecutionContext, config: DeepSWEEvalConfig, storage: PosttrainStorage
) -> dg.MaterializeResult:
    """DeepSWE-style evaluation of one checkpoint on the held-out tasks: several attempts per task,
    only committed work graded, per-attempt rows (reward, f2p, p2p, partial, target scores) in Parquet,
    one file per eval run (``evals/deepswe/<checkpoint>/<run_id>.parquet``, the engine's output beside
    it in ``<run_id>.engine.log``), so repeats are kept.
    The checkpoint's base model (and adapter, if any) is served by a local engine; episodes run in
    sandboxes; attempts lost to sandbox failures are retried, never scored. A failed run is retried
    (2 more tries, 30 s then 60 s later), and the checkpoint sensor asks again after a run that failed
    for good. ``flagged_attempts`` counts graded attempts with a cheating signal and ``signals`` how
    many carry each one; flagged attempts are scored as graded. ``per_task`` compares each task
    with the run's base model (flips, attempts, flawed marks); ``viewer`` opens every attempt
    (transcript, tests, diff) in the trajectory viewer. A checkpoint of a run that ``rl_run``
    launched on Kubernetes is evaluated in an eval pod of that run, on its own engines and sandbox
    pool (:mod:`training.fleet_eval`), its rows written on the run volume: where the run ran decides."""
    key = context.partition_key
    try:  # the one [eval] of everything below; a config that does not validate fails at once, not retried
        section = parse_eval_table(config.model_dump(), source=f"deepswe_eval config of {key}")
    except SettingsError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    rows_path = eval_rows_path(storage, key, context.run_id)
    engine_log = None
    harbor = is_harbor_dataset(section.dataset)
    pod_file = None if harbor else run_eval_pod_file(storage, key)  # Harbor tasks run here, always
    on_fleet = pod_file is not None
    if harbor:  # real DeepSWE tasks: their images, DeepSWE v1.1's verifier flow
        policy = checkpoint_policy(storage.checkpoint_dir(key), name=key)
        adapter_version = policy.adapter_version
        tasks, rows = harbor_eval_rows(context, section, storage, policy)
    else:
        tasks = eval_tasks(section, bundled_dir=storage.datasets_dir() / "bundled")  # the same in the eval pod
        if on_fleet:
            rows, adapter_version = fleet_eval_rows(context, section, storage, pod_file, rows_path)
        else:
            policy = checkpoint_policy(storage.checkpoint_dir(key), name=key)
            adapter_version = policy.adapter_version
            engine_log = rows_path.with_suffix(".engine.log")
            factory = platform_sandbox_factory(section.sandbox_runtime)
            rows = evaluate_checkpoint(  # how each task is run: the section's run keys, read where they act
                tasks, policy.base_model, factory, section, checkpoint=key, adapter=policy.adapter,
                adapter_version=policy.adapter_version, log=context.log.info, engine_log=engine_log,
            )
    path = rows_path if on_fleet else write_rows(rows, rows_path)  # the eval pod wrote its own

    frame = pd.DataFrame(rows)
    summary = run_summary(frame, section.attempts)
    metadata = {
        "path": dg.MetadataValue.path(str(path)),
        **({"engine_log": dg.MetadataValue.path(str(engine_log))} if engine_log else {}),
        "run_id": context.run_id,
        "tasks": len(tasks),
        **summary,
        "signals": dg.MetadataValue.json(summary["signals"]),
        "adapter_version": adapter_version or "base",
        "viewer": dg.MetadataValue.url(links.url(links.checkpoint_path(key))),
    }
    ensure_flawed_lists(storage.path)
    tasks_table = checkpoint_tasks(storage.path, key, context.run_id)
    metadata["per_task"] = per_task_table(tasks_table["rows"], key)
    metadata["flips"] = dg.MetadataValue.json({"compared_with": tasks_table["base"], **flip_counts(tasks_table["rows"])})
    checks = [check_attempts_recorded(frame, [t.id for t in tasks], section.attempts),
              check_infra_share(frame, section.max_infra_error_share), check_no_duplicates(frame)]
    return dg.MaterializeResult(metadata={k: rounded(v) for k, v in metadata.items()}, check_results=checks)


def run_eval_pod_file(storage: PosttrainStorage, checkpoint: str) -> Path | None:
    """The eval pod ``rl_run`` left in the folder of ``checkpoint``'s run when it launched the run on
    Kubernetes (:data:`training.planner.k8s.EVAL_POD_FILE`), else ``None``."""
    from training.planner.k8s import EVAL_POD_FILE

    path = storage.run_dir(parse_checkpoint_partition_key(checkpoint)[0]) / EVAL_POD_FILE
    return path if path.is_file() else None


def fleet_eval_rows(context: dg.AssetExecutionContext, section: EvalSection, storage: PosttrainStorage,
                    pod_file: Path, rows_path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """Evaluate the partition's checkpoint in the eval pod of its Kubernetes run (``pod_file``,
    :func:`training.planner.k8s.eval_pod`): ``python -m training.fleet_eval`` through Dagster Pipes,
    on the run's engines and sandbox pool. The storage root is the run volume's mount, so the pod's
    paths are the volume's (``/run-data/...``) and the rows it writes appear at ``rows_path`` here.
    Returns the rows (read back from ``rows_path``) and the checkpoint's adapter version."""
    from training.checkpoint import read_metadata
    from training.planner.k8s import DATA_MOUNT, EVAL_MODULE

    key = context.partition_key
    launcher = WorkloadLauncher.from_env()  # the code location's: POSTTRAIN_TARGET and KUBECONFIG
    if launcher.target != "k8s":
        raise RuntimeError(f"checkpoint {key}: its run ran on Kubernetes and is evaluated on its own fleet there; this "
                           "Dagster has no cluster (start it with POSTTRAIN_TARGET=k8s and KUBECONFIG)")
    pod = json.loads(pod_file.read_text())
    pod["metadata"].setdefault("labels", {})[f"{LABEL_PREFIX}/checkpoint"] = label_value(key)
    in_pod = lambda path: f"{DATA_MOUNT}/{Path(path).resolve().relative_to(storage.path).as_posix()}"  # noqa: E731
    ckpt = storage.checkpoint_dir(key)
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    hand_to_workloads(rows_path.parent)
    settings = {k: getattr(section, k) for k in POD_KEYS}  # which tasks and how they are run (evals.settings)
    launcher.run(context, EVAL_MODULE, ["--checkpoint", key, "--checkpoint-dir", in_pod(ckpt), "--rows", in_pod(rows_path),
                                        "--settings", json.dumps(settings)],
                 pod_spec=pod["spec"], pod_meta=pod["metadata"], namespace=pod["namespace"])
    if not rows_path.is_file():
        raise FileNotFoundError(f"checkpoint {key}: the eval pod ended without writing {rows_path}")
    return pd.read_parquet(rows_path).to_dict("records"), read_metadata(ckpt, name=key).get("adapter_version")


class EvalReportConfig(dg.Config):
    """``flawed_dir``: folder of flawed-task lists (default: ``<datasets>/flawed``); ``k``: the k of pass@k;
    ``exclude_flagged``: leave attempts with a cheating signal out of every score (by default they are
    scored, and the report also gives every score without them)."""

    flawed_dir: str = ""
    k: int = 8
    resamples: int = 2000
    exclude_flagged: bool = False


# Refresh after every deepswe_eval materialization, once no report run is in progress. Evals of other
# checkpoints still running do not hold it back: during an RL run some eval is nearly always going.
#
# Why not ``any_deps_updated().since_last_handled()``: the automation sensor looks at the instance
# every 30 s, and when the trigger (a dep updated since the last tick) and the reset (the report was
# requested or materialized since the last tick) are both true on one tick, SINCE keeps the trigger
# only if both carry event timestamps and the trigger's is later. In Dagster 1.13, ``|`` and ``&``
# drop those timestamps, and both built-in compositions use them (``any_deps_updated`` is
# ``newly_updated & ~executed_with_root_target | will_be_requested``, ``handled`` is
# ``newly_requested | newly_updated | initial_evaluation``), so the reset always won: a second eval
# that finished within the same 30 s as the previous refresh (or its request) was dropped, and the
# report stayed at the older rows. Here both sides are single operands that carry timestamps (a dep's
# materialization time; the requesting tick's time), so an eval that lands after the request that
# reset the condition sets it again. The report's own materialization is no reset: each refresh the
# sensor launches was requested first, and a report run that read its rows before the eval landed is
# followed by one more refresh.
REPORT_AUTOMATION = (
    dg.AutomationCondition.any_deps_match(dg.AutomationCondition.newly_updated())
    .since(dg.AutomationCondition.newly_requested())
    & ~dg.AutomationCondition.in_progress()
).with_label("after every deepswe_eval materialization")


@dg.asset(
    group_name="evals", deps=[deepswe_eval], automation_condition=REPORT_AUTOMATION,
    check_specs=[dg.AssetCheckSpec(REPORT_CHECK, asset="eval_report", description=(
        "Every checkpoint whose deepswe_eval partition was materialized appears in the report."))],
)
def eval_report(
    context: dg.AssetExecutionContext, config: EvalReportConfig, storage: PosttrainStorage
) -> dg.MaterializeResult:
    """First, each checkpoint's change in held-out pass@1 from its run's base model, paired on the same
    tasks with a 95% interval (paired bootstrap over tasks of their attempt means), overall and per level.
    Per checkpoint: pass@1, pass@k, partial and strict target score with 95% bootstrap intervals,
    and the change from the run's base model (step 0) with a paired 95% interval; every score again
    with each flawed-task list (``datasets/flawed/``) left out and without flagged attempts. Each
    checkpoint is scored on its newest eval run; ``repeats`` shows pass@1 of every run and the
    spread between them. The plots put every run side by side: pass@1 per step, the training
    curves, pass@k and target scores. Refreshes on its own after every ``deepswe_eval`` materialization."""
    folder = storage.evals_dir() / "deepswe"
    every_run = load_attempt_rows(folder)
    if every_run.empty:
        raise FileNotFoundError(f"eval_report: no evaluated checkpoint under {folder}")
    rows = newest_runs(every_run)
    flawed_dir = Path(config.flawed_dir) if config.flawed_dir else ensure_flawed_lists(storage.path)
    lists = load_flawed_lists(flawed_dir)
    report = build_report(rows, lists, k=config.k, resamples=config.resamples, exclude_flagged=config.exclude_flagged)
    graded = graded_rows(rows)
    flagged_attempts = int(flagged_mask(graded).sum())
    if config.exclude_flagged:
        rows = rows[~flagged_mask(rows)]
    out = storage.reports_dir()
    out.mkdir(parents=True, exist_ok=True)
    tables = markdown_tables(report, k=config.k)
    headline = headline_markdown(headlines(rows, resamples=config.resamples))
    spread = repeat_spread(every_run, config.k)
    repeats = spread_markdown(spread)
    (out / "eval_report.md").write_text("# Evaluation report\n\n## Change from the base model\n\n" + headline
                                        + "\n" + tables + "\n### Repeats\n\n" + repeats)
    report_rows(report).round(4).to_csv(out / "eval_report.csv", index=False)
    p1 = plot_pass_at_1(report, out / "pass_at_1.png")
    pk = plot_pass_at_k(rows, out / "pass_at_k.png", k_max=config.k)
    ts = plot_target_scores(report, out / "target_scores.png")
    run_names = sorted({parse_key(c)[0] for c in rows["checkpoint"].unique() if parse_key(c)})
    curves = {name: rows_from_steps_parquet(metrics_dir(storage.run_dir(name)) / "steps.parquet") for name in run_names}
    curves = {name: r for name, r in curves.items() if r}
    metadata: dict[str, Any] = {
        "checkpoints": int(rows["checkpoint"].nunique()),
        "attempts": len(rows),
        "eval_runs": int(every_run["run_id"].nunique()),
        "flagged_attempts": flagged_attempts,
        "flagged_excluded": config.exclude_flagged,
        "signals": dg.MetadataValue.json(signal_counts(graded)),
        "flawed_dir": dg.MetadataValue.path(str(flawed_dir)),
        "flawed_lists": dg.MetadataValue.json({fl.name: sorted(fl.ids) for fl in lists}),
        "change from the base model": dg.MetadataValue.md(headline),
        "scores": dg.MetadataValue.md(tables),
        "repeats": dg.MetadataValue.md(repeats),
        "pass@1 per checkpoint": dg.MetadataValue.md(png_markdown(p1, "pass@1 per checkpoint")),
        "pass@k curves": dg.MetadataValue.md(png_markdown(pk, "pass@k curves")),
        "target scores": dg.MetadataValue.md(png_markdown(ts, "target scores")),
        "report": dg.MetadataValue.path(str(out / "eval_report.md")),
    }
    if curves:
        png = plot_curves(curves, out / "training_curves.png", title="training curves, runs side by side")
        metadata["training curves"] = dg.MetadataValue.md(png_markdown(png, "training curves"))
    # the newest checkpoint's headline numbers, as plain numbers the asset's plots can follow
    last = [r for r in report if r.subset == "all"]
    if last:
        for name, est in last[-1].estimates.items():
            metadata[f"newest {name}"] = round(est.value, 3)
    # per run, its newest checkpoint task by task against the base model, and every checkpoint's flips
    flips = []
    newest_of_run: dict[str, str] = {}
    for ckpt in sorted(rows["checkpoint"].unique(), key=lambda c: parse_key(c) or (c, -1)):
        table = checkpoint_tasks(storage.path, ckpt)
        flips.append(dg.TableRecord(data={
            "checkpoint": ckpt, "compared_with": table["base"] or "", "tasks": len(table["rows"]),
            **flip_counts(table["rows"]), "viewer": links.url(links.checkpoint_path(ckpt))}))
        if table["base"]:
            newest_of_run[parse_key(ckpt)[0]] = ckpt
    metadata["flips per checkpoint"] = dg.MetadataValue.table(flips, dg.TableSchema(columns=[
        dg.TableColumn("checkpoint"), dg.TableColumn("compared_with"), dg.TableColumn("tasks", "int"),
        dg.TableColumn("gained", "int"), dg.TableColumn("lost", "int"), dg.TableColumn("viewer")]))
    for run_name, ckpt in sorted(newest_of_run.items()):
        metadata[f"per_task {ckpt}"] = per_task_table(checkpoint_tasks(storage.path, ckpt)["rows"], ckpt)
    metadata["viewer"] = dg.MetadataValue.url(links.url("/evals"))
    evaluated = set(context.instance.get_materialized_partitions(dg.AssetKey("deepswe_eval")))
    check = check_report_complete(set(rows["checkpoint"].unique()), evaluated)
    return dg.MaterializeResult(metadata=metadata, check_results=[check])


defs = dg.Definitions(assets=[deepswe_eval, eval_report])
