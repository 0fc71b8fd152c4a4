"""The environment check of Harbor tasks: what the reference solution does in the task's image.

:func:`check_environments` keeps one :class:`EnvironmentRecord` per task and image build (under
``HOME/datasets/environment-check/``): the existing tests the reference solution fails there, which
strict credit then spares (:func:`with_environment_records`). :func:`environment_check` runs the
``oracle`` and ``nop`` agents on every task: a task whose oracle does not reach reward 1, or whose
nop passes a target test or reaches reward 1, is *environment-flawed*, listed with the evidence
apart from the published flawed lists (:func:`write_environment_flawed`).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from evals.grading import clean_test_ids
from evals.harbor.verify import ENVIRONMENT_BROKEN, Verification, run_attempt
from evals.sandbox import SandboxFactory
from evals.tasks import Task


ENVIRONMENT_RECORDS = "environment-check"  # HOME/datasets/environment-check/<task>.json


@dataclass(frozen=True)
class EnvironmentRecord:
    """What the reference solution does in this environment, for one task on one build of its image:
    the existing tests it fails (no attempt can pass them here, so strict credit spares them) and
    the target tests it fails (the task is environment-flawed). ``image_key`` is the image's recipe
    key (:func:`sandboxes.harbor.harbor_image_key`): a rebuilt image is checked again."""

    task_id: str
    image_key: str
    status: str
    oracle_reward: float | None
    broken_existing: tuple[str, ...]
    broken_target: tuple[str, ...]

    def to_json(self) -> dict:
        return {**asdict(self), "broken_existing": list(self.broken_existing),
                "broken_target": list(self.broken_target)}


def environment_record_path(home: str | Path, task_id: str) -> Path:
    return Path(home) / "datasets" / ENVIRONMENT_RECORDS / f"{task_id}.json"


def environment_record(task: Task, oracle: Verification, image_key: str) -> EnvironmentRecord:
    """The record of ``task`` from its reference solution's verification ``oracle``."""
    failing = [t for t in clean_test_ids(task.existing_tests) if oracle.statuses.get(t) != "passed"]
    targets = [t for t in clean_test_ids(task.target_tests) if oracle.statuses.get(t) != "passed"]
    reward = oracle.scores.reward if oracle.scores is not None else None
    return EnvironmentRecord(task.id, image_key, oracle.status, reward, tuple(failing), tuple(targets))


