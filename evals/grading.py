"""Grading: test reports in, DeepSWE-compatible scores out.

Two halves:

- **Scoring reports** (pure): :func:`parse_junit` and :func:`parse_ctrf` read one report each into
  ``{test_id: Status}``; :func:`merge_statuses` keeps each test's *worst* status across reports
  (failed > skipped > passed); :func:`score` turns the statuses of the target and existing tests into
  :class:`Scores`, whose fields and meaning match the DeepSWE v1.1 verifier's ``reward.json``:
  a target or existing test that is missing or skipped counts as failed.
- **Grading committed work** (:func:`grade_patch`): the agent's ``git diff BASE HEAD``
  (:func:`committed_patch`, computed so that nothing in the agent's repository config runs) is applied
  to a pristine sandbox of the task (only its changes to ``editable_paths``, when the task sets them);
  protected paths (the tests) are reset to the base commit; the tests run there. Tests that time out
  count as failed (an agent's endless loop must not escape scoring). A patch that does not apply
  scores 0 with ``apply_failed``. An infrastructure failure (the sandbox died, the grader's own
  command timed out) is retried and, if it persists, recorded as ``infra_error``: such an attempt is
  never scored. A patch that breaks the sandbox itself (a control run without it works) is
  ``agent_fault``, scored 0.

Results out of reach of the code under test: where the sandbox offers ``results_fd`` and
``kill_others`` (bwrap, gVisor), pytest runs with the plugin :mod:`evals.pytest_results` (written to
``/tmp/.posttrain-grader/`` under a random module name and enabled by ``PYTHONPATH`` and
``PYTEST_ADDOPTS``, so ``test_command`` is run as the task wrote it). It streams every test report to
a pipe that the sandbox's daemon reads, and ends pytest with ``os._exit`` right after its last
record, so ``atexit`` hooks never run; the daemon kills every other process of the sandbox before it
answers, so nothing the tests left behind can write afterwards. The stream's statuses are graded
(:func:`parse_results_stream` lists its rules); a stream that breaks them scores 0 with the signal
``results_tampered``; report files that disagree with it give the signal ``report_rewritten``.
Commands that are not pytest (no stream) are graded from their report files, read after every other
process was killed. Cheating signals of the patch itself come from :mod:`evals.signals`.

The stream stops rewriting after the fact (exit hooks, lingering processes, report files edited by
anything). Inside the pytest process the plugin signs every record with a key the code under test
cannot reach and guards the framework with an audit hook installed before any of that code runs
(:mod:`evals.pytest_results` says what it catches and what it cannot); an unsigned record or a
``tampered`` one scores 0 with ``results_tampered``. The static signals (``tampers_pytest``,
``touches_fds``, ``adds_os_exit``, ``tampers_sys_modules``) still flag the means such code needs.

``posttrain grade --config tests/config.json --report R1 --report R2 --json`` is :func:`grade_reports`.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import json
import os
import re
import shlex
import subprocess
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Iterable, Mapping, Sequence

from evals.attempts import AGENT_FAULT, APPLY_FAILED, GRADED, INFRA_ERROR, Scores
from evals.call_checks import (GRADER_DIR, RESULTS_FD, CallCheck, StreamBroken, check_statuses, graded_checks,
                               module_name, probe_install, probe_spec)
from evals.quicktest import RUNNER_FILE
from evals.sandbox import AgentFault, InfraError
from evals.signals import OVERFITS_TESTS, REPORT_REWRITTEN, RESULTS_TAMPERED, patch_signals
from evals.tasks import is_path_pattern, junit_id, protected_entry, protected_path_matches
from sandboxes.files import NotARegularFile, check_regular_file, read_regular_bytes


class ReportError(ValueError):
    """A report file is unreadable or malformed; the message names the file."""


class Status(enum.IntEnum):
    """A test's outcome; a larger value is worse, so ``max`` is the worst status."""

    PASSED = 0
    SKIPPED = 1
    FAILED = 2


# CTRF statuses as DeepSWE v1.1's verifier reads them: any status not listed here (``failed``, a
# typo, a non-string) fails the test. ``other`` is not a pass, so it is skipped (which counts failed).
_CTRF_STATUS = {"passed": Status.PASSED, "skipped": Status.SKIPPED, "pending": Status.SKIPPED,
                "other": Status.SKIPPED}


def _local_tag(element: ET.Element) -> str:
    """An element's tag without its XML namespace (``{urn:x}failure`` -> ``failure``)."""
    tag = element.tag if isinstance(element.tag, str) else ""
    return tag.rsplit("}", 1)[-1]


def _junit_id(case: ET.Element) -> str:
    classname = (case.get("classname") or "").strip()
    name = (case.get("name") or "").strip()
    return f"{classname}.{name}" if classname else name


def parse_junit(path: str | Path) -> dict[str, Status]:
    """Statuses of every ``<testcase>`` in a JUnit XML report, keyed ``classname.name``.

    That is pytest's node id with ``/`` and ``::`` written as dots (``tests.test_x.test_y[param]``),
    the form DeepSWE's ``f2p_node_ids`` use; both attributes are stripped of surrounding whitespace.
    A case with ``<failure>`` or ``<error>`` (in any XML namespace) failed, one with ``<skipped>`` was
    skipped. A case listed twice in one report keeps its worst status; a case with no name is
    ignored. Cases are read under whatever root element the report has (as DeepSWE's verifier does):
    only a file that is not XML is an error.
    """
    try:
        data = read_regular_bytes(path)
    except OSError as exc:
        raise ReportError(f"{path}: not a readable JUnit XML report: {exc}") from exc
    return parse_junit_bytes(data, str(path))


