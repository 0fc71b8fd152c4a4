"""pytest-graded tasks cannot be forged by the code under test, which runs inside the pytest process.

The task is a tiny SWE-bench row built here for real (as in ``test_swebench_integrity.py``): a git
repository whose ``calc.sub`` adds instead of subtracting, two target tests and one existing test,
built into an image of the sandbox store. Each attack below keeps the bug and appends code to
``calc.py`` that reaches pytest under a computed name (no literal ``_pytest`` for the static
``tampers_pytest`` signal to see) and makes every test pass; graded by
:func:`evals.grading.grade_patch` in real bwrap and gVisor sandboxes, each scores 0 with
``results_tampered``. Each is first shown to pass every target on a plain pytest run of the
repository, where the grader's plugin is absent (so a 0 below is the grader's doing); the forged
records, which only matter to the grader's stream, are shown to score 1.0 at 1ec7686 by running
this file there. The honest fix still scores 1.0 with no signal.
"""

from __future__ import annotations

import dis
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from evals import grading
from evals.grading import GRADED, PLUGIN_SOURCE, grade_patch, parse_results_stream
from evals.signals import RESULTS_TAMPERED
from evals.tasks import load_swebench

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
IMAGE = "posttrain-swe-tamper"
BUGGY = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a + b\n"
HONEST = {"calc.py": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"}
BASE_FILES = {
    "calc.py": BUGGY,
    "pyproject.toml": '[project]\nname = "calc"\nversion = "0.1"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
    "tests/test_calc.py": "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                          "def test_sub():\n    assert sub(5, 3) == 2\n",
}
HIDDEN_TEST = "\n\ndef test_sub_negative():\n    assert sub(3, 5) == -2\n"
NODE_IDS = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_sub", "tests/test_calc.py::test_sub_negative"]

# every report made passes: TestReport's constructor, reached as '_py' + 'test.reports'
FORCE_REPORTS = """
import importlib

_reports = importlib.import_module("_py" + "test.reports")
_made = _reports.TestReport.__init__


def _passed(self, *args, **kwargs):
    _made(self, *args, **kwargs)
    self.outcome, self.longrepr = "passed", None


_reports.TestReport.__init__ = _passed
"""

# a module attribute of the runner replaced: every phase is run, then reported as passed
REPLACE_RUNNER = """
import importlib

_runner = importlib.import_module("_py" + "test.runner")
_call_and_report = _runner.call_and_report


def _passing(item, when, log=True, **kwargs):
    report = _call_and_report(item, when, log=False, **kwargs)
    report.outcome, report.longrepr = "passed", None
    if log:
        item.ihook.pytest_runtest_logreport(report=report)
    return report


_runner.call_and_report = _passing
"""

# records written straight to the results pipe: the rest of the plugin's session, every test
# passed, then the process ends before the plugin writes anything of its own
FORGE_RECORDS = f"""
import json as _json
import os as _os
import stat as _stat
import sys as _sys


def _forge():
    plugin = next((m for n, m in list(_sys.modules.items()) if n.startswith("_posttrain_results_")), None)
    session = getattr(plugin, "_SESSION", "forged")
    records = [{{"event": "collected", "session": session, "count": {len(NODE_IDS)}}}]
    for nodeid in {NODE_IDS!r}:
        for when in ("setup", "call", "teardown"):
            records.append({{"event": "report", "session": session, "nodeid": nodeid, "when": when,
                            "outcome": "passed"}})
    records.append({{"event": "finish", "session": session, "exitstatus": 0}})
    data = "".join(_json.dumps(r) + "\\n" for r in records).encode()
    for fd in range(3, 1024):
        try:
            if _stat.S_ISFIFO(_os.fstat(fd).st_mode):
                _os.write(fd, data)
        except OSError:
            pass
    _os._exit(0)


_forge()
"""

# a plugin registered through the plugin manager, found through the importing frames and named
# by a computed attribute: its makereport wrapper makes every report pass
REGISTER_PLUGIN = """
import importlib
import sys

_framework = importlib.import_module("py" + "test")


class _Passing:
    @_framework.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome, report.longrepr = "passed", None


def _register():
    frame = sys._getframe()
    while frame is not None:
        config = getattr(frame.f_locals.get("self"), "config", None)
        if config is not None:
            getattr(config, "plugin" + "manager").register(_Passing())
            return
        frame = frame.f_back


_register()
"""

# patched for one report and restored before anything looks: sub() arms it, the report of the
# test that called it says passed and the CallInfo says nothing raised
ONE_SHOT = """
import importlib

_reports = importlib.import_module("_py" + "test.reports")


def _arm():
    cls = _reports.TestReport
    made = cls.__dict__["from_item_and_call"]

    def once(klass, item, call):
        cls.from_item_and_call = made
        report = made.__func__(klass, item, call)
        report.outcome, report.longrepr = "passed", None
        call.excinfo = None
        return report

    cls.from_item_and_call = classmethod(once)


def sub(a, b):
    _arm()
    return a + b
"""

ATTACKS = [
    pytest.param(FORCE_REPORTS, True, id="reports-forced-passed"),
    pytest.param(REPLACE_RUNNER, True, id="runner-call_and_report-replaced"),
    pytest.param(FORGE_RECORDS, False, id="records-written-to-the-results-fd"),
    pytest.param(REGISTER_PLUGIN, True, id="plugin-registered-through-the-pluginmanager"),
    pytest.param(ONE_SHOT, True, id="report-patched-once-and-restored"),
]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}, check=True).stdout


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)


