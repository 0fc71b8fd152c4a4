import json
import statistics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagster_project.cli import main
from evals.tasks import TaskLoadError, load_harbor, load_harbor_task, load_swebench, load_tasks, summarize

from .conftest import DEEPSWE

needs_deepswe = pytest.mark.skipif(not DEEPSWE.is_dir(), reason="the shared DeepSWE copy is not on this machine")


@needs_deepswe
def test_deepswe_loads_111_complete_and_reports_2_incomplete():
    task_set = load_harbor(DEEPSWE)
    assert len(task_set.tasks) == 111
    assert sorted(t.id for t in task_set.incomplete) == ["expr-try-catch-errors", "meriyah-explicit-resource-declarations"]
    assert all("tests/config.json" in t.reason for t in task_set.incomplete)
    # medians recomputed straight from the raw files
    configs = [json.loads(p.read_text()) for p in sorted(DEEPSWE.glob("tasks/*/tests/config.json"))]
    summary = summarize(task_set)
    assert summary["median_target_tests"] == statistics.median(len(c["f2p_node_ids"]) for c in configs) == 43
    assert summary["median_existing_tests"] == statistics.median(len(c["p2p_node_ids"]) for c in configs) == 162
    assert summary["by_language"] == {"go": 33, "javascript": 5, "python": 34, "rust": 5, "typescript": 34}
    task = task_set.by_id()["adaptix-name-mapping-aliases"]
    assert task.report_format == "junit" and task.image and task.base_commit
    go = task_set.by_id()["abs-module-cache-flags"]
    assert go.report_format == "ctrf" and go.ctrf_node_id == "suite.name"


@needs_deepswe
def test_deepswe_metadata_copy_with_sources_reports_every_task_unbuildable_with_the_reason(tmp_path):
    """The shared copy keeps only data files: given a sources folder, no task can be built, and each
    says why (no recipe; the two without config.json say that first)."""
    task_set = load_harbor(DEEPSWE, sources=tmp_path)
    assert not task_set.tasks and len(task_set.incomplete) == 113
    reasons = {t.id: t.reason for t in task_set.incomplete}
    assert sum(r.startswith("cannot be built: ") and "no environment/Dockerfile" in r for r in reasons.values()) == 111
    assert "tests/config.json" in reasons["expr-try-catch-errors"]
    task = load_harbor(DEEPSWE).by_id()["tomlkit-toml-table-converters"]
    assert task.metadata["test_files"] == ["config.json"] and task.metadata["environment"] == ""
    assert task.metadata["docker_image"].startswith("public.ecr.aws/")


