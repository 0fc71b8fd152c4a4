"""Grading: test reports in, DeepSWE-compatible scores out.

Two halves:

- **Scoring reports** (pure): :func:`parse_junit` and :func:`parse_ctrf` read one report each into
  ``{test_id: Status}``; :func:`merge_statuses` keeps each test's *worst* status across reports
  (failed > skipped > passed); :func:`score` turns the statuses of the target and existing tests into
  :class:`Scores`, whose fields and meaning match the DeepSWE v1.1 verifier's ``reward.json``:
  a target or existing test that is missing or skipped counts as failed.
- **Grading committed work** (:func:`grade_patch`): the agent's ``git diff BASE HEAD`` is applied to a
  pristine sandbox of the task (only its changes to ``editable_paths``, when the task sets them);
  protected paths (the tests) are reset to the base commit; the tests run there. Tests that time out
  count as failed (an agent's endless loop must not escape scoring); a sandbox that dies is infra. A patch that does not apply scores 0 with ``apply_failed``. An infrastructure failure (the
  sandbox died, the grader's own command timed out) is retried and, if it persists, recorded as
  ``infra_error``: such an attempt is never scored.

``posttrain grade --config tests/config.json --report R1 --report R2 --json`` is :func:`grade_reports`.
"""

from __future__ import annotations

import enum
import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from evals.sandbox import InfraError


class ReportError(ValueError):
    """A report file is unreadable or malformed; the message names the file."""


class Status(enum.IntEnum):
    """A test's outcome; a larger value is worse, so ``max`` is the worst status."""

    PASSED = 0
    SKIPPED = 1
    FAILED = 2


_CTRF_STATUS = {"passed": Status.PASSED, "skipped": Status.SKIPPED, "pending": Status.SKIPPED,
                "failed": Status.FAILED, "other": Status.FAILED}


def _junit_id(case: ET.Element) -> str:
    classname = case.get("classname") or ""
    name = case.get("name") or ""
    return f"{classname}.{name}" if classname else name


def parse_junit(path: str | Path) -> dict[str, Status]:
    """Statuses of every ``<testcase>`` in a JUnit XML report, keyed ``classname.name``.

    That is pytest's node id with ``/`` and ``::`` written as dots (``tests.test_x.test_y[param]``),
    the form DeepSWE's ``f2p_node_ids`` use. A case with ``<failure>`` or ``<error>`` failed, one with
    ``<skipped>`` was skipped. A case listed twice in one report keeps its worst status.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ReportError(f"{path}: not a readable JUnit XML report: {exc}") from exc
    return parse_junit_bytes(data, str(path))


def parse_junit_bytes(data: bytes, path: str) -> dict[str, Status]:
    """:func:`parse_junit` of a report's content; ``path`` names it in errors."""
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise ReportError(f"{path}: not a readable JUnit XML report: {exc}") from exc
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportError(f"{path}: root element <{root.tag}>, expected <testsuites> or <testsuite>")
    statuses: dict[str, Status] = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            status = Status.FAILED
        elif "skipped" in tags:
            status = Status.SKIPPED
        else:
            status = Status.PASSED
        test_id = _junit_id(case)
        statuses[test_id] = max(status, statuses.get(test_id, Status.PASSED))
    return statuses


def parse_ctrf(path: str | Path, node_id: str = "name") -> dict[str, Status]:
    """Statuses of every test in a CTRF JSON report (``results.tests[]``).

    ``node_id="name"`` keys a test by its ``name``; ``"suite.name"`` by ``suite + "." + name`` (Go's
    ``package.TestName``), falling back to ``name`` when a test has no suite. Statuses ``pending``
    count as skipped and ``other`` as failed.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ReportError(f"{path}: not a readable CTRF JSON report: {exc}") from exc
    return parse_ctrf_bytes(raw, str(path), node_id)


def parse_ctrf_bytes(raw: bytes, path: str, node_id: str = "name") -> dict[str, Status]:
    """:func:`parse_ctrf` of a report's content; ``path`` names it in errors."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not a readable CTRF JSON report: {exc}") from exc
    tests = data.get("results", {}).get("tests") if isinstance(data, dict) else None
    if not isinstance(tests, list):
        raise ReportError(f"{path}: missing key 'results.tests' (a list)")
    if node_id not in ("name", "suite.name"):
        raise ReportError(f"{path}: node id rule {node_id!r}, expected 'name' or 'suite.name'")
    statuses: dict[str, Status] = {}
    for i, test in enumerate(tests):
        if not isinstance(test, dict) or "name" not in test or "status" not in test:
            raise ReportError(f"{path}: results.tests[{i}] needs 'name' and 'status'")
        status = _CTRF_STATUS.get(str(test["status"]).lower())
        if status is None:
            raise ReportError(f"{path}: results.tests[{i}] has unknown status {test['status']!r}")
        suite = test.get("suite")
        if isinstance(suite, list):  # CTRF allows the suite as a path of names
            suite = ".".join(str(s) for s in suite)
        test_id = f"{suite}.{test['name']}" if node_id == "suite.name" and suite else str(test["name"])
        statuses[test_id] = max(status, statuses.get(test_id, Status.PASSED))
    return statuses


