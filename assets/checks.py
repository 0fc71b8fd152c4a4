"""Every asset check's name and function: what each check asserts about an asset's output.

``checkpoints``, ``deepswe_eval`` and ``eval_report`` declare their checks (``check_specs``) and call
these functions on what they wrote; ``task_dataset``'s run on their own (:func:`task_dataset_checks`,
read back from its files). The checks read only that output, so each is testable without a run.
"""

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
from safetensors import safe_open

from assets.resources import PosttrainStorage
from evals.attempts import INFRA_ERROR, STATUSES
from evals.report import infra_error_share, status_counts
from training.checkpoint import CheckpointLoadError, adapter_dir, check_checkpoint, read_metadata

# deepswe_eval's checks
ATTEMPTS_CHECK = "every_attempt_graded_or_infra_error"
INFRA_CHECK = "infra_error_share_under_threshold"
DUPLICATES_CHECK = "no_duplicate_attempts"
# eval_report's
REPORT_CHECK = "every_evaluated_checkpoint_present"
# checkpoints'
COMPLETE_CHECK = "checkpoint_complete"
ADAPTER_CHECK = "adapter_loads"
# files of a checkpoint past step 0 besides metadata.json and the adapter (training.loop.RunState.checkpoint)
TRAINER_FILES = ("optimizer.pt", "rng.pt", "curriculum.json", "store.sqlite")


def check_checkpoint_complete(ckpt: Path, step: int) -> dg.AssetCheckResult:
    """Every file a checkpoint of ``step`` holds is there and loads (:func:`training.checkpoint.check_checkpoint`).
    A model ``posttrain eval --model`` registered holds its metadata (and adapter) only: no trainer state."""
    expected = ["metadata.json", "curriculum.json"] + ([*TRAINER_FILES, "adapter/"] if step else [])
    try:
        registered = read_metadata(ckpt).get("registered_model")
    except (CheckpointLoadError, FileNotFoundError):
        registered = None
    if registered:
        expected = ["metadata.json"] + (["adapter/"] if read_metadata(ckpt).get("adapter") else [])
    missing = [name for name in expected if not (ckpt / name.rstrip("/")).exists()]
    problem = f"missing {', '.join(missing)}" if missing else ""
    if not problem and not registered:
        try:
            check_checkpoint(ckpt)
        except (CheckpointLoadError, FileNotFoundError) as exc:
            problem = str(exc)
    return dg.AssetCheckResult(
        check_name=COMPLETE_CHECK, passed=not problem, severity=dg.AssetCheckSeverity.ERROR,
        metadata={"path": dg.MetadataValue.path(str(ckpt)), "files_expected": ", ".join(expected),
                  **({"problem": problem} if problem else {})},
        description=problem or None,
    )


def check_adapter_loads(ckpt: Path, step: int) -> dg.AssetCheckResult:
    """The peft adapter of the checkpoint loads: ``adapter_config.json`` parses with a LoRA rank, and
    its safetensors hold LoRA A/B tensors whose rank is that rank. Step 0 (the base model) has none."""
    meta: dict[str, Any] = {}
    problem = ""
    try:
        metadata = read_metadata(ckpt)
    except (CheckpointLoadError, FileNotFoundError) as exc:
        metadata, problem = {}, str(exc)
    if not problem and not metadata.get("adapter"):
        meta["adapter"] = "none (the base model)"
        if step:
            problem = f"step {step} names no adapter in {ckpt / 'metadata.json'} (key 'adapter')"
    elif not problem:
        folder = adapter_dir(ckpt)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            rank = int(config["r"])
            ranks, tensors = set(), 0
            weights = sorted(folder.glob("*.safetensors"))
            if not weights:
                raise FileNotFoundError(f"no *.safetensors file in {folder}")
            for path in weights:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        tensors += 1
                        shape = handle.get_slice(name).get_shape()
                        if "lora_A" in name:
                            ranks.add(shape[0])
                        elif "lora_B" in name:
                            ranks.add(shape[-1])
            if not ranks:
                raise ValueError(f"no lora_A/lora_B tensor among the {tensors} tensors of {folder}")
            if ranks != {rank}:
                raise ValueError(f"adapter_config.json says r = {rank}, the tensors have rank(s) {sorted(ranks)}")
            meta.update({"lora_rank": rank, "tensors": tensors})
        except Exception as exc:  # json, KeyError, safetensors' own errors: each is a broken adapter
            problem = f"adapter {folder} does not load: {type(exc).__name__}: {exc}"
    return dg.AssetCheckResult(
        check_name=ADAPTER_CHECK, passed=not problem, severity=dg.AssetCheckSeverity.ERROR,
        metadata={**meta, **({"problem": problem} if problem else {})}, description=problem or None,
    )


