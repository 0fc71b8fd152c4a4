"""A pytest plugin that streams each test's outcome to the grader, out of reach of later rewriting.

The grader (:func:`evals.grading.grade_patch`) copies this file into the grading sandbox, outside the
repository and under a random module name, and enables it for the task's own test command through
the environment (``PYTHONPATH`` and ``PYTEST_ADDOPTS=-p <module>``), so the command itself stays as
the task wrote it. ``POSTTRAIN_RESULTS_FD`` names the write end of a pipe whose reader is the
sandbox's daemon (``pxd``), which never imports the code under test.

Stdlib and pytest only. One JSON object per line, written with a single ``os.write`` each (a pipe
keeps writes under 4 KiB whole):

- ``{"event": "start", "session": S, "pid": P}`` when pytest loads the plugin, before any conftest
  or test module is imported;
- ``{"event": "report", "session": S, "nodeid": N, "when": "collect", "outcome": O}`` for a
  collector that did not pass (a test module that fails to import, a module-level skip);
- ``{"event": "collected", "session": S, "count": C}`` when collection is done;
- ``{"event": "report", "session": S, "nodeid": N, "when": W, "outcome": O}`` for each setup, call
  and teardown report (``pytest_runtest_logreport``);
- ``{"event": "finish", "session": S, "exitstatus": X}`` last, from ``pytest_unconfigure`` after every
  other plugin (the JUnit writer included) is done; then the process ends at once with
  ``os._exit(X)``, so ``atexit`` hooks and finalizers of the code under test never run.

``S`` is a random id drawn when the plugin loads. The plugin moves the pipe to a high close-on-exec
descriptor and drops ``POSTTRAIN_RESULTS_FD`` from the environment, so programs the tests start do
not inherit it. With no such variable (or a descriptor that is not a pipe) the plugin does nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys

import pytest

FD_ENV = "POSTTRAIN_RESULTS_FD"


def _open_stream() -> int | None:
    raw = os.environ.pop(FD_ENV, None)
    if raw is None:
        return None
    try:
        fd = int(raw)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 200)
        os.close(fd)
        return moved
    except (ValueError, OSError):
        return None


_FD = _open_stream()
_SESSION = os.urandom(12).hex()
_EXIT_STATUS: list[int] = []


def _emit(record: dict) -> None:
    global _FD
    if _FD is None:
        return
    line = json.dumps({**record, "session": _SESSION}, separators=(",", ":")).encode() + b"\n"
    try:
        view = memoryview(line)
        while view:
            view = view[os.write(_FD, view):]
    except OSError:
        _FD = None  # the reader is gone; the grader sees an unfinished stream


_emit({"event": "start", "pid": os.getpid()})


def pytest_collectreport(report) -> None:
    if not report.passed:
        _emit({"event": "report", "nodeid": report.nodeid, "when": "collect", "outcome": report.outcome})


def pytest_collection_finish(session) -> None:
    _emit({"event": "collected", "count": len(session.items)})


def pytest_runtest_logreport(report) -> None:
    _emit({"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome})


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    if _FD is None or not _EXIT_STATUS:
        return
    status = _EXIT_STATUS[-1]
    _emit({"event": "finish", "exitstatus": status})
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status)