def read_environment_record(home: str | Path, task_id: str, image_key: str) -> EnvironmentRecord | None:
    """The record of ``task_id`` made on the image of ``image_key``, or None (never checked, or
    checked on another build). A file that is not a record raises ``ValueError`` naming it."""
    path = environment_record_path(home, task_id)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        record = EnvironmentRecord(str(data["task_id"]), str(data["image_key"]), str(data["status"]),
                                   data["oracle_reward"], tuple(data["broken_existing"]), tuple(data["broken_target"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an environment record ({type(exc).__name__}: {exc}); remove it and the "
                         "next eval checks the task again") from None
    return record if record.image_key == image_key and record.task_id == task_id else None


def write_environment_record(home: str | Path, record: EnvironmentRecord) -> Path:
    path = environment_record_path(home, record.task_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record.to_json(), indent=1) + "\n")
    tmp.replace(path)
    return path


def with_environment_records(tasks: Sequence[Task], records: Mapping[str, EnvironmentRecord]) -> list[Task]:
    """``tasks`` with the existing tests their reference solution fails here in
    ``metadata["environment_broken_tests"]``, where ``records`` has them (:func:`grade_harbor_reports`)."""
    out = []
    for task in tasks:
        record = records.get(task.id)
        if record is not None and record.broken_existing:
            task = replace(task, metadata={**task.metadata, ENVIRONMENT_BROKEN: record.broken_existing})
        out.append(task)
    return out


def check_environments(tasks: Sequence[Task], factory: SandboxFactory, home: str | Path,
                       image_keys: Mapping[str, str], *, run_missing: bool = True, workers: int = 1,
                       log: Callable[[str], None] | None = None) -> dict[str, EnvironmentRecord]:
    """Each task's environment record for its current image: the one recorded under ``home``, else
    (``run_missing``) one made now by running the reference solution through the verifier once and
    written for the next eval. A reference run lost to the infrastructure leaves no record (strict
    credit then counts every existing test) and is logged."""

    def one(task: Task) -> tuple[str, EnvironmentRecord | None]:
        key = image_keys.get(task.id, "")
        record = read_environment_record(home, task.id, key)
        if record is not None or not run_missing:
            return task.id, record
        _, oracle = run_attempt(task, "oracle", factory)
        if oracle.scores is None:
            if log is not None:
                log(f"{task.id}: the reference solution's run was lost ({oracle.detail[:300]}); strict credit "
                    "counts every existing test")
            return task.id, None
        record = environment_record(task, oracle, key)
        write_environment_record(home, record)
        if log is not None:
            log(f"{task.id}: environment checked: the reference solution fails {len(record.broken_existing)} "
                f"existing and {len(record.broken_target)} target tests here")
        return task.id, record

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        found = dict(pool.map(one, tasks))
    return {task_id: record for task_id, record in found.items() if record is not None}


@dataclass(frozen=True)
class EnvironmentFlaw:
    """A task whose environment is wrong: the oracle fails or the nop passes, with the tests that show it."""

    id: str
    agent: str
    reward: float | None
    tests: tuple[str, ...]
    reason: str

    def to_json(self) -> dict:
        return {"id": self.id, "reason": self.reason, "source": "posttrain environment check (oracle and nop agents)",
                "agent": self.agent, "reward": self.reward, "tests": list(self.tests)}


def flaws_of(task: Task, oracle: Verification, nop: Verification) -> list[EnvironmentFlaw]:
    """The environment flaws that the oracle's and the nop's verifications of ``task`` show."""
    out = []
    if oracle.scores is None or oracle.scores.reward != 1.0:
        failing = tuple(t for t in clean_test_ids([*task.target_tests, *task.existing_tests])
                        if oracle.statuses.get(t) != "passed")
        reward = oracle.scores.reward if oracle.scores is not None else None
        why = oracle.status if oracle.scores is None else f"{len(failing)} tests fail"
        out.append(EnvironmentFlaw(task.id, "oracle", reward, failing,
                                   f"the reference solution does not pass ({why}): {', '.join(failing[:10])}"))
    if nop.scores is not None:
        passing = tuple(t for t in clean_test_ids(task.target_tests) if nop.statuses.get(t) == "passed")
        if nop.scores.reward == 1.0 or passing:
            out.append(EnvironmentFlaw(task.id, "nop", nop.scores.reward, passing,
                                       f"without any change {len(passing)} target tests pass: {', '.join(passing[:10])}"))
    return out


def environment_check(tasks: Sequence[Task], factory: SandboxFactory, *, workers: int = 1,
                      log: Callable[[str], None] | None = None, home: str | Path | None = None,
                      image_keys: Mapping[str, str] | None = None) -> tuple[list[EnvironmentFlaw], list[dict]]:
    """Oracle and nop on every task; returns the environment flaws and one summary row per task
    (rewards, verifier seconds, agreement with the task's own reward.json, the existing tests the
    oracle fails). With ``home`` each task's :class:`EnvironmentRecord` is written there, for its
    image of ``image_keys``, so that later evals' strict credit spares those tests."""

    def one(task: Task):
        _, oracle = run_attempt(task, "oracle", factory)
        _, nop = run_attempt(task, "nop", factory)
        flaws = flaws_of(task, oracle, nop)
        record = environment_record(task, oracle, (image_keys or {}).get(task.id, ""))
        if home is not None and oracle.scores is not None:
            write_environment_record(home, record)
        row = {"task_id": task.id, "broken_existing": len(record.broken_existing),
               "oracle_reward": oracle.scores.reward if oracle.scores else None,
               "nop_reward": nop.scores.reward if nop.scores else None,
               "oracle_verifier_s": round(oracle.verifier_s, 2), "nop_verifier_s": round(nop.verifier_s, 2),
               "oracle_agrees": oracle.agrees, "nop_agrees": nop.agrees,
               "disagreements": {"oracle": oracle.disagreements, "nop": nop.disagreements},
               "flawed": bool(flaws)}
        if log is not None:
            log(f"{task.id}: oracle {row['oracle_reward']} nop {row['nop_reward']}"
                + (" (environment-flawed)" if flaws else ""))
        return flaws, row

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(one, tasks))
    return [f for flaws, _ in results for f in flaws], [row for _, row in results]


def write_environment_flawed(flaws: Sequence[EnvironmentFlaw], home: str | Path, dataset: str,
                             checked: Sequence[str] | None = None) -> Path:
    """The environment-flawed list of ``dataset``, apart from the published lists:
    ``HOME/datasets/environment-flawed/<dataset>.jsonl``, one entry per flaw (``id``, ``reason``,
    ``source``, ``agent``, ``reward``, ``tests``), readable by :func:`evals.flawed.load_flawed_list`.

    ``checked``: the ids of the tasks this check ran (default: the flaws' own). Their earlier entries
    are replaced; entries of tasks not checked this time stay, so checks of a dataset task by task
    add up to the list of the whole dataset. The file is replaced whole (temporary name, rename)."""
    path = Path(home) / "datasets" / "environment-flawed" / f"{dataset}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    replaced = set(checked if checked is not None else ()) | {f.id for f in flaws}
    kept: list[str] = []
    if path.is_file():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry_id = json.loads(line)["id"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}: line {n} is not an environment-flawed entry (a JSON object with "
                                 "an 'id'); fix or remove the file, nothing was written") from None
            if entry_id not in replaced:
                kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept) + "".join(json.dumps(f.to_json()) + "\n" for f in flaws))
    tmp.replace(path)
    return path