@needs_deepswe
def test_tasks_inspect_json_keys(capsys):
    assert main(["tasks", "inspect", str(DEEPSWE), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["tasks", "incomplete", "by_language", "median_target_tests", "median_existing_tests", "ids"]
    assert out["tasks"] == 111 == len(out["ids"])
    assert len(out["incomplete"]) == 2


def _harbor_task(root, name, config=None, language="python"):
    d = root / "tasks" / name
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text(
        f'[metadata]\ntask_id = "{name}"\nlanguage = "{language}"\n[environment]\ndocker_image = "img:{name}"\n'
    )
    (d / "instruction.md").write_text(f"do {name}")
    if config is not None:
        (d / "tests" / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def test_harbor_incomplete_and_malformed(tmp_path):
    good = {"base_commit": "abc", "f2p_node_ids": ["t1", "t2"], "p2p_node_ids": ["t3"],
            "grade": {"format": "junit", "reports": ["/logs/a.xml"]}}
    _harbor_task(tmp_path, "good", good)
    _harbor_task(tmp_path, "partial", None, language="go")
    task_set = load_harbor(tmp_path)
    assert [t.id for t in task_set.tasks] == ["good"]
    assert task_set.incomplete[0].id == "partial" and task_set.incomplete[0].language == "go"
    assert task_set.tasks[0].target_tests == ("t1", "t2")

    # a malformed task is reported incomplete with the reason; the others still load
    bad = _harbor_task(tmp_path, "broken", {"f2p_node_ids": ["x"], "grade": {"format": "junit"}})
    with pytest.raises(TaskLoadError, match=r"broken/tests/config.json: missing key 'p2p_node_ids'"):
        load_harbor_task(bad)
    task_set = load_harbor(tmp_path)
    assert [t.id for t in task_set.tasks] == ["good"]
    reasons = {t.id: t.reason for t in task_set.incomplete}
    assert "broken/tests/config.json: missing key 'p2p_node_ids'" in reasons["broken"]
    (bad / "tests" / "config.json").write_text("{not json")
    reasons = {t.id: t.reason for t in load_harbor(tmp_path).incomplete}
    assert "broken/tests/config.json: not valid JSON" in reasons["broken"]


def _swe_rows():
    return [
        {"instance_id": "owner__repo-1", "repo": "owner/repo", "base_commit": "c0ffee", "problem_statement": "fix it",
         "FAIL_TO_PASS": json.dumps(["tests/test_a.py::test_x"]),
         "PASS_TO_PASS": json.dumps(["tests/test_a.py::test_y", "tests/test_b.py::test_z"])},
        {"instance_id": "owner__repo-2", "repo": "owner/repo", "base_commit": "beef", "problem_statement": "again",
         "FAIL_TO_PASS": json.dumps(["t1", "t2", "t3"]), "PASS_TO_PASS": "[]"},
    ]


def test_swebench_jsonl_and_parquet(tmp_path):
    jsonl = tmp_path / "swe.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in _swe_rows()) + "\n")
    parquet = tmp_path / "swe.parquet"
    pq.write_table(pa.Table.from_pylist(_swe_rows()), parquet)
    array = tmp_path / "swe.json"
    array.write_text(json.dumps(_swe_rows()))
    for path in (jsonl, parquet, array):
        task_set = load_tasks(path)
        assert [t.id for t in task_set.tasks] == ["owner__repo-1", "owner__repo-2"]
        first = task_set.tasks[0]
        # pytest node ids become the JUnit ids the grader reads
        assert first.target_tests == ("tests.test_a.test_x",)
        assert first.existing_tests == ("tests.test_a.test_y", "tests.test_b.test_z")
        assert first.image == "swebench/sweb.eval.x86_64.owner_1776_repo-1:latest"
        assert summarize(task_set)["median_target_tests"] == 2.0


def test_swebench_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    row = _swe_rows()[0] | {"FAIL_TO_PASS": "[not json"}
    path.write_text(json.dumps(_swe_rows()[1]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskLoadError, match=r"bad.jsonl: line 2: key 'FAIL_TO_PASS' is not a JSON list string"):
        load_swebench(path)
    path.write_text(json.dumps({"instance_id": "x", "base_commit": "y"}) + "\n")
    with pytest.raises(TaskLoadError, match=r"line 1: missing key 'problem_statement'"):
        load_swebench(path)


def test_inspect_bad_path_exits_2(capsys, tmp_path):
    assert main(["tasks", "inspect", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("key, value", [
    ("module_file", "/tmp/anywhere.py"), ("module_file", "../up.py"), ("module_file", "pkg/m.py"),
    ("test_file", "../../outside.py"), ("test_file", "/etc/passwd"), ("reference_edits", [["m.py", "2", "x"]]),
])
def test_bundled_metadata_paths_outside_the_task_are_refused_naming_the_key(small_suite, tmp_path, key, value):
    """A bundled task's metadata is data: the files it names must be inside the task's repository, or
    the loader refuses the task naming the file and key (nothing of it is written or run on the host)."""
    import json
    import shutil

    from evals.tasks import TaskLoadError, load_bundled

    suite = tmp_path / "suite"
    shutil.copytree(small_suite, suite)
    first = json.loads((suite / "suite.json").read_text())["tasks"][0]
    path = suite / "tasks" / first / "task.json"
    data = json.loads(path.read_text())
    data["metadata"][key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(TaskLoadError, match=f"{path}: key 'metadata.{key}'"):
        load_bundled(suite)
