"""Asset checks on ``task_dataset``: what it wrote (``datasets/tasks.parquet``, ``incomplete.json``)
is read back and judged. The checks of ``checkpoints``, ``deepswe_eval`` and ``eval_report`` run with
their assets (``assets/training.py``, ``assets/evals.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg

from assets.resources import PosttrainStorage


def _tasks(datasets: Path) -> Any:
    import pandas as pd

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


checks = [task_dataset_checks]