def parse_report(path: str | Path, report_format: str, node_id: str = "name") -> dict[str, Status]:
    if report_format == "junit":
        return parse_junit(path)
    if report_format == "ctrf":
        return parse_ctrf(path, node_id)
    raise ReportError(f"{path}: report format {report_format!r}, expected 'junit' or 'ctrf'")


def merge_statuses(reports: Iterable[Mapping[str, Status]]) -> dict[str, Status]:
    """Each test's worst status over all reports (failed > skipped > passed)."""
    merged: dict[str, Status] = {}
    for report in reports:
        for test_id, status in report.items():
            merged[test_id] = max(status, merged.get(test_id, Status.PASSED))
    return merged


@dataclass(frozen=True)
class Scores:
    """One attempt's scores, named as in DeepSWE v1.1's ``reward.json``."""

    reward: float
    f2p: float
    p2p: float
    partial: float
    target_score: float
    strict_target_score: float
    f2p_total: int
    f2p_passed: int
    p2p_total: int
    p2p_passed: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def score(target_tests: Sequence[str], existing_tests: Sequence[str], statuses: Mapping[str, Status]) -> Scores:
    """Scores of one attempt; only ``Status.PASSED`` counts as passing, a missing test failed.

    ``reward`` is 1 iff there is at least one target test, every target passes and no existing test
    fails; ``f2p`` is the share of targets passed (0.0 with none); ``p2p`` the share of existing tests
    passed (1.0 with none); ``partial`` is all passed over all (0.0 with no tests);
    ``strict_target_score`` is ``f2p``, but 0 as soon as an existing test fails.
    """
    targets = list(dict.fromkeys(target_tests))
    existing = list(dict.fromkeys(existing_tests))
    f2p_passed = sum(statuses.get(t) is Status.PASSED for t in targets)
    p2p_passed = sum(statuses.get(t) is Status.PASSED for t in existing)
    f2p = f2p_passed / len(targets) if targets else 0.0
    p2p = p2p_passed / len(existing) if existing else 1.0
    total = len(targets) + len(existing)
    existing_ok = p2p_passed == len(existing)
    return Scores(
        reward=1.0 if targets and f2p_passed == len(targets) and existing_ok else 0.0,
        f2p=f2p,
        p2p=p2p,
        partial=(f2p_passed + p2p_passed) / total if total else 0.0,
        target_score=f2p,
        strict_target_score=f2p if existing_ok else 0.0,
        f2p_total=len(targets),
        f2p_passed=f2p_passed,
        p2p_total=len(existing),
        p2p_passed=p2p_passed,
    )


def zero_scores(target_tests: Sequence[str], existing_tests: Sequence[str]) -> Scores:
    """Scores of an attempt whose patch did not apply: nothing passes, not even existing tests."""
    return score(target_tests, existing_tests, {})


def load_harbor_config(path: str | Path) -> dict:
    """A Harbor ``tests/config.json``, checked for the keys grading needs."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not a readable JSON task config: {exc}") from exc
    for key in ("f2p_node_ids", "p2p_node_ids", "grade"):
        if key not in (config if isinstance(config, dict) else {}):
            raise ReportError(f"{path}: missing key {key!r}")
    fmt = config["grade"].get("format") if isinstance(config["grade"], dict) else None
    if fmt not in ("junit", "ctrf"):
        raise ReportError(f"{path}: key 'grade.format' is {fmt!r}, expected 'junit' or 'ctrf'")
    return config


def grade_reports(config_path: str | Path, report_paths: Sequence[str | Path]) -> Scores:
    """Grade report files (in order) against a Harbor task config, as DeepSWE's verifier does."""
    config = load_harbor_config(config_path)
    if not report_paths:
        raise ReportError(f"{config_path}: no report given to grade")
    grade = config["grade"]
    reports = [parse_report(p, grade["format"], grade.get("node_id", "name")) for p in report_paths]
    return score(config["f2p_node_ids"], config["p2p_node_ids"], merge_statuses(reports))


# ---------------------------------------------------------------- grading committed work

