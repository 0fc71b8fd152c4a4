"""posttrain's quick test runner (evals/quicktest.py) reads as pytest does, to the harness and the grader.

Each comparison runs the real pytest of this environment on the same files: exit status, the
``test`` action's observation, and the JUnit statuses must be the same. The results stream is parsed
by the grader's own parser.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evals.actions import apply_edits, failing_summary
from evals.bundled import REPORT, RUNNER_PATH, RUNNER_SOURCE, TEST_COMMAND, generate
from evals.grading import parse_junit_bytes, parse_results_stream, pytest_sessions
from evals.harness import error_lines

PYTEST = f"python3 -m pytest -q -p no:cacheprovider --tb=short --junitxml={REPORT} tests"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "POSTTRAIN_RESULTS"))}
    env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONDONTWRITEBYTECODE="1",
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    return env


def _run(command: str, repo: Path, **kwargs) -> tuple[int, str, dict[str, str]]:
    (repo / REPORT).unlink(missing_ok=True)
    proc = subprocess.run(command, shell=True, cwd=repo, env=_env(), capture_output=True, text=True, timeout=60, **kwargs)
    report = repo / REPORT
    statuses = ({k: v.name for k, v in parse_junit_bytes(report.read_bytes(), str(report)).items()}
                if report.exists() else {})
    return proc.returncode, proc.stdout + proc.stderr, statuses


def _observation(code: int, output: str) -> str:
    """What the harness's ``test`` action shows the agent (evals.harness.execute)."""
    if code == 0:
        return "all tests pass"
    return (failing_summary(output) or error_lines(output) or output[-400:]).replace("AssertionError: ", "")


def _repo(tmp_path: Path, module: str, tests: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True, exist_ok=True)
    (repo / "mod.py").write_text(module)
    (repo / "tests" / "test_mod.py").write_text(tests)
    (repo / RUNNER_PATH).write_text(RUNNER_SOURCE.read_text())
    return repo


TESTS = """from mod import f, g, h, k


def test_f():
    assert f(2) == 3


def test_g():
    assert g(list(range(12))) == [8, 9, 10, 11]


def test_h():
    assert h(3) == 'a-3'


def test_k():
    assert k(2) == 4
    assert k(3) == 7


def test_passes():
    assert k(0) == 0
"""
MODULE = """def f(x):
    return x + 'a'


def g(items):
    return items[4:]


def h(n):
    return 'a_' + str(n)


def k(x):
    return x * 2
"""


@pytest.mark.parametrize("module", [
    pytest.param(MODULE, id="asserts-and-an-exception"),
    pytest.param(MODULE + "\ndef broken(:\n", id="syntax-error"),
    pytest.param(MODULE + "\nundefined_name\n", id="name-error-at-import"),
    pytest.param(MODULE.replace("def g(", "def renamed("), id="import-error"),
    pytest.param("def f(x):\n    return 3\n\n\ndef g(items):\n    return items[-4:]\n\n\n"
                 "def h(n):\n    return 'a-' + str(n)\n\n\ndef k(x):\n    return 7 if x == 3 else x * 2\n", id="all-pass"),
])
def test_the_quick_runner_reads_as_pytest_does(tmp_path, module):
    repo = _repo(tmp_path, module, TESTS)
    p_code, p_out, p_statuses = _run(PYTEST, repo)
    q_code, q_out, q_statuses = _run(TEST_COMMAND, repo)
    assert q_code == p_code, q_out
    assert _observation(q_code, q_out) == _observation(p_code, p_out), (p_out, q_out)
    assert q_statuses == p_statuses


def test_the_bundled_suites_tests_read_the_same_under_both(tmp_path):
    gens = generate()[::45]  # 9 tasks over the three levels and their bug kinds
    assert {g.difficulty for g in gens} == {1, 2, 3}
    for gen in gens:
        repo = tmp_path / gen.id
        for rel, text in gen.files.items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        module = gen.files[f"{gen.module}.py"]
        fixed = apply_edits(module, [(line, text) for _, line, text in gen.reference_edits])
        for state in (module, fixed):
            (repo / f"{gen.module}.py").write_text(state)
            p_code, p_out, p_statuses = _run(PYTEST, repo)
            q_code, q_out, q_statuses = _run(TEST_COMMAND, repo)
            assert (q_code, _observation(q_code, q_out), q_statuses) == (p_code, _observation(p_code, p_out), p_statuses), gen.id
        assert q_code == 0  # the reference fix passes