def check_attempts_recorded(frame: Any, task_ids: list[str], attempts: int) -> dg.AssetCheckResult:
    """Every (task, attempt) of the run has a row whose status is one of
    :data:`evals.attempts.STATUSES`; a graded attempt has a reward and an infra error says what failed."""
    expected = {(t, a) for t in task_ids for a in range(attempts)}
    seen = set(zip(frame["task_id"], frame["attempt"].astype(int))) if len(frame) else set()
    missing = sorted(expected - seen)
    unknown = frame[~frame["status"].isin(STATUSES)] if len(frame) else frame
    infra = frame["status"] == INFRA_ERROR if len(frame) else pd.Series(dtype=bool)
    scored = frame[~infra] if len(frame) else frame
    unscored = scored[scored["reward"].isna()] if len(scored) else scored
    silent = frame[infra & frame["detail"].fillna("").eq("")] if len(frame) else frame
    problems = []
    if missing:
        problems.append(f"{len(missing)} attempt(s) without a row, e.g. task {missing[0][0]} attempt {missing[0][1]}")
    if len(unknown):
        problems.append(f"{len(unknown)} row(s) with status {sorted(set(unknown['status']))[0]!r} "
                        f"(expected one of {', '.join(STATUSES)})")
    if len(unscored):
        problems.append(f"{len(unscored)} graded row(s) without a reward, e.g. task {unscored['task_id'].iloc[0]}")
    if len(silent):
        problems.append(f"{len(silent)} infra error(s) that do not say what failed (empty 'detail')")
    return dg.AssetCheckResult(
        check_name=ATTEMPTS_CHECK, passed=not problems,
        metadata={"expected_attempts": len(expected), "rows": len(frame),
                  "by_status": dg.MetadataValue.json(status_counts(frame)),
                  **({"problems": "; ".join(problems)} if problems else {})},
        description="; ".join(problems) or None,
    )


def check_infra_share(frame: Any, threshold: float) -> dg.AssetCheckResult:
    """The share of attempts lost to the infrastructure is at most ``threshold``."""
    share = infra_error_share(frame)
    passed = share <= threshold
    return dg.AssetCheckResult(
        check_name=INFRA_CHECK, passed=passed, severity=dg.AssetCheckSeverity.WARN,
        metadata={"infra_error_share": round(share, 4), "threshold": threshold},
        description=None if passed else f"{share:.1%} of attempts were infra errors (threshold {threshold:.1%}): "
                                        "the sandboxes or the engine failed, not the model",
    )


def check_no_duplicates(frame: Any) -> dg.AssetCheckResult:
    """No (task, attempt) appears twice in the run's rows."""
    dupes = frame[frame.duplicated(["task_id", "attempt"], keep=False)] if len(frame) else frame
    pairs = sorted(set(zip(dupes["task_id"], dupes["attempt"]))) if len(dupes) else []
    return dg.AssetCheckResult(
        check_name=DUPLICATES_CHECK, passed=not pairs,
        metadata={"duplicated_attempts": len(pairs)},
        description=f"{len(pairs)} attempt(s) recorded more than once, e.g. task {pairs[0][0]} attempt {pairs[0][1]}"
        if pairs else None,
    )


def check_report_complete(reported: set[str], evaluated: set[str]) -> dg.AssetCheckResult:
    """Every checkpoint with a materialized ``deepswe_eval`` partition is in the report."""
    missing = sorted(evaluated - reported)
    return dg.AssetCheckResult(
        check_name=REPORT_CHECK, passed=not missing,
        metadata={"evaluated": len(evaluated), "reported": len(reported),
                  **({"missing": dg.MetadataValue.json(missing)} if missing else {})},
        description=f"evaluated but not in the report: {', '.join(missing)} (their attempt rows are not under "
                    "evals/deepswe/)" if missing else None,
    )


# task_dataset's checks


def _tasks(datasets: Path) -> Any:
    path = datasets / "tasks.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"task_dataset: {path} is missing; materialize task_dataset first")
    return pd.read_parquet(path)


def _suite_ids(datasets: Path) -> set[str] | None:
    """Task ids of the bundled suite's index (its tasks all passed validation), or None when not built."""
    index = datasets / "bundled" / "suite.json"
    if not index.is_file():
        return None
    return set(json.loads(index.read_text()).get("tasks", []))


