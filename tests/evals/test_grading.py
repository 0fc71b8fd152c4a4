"""The grader on crafted reports (both formats), and on committed work in real working copies."""

import contextlib
import json
from dataclasses import replace

import pytest

from dagster_project.cli import main
from evals.grading import (
    APPLY_FAILED, GRADED, INFRA_ERROR, ReportError, Status, committed_patch, grade_patch, grade_reports,
    merge_statuses, parse_ctrf, parse_junit, score,
)
from evals.bundled import REPORT
from evals.sandbox import InfraError

JUNIT_BASE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
  <testcase classname="tests.test_a" name="test_old_1" time="0.01"/>
  <testcase classname="tests.test_a" name="test_old_2" time="0.01"/>
  <testcase classname="tests.test_a" name="test_flaky" time="0.01"/>
  <testcase classname="tests.test_a" name="test_p[1-2]" time="0.01"/>
</testsuite></testsuites>"""

JUNIT_NEW = """<?xml version="1.0" encoding="utf-8"?>
<testsuite name="pytest" tests="5">
  <testcase classname="tests.test_a" name="test_old_1"/>
  <testcase classname="tests.test_a" name="test_flaky"><failure message="boom">trace</failure></testcase>
  <testcase classname="tests.test_b" name="test_new_1"/>
  <testcase classname="tests.test_b" name="test_new_2"><skipped message="later"/></testcase>
  <testcase classname="tests.test_b" name="test_new_3"><error message="setup"/></testcase>