def _streamed(repo: Path, command: str = TEST_COMMAND) -> tuple[subprocess.CompletedProcess, bytes]:
    read, write = os.pipe()
    env = {**_env(), "POSTTRAIN_RESULTS_FD": str(write)}
    try:
        proc = subprocess.Popen(command, shell=True, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(write,))
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    out = proc.communicate(timeout=60)[0]
    return subprocess.CompletedProcess(command, proc.returncode, out.decode()), data


def test_the_results_stream_follows_the_graders_protocol(tmp_path):
    repo = _repo(tmp_path, MODULE, TESTS)
    (repo / "tests" / "test_env.py").write_text(
        "import os\n\n\ndef test_the_stream_is_out_of_reach():\n"
        "    assert 'POSTTRAIN_RESULTS_FD' not in os.environ\n")
    proc, data = _streamed(repo)
    stream = parse_results_stream(data, max_sessions=pytest_sessions(TEST_COMMAND))
    assert stream.tampering == "" and stream.finished and stream.sessions == 1
    assert stream.exit_statuses == (1,) == (proc.returncode,)
    statuses = {k: v.name for k, v in stream.statuses.items()}
    assert statuses == {k: v.name for k, v in parse_junit_bytes((repo / REPORT).read_bytes(), REPORT).items()}
    assert statuses["tests.test_env.test_the_stream_is_out_of_reach"] == "PASSED"
    assert statuses["tests.test_mod.test_passes"] == "PASSED" and statuses["tests.test_mod.test_k"] == "FAILED"


def test_a_collection_error_is_streamed_and_nothing_runs(tmp_path):
    repo = _repo(tmp_path, MODULE + "\nundefined_name\n", TESTS)
    proc, data = _streamed(repo)
    stream = parse_results_stream(data, max_sessions=1)
    assert proc.returncode == 2 and stream.tampering == "" and stream.finished
    assert {k: v.name for k, v in stream.statuses.items()} == {"tests.test_mod": "FAILED"}


def test_code_under_test_gets_no_atexit_after_the_results(tmp_path):
    marker = tmp_path / "atexit-ran"
    repo = _repo(tmp_path, MODULE + f"\nimport atexit\natexit.register(lambda: open({str(marker)!r}, 'w').close())\n", TESTS)
    proc, data = _streamed(repo)
    assert parse_results_stream(data, max_sessions=1).finished and proc.returncode == 1
    assert not marker.exists()


def test_a_test_that_ends_the_process_has_no_call_and_fails(tmp_path):
    repo = _repo(tmp_path, MODULE, "import os\n\n\ndef test_a():\n    assert True\n\n\n"
                                   "def test_exits():\n    os._exit(0)\n\n\ndef test_after():\n    assert True\n")
    proc, data = _streamed(repo)
    stream = parse_results_stream(data, max_sessions=1)
    assert proc.returncode == 0 and stream.tampering == "" and not stream.finished
    assert {k: v.name for k, v in stream.statuses.items()} == {"tests.test_mod.test_a": "PASSED",
                                                              "tests.test_mod.test_exits": "FAILED"}


def test_a_test_wanting_fixtures_fails_its_setup(tmp_path):
    repo = _repo(tmp_path, MODULE, "def test_wants(tmp_path):\n    assert tmp_path\n")
    proc, data = _streamed(repo)
    stream = parse_results_stream(data, max_sessions=1)
    assert proc.returncode == 1 and stream.finished
    assert {k: v.name for k, v in stream.statuses.items()} == {"tests.test_mod.test_wants": "FAILED"}
    assert "fixtures are not supported" in proc.stdout


def test_an_unknown_option_is_a_usage_error(tmp_path):
    repo = _repo(tmp_path, MODULE, TESTS)
    code, out, _ = _run(f"python3 -S {RUNNER_PATH} --maxfail=1 tests", repo)
    assert code == 4 and "unrecognized arguments: --maxfail=1" in out


def test_the_bundled_test_command_counts_as_one_pytest_session():
    assert pytest_sessions(TEST_COMMAND) == 1
    assert pytest_sessions(f"{TEST_COMMAND}; {TEST_COMMAND}") is None