def check_none_dropped(datasets: Path) -> dg.AssetCheckResult:
    """Every task a source lists is in ``tasks.parquet`` or in ``incomplete.json`` with a reason: a
    bundled suite's index against both, and each incomplete entry naming why."""
    frame = _tasks(datasets)
    incomplete_path = datasets / "incomplete.json"
    problems = []
    incomplete: list[dict[str, Any]] = []
    if not incomplete_path.is_file():
        problems.append(f"{incomplete_path} is missing: tasks that did not load are not recorded")
    else:
        incomplete = json.loads(incomplete_path.read_text())
        silent = [i.get("id", "?") for i in incomplete if not str(i.get("reason") or "").strip()]
        if silent:
            problems.append(f"incomplete task(s) without a reason: {', '.join(silent[:5])}")
    accounted = set(frame["id"]) | {str(i.get("id")) for i in incomplete}
    listed = _suite_ids(datasets)
    dropped = sorted((listed or set()) - accounted)
    if dropped:
        problems.append(f"{len(dropped)} task(s) of the bundled suite neither loaded nor reported incomplete, "
                        f"e.g. {', '.join(dropped[:5])}")
    return dg.AssetCheckResult(
        check_name="no_task_dropped_silently", passed=not problems,
        metadata={"tasks": len(frame), "incomplete": len(incomplete),
                  **({"problems": "; ".join(problems)} if problems else {})},
        description="; ".join(problems) or None,
    )


def check_splits_disjoint(datasets: Path) -> dg.AssetCheckResult:
    """No task id appears twice, and no train task is an eval task again: same id, or same instruction
    on the same starting snapshot (base commit, else image). Generated suites word instructions from
    templates ("A test of orders.py fails. Fix the bug in orders.py."), so the text alone repeats
    across different repositories; the same text on the same commit is the same task."""
    frame = _tasks(datasets)
    problems = []
    dupes = sorted(frame["id"][frame["id"].duplicated()].unique())
    if dupes:
        problems.append(f"task id(s) appear more than once: {', '.join(dupes[:5])}")
    train, held_out = frame[frame["split"] == "train"], frame[frame["split"] == "eval"]
    both = sorted(set(train["id"]) & set(held_out["id"]))
    if both:
        problems.append(f"in both train and eval: {', '.join(both[:5])}")
    def same_task_keys(part: Any) -> set[tuple[str, str]]:
        def text(column: str) -> list[str]:
            values = part[column] if column in part else [None] * len(part)
            return [v if isinstance(v, str) else "" for v in values]

        snapshots = [commit or image for commit, image in zip(text("base_commit"), text("image"))]
        return set(zip(part["instruction"], snapshots))

    same_task = sorted(same_task_keys(train) & same_task_keys(held_out))
    if same_task:
        problems.append(f"{len(same_task)} instruction(s) shared by a train and an eval task on the same snapshot")
    return dg.AssetCheckResult(
        check_name="splits_disjoint", passed=not problems,
        metadata={"train": len(train), "eval": len(held_out), **({"problems": "; ".join(problems)} if problems else {})},
        description="; ".join(problems) or None,
    )


def check_oracles_pass(datasets: Path) -> dg.AssetCheckResult:
    """Every task with an oracle (a reference solution) has been seen to pass. The bundled suite's
    build grades each reference solution and indexes only a suite where all scored 1
    (:func:`evals.bundled.validate_task`), so a bundled task passes when the index lists it and its
    ``failing_output`` (written by that validation) is there; tasks of other sources carry no oracle
    result yet and are counted as ``without_oracle_result``."""
    frame = _tasks(datasets)
    listed = _suite_ids(datasets) or set()
    verified, failed, unverified = [], [], []
    for row in frame.to_dict("records"):
        meta = json.loads(row.get("metadata") or "{}")
        has_oracle = bool(meta.get("reference_edits"))
        if row.get("source") == "bundled" and has_oracle:
            (verified if row["id"] in listed and "failing_output" in meta else failed).append(row["id"])
        elif has_oracle:
            failed.append(row["id"])  # an oracle nobody ran
        else:
            unverified.append(row["id"])
    return dg.AssetCheckResult(
        check_name="oracles_pass", passed=not failed,
        metadata={"oracle_passed": len(verified), "without_oracle_result": len(unverified),
                  **({"not_verified": dg.MetadataValue.json(sorted(failed)[:50])} if failed else {})},
        description=(f"{len(failed)} task(s) with a reference solution not validated by the suite build, e.g. "
                     f"{sorted(failed)[0]}") if failed else None,
    )


@dg.multi_asset_check(
    specs=[
        dg.AssetCheckSpec("no_task_dropped_silently", asset="task_dataset", description=(
            "Every task a source lists is either loaded or reported in incomplete.json with the reason.")),
        dg.AssetCheckSpec("splits_disjoint", asset="task_dataset", description=(
            "Train and held-out eval tasks share no id and no instruction; no id appears twice.")),
        dg.AssetCheckSpec("oracles_pass", asset="task_dataset", description=(
            "Every task whose oracle (reference solution) exists passed with it; for the bundled suite this is "
            "the suite build's own validation, which grades each reference solution in a sandbox.")),
    ],
)
def task_dataset_checks(storage: PosttrainStorage):
    """The task dataset's checks, read from the files ``task_dataset`` wrote."""
    datasets = storage.datasets_dir()
    yield check_none_dropped(datasets)
    yield check_splits_disjoint(datasets)
    yield check_oracles_pass(datasets)


defs = dg.Definitions(asset_checks=[task_dataset_checks])