</testsuite>"""


def _config(tmp_path, f2p, p2p, fmt="junit", node_id=None):
    grade = {"format": fmt, "reports": []}
    if node_id:
        grade["node_id"] = node_id
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"base_commit": "abc", "f2p_node_ids": f2p, "p2p_node_ids": p2p, "grade": grade}))
    return path


def test_junit_statuses_and_worst_across_reports(tmp_path):
    (tmp_path / "base.xml").write_text(JUNIT_BASE)
    (tmp_path / "new.xml").write_text(JUNIT_NEW)
    base, new = parse_junit(tmp_path / "base.xml"), parse_junit(tmp_path / "new.xml")
    assert base["tests.test_a.test_p[1-2]"] is Status.PASSED
    assert new["tests.test_b.test_new_2"] is Status.SKIPPED
    assert new["tests.test_b.test_new_3"] is Status.FAILED
    merged = merge_statuses([base, new])
    assert merged["tests.test_a.test_flaky"] is Status.FAILED  # passed in one, failed in the other
    assert merged["tests.test_a.test_old_2"] is Status.PASSED


def test_grade_junit_pins_every_field(tmp_path, capsys):
    (tmp_path / "base.xml").write_text(JUNIT_BASE)
    (tmp_path / "new.xml").write_text(JUNIT_NEW)
    config = _config(
        tmp_path,
        f2p=["tests.test_b.test_new_1", "tests.test_b.test_new_2", "tests.test_b.test_new_3", "tests.test_b.test_gone"],
        p2p=["tests.test_a.test_old_1", "tests.test_a.test_old_2", "tests.test_a.test_flaky", "tests.test_a.test_p[1-2]"],
    )
    code = main(["grade", "--config", str(config), "--report", str(tmp_path / "base.xml"),
                 "--report", str(tmp_path / "new.xml"), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    # targets: new_1 passed; new_2 skipped, new_3 errored, test_gone missing -> 1 of 4
    # existing: old_1, old_2, p[1-2] passed; flaky failed in new.xml -> 3 of 4
    assert out == {
        "reward": 0.0, "f2p": 0.25, "p2p": 0.75, "partial": 4 / 8, "target_score": 0.25,
        "strict_target_score": 0.0, "f2p_total": 4, "f2p_passed": 1, "p2p_total": 4, "p2p_passed": 3,
    }


def test_grade_ctrf_suite_name_and_reward_one(tmp_path):
    report = {"results": {"tool": {"name": "gotest"}, "tests": [
        {"name": "TestNew", "suite": "example.com/m/pkg", "status": "passed", "duration": 1},
        {"name": "TestOld", "suite": "example.com/m/pkg", "status": "passed", "duration": 1},
        {"name": "TestOld", "suite": "example.com/m/other", "status": "pending", "duration": 0},
    ]}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    statuses = parse_ctrf(tmp_path / "r.json", "suite.name")
    assert statuses == {"example.com/m/pkg.TestNew": Status.PASSED, "example.com/m/pkg.TestOld": Status.PASSED,
                        "example.com/m/other.TestOld": Status.SKIPPED}
    config = _config(tmp_path, ["example.com/m/pkg.TestNew"], ["example.com/m/pkg.TestOld"], "ctrf", "suite.name")
    s = grade_reports(config, [tmp_path / "r.json"])
    assert (s.reward, s.f2p, s.p2p, s.partial, s.strict_target_score) == (1.0, 1.0, 1.0, 1.0, 1.0)
    # the pending one is an existing test too: skipped counts as failed
    config = _config(tmp_path, ["example.com/m/pkg.TestNew"],
                     ["example.com/m/pkg.TestOld", "example.com/m/other.TestOld"], "ctrf", "suite.name")
    s = grade_reports(config, [tmp_path / "r.json"])
    assert (s.reward, s.f2p, s.p2p, s.strict_target_score, s.target_score) == (0.0, 1.0, 0.5, 0.0, 1.0)


def test_ctrf_name_ids_and_worst_status_in_two_reports(tmp_path):
    first = {"results": {"tests": [{"name": "a > works", "status": "passed"}, {"name": "b", "status": "failed"}]}}
    second = {"results": {"tests": [{"name": "a > works", "status": "skipped"}, {"name": "b", "status": "passed"}]}}
    (tmp_path / "1.json").write_text(json.dumps(first))
    (tmp_path / "2.json").write_text(json.dumps(second))
    config = _config(tmp_path, ["a > works"], ["b"], "ctrf")
    s = grade_reports(config, [tmp_path / "1.json", tmp_path / "2.json"])
    assert (s.f2p_passed, s.p2p_passed, s.reward, s.partial) == (0, 0, 0.0, 0.0)


def test_score_edge_cases():
    none = score([], [], {})
    assert (none.reward, none.f2p, none.p2p, none.partial) == (0.0, 0.0, 1.0, 0.0)
    no_existing = score(["t"], [], {"t": Status.PASSED})
    assert (no_existing.reward, no_existing.p2p, no_existing.partial) == (1.0, 1.0, 1.0)
    dup = score(["t", "t"], ["e"], {"t": Status.PASSED, "e": Status.PASSED})
    assert dup.f2p_total == 1  # a test id listed twice is one test


def test_bad_reports_name_the_file(tmp_path):
    (tmp_path / "bad.xml").write_text("<testsuite><testcase")
    with pytest.raises(ReportError, match="bad.xml: not a readable JUnit XML report"):
        parse_junit(tmp_path / "bad.xml")
    (tmp_path / "bad.json").write_text(json.dumps({"results": {}}))
    with pytest.raises(ReportError, match=r"bad.json: missing key 'results.tests'"):
        parse_ctrf(tmp_path / "bad.json")


# ---------------------------------------------------------------- malformed reports, as DeepSWE v1.1's verifier reads them


def test_whitespace_around_test_names_and_whitelist_ids_is_stripped(tmp_path):
    (tmp_path / "r.xml").write_text('<testsuite><testcase classname=" tests.test_a " name=" test_x\n"/>'
                                    '<testcase classname="tests.test_a" name="test_y "><failure/></testcase></testsuite>')
    assert parse_junit(tmp_path / "r.xml") == {"tests.test_a.test_x": Status.PASSED, "tests.test_a.test_y": Status.FAILED}
    (tmp_path / "r.json").write_text(json.dumps({"results": {"tests": [
        {"name": "  TestA ", "suite": " pkg ", "status": " Passed "}]}}))
    assert parse_ctrf(tmp_path / "r.json", "suite.name") == {"pkg.TestA": Status.PASSED}
    config = _config(tmp_path, [" tests.test_a.test_x ", "tests.test_a.test_x", "  "], ["tests.test_a.test_y\t"])
    s = grade_reports(config, [tmp_path / "r.xml"])
    assert (s.f2p_total, s.f2p_passed, s.p2p_total, s.p2p_passed, s.reward) == (1, 1, 1, 0, 0.0)


def test_a_namespaced_junit_failure_counts_as_failed(tmp_path):
    (tmp_path / "r.xml").write_text('<testsuite xmlns:x="urn:x"><testcase classname="c" name="a"><x:failure/></testcase>'
                                    '<testcase classname="c" name="b"><x:error/></testcase>'
                                    '<testcase classname="c" name="s"><x:skipped/></testcase></testsuite>')
    assert parse_junit(tmp_path / "r.xml") == {"c.a": Status.FAILED, "c.b": Status.FAILED, "c.s": Status.SKIPPED}


def test_the_first_name_of_a_ctrf_suite_given_as_a_list_names_it(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"results": {"tests": [
        {"name": "TestA", "suite": ["pkg/one", "inner"], "status": "passed"},
        {"name": "TestB", "suite": [], "status": "passed"}]}}))
    assert parse_ctrf(tmp_path / "r.json", "suite.name") == {"pkg/one.TestA": Status.PASSED, "TestB": Status.PASSED}


def test_tests_of_a_missing_or_malformed_report_count_as_failed(tmp_path, capsys):
    (tmp_path / "base.xml").write_text(JUNIT_BASE)
    (tmp_path / "new.xml").write_text("<testsuite><testcase")  # cut off mid-write
    config = _config(tmp_path, ["tests.test_b.test_new_1"], ["tests.test_a.test_old_1", "tests.test_a.test_old_2"])
    notes: list[str] = []
    s = grade_reports(config, [tmp_path / "base.xml", tmp_path / "new.xml", tmp_path / "gone.xml"], notes)
    assert (s.reward, s.f2p_passed, s.p2p_passed, s.partial) == (0.0, 0, 2, 2 / 3)
    assert len(notes) == 2 and "new.xml" in notes[0] and "gone.xml" in notes[1]
    assert main(["grade", "--config", str(config), "--report", str(tmp_path / "gone.xml"), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["f2p_passed"] == 0 and "gone.xml" in out.err and "count as failed" in out.err


def test_a_junit_root_that_is_not_testsuites_is_read(tmp_path):
    (tmp_path / "r.xml").write_text('<report><run><testcase classname="c" name="a"/>'
                                    '<testcase classname="c" name="b"><failure/></testcase></run></report>')
    assert parse_junit(tmp_path / "r.xml") == {"c.a": Status.PASSED, "c.b": Status.FAILED}


def test_an_unknown_ctrf_status_fails_the_test(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"results": {"tests": [
        {"name": "a", "status": "weird"}, {"name": "b"}, {"name": "c", "status": 1}, {"name": "d", "status": "other"},
        {"name": "e", "status": "PASSED"}]}}))
    assert parse_ctrf(tmp_path / "r.json") == {"a": Status.FAILED, "b": Status.FAILED, "c": Status.FAILED,
                                               "d": Status.SKIPPED, "e": Status.PASSED}


def test_a_ctrf_test_with_no_name_is_ignored(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"results": {"tests": [
        {"status": "failed"}, {"name": "", "status": "failed"}, {"name": "   ", "status": "failed"}, "junk", 3,
        {"name": "a", "status": "passed"}]}}))
    assert parse_ctrf(tmp_path / "r.json") == {"a": Status.PASSED}
    (tmp_path / "r.xml").write_text('<testsuite><testcase classname="c"><failure/></testcase><testcase classname="c" name="a"/></testsuite>')
    assert parse_junit(tmp_path / "r.xml") == {"c.a": Status.PASSED}


# ---------------------------------------------------------------- committed work, real working copies


def _workdir(task, factory):
    return factory(task)


def test_only_committed_work_is_graded(small_tasks):
    from evals.actions import apply_edits
    from evals.bundled import default_sandbox_factory

    factory = default_sandbox_factory()
    task = small_tasks[0]
    module = task.metadata["module_file"]
    edits = [(line, text) for _, line, text in task.metadata["reference_edits"]]
    with factory(task) as box:
        box.write_file(module, apply_edits(box.read_file(module).decode(), edits).encode())
        uncommitted = committed_patch(box, task.base_commit)  # the fix is in the work tree only
        assert box.exec("git add -A && git commit -qm fix").exit_code == 0
        committed = committed_patch(box, task.base_commit)
    assert uncommitted == ""
    not_done = grade_patch(task, uncommitted, factory)
    assert not_done.status == GRADED and not_done.scores.reward == 0.0
    assert not_done.scores.f2p_passed == 0 and not_done.scores.p2p == 1.0
    done = grade_patch(task, committed, factory)
    assert done.status == GRADED and done.scores.reward == 1.0 and done.scores.partial == 1.0


def test_editing_the_tests_does_not_pass(small_tasks):
    from evals.bundled import default_sandbox_factory

    factory = default_sandbox_factory()
    task = small_tasks[0]
    with factory(task) as box:
        box.write_file(task.metadata["test_file"], b"def test_nothing():\n    pass\n")
        box.exec("git add -A && git commit -qm cheat")
        patch = committed_patch(box, task.base_commit)
    result = grade_patch(task, patch, factory)
    assert result.status == GRADED and result.scores.reward == 0.0


def test_a_conftest_that_forces_passes_is_not_graded(small_tasks):
    from evals.sandbox import platform_sandbox_factory

    # under pytest, which loads conftest files (the bundled suite's own runner loads none): the
    # sandboxes declare the host toolchain that has it, as a SWE-bench image does
    factory = platform_sandbox_factory("bwrap", toolchains=("posttrain-python",))
    task = replace(small_tasks[0], test_command=f"python3 -m pytest -q -p no:cacheprovider --junitxml={REPORT} tests")
    cheat = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
             "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    with factory(task) as box:
        box.write_file("conftest.py", cheat.encode())
        box.write_file("tests/conftest.py", cheat.encode())
        box.exec("git add -A && git commit -qm cheat")
        patch = committed_patch(box, task.base_commit)
        # the cheat does work when it is not filtered out
        assert box.exec(task.test_command).exit_code == 0
    assert "conftest.py" in patch
    result = grade_patch(task, patch, factory)
    assert result.status == GRADED and result.scores.reward == 0.0 and result.scores.f2p_passed == 0


def test_patch_that_does_not_apply_scores_zero(small_tasks):
    from evals.bundled import default_sandbox_factory

    task = small_tasks[0]
    m = task.metadata["module_file"]
    bogus = f"diff --git a/{m} b/{m}\n--- a/{m}\n+++ b/{m}\n@@ -1 +1 @@\n-not this line\n+b\n"
    result = grade_patch(task, bogus, default_sandbox_factory())
    assert result.status == APPLY_FAILED
    s = result.scores
    assert (s.reward, s.f2p, s.p2p, s.partial, s.f2p_passed, s.p2p_passed) == (0.0, 0.0, 0.0, 0.0, 0, 0)


def test_infra_failure_is_retried_then_recorded_not_scored(small_tasks):
    from evals.bundled import default_sandbox_factory

    task = small_tasks[0]
    real = default_sandbox_factory()
    opened = []

    @contextlib.contextmanager
    def dies_twice(t):
        # stands in for a sandbox runtime whose sandbox dies; the third one is real
        opened.append(t.id)
        if len(opened) <= 2:
            raise InfraError("sandbox died")
        with real(t) as box:
            yield box

    result = grade_patch(task, "", dies_twice, infra_retries=2)
    assert result.status == GRADED and result.infra_retries == 2 and result.scores.reward == 0.0
    opened.clear()

    @contextlib.contextmanager
    def always_dies(t):
        raise InfraError("sandbox died")
        yield

    result = grade_patch(task, "", always_dies, infra_retries=1)
    assert result.status == INFRA_ERROR and result.scores is None and "sandbox died" in result.detail


def test_tests_that_hang_count_as_failed_not_infra(small_tasks):
    import dataclasses

    from evals.bundled import default_sandbox_factory
    from evals.tasks import ResourceLimits

    factory = default_sandbox_factory()
    task = dataclasses.replace(small_tasks[0], limits=ResourceLimits(test_timeout_s=3.0))
    module = task.metadata["module_file"]
    with factory(task) as box:
        source = box.read_file(module).decode()
        box.write_file(module, (source + "\nwhile True:\n    pass\n").encode())  # importing it never returns
        box.exec("git add -A && git commit -qm loop")
        patch = committed_patch(box, task.base_commit)
    result = grade_patch(task, patch, factory)
    assert result.status == GRADED and "timed out" in result.detail
    assert result.scores.reward == 0.0 and result.scores.f2p_passed == 0 and result.scores.p2p_passed == 0


# ---------------------------------------------------------------- the config's ids, through the real CLI


@pytest.mark.parametrize("key, value, expected", [
    ("p2p_node_ids", "t.b", "key 'p2p_node_ids' is \"t.b\", expected a list of test ids (strings)"),
    ("f2p_node_ids", ["t.a", 3], "key 'f2p_node_ids' is [\"t.a\", 3], expected a list of test ids (strings)"),
    ("f2p_node_ids", {"t.a": True}, "key 'f2p_node_ids' is {\"t.a\": true}, expected a list of test ids"),
], ids=["string-for-list", "number-in-list", "object-for-list"])
def test_grade_refuses_test_ids_that_are_not_a_list_of_strings(tmp_path, key, value, expected):
    """``"p2p_node_ids": "t.b"`` was graded as the three tests ``t``, ``.`` and ``b`` (and
    ``posttrain grade`` exited 0 with p2p_total 3): the ids of a config are checked as they are read,
    and the real command, run as the researcher runs it, exits 2 naming the file and the key."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # the tree this test belongs to: its code is the one run
    (tmp_path / "r.xml").write_text('<testsuite><testcase classname="t" name="a"/>'
                                    '<testcase classname="t" name="b"/></testsuite>')
    config = {"f2p_node_ids": ["t.a"], "p2p_node_ids": ["t.b"], "grade": {"format": "junit", "reports": []}}
    config[key] = value
    path = tmp_path / "task-config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([str(Path(sys.executable).parent / "posttrain"), "grade", "--config", str(path),
                           "--report", str(tmp_path / "r.xml"), "--json"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == "" and f"posttrain grade: {path}: {expected}" in done.stderr