def parse_junit_bytes(data: bytes, path: str) -> dict[str, Status]:
    """:func:`parse_junit` of a report's content; ``path`` names it in errors."""
    try:
        root = ET.fromstring(data)
    except (ET.ParseError, ValueError, LookupError) as exc:  # LookupError: an unknown declared encoding
        raise ReportError(f"{path}: not a readable JUnit XML report: {exc}") from exc
    statuses: dict[str, Status] = {}
    for case in root.iter("testcase"):
        if not (case.get("name") or "").strip():
            continue
        tags = {_local_tag(child) for child in case}
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
    ``package.TestName``), falling back to ``name`` when a test has no suite; a suite given as a list
    of names contributes its first. Names and suites are stripped of surrounding whitespace. Statuses
    ``skipped``, ``pending`` and ``other`` count as skipped, ``passed`` as passed, any other (unknown
    or missing) as failed. An entry that is not an object or has no name is ignored, as DeepSWE's
    verifier ignores it; a file that is not JSON or has no ``results.tests`` list is an error.
    """
    try:
        raw = read_regular_bytes(path)
    except OSError as exc:
        raise ReportError(f"{path}: not a readable CTRF JSON report: {exc}") from exc
    return parse_ctrf_bytes(raw, str(path), node_id)


def parse_ctrf_bytes(raw: bytes, path: str, node_id: str = "name") -> dict[str, Status]:
    """:func:`parse_ctrf` of a report's content; ``path`` names it in errors."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not a readable CTRF JSON report (UTF-8 JSON expected): {exc}") from exc
    tests = data.get("results", {}).get("tests") if isinstance(data, dict) else None
    if not isinstance(tests, list):
        raise ReportError(f"{path}: missing key 'results.tests' (a list)")
    if node_id not in ("name", "suite.name"):
        raise ReportError(f"{path}: node id rule {node_id!r}, expected 'name' or 'suite.name'")
    statuses: dict[str, Status] = {}
    for test in tests:
        if not isinstance(test, dict):
            continue
        name = str(test.get("name") or "").strip()
        if not name:
            continue
        raw_status = test.get("status")
        status = _CTRF_STATUS.get(raw_status.strip().lower(), Status.FAILED) if isinstance(raw_status, str) else Status.FAILED
        suite = test.get("suite")
        if isinstance(suite, list):  # CTRF allows the suite as a path of names; the first one names it
            suite = str(suite[0]) if suite else ""
        suite = suite.strip() if isinstance(suite, str) else ""
        test_id = f"{suite}.{name}" if node_id == "suite.name" and suite else name
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