@pytest.fixture(scope="module")
def swe(tmp_path_factory):
    """(the loaded task, a function that turns {path: text} into the committed patch, the repository)."""
    from sandboxes.images import build_image
    from sandboxes.runtimes import default_store

    root = tmp_path_factory.mktemp("swe-tamper")
    repo = root / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _write(repo, BASE_FILES)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "calc")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "tests/test_calc.py").write_text(BASE_FILES["tests/test_calc.py"] + HIDDEN_TEST)
    test_patch = _git(repo, "diff", "--binary")
    _git(repo, "checkout", "-q", "--", ".")
    build_image(IMAGE, repo, default_store(), toolchains=("posttrain-python",))
    row = {"instance_id": "calc__calc-2", "repo": "calc/calc", "base_commit": base, "image_name": IMAGE,
           "problem_statement": "calc.sub(a, b) adds its arguments; it should subtract b from a.",
           "test_patch": test_patch, "patch": "",
           "FAIL_TO_PASS": json.dumps(NODE_IDS[1:]), "PASS_TO_PASS": json.dumps(NODE_IDS[:1])}
    rows = root / "swe.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    (task,) = load_swebench(rows).tasks

    def patch_of(files: dict[str, str]) -> str:
        _write(repo, files)
        _git(repo, "add", "-A")
        patch = _git(repo, "diff", "--cached", "--binary", "--no-renames", base)
        _git(repo, "reset", "-q", "--hard", base)
        _git(repo, "clean", "-qfdx")
        return patch

    return task, patch_of, repo


RUNTIMES = ["bwrap", pytest.param("gvisor", marks=pytest.mark.skipif(shutil.which("runsc") is None,
                                                                    reason="gVisor's runsc is not installed"))]


@pytest.fixture(params=RUNTIMES)
def factory(request):
    from evals.sandbox import platform_sandbox_factory

    return platform_sandbox_factory(request.param)


def _plain_pytest_passes(repo: Path, files: dict[str, str], tmp_path: Path) -> bool:
    """Whether a plain pytest run (no grader's plugin) of the repository with the hidden test and
    ``files`` passes every test."""
    work = tmp_path / "plain"
    shutil.copytree(repo, work)
    _write(work, {"tests/test_calc.py": BASE_FILES["tests/test_calc.py"] + HIDDEN_TEST, **files})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_calc.py"],
                         cwd=work, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return run.returncode == 0 and "3 passed" in run.stdout


def test_the_honest_fix_scores_one_without_a_signal(swe, factory):
    task, patch_of, _ = swe
    result = grade_patch(task, patch_of(HONEST), factory, infra_retries=1)
    assert result.status == GRADED, result.detail
    assert result.scores.reward == 1.0 and result.scores.f2p_passed == 2 and result.scores.p2p_passed == 1
    assert result.signals == (), result.detail


@pytest.mark.parametrize("attack, shown_plain", ATTACKS)
def test_code_under_test_that_forges_passes_scores_zero(swe, factory, attack, shown_plain, tmp_path):
    task, patch_of, repo = swe
    files = {"calc.py": BUGGY + attack}
    if shown_plain:  # the trick works where pytest runs without the grader's plugin
        assert _plain_pytest_passes(repo, files, tmp_path)
    result = grade_patch(task, patch_of(files), factory, infra_retries=1)
    assert result.status == GRADED, result.detail
    assert result.scores.reward == 0.0 and result.scores.f2p_passed == 0, result.detail
    assert RESULTS_TAMPERED in result.signals and result.detail.startswith(RESULTS_TAMPERED), result.detail
    assert "tampers_pytest" not in result.signals  # no literal for the static signal: the run caught it


# ---------------------------------------------------------------- the signed stream, pure


def _signed(key: bytes, *sessions) -> bytes:
    lines = []
    for records in sessions:
        for n, record in enumerate(records):
            body = json.dumps(record, separators=(",", ":")).encode()
            lines.append(body + b"\t" + grading._record_mac(key, n, body))
        key = hashlib.sha256(grading._RATCHET_PREFIX + key).digest()
    return b"".join(line + b"\n" for line in lines)