GRADED, APPLY_FAILED, INFRA_ERROR = "graded", "apply_failed", "infra_error"
PATCH_PATH = ".git/posttrain-graded.patch"  # inside .git: never part of the work tree


@dataclass(frozen=True)
class GradeResult:
    """The outcome of grading one attempt.

    ``status`` is ``graded`` (``scores`` hold), ``apply_failed`` (the patch did not apply; ``scores``
    are all zero) or ``infra_error`` (the grader could not run after ``infra_retries`` retries;
    ``scores`` is None and the attempt must not be counted).
    """

    status: str
    scores: Scores | None
    detail: str = ""
    infra_retries: int = 0
    statuses: Mapping[str, str] | None = None
    test_output: str = ""


def committed_patch(sandbox, base_commit: str) -> str:
    """``git diff --binary BASE HEAD`` in the agent's sandbox: only committed work is graded."""
    result = sandbox.exec(f"git diff --binary {base_commit} HEAD", timeout_s=60, output_cap_bytes=8 << 20)
    if result.timed_out or result.exit_code != 0:
        raise InfraError(f"git diff {base_commit} HEAD failed (exit {result.exit_code}): {result.output[-500:]}")
    if result.truncated:
        raise InfraError("the committed patch exceeds 8 MiB")
    return result.output


def _run_tests(task, sandbox, patch: str) -> GradeResult:
    if patch.strip():
        sandbox.write_file(PATCH_PATH, patch.encode())
        includes = "".join(f" --include='{p}'" for p in task.editable_paths)
        applied = sandbox.exec(f"git apply --whitespace=nowarn{includes} {PATCH_PATH}", timeout_s=60)
        if applied.timed_out:
            raise InfraError("git apply timed out")
        if applied.exit_code != 0:
            return GradeResult(APPLY_FAILED, zero_scores(task.target_tests, task.existing_tests),
                               detail=applied.output[-2000:])
    if task.protected_paths and task.base_commit:
        # exactly the base version: files the patch added under a protected path go too
        base = task.base_commit
        script = "; ".join(
            f"rm -rf '{p}' && {{ ! git cat-file -e {base}:'{p}' 2>/dev/null || git checkout -q {base} -- '{p}'; }}"
            for p in task.protected_paths
        )
        restored = sandbox.exec(f"set -e; {script}", timeout_s=60)
        if restored.exit_code != 0:
            raise InfraError(f"restoring {task.protected_paths} from the base commit failed: {restored.output[-500:]}")
    for report in task.report_paths:
        sandbox.exec(f"rm -f '{report}'", timeout_s=30)
    run = sandbox.exec(task.test_command, timeout_s=task.limits.test_timeout_s, output_cap_bytes=1 << 20)
    reports = []
    missing = []
    for report in task.report_paths:
        try:
            data = sandbox.read_file(report)
        except FileNotFoundError:
            missing.append(report)
            continue
        try:
            if task.report_format == "junit":
                reports.append(parse_junit_bytes(data, report))
            else:
                reports.append(parse_ctrf_bytes(data, report, task.ctrf_node_id))
        except ReportError as exc:
            missing.append(f"{report} ({exc})")
    statuses = merge_statuses(reports)
    detail = "; ".join(
        ([f"tests timed out after {task.limits.test_timeout_s:g}s"] if run.timed_out else [])
        + [f"report missing or unreadable: {m}" for m in missing]
    )
    return GradeResult(GRADED, score(task.target_tests, task.existing_tests, statuses), detail=detail,
                       statuses={k: v.name.lower() for k, v in statuses.items()}, test_output=run.output[-4000:])


def grade_patch(task, patch: str, sandbox_factory, *, infra_retries: int = 2) -> GradeResult:
    """Apply ``patch`` to a pristine sandbox of ``task``, run its tests, and score the reports.

    Tests that a report does not list (the run crashed, timed out, or a report is missing) count as
    failed: that is the patch's doing. A failure of the sandbox itself (:class:`InfraError` or an
    ``OSError`` from the runtime) is retried ``infra_retries`` times and then returned as
    ``infra_error`` with no scores.
    """
    errors = []
    for attempt in range(infra_retries + 1):
        try:
            with sandbox_factory(task) as sandbox:
                result = _run_tests(task, sandbox, patch)
            return GradeResult(result.status, result.scores, result.detail, attempt, result.statuses, result.test_output)
        except (InfraError, OSError) as exc:
            errors.append(f"try {attempt + 1}: {type(exc).__name__}: {exc}")
    return GradeResult(INFRA_ERROR, None, detail=" | ".join(errors), infra_retries=infra_retries)