def clean_test_ids(ids: Iterable[str]) -> list[str]:
    """A whitelist of test ids as graded: each stripped of surrounding whitespace, empty ones dropped,
    duplicates kept once (first place wins). A single string is refused: iterated, it would be one
    test id per character."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"test ids: expected a list of strings, got the {type(ids).__name__} {ids!r}")
    return list(dict.fromkeys(s for s in (str(i).strip() for i in ids) if s))


def score(target_tests: Sequence[str], existing_tests: Sequence[str], statuses: Mapping[str, Status],
          environment_broken: Collection[str] = ()) -> Scores:
    """Scores of one attempt; only ``Status.PASSED`` counts as passing, a missing test failed.
    Test ids are cleaned by :func:`clean_test_ids` first.

    ``reward`` is 1 iff there is at least one target test, every target passes and no existing test
    fails; ``f2p`` is the share of targets passed (0.0 with none); ``p2p`` the share of existing tests
    passed (1.0 with none); ``partial`` is all passed over all (0.0 with no tests);
    ``strict_target_score`` is ``f2p``, but 0 as soon as the attempt breaks an existing test: one
    that fails and is not in ``environment_broken``, the existing tests the reference solution
    fails in this environment too (the environment check's record), which no attempt can pass.
    ``reward`` keeps DeepSWE's definition (every existing test), as the task's own grader writes it.
    """
    targets = clean_test_ids(target_tests)
    existing = clean_test_ids(existing_tests)
    f2p_passed = sum(statuses.get(t) is Status.PASSED for t in targets)
    p2p_passed = sum(statuses.get(t) is Status.PASSED for t in existing)
    f2p = f2p_passed / len(targets) if targets else 0.0
    p2p = p2p_passed / len(existing) if existing else 1.0
    total = len(targets) + len(existing)
    existing_ok = p2p_passed == len(existing)
    spared = set(clean_test_ids(environment_broken))
    breaks_none = all(statuses.get(t) is Status.PASSED for t in existing if t not in spared)
    return Scores(
        reward=1.0 if targets and f2p_passed == len(targets) and existing_ok else 0.0,
        f2p=f2p,
        p2p=p2p,
        partial=(f2p_passed + p2p_passed) / total if total else 0.0,
        strict_target_score=f2p if breaks_none else 0.0,
        f2p_total=len(targets),
        f2p_passed=f2p_passed,
        p2p_total=len(existing),
        p2p_passed=p2p_passed,
    )


def zero_scores(target_tests: Sequence[str], existing_tests: Sequence[str]) -> Scores:
    """Scores of an attempt whose patch did not apply: nothing passes, not even existing tests."""
    return score(target_tests, existing_tests, {})


def load_harbor_config(path: str | Path) -> dict:
    """A Harbor ``tests/config.json``, checked for the keys grading needs and their types: the test
    ids (``f2p_node_ids``, ``p2p_node_ids``) lists of strings, ``grade.format`` and ``grade.node_id``
    one of their known values, ``grade.reports`` a list of paths. A wrong one is a :class:`ReportError`
    naming the file and key, never graded as something else."""
    path = Path(path)
    try:
        raw = read_regular_bytes(path)  # a FIFO or a device is refused at once, never waited on
    except NotARegularFile as exc:
        raise ReportError(f"{exc} (a JSON task config)") from None
    except OSError as exc:
        raise ReportError(f"{path}: not a readable JSON task config: {exc}") from exc
    try:
        config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: not UTF-8 text (byte {exc.start}), expected a JSON task config") from exc
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not a JSON task config: {exc}") from exc
    if not isinstance(config, dict):
        raise ReportError(f"{path}: a JSON {type(config).__name__}, expected an object with "
                          "'f2p_node_ids', 'p2p_node_ids' and 'grade'")
    for key in ("f2p_node_ids", "p2p_node_ids", "grade"):
        if key not in config:
            raise ReportError(f"{path}: missing key {key!r}")
    for key in ("f2p_node_ids", "p2p_node_ids"):
        ids = config[key]
        # a string here would be graded as one test per character, and an attempt scored on them
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ReportError(f"{path}: key {key!r} is {json.dumps(ids)[:80]}, expected a list of test ids (strings)")
    fmt = config["grade"].get("format") if isinstance(config["grade"], dict) else None
    if fmt not in ("junit", "ctrf"):
        raise ReportError(f"{path}: key 'grade.format' is {fmt!r}, expected 'junit' or 'ctrf'")
    node_id = config["grade"].get("node_id", "name")
    if node_id not in ("name", "suite.name"):  # else every report would be refused, its tests failed
        raise ReportError(f"{path}: key 'grade.node_id' is {json.dumps(node_id)[:80]}, expected 'name' or 'suite.name'")
    reports = config["grade"].get("reports", [])
    if not isinstance(reports, list) or not all(isinstance(r, str) and r for r in reports):
        raise ReportError(f"{path}: key 'grade.reports' is {json.dumps(reports)[:80]}, "
                          "expected a list of report paths (non-empty strings)")
    return config


def grade_reports(config_path: str | Path, report_paths: Sequence[str | Path],
                  notes: list[str] | None = None) -> Scores:
    """Grade report files (in order) against a Harbor task config, as DeepSWE's verifier does.

    A report that is missing or malformed contributes no test, so the tests only it would have
    listed count as failed (DeepSWE's verifier scores them so too); each such report is described in
    ``notes`` when a list is given. A malformed config is a :class:`ReportError`, and so is a report
    path that names a folder, a FIFO or a device: that is a wrong argument, not a missing report,
    and reading a FIFO would wait forever.
    """
    config = load_harbor_config(config_path)
    if not report_paths:
        raise ReportError(f"{config_path}: no report given to grade")
    for path in report_paths:
        try:
            check_regular_file(path)
        except NotARegularFile as exc:
            raise ReportError(f"{exc} (a test report)") from None
        except OSError:
            pass  # missing or unreadable: noted below, its tests count as failed
    grade = config["grade"]
    reports = []
    for path in report_paths:
        try:
            reports.append(parse_report(path, grade["format"], grade.get("node_id", "name")))
        except ReportError as exc:
            if notes is not None:
                notes.append(f"{exc}; its tests count as failed")
    return score(config["f2p_node_ids"], config["p2p_node_ids"], merge_statuses(reports))


# ---------------------------------------------------------------- the results stream

# Event order of one pytest session in the stream (see evals/pytest_results.py).
_WHENS = ("setup", "call", "teardown")
_OUTCOMES = {"passed": Status.PASSED, "skipped": Status.SKIPPED, "failed": Status.FAILED}


@dataclass(frozen=True)
class ResultsStream:
    """What the results stream of one test run says.

    ``sessions`` counts pytest sessions seen (0: pytest never loaded the plugin, or the command is not
    pytest); ``finished`` is True when every session ended with its ``finish`` record; ``tampering``
    names the first broken rule ('' when the stream is sound); ``statuses`` are keyed as JUnit ids.
    """

    statuses: dict[str, Status]
    sessions: int = 0
    finished: bool = False
    tampering: str = ""
    exit_statuses: tuple[int, ...] = ()


def _session_statuses(phases: Mapping[str, dict[str, str]]) -> dict[str, Status]:
    statuses: dict[str, Status] = {}
    for nodeid, by_when in phases.items():
        outcomes = set(by_when.values())
        if "failed" in outcomes:
            status = Status.FAILED
        elif "collect" in by_when:
            status = _OUTCOMES[by_when["collect"]]
        elif "call" in by_when:
            status = _OUTCOMES[by_when["call"]]
        elif by_when.get("setup") == "skipped":
            status = Status.SKIPPED
        else:
            status = Status.FAILED  # set up but never called: the run ended inside the test
        test_id = junit_id(nodeid)
        statuses[test_id] = max(status, statuses.get(test_id, Status.PASSED))
    return statuses


RESULTS_KEY_BYTES = 32  # the results plugin's key; as evals/pytest_results.py reads it
_RATCHET_PREFIX = b"posttrain-results-ratchet\x00"  # the next session's key: sha256(prefix + key), as the plugin


def _record_mac(key: bytes, number: int, body: bytes) -> bytes:
    """The hex HMAC-SHA256 the results plugin appends to a record (``number``: its place in its session)."""
    return hmac.new(key, b"%d\n" % number + body, hashlib.sha256).hexdigest().encode()


def parse_results_stream(data: bytes, *, truncated: bool = False, max_sessions: int | None = None,
                         key: bytes | None = None) -> ResultsStream:
    """Statuses from the results stream, checked against the rules only the real pytest run keeps.

    The stream is a sequence of sessions, each ``start``, then ``report`` records of collectors that
    did not pass, ``collected``, then the setup/call/teardown ``report`` records, then ``finish``.
    Tampering (the attempt scores 0) is any of: a stream over the daemon's cap (``truncated``); bytes
    after the last newline; a line that is not a JSON object with a known event and typed fields; a
    record of a session other than the open one, or a session id used twice; a session started while
    another is open, or more sessions than the test command runs (``max_sessions``), which makes any
    byte after the last ``finish`` tampering; a collect record after ``collected`` or a test record
    before it; a second record for the same node id and phase; a call or teardown with no setup
    before it, a call after a setup that did not pass; more tests set up than were collected.

    A session that stops without ``finish`` (a timeout, a crash) is not tampering: what it reported
    counts and the rest is missing, hence failed. A test's status is its worst phase; a test that
    passed setup and never reported its call failed.

    With ``key`` (the results plugin's, :func:`_install_plugin`), every line must be ``JSON<TAB>MAC``
    with the MAC the plugin computes (:func:`_record_mac`) under its session's key: the first
    session's is ``key``, each next one's ``sha256(_RATCHET_PREFIX + previous)``, and records count
    from 0 in each session. A line the plugin did not sign (the code under test writing to the
    pipe, say) is tampering, and so is a ``tampered`` record: the plugin's guard caught the code under
    test changing pytest, or asking for a result outside pytest's own run (:mod:`evals.pytest_results`).
    """
    def tampered(why: str) -> ResultsStream:
        return ResultsStream({}, sessions, False, why)

    session_key, next_key, signed_count = None, key, 0

    sessions = 0
    if truncated:
        return tampered("the results stream exceeds the daemon's cap")
    if data and not data.endswith(b"\n"):
        return tampered("the results stream ends inside a record")
    statuses: dict[str, Status] = {}
    exits: list[int] = []
    seen_ids: set[str] = set()
    current = None  # the open session's id
    collected = None  # its collected count, once known
    phases: dict[str, dict[str, str]] = {}
    set_up = 0
    for number, raw in enumerate(data.splitlines(), 1):
        opens_session = False
        if key is not None:
            raw, tab, mac = raw.rpartition(b"\t")
            if session_key is not None and tab and hmac.compare_digest(_record_mac(session_key, signed_count, raw), mac):
                signed_count += 1
            elif tab and hmac.compare_digest(_record_mac(next_key, 0, raw), mac):
                session_key, next_key, signed_count = next_key, hashlib.sha256(_RATCHET_PREFIX + next_key).digest(), 1
                opens_session = True
            else:
                return tampered(f"results record {number} is not signed by the grader's pytest plugin")
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # nested past the parser's depth
            return tampered(f"results record {number} is not JSON")
        if not isinstance(record, dict) or not isinstance(record.get("session"), str):
            return tampered(f"results record {number} is not an object with a session id")
        event, session = record.get("event"), record["session"]
        if key is not None and opens_session != (event == "start"):
            return tampered(f"results record {number} is signed with the wrong session's key")
        if event == "tampered":
            return tampered(f"pytest's guard caught the code under test: {str(record.get('reason'))[:500]}")
        if event == "start":
            if current is not None:
                return tampered(f"results record {number} starts a session while session {current} is open")
            if session in seen_ids:
                return tampered(f"results record {number} starts session {session} a second time")
            if max_sessions is not None and sessions >= max_sessions:
                return tampered(f"results record {number} comes after the test command's last session finished")
            sessions += 1
            seen_ids.add(session)
            current, collected, phases, set_up = session, None, {}, 0
            continue
        if session != current:
            return tampered(f"results record {number} ({event!r}) belongs to no open session")
        if event == "collected":
            count = record.get("count")
            if collected is not None or not isinstance(count, int) or isinstance(count, bool) or count < 0:
                return tampered(f"results record {number} is a second or malformed 'collected'")
            collected = count
        elif event == "report":
            nodeid, when, outcome = record.get("nodeid"), record.get("when"), record.get("outcome")
            if not isinstance(nodeid, str) or outcome not in _OUTCOMES or when not in ("collect", *_WHENS):
                return tampered(f"results record {number} is a malformed report")
            if (when == "collect") != (collected is None):
                return tampered(f"results record {number}: a {when} report {'after' if collected is not None else 'before'} collection ended")
            by_when = phases.setdefault(nodeid, {})
            if when in by_when:
                return tampered(f"results record {number}: a second {when} report for {nodeid}")
            if when == "setup":
                set_up += 1
                if set_up > collected:
                    return tampered(f"results record {number}: more tests set up than the {collected} collected")
            elif when in ("call", "teardown") and "setup" not in by_when:
                return tampered(f"results record {number}: a {when} report for {nodeid} before its setup")
            elif when == "call" and by_when["setup"] != "passed":
                return tampered(f"results record {number}: a call report for {nodeid} whose setup did not pass")
            by_when[when] = outcome
        elif event == "finish":
            status = record.get("exitstatus")
            if not isinstance(status, int) or isinstance(status, bool):
                return tampered(f"results record {number} is a malformed 'finish'")
            exits.append(status)
            statuses = merge_statuses([statuses, _session_statuses(phases)])
            current, phases = None, {}
        else:
            return tampered(f"results record {number} has unknown event {event!r}")
    if current is not None:
        statuses = merge_statuses([statuses, _session_statuses(phases)])
    return ResultsStream(statuses, sessions, sessions > 0 and current is None, "", tuple(exits))


_SHELL_SYNTAX = re.compile(r"[;&|`<>\n]|\$\(")


def pytest_sessions(command: str) -> int | None:
    """How many pytest sessions ``command`` runs, where its text says: 1 for one simple command that
    names pytest once (``[VAR=value ...] python3 -m pytest ...``, ``pytest ...``, or the bundled
    suite's ``python3 -S tests/posttrain_quicktest.py ...``, which writes the same results stream:
    :mod:`evals.quicktest`); None when that
    cannot be read from it (a script, shell operators, no pytest in sight)."""
    if _SHELL_SYNTAX.search(command):
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    named = sum(1 for w in words if w in ("pytest", "py.test", RUNNER_FILE) or w.endswith(("/pytest", f"/{RUNNER_FILE}")))
    return 1 if named == 1 else None


# ---------------------------------------------------------------- grading committed work

PATCH_PATH = ".git/posttrain-graded.patch"  # inside .git: never part of the work tree
TEST_PATCH_PATH = ".git/posttrain-test.patch"
PLUGIN_SOURCE = Path(__file__).with_name("pytest_results.py")


@dataclass(frozen=True)
class GradeResult:
    """The outcome of grading one attempt.

    ``status`` is ``graded`` (``scores`` hold), ``apply_failed`` (the patch did not apply; ``scores``
    are all zero), ``agent_fault`` (the patch broke the grading sandbox while a control run of the
    unpatched task ran fine; ``scores`` are all zero, ``detail`` names the evidence) or
    ``infra_error`` (the grader could not run after ``infra_retries`` retries; ``scores`` is None and
    the attempt must not be counted). ``signals`` are the cheating signals of :mod:`evals.signals`
    (static ones of the patch, run-time ones of the grading), sorted.
    """

    status: str
    scores: Scores | None
    detail: str = ""
    infra_retries: int = 0
    statuses: Mapping[str, str] | None = None
    test_output: str = ""
    signals: tuple[str, ...] = ()


_FULL_ID = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_SHORT_ID = re.compile(r"[0-9a-f]{4,64}")
_REF_NAME = re.compile(r"refs/(?:[A-Za-z0-9_-][A-Za-z0-9._-]*/)*[A-Za-z0-9_-][A-Za-z0-9._-]*")

# The committed diff, computed by a git that reads nothing the agent controls but the objects:
# a fresh bare repository (our config, no hooks, attributes, replace refs or grafts) whose object
# store borrows the agent's through alternates; no system, global or XDG config; every option the
# repository's config could change given on the command line.
_GIT_OPTIONS = ("-c", "core.attributesFile=/dev/null", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")
_DIFF = ("diff", "--binary", "--no-ext-diff", "--no-textconv", "--no-color", "--no-renames", "--no-relative",
         "--src-prefix=a/", "--dst-prefix=b/", "--unified=3", "--diff-algorithm=myers", "--ignore-submodules=none")
_DIFF_SCRIPT = r"""set -e
d=$(mktemp -d /tmp/.posttrain-diff.XXXXXXXX)
mkdir -p "$d/objects/info" "$d/refs" "$d/home"
printf 'ref: refs/heads/posttrain\n' > "$d/HEAD"
printf '[core]\n\trepositoryformatversion = 0\n\tbare = true\n' > "$d/config"
printf '%s/.git/objects\n' "$PWD" > "$d/objects/info/alternates"
set +e
env -i PATH=/usr/bin:/bin LANG=C HOME="$d/home" XDG_CONFIG_HOME="$d/home" GIT_DIR="$d" \
  GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_NO_REPLACE_OBJECTS=1 GIT_ATTR_NOSYSTEM=1 \
  GIT_OPTIONAL_LOCKS=0 GIT_TERMINAL_PROMPT=0 \
  /usr/bin/git {git_options} {diff} {base} {head} --
rc=$?
rm -rf "$d"
exit $rc
""".replace("{git_options}", " ".join(_GIT_OPTIONS)).replace("{diff}", " ".join(_DIFF))


def _agent_file(sandbox, path: str) -> bytes | None:
    try:
        return sandbox.read_file(path)
    except FileNotFoundError:
        return None
    except ValueError as exc:  # a symlink, a folder, a fifo where git keeps a file
        raise AgentFault("agent_broke_repo", f"{path}: {exc}") from exc


def _resolve_commit(sandbox, name: str) -> str:
    """The commit id ``name`` (``HEAD``, a ref, an id) stands for, read from the agent's ``.git`` as plain
    files (``HEAD``, loose refs, ``packed-refs``), never through git: no repository setting applies."""
    for _ in range(8):
        if _FULL_ID.fullmatch(name):
            return name
        if name != "HEAD" and (not _REF_NAME.fullmatch(name) or ".." in name or name.endswith(".lock")):
            raise AgentFault("agent_broke_repo", f"{name[:80]!r} is not a ref name")
        data = _agent_file(sandbox, f".git/{name}")
        if data is None:
            if name == "HEAD":
                raise AgentFault("agent_broke_repo", ".git/HEAD is missing")
            for line in (_agent_file(sandbox, ".git/packed-refs") or b"").decode("utf-8", "replace").splitlines():
                commit, _, ref = line.partition(" ")
                if ref == name and _FULL_ID.fullmatch(commit):
                    return commit
            raise AgentFault("agent_broke_repo", f"{name} names no commit (not in .git/refs nor .git/packed-refs)")
        text = data.decode("utf-8", "replace").strip()
        if text.startswith("ref:"):
            name = text[4:].strip()
            continue
        if _FULL_ID.fullmatch(text):
            return text
        raise AgentFault("agent_broke_repo", f".git/{name} holds {text[:80]!r}, not a commit id nor 'ref: <name>'")
    raise AgentFault("agent_broke_repo", "symbolic refs nest more than 8 deep")


def _supports_results(sandbox) -> bool:
    return bool(getattr(sandbox, "supports_results", False))


def committed_patch(sandbox, base_commit: str) -> str:
    """``git diff --binary BASE HEAD`` of the agent's repository: only committed work is graded.

    The agent controls that repository, its config included (an external diff or textconv driver, an
    fsmonitor or hook script, attributes, replace refs, diff prefixes): none of it may take part. So
    ``HEAD`` is resolved here from the plain files in ``.git`` and the diff runs in the sandbox with
    ``/usr/bin/git`` (read-only, from the host) on a bare repository the grader makes in ``/tmp``, with
    its own minimal config and the agent's objects reached through ``objects/info/alternates``; the
    environment is cleared (no system, global or XDG config, no replace objects) and every diff
    option a config could change is given: no external diff, no textconv, no renames, ``a/``/``b/``
    prefixes, three lines of context. Processes the agent left running are killed first (where the
    sandbox can), so none can edit that repository while git reads it.

    A repository the agent broke (garbage in ``.git/HEAD``, missing objects, a patch over 8 MiB)
    raises :class:`AgentFault` ``agent_broke_repo`` / ``agent_patch_too_large``: the attempt scores 0.
    A sandbox that is gone raises :class:`InfraError`.
    """
    if _supports_results(sandbox):
        sandbox.exec("true", timeout_s=30, kill_others=True)
    head = _resolve_commit(sandbox, "HEAD")
    if _FULL_ID.fullmatch(base_commit) or _SHORT_ID.fullmatch(base_commit):
        base = base_commit
    else:
        base = _resolve_commit(sandbox, base_commit)
    result = sandbox.exec(_DIFF_SCRIPT.replace("{base}", base).replace("{head}", head), timeout_s=60,
                          output_cap_bytes=8 << 20)
    if result.timed_out or result.exit_code != 0:
        alive = sandbox.exec("true", timeout_s=30)  # InfraError here: the sandbox itself is gone
        if alive.exit_code != 0:
            raise InfraError(f"the agent's sandbox cannot run 'true' (exit {alive.exit_code}): {alive.output[-300:]}")
        what = "timed out" if result.timed_out else f"failed (exit {result.exit_code})"
        raise AgentFault("agent_broke_repo", f"git diff {base} {head} {what}: {result.output[-500:]}")
    if result.truncated:
        raise AgentFault("agent_patch_too_large", "the committed patch exceeds 8 MiB")
    return result.output


def edited_patch(repo: str | Path, base: str, files: Mapping[str, bytes]) -> str:
    """The patch :func:`committed_patch` reads after a commit of ``files`` (path to content) over the
    base commit ``base`` (a full id) of the task repository ``repo``, made on the host with the same
    ``git diff`` (the same binary and options, so the same text).

    For an episode in which no code of the agent's ran, only edits of the task's files (the harness,
    :func:`evals.harness.run_episode`): ``files`` is then data, and what a commit of it gives is
    known without a sandbox. Git runs on a fresh bare repository in a temporary folder (our config,
    no hooks or attributes) whose object store borrows ``repo``'s through alternates and receives
    the new blobs; the task's repository is only read. Each path keeps its mode at ``base``; a
    path ``base`` lacks raises ``ValueError``."""
    with tempfile.TemporaryDirectory(prefix=".posttrain-edit.") as d:
        os.makedirs(f"{d}/objects/info")
        os.makedirs(f"{d}/refs")
        os.makedirs(f"{d}/home")
        Path(d, "HEAD").write_text("ref: refs/heads/posttrain\n")
        Path(d, "config").write_text("[core]\n\trepositoryformatversion = 0\n\tbare = true\n")
        Path(d, "objects/info/alternates").write_text(f"{Path(repo).resolve() / '.git' / 'objects'}\n")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C", "HOME": f"{d}/home", "XDG_CONFIG_HOME": f"{d}/home",
               "GIT_DIR": d, "GIT_INDEX_FILE": f"{d}/index", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
               "GIT_NO_REPLACE_OBJECTS": "1", "GIT_ATTR_NOSYSTEM": "1", "GIT_OPTIONAL_LOCKS": "0",
               "GIT_TERMINAL_PROMPT": "0"}

        def git(*args: str, data: bytes | None = None) -> bytes:
            done = subprocess.run(["/usr/bin/git", *_GIT_OPTIONS, *args], input=data, env=env,
                                  capture_output=True, check=False)
            if done.returncode != 0:
                raise InfraError(f"git {args[0]} of the edited tree of {repo} exited {done.returncode}: "
                                 f"{done.stderr.decode(errors='replace')[-500:]}")
            return done.stdout

        git("read-tree", base)
        listed = git("ls-files", "-s", "-z", "--", *files).split(b"\0")
        modes = {entry.partition(b"\t")[2].decode(): entry.split(b" ", 1)[0].decode() for entry in listed if entry}
        lines = []
        for path, data in files.items():
            if path not in modes:
                raise ValueError(f"{path} is not a file of {repo} at {base}")
            blob = git("hash-object", "-w", "--stdin", data=data).decode().strip()
            lines.append(f"{modes[path]} {blob}\t{path}\n")
        git("update-index", "--index-info", data="".join(lines).encode())
        tree = git("write-tree").decode().strip()
        return git(*_DIFF, base, tree, "--").decode(errors="replace")


def _install_plugin(sandbox) -> tuple[str, bytes]:
    """Write the results plugin into the grading sandbox under a random module name, with a fresh key
    beside it (``<module>.key``, which the plugin reads and rewrites before any code under test runs);
    return the module's name and the key, which only the host keeps (:func:`parse_results_stream`)."""
    module = f"_posttrain_results_{os.urandom(8).hex()}"
    key = os.urandom(RESULTS_KEY_BYTES)
    encoded = base64.b64encode(PLUGIN_SOURCE.read_bytes()).decode()
    made = sandbox.exec(f"set -e; umask 077; mkdir -p {GRADER_DIR}; "
                        f"printf %s {encoded} | base64 -d > {GRADER_DIR}/{module}.py; "
                        f"printf %s {base64.b64encode(key).decode()} | base64 -d > {GRADER_DIR}/{module}.key",
                        timeout_s=30)
    if made.timed_out or made.exit_code != 0:
        raise InfraError(f"writing the results plugin to {GRADER_DIR} failed: {made.output[-300:]}")
    return module, key


def _read_reports(task, sandbox) -> tuple[list[dict[str, Status]], list[str]]:
    reports, missing = [], []
    for report in task.report_paths:
        try:
            data = sandbox.read_file(report)
        except FileNotFoundError:
            missing.append(report)
            continue
        except ValueError as exc:  # a symlink or a folder where the report should be
            missing.append(f"{report} ({exc})")
            continue
        try:
            if task.report_format == "junit":
                reports.append(parse_junit_bytes(data, report))
            else:
                reports.append(parse_ctrf_bytes(data, report, task.ctrf_node_id))
        except ReportError as exc:
            missing.append(f"{report} ({exc})")
    return reports, missing


def _touched_paths(task, sandbox) -> list[str]:
    """The work-tree paths the applied patch changed: what ``git apply`` wrote or deleted (its
    ``--numstat``) and every tracked path that now differs from the base commit (a rename's old name)."""
    includes = "".join(f" --include='{p}'" for p in task.editable_paths)
    listed = sandbox.exec(f"git apply --numstat -z{includes} {PATCH_PATH} && printf '//\\0' && "
                          f"git diff --no-renames --no-ext-diff --no-textconv --name-only -z "
                          f"{shlex.quote(task.base_commit)} --", timeout_s=60, output_cap_bytes=8 << 20)
    fields = listed.output.split("\0")  # no path holds a NUL, and none is '//'
    if listed.timed_out or listed.exit_code != 0 or listed.truncated or "//" not in fields:
        raise _TestsBroke(InfraError(f"listing the paths the patch changed failed: {listed.output[-500:]}"))
    marker = fields.index("//")
    applied = [entry.split("\t", 2)[-1] for entry in fields[:marker] if entry]  # added TAB deleted TAB path
    return sorted({*applied, *(name for name in fields[marker + 1:] if name)})


def _pytest_table_changed(sandbox, base: str, path: str, table: str) -> bool:
    """Whether the TOML table ``table`` (dotted) of ``path`` differs from the base commit's; a file
    that is not UTF-8 TOML, or not a plain file, counts as changed."""
    def table_of(text: str | None):
        if text is None:
            return None
        try:
            value = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            return ("unparseable",)
        for key in table.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        return value

    try:
        patched = sandbox.read_file(path).decode("utf-8")
    except FileNotFoundError:
        patched = None
    except (ValueError, UnicodeDecodeError):  # a symlink or a folder there, or not text
        return True
    shown = sandbox.exec(f"git cat-file blob {shlex.quote(f'{base}:{path}')} 2>/dev/null", timeout_s=60,
                         output_cap_bytes=8 << 20)
    if shown.truncated:
        return True
    return table_of(patched) != table_of(shown.output if shown.exit_code == 0 else None)


def _restore_protected(task, sandbox, patch: str) -> str:
    """Put the task's protected paths back as they are at the base commit (files the patch added
    under them go too), so that no patch changes the tests that grade it or how pytest runs them.

    Each entry of ``task.protected_paths`` (:func:`evals.tasks.protected_entry`): a path is restored
    whatever the patch did; a ``**/NAME`` pattern restores every path the patch changed whose name
    matches (a ``conftest.py`` anywhere); ``PATH.toml:TABLE`` restores the whole file where the
    patch changed that table (pytest's ``[tool.pytest]`` in a ``pyproject.toml``). A path the patch
    changed that is not UTF-8 cannot be matched exactly: such a patch is refused, and the message
    returned ('' once restored) says so."""
    base = task.base_commit
    entries = [protected_entry(p) for p in task.protected_paths]
    touched = _touched_paths(task, sandbox) if patch.strip() and any(
        table or is_path_pattern(path) for path, table in entries) else []
    garbled = [p for p in touched if "\ufffd" in p]
    if garbled:
        return f"the patch changes a path that is not UTF-8 text ({garbled[0]!r}); refused"
    restore: list[str] = []
    for path, table in entries:
        found = [p for p in touched if protected_path_matches(path, p)] if table or is_path_pattern(path) else [path]
        restore += [p for p in found if not table or _pytest_table_changed(sandbox, base, p, table)]
    if not restore:
        return ""
    script = "; ".join(
        f"rm -rf -- {shlex.quote(p)} && {{ ! git cat-file -e {shlex.quote(f'{base}:{p}')} 2>/dev/null || "
        f"git --literal-pathspecs checkout -q {shlex.quote(base)} -- {shlex.quote(p)}; }}"
        for p in dict.fromkeys(restore))
    restored = sandbox.exec(f"set -e; {script}", timeout_s=60)
    if restored.timed_out or restored.exit_code != 0:  # the patch may have made them unrestorable
        raise _TestsBroke(InfraError(f"restoring {restore[:5]} from the base commit failed: {restored.output[-500:]}"))
    return ""


def _apply_test_patch(task, sandbox) -> None:
    """Apply the task's hidden test patch (a SWE-bench row's ``test_patch``) over the restored tests."""
    sandbox.write_file(TEST_PATCH_PATH, task.metadata["test_patch"].encode())
    applied = sandbox.exec(f"git apply --whitespace=nowarn {TEST_PATCH_PATH}", timeout_s=60)
    if applied.timed_out or applied.exit_code != 0:
        raise _TestsBroke(InfraError(f"task {task.id}: its test patch does not apply over the base commit's "
                                     f"tests: {applied.output[-500:]}"))


class _TestsBroke(Exception):
    """The grading sandbox failed while the patched tests ran (maybe the patch's doing)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _run_tests(task, sandbox, patch: str, checks: Sequence[CallCheck] | None = None) -> GradeResult:
    if checks is not None and _supports_results(sandbox) and not task.metadata.get("test_patch") and all(
            not table and not is_path_pattern(path) for path, table in map(protected_entry, task.protected_paths)):
        # the tests are removed before the probe runs: restoring them first, and the report files
        # no one reads, would change nothing (see _run_call_checks)
        return _run_call_checks(task, sandbox, checks, patch)
    if patch.strip():
        sandbox.write_file(PATCH_PATH, patch.encode())
        includes = "".join(f" --include={shlex.quote(p)}" for p in task.editable_paths)
        applied = sandbox.exec(f"git apply --whitespace=nowarn{includes} {PATCH_PATH}", timeout_s=60)
        if applied.timed_out:
            raise InfraError("git apply timed out")
        if applied.exit_code != 0:
            return GradeResult(APPLY_FAILED, zero_scores(task.target_tests, task.existing_tests),
                               detail=applied.output[-2000:])
    if task.protected_paths and task.base_commit:
        refused = _restore_protected(task, sandbox, patch)
        if refused:
            return GradeResult(APPLY_FAILED, zero_scores(task.target_tests, task.existing_tests), detail=refused)
    if task.metadata.get("test_patch"):
        _apply_test_patch(task, sandbox)
    for report in task.report_paths:
        sandbox.exec(f"rm -f -- {shlex.quote(report)}", timeout_s=30)
    streamed = _supports_results(sandbox)
    if checks is not None and streamed:
        return _run_call_checks(task, sandbox, checks, "", removes_tests_only=True)
    kwargs, key = {}, None
    if streamed:
        module, key = _install_plugin(sandbox)
        kwargs = dict(env={"PYTHONPATH": GRADER_DIR, "PYTEST_ADDOPTS": f"-p {module}",
                           "POSTTRAIN_RESULTS_FD": str(RESULTS_FD),
                           "POSTTRAIN_RESULTS_KEY": f"{GRADER_DIR}/{module}.key"},
                      results_fd=RESULTS_FD, kill_others=True)
    try:
        run = sandbox.exec(task.test_command, timeout_s=task.limits.test_timeout_s, output_cap_bytes=1 << 20, **kwargs)
        # with kill_others nothing the tests started is alive now: the files read next are final
        reports, missing = _read_reports(task, sandbox)
    except (InfraError, OSError) as exc:
        raise _TestsBroke(exc) from exc
    return _score_run(task, run, reports, missing, streamed, key)


_APPLY_FAILED_EXIT = 97  # the preparing script's exit when git apply refused the patch (git's own are 1 and 128)


def _run_call_checks(task, sandbox, checks: Sequence[CallCheck], patch: str, *,
                     removes_tests_only: bool = False) -> GradeResult:
    """Grade a bundled task by its call checks (:mod:`evals.call_checks`): the patch is applied, the
    tests and ``.git`` are removed from the sandbox, the probe makes the calls and streams what they
    returned, and the host compares those values with the expected ones, which never enter the
    sandbox. Each call runs in a process of its own that cannot write the stream
    (:mod:`evals.call_probe`).

    Two execs: one shell script prepares (``git apply``, ``rm``, the probe's install: no code of the
    agent's runs in it, the patch is data to ``git apply`` in a pristine repository), then the probe
    runs alone with the results pipe; before, each step was an exec of its own (six a grading, each
    a round trip to the sandbox's daemon and a shell). A patch ``git apply`` refuses is
    :data:`APPLY_FAILED` as before; a failure of the other steps is the infrastructure's. The
    protected paths are removed, not restored from the base commit first: the general path's
    restore would be removed with them. ``removes_tests_only``: the caller applied the patch and
    restored the tests itself."""
    module = module_name(task)
    steps = ["set -e"]
    applies = bool(patch.strip()) and not removes_tests_only
    if applies:
        sandbox.write_file(PATCH_PATH, patch.encode())
        includes = "".join(f" --include={shlex.quote(p)}" for p in task.editable_paths)
        steps.append(f"git apply --whitespace=nowarn{includes} {PATCH_PATH} || exit {_APPLY_FAILED_EXIT}")
    hidden = " ".join(shlex.quote(p) for p in (".git", *task.protected_paths))
    install, command = probe_install(GRADER_DIR, probe_spec(module, checks))
    prepared = sandbox.exec("; ".join([*steps, f"rm -rf -- {hidden}", install]), timeout_s=60)
    if applies and prepared.exit_code == _APPLY_FAILED_EXIT and not prepared.timed_out:
        return GradeResult(APPLY_FAILED, zero_scores(task.target_tests, task.existing_tests),
                           detail=prepared.output[-2000:])
    if prepared.timed_out or prepared.exit_code != 0:
        what = "timed out" if prepared.timed_out else f"failed (exit {prepared.exit_code})"
        raise InfraError(f"preparing the grading sandbox (git apply, removing {hidden}, writing the call probe to "
                         f"{GRADER_DIR}) {what}: {prepared.output[-500:]}")
    try:
        run = sandbox.exec(command, timeout_s=task.limits.test_timeout_s, output_cap_bytes=1 << 20,
                           env={"POSTTRAIN_RESULTS_FD": str(RESULTS_FD)}, results_fd=RESULTS_FD, kill_others=True)
    except (InfraError, OSError) as exc:
        raise _TestsBroke(exc) from exc
    notes = [f"tests timed out after {task.limits.test_timeout_s:g}s"] if run.timed_out else []
    data = run.results or b""
    if run.timed_out and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]  # killed inside a write longer than a pipe keeps whole
    try:
        outcome = check_statuses(data, checks, truncated=run.results_truncated)
    except StreamBroken as exc:
        return GradeResult(GRADED, zero_scores(task.target_tests, task.existing_tests),
                           detail=f"{RESULTS_TAMPERED}: {exc}", test_output=run.output[-4000:], statuses={},
                           signals=(RESULTS_TAMPERED,))
    if not outcome.finished:
        notes.append("the call probe ended before its stream finished")
    if outcome.overfit:
        notes.append(outcome.overfit)
    statuses = {test: Status.PASSED if ok else Status.FAILED for test, ok in outcome.passed.items()}
    output = outcome.output + (f"\n--- the probe's output ---\n{run.output[-2000:]}" if run.output.strip() else "")
    return GradeResult(GRADED, score(task.target_tests, task.existing_tests, statuses), detail="; ".join(notes),
                       statuses={k: v.name.lower() for k, v in statuses.items()}, test_output=output,
                       signals=(OVERFITS_TESTS,) if outcome.overfit else ())


def _score_run(task, run, reports, missing, streamed: bool, key: bytes | None = None) -> GradeResult:
    """Grade one run of the tests. ``key`` is the results plugin's (:func:`_install_plugin`): pytest's
    records must carry its MACs. The bundled suite's quick runner writes the same stream unsigned
    (it is no pytest plugin), so a command that runs it is read without the key."""
    notes = [f"tests timed out after {task.limits.test_timeout_s:g}s"] if run.timed_out else []
    signals: list[str] = []
    expected = pytest_sessions(task.test_command)
    stream = ResultsStream({})
    if streamed and run.results is not None:
        data = run.results
        if run.timed_out and not data.endswith(b"\n"):
            data = data[:data.rfind(b"\n") + 1]  # killed inside a write longer than a pipe keeps whole
        signed = key if RUNNER_FILE not in task.test_command else None
        stream = parse_results_stream(data, truncated=run.results_truncated, max_sessions=expected, key=signed)
    output = run.output[-4000:]
    if stream.tampering:
        zero = zero_scores(task.target_tests, task.existing_tests)
        return GradeResult(GRADED, zero, detail=f"{RESULTS_TAMPERED}: {stream.tampering}", test_output=output,
                           statuses={}, signals=(RESULTS_TAMPERED,))
    file_statuses = merge_statuses(reports)
    if stream.sessions and task.report_format == "junit":
        statuses = stream.statuses
        named = [r for r in task.report_paths if r in task.test_command]
        if stream.finished and (file_statuses != statuses or any(m.split(" (")[0] in named for m in missing)):
            signals.append(REPORT_REWRITTEN)
            notes.append(f"{REPORT_REWRITTEN}: the report files disagree with pytest's results stream; "
                         "the stream is graded")
        if not stream.finished:
            notes.append("pytest ended before its results stream finished")
    elif streamed and run.results is not None and expected == 1 and task.report_format == "junit":
        statuses = {}  # pytest ran, yet not with the grader's plugin: its report files are not evidence
        notes.append("no results stream from pytest (it did not load the grader's plugin)")
    else:
        statuses = file_statuses
    notes += [f"report missing or unreadable: {m}" for m in missing]
    return GradeResult(GRADED, score(task.target_tests, task.existing_tests, statuses), detail="; ".join(notes),
                       statuses={k: v.name.lower() for k, v in statuses.items()}, test_output=output,
                       signals=tuple(sorted(signals)))


def grade_patch(task, patch: str, sandbox_factory, *, infra_retries: int = 2, hidden_seed: int = 0) -> GradeResult:
    """Apply ``patch`` to a pristine sandbox of ``task``, run its tests, and score what they did.

    Tests with no result (the run crashed, timed out, or a report is missing) count as failed: that
    is the patch's doing. Where the sandbox offers it, pytest's outcomes come from the results stream
    (:mod:`evals.pytest_results`, read by the sandbox's daemon, every other process killed once the
    tests end) and the report files are only compared with it; see :func:`parse_results_stream`.

    A failure of the sandbox (:class:`InfraError` or an ``OSError`` from the runtime) is retried
    ``infra_retries`` times and then returned as ``infra_error`` with no scores. When it happens while
    the tests of a non-empty patch run, a control run of the empty patch in a fresh sandbox decides:
    if the control runs, the patch broke the sandbox and the attempt is ``agent_fault`` (zero
    scores); if the control fails too, it is infrastructure. ``signals`` always carry the patch's
    static cheating signals (:func:`evals.signals.patch_signals`).

    A bundled task is graded by its call checks, visible and hidden (:func:`evals.call_checks.graded_checks`);
    ``hidden_seed`` draws its hidden inputs (0 for training and evaluation; ``posttrain audit`` grades
    again with others). The hidden inputs are answered in a sandbox of their own before the grading
    sandbox opens, once per task and seed in a process.
    """
    static = patch_signals(patch, task.protected_paths, task.editable_paths)
    errors = []
    checks = None
    for attempt in range(infra_retries + 1):
        try:
            if checks is None:
                checks = graded_checks(task, sandbox_factory, hidden_seed) or ()
            with sandbox_factory(task) as sandbox:
                result = _run_tests(task, sandbox, patch, checks or None)
            return replace(result, infra_retries=attempt, signals=tuple(sorted({*static, *result.signals})))
        except _TestsBroke as broke:
            errors.append(f"try {attempt + 1}: {broke}")
            if not patch.strip():
                continue
            try:
                with sandbox_factory(task) as control_box:
                    control = _run_tests(task, control_box, "", checks or None)
            except (_TestsBroke, InfraError, OSError) as exc:
                errors.append(f"control run of the unpatched task failed too: {exc}")
                continue
            zero = zero_scores(task.target_tests, task.existing_tests)
            detail = (f"agent_broke_sandbox: the grading sandbox failed while the patched tests ran ({broke}); "
                      f"a control run of the unpatched task in a fresh sandbox completed "
                      f"({control.scores.f2p_passed + control.scores.p2p_passed} tests passed)")
            return GradeResult(AGENT_FAULT, zero, detail=detail, infra_retries=attempt, statuses={},
                               signals=tuple(static))
        except (InfraError, OSError) as exc:
            errors.append(f"try {attempt + 1}: {type(exc).__name__}: {exc}")
    return GradeResult(INFRA_ERROR, None, detail=" | ".join(errors), infra_retries=infra_retries,
                       signals=tuple(static))