def test_grade_refuses_a_node_id_rule_or_report_list_it_cannot_use(tmp_path):
    """A ``grade.node_id`` no parser knows made every report a warning and its tests failed, exit 0:
    it is the config that is wrong, so it is refused as the ids are."""
    (tmp_path / "r.json").write_text(json.dumps({"results": {"tests": [{"name": "a", "status": "passed"}]}}))
    config = _config(tmp_path, ["a"], [], "ctrf", "suite")
    with pytest.raises(ReportError, match=r"config.json: key 'grade.node_id' is \"suite\", expected 'name' or 'suite.name'"):
        grade_reports(config, [tmp_path / "r.json"])
    config.write_text(json.dumps({"f2p_node_ids": ["a"], "p2p_node_ids": [], "grade": {"format": "ctrf", "reports": "r.json"}}))
    with pytest.raises(ReportError, match=r"config.json: key 'grade.reports' is \"r.json\", expected a list of report paths"):
        grade_reports(config, [tmp_path / "r.json"])
    assert grade_reports(_config(tmp_path, ["a"], [], "ctrf"), [tmp_path / "r.json"]).reward == 1.0


def test_a_single_string_is_not_a_list_of_test_ids():
    """Whatever the caller, ``score`` never reads ``"t.b"`` as the tests ``t``, ``.`` and ``b``."""
    with pytest.raises(TypeError, match="test ids: expected a list of strings, got the str 't.b'"):
        score(["t.a"], "t.b", {"t.a": Status.PASSED})