def _session(sid: str, outcome: str = "passed", finish: bool = True) -> list[dict]:
    records = [{"event": "start", "session": sid, "pid": 7}, {"event": "collected", "session": sid, "count": 1}]
    records += [{"event": "report", "session": sid, "nodeid": "tests/test_m.py::test_a", "when": w,
                 "outcome": outcome if w == "call" else "passed"} for w in ("setup", "call", "teardown")]
    return records + ([{"event": "finish", "session": sid, "exitstatus": 0}] if finish else [])


def test_a_signed_stream_is_read_and_each_session_has_its_own_key():
    key = os.urandom(32)
    one = parse_results_stream(_signed(key, _session("s1")), max_sessions=1, key=key)
    assert one.tampering == "" and one.finished and one.statuses == {"tests.test_m.test_a": grading.Status.PASSED}
    two = parse_results_stream(_signed(key, _session("s1"), _session("s2", "failed")), key=key)
    assert two.tampering == "" and two.sessions == 2
    assert two.statuses == {"tests.test_m.test_a": grading.Status.FAILED}


@pytest.mark.parametrize("stream, why", [
    (lambda key: _signed(key, _session("s1", finish=False)) + json.dumps(_session("s1")[-1]).encode() + b"\n",
     "record 6 is not signed"),
    (lambda key: _signed(os.urandom(32), _session("s1")), "record 1 is not signed"),
    (lambda key: _signed(key, _session("s1", finish=False))
     + _signed(hashlib.sha256(grading._RATCHET_PREFIX + key).digest(), _session("s1")[-1:]),
     "signed with the wrong session's key"),
    (lambda key: _signed(key, _session("s1", finish=False) + [{"event": "tampered", "session": "s1",
                                                                "reason": "TestReport.__init__ was replaced"}]),
     "pytest's guard caught the code under test: TestReport.__init__ was replaced"),
], ids=["an-unsigned-record", "another-key", "a-record-of-another-session", "the-guards-record"])
def test_records_the_plugin_did_not_sign_are_tampering(stream, why):
    key = os.urandom(32)
    result = parse_results_stream(stream(key), max_sessions=1, key=key)
    assert why in result.tampering and result.statuses == {}


def _plugin_module():
    """The plugin imported here, as pytest would import it with no results pipe: it arms nothing."""
    assert "POSTTRAIN_RESULTS_FD" not in os.environ
    spec = importlib.util.spec_from_file_location("_posttrain_results_imported_by_tests", PLUGIN_SOURCE)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    assert plugin._ACTIVE is False
    return plugin


def test_the_host_and_the_plugin_agree_on_the_keys():
    plugin = _plugin_module()
    assert plugin.KEY_BYTES == grading.RESULTS_KEY_BYTES and plugin.RATCHET_PREFIX == grading._RATCHET_PREFIX


def test_the_guard_looks_up_no_global_or_builtin_name():
    """Everything that runs once the code under test may have run (the audit hook, the generator
    and its helpers) takes its names from closures: the code under test can rebind a module's
    globals and the builtins, not a closure it cannot reach."""
    plugin = _plugin_module()

    def global_loads(code, where):
        found = [f"{where}:{i.argval}" for i in dis.get_instructions(code)
                 if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL")]
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found += global_loads(const, f"{where}/{const.co_name}")
        return found

    late = [c for c in plugin._make_guardian.__code__.co_consts if isinstance(c, types.CodeType)]
    assert {c.co_name for c in late} >= {"guardian", "add_module", "add_class", "functions_in"}
    found = [g for c in late for g in global_loads(c, c.co_name)]
    found += global_loads(plugin._guard.__code__, "_guard") + global_loads(plugin._flush.__code__, "_flush")
    assert found == []


def test_a_real_pytest_run_with_a_key_is_signed_and_guarded(tmp_path):
    """The plugin on a real pytest run on this host, with a pipe and a key file as the grader gives
    them: every record verifies, the guard is on, the key file now holds the next session's key."""
    (tmp_path / "plug").mkdir()
    shutil.copy(PLUGIN_SOURCE, tmp_path / "plug" / "_results_plugin_signed.py")
    key = os.urandom(32)
    (tmp_path / "plug" / "k.key").write_bytes(key)
    _write(tmp_path, {"tests/test_x.py": "def test_ok():\n    pass\n\n\ndef test_bad():\n    assert 0\n"})
    r, w = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "plug"), "PYTEST_ADDOPTS": "-p _results_plugin_signed",
           "POSTTRAIN_RESULTS_FD": str(w), "POSTTRAIN_RESULTS_KEY": str(tmp_path / "plug" / "k.key"),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                            env=env, pass_fds=(w,), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    output = proc.communicate()[0].decode()
    stream = parse_results_stream(data, max_sessions=1, key=key)
    assert stream.tampering == "" and stream.finished, output
    assert stream.statuses == {"tests.test_x.test_ok": grading.Status.PASSED,
                               "tests.test_x.test_bad": grading.Status.FAILED}
    assert b'"guarded":true' in data.splitlines()[0]
    assert (tmp_path / "plug" / "k.key").read_bytes() == hashlib.sha256(grading._RATCHET_PREFIX + key).digest()
