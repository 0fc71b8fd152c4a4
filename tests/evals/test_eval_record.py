"""An eval never corrupts the record it adds to (issue 52): ``posttrain eval --model`` refuses a Harbor
dataset it cannot evaluate as asked before any Dagster run (exit 2, naming the task and its file, the
builder's message whole), so a registered model's ``eval.json`` and its checkpoint's rows stay as
they were; the direct path's closing list keeps a build error whole; ``posttrain tasks sources``
calls no task "ready" that its build refuses and counts a repository several tasks share once.

Real Harbor tasks this project owns (the bundled suite exported as Harbor tasks), real image builds
in bwrap, a real Dagster instance on disk. The model folder is a bare ``config.json``: every case
here is refused before a model would be served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dagster_project.cli import main
from evals.harbor import export_harbor
from evals.tasks import load_bundled

LONG_ERROR = "START-OF-WHY " + "x" * 900 + " END-OF-WHY"  # longer than any cut the old code made


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Three bundled tasks (one per level) built for real, exported as a Harbor dataset."""
    from evals.bundled import build_suite

    root = tmp_path_factory.mktemp("eval-record")
    build_suite(root / "suite", per_level=1, rl_per_level=0, extra_eval_per_level=0, workers=2)
    export_harbor(list(load_bundled(root / "suite").tasks), root / "dataset")
    return root / "dataset"


@pytest.fixture
def dataset(exported, tmp_path):
    shutil.copytree(exported, tmp_path / "dataset")
    return tmp_path / "dataset"


@pytest.fixture
def home(posttrain_home, monkeypatch):
    monkeypatch.delenv("DAGSTER_HOME")  # posttrain sets it: $POSTTRAIN_HOME/dagster
    return posttrain_home


def _ids(dataset: Path) -> list[str]:
    return sorted(p.name for p in (dataset / "tasks").iterdir())


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _earlier_settings(home: Path) -> tuple[Path, str]:
    """``runs/tiny/eval.json`` as an earlier eval of the model ``tiny`` left it."""
    path = home / "runs" / "tiny" / "eval.json"
    path.parent.mkdir(parents=True)
    text = json.dumps({"eval": {"dataset": "bundled", "attempts": 4}}, indent=1) + "\n"
    path.write_text(text)
    return path, text


def _dagster_runs(home: Path) -> int:
    import dagster as dg

    if not (home / "dagster").is_dir():
        return 0
    with dg.DagsterInstance.from_config(str(home / "dagster")) as instance:
        return len(instance.get_runs())


def test_a_named_task_without_tests_is_refused_before_any_run_and_the_record_is_untouched(dataset, home, tmp_path,
                                                                                          capsys):
    ok, no_tests, _ = _ids(dataset)
    shutil.rmtree(dataset / "tasks" / no_tests / "tests")
    settings, before = _earlier_settings(home)
    command = ["eval", str(dataset), "--sources", str(dataset / "repos"), "--model", str(_model(tmp_path)),
               "--name", "tiny", "--offline", "--attempts", "1", "--tasks", no_tests]

    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"task {no_tests} ({dataset / 'tasks' / no_tests}): missing tests/config.json" in err
    assert "nothing was run or recorded" in err
    assert settings.read_text() == before  # a backfill still evaluates as the earlier eval did
    assert not (home / "evals" / "deepswe").exists()  # no rows to mix into the checkpoint's record
    assert _dagster_runs(home) == 0


def test_an_image_that_does_not_build_is_refused_before_any_run_with_the_builders_whole_message(dataset, home,
                                                                                              tmp_path, capsys):
    ok, _, bad = _ids(dataset)
    recipe = dataset / "tasks" / bad / "environment" / "Dockerfile"
    recipe.write_text(recipe.read_text() + f"RUN echo '{LONG_ERROR}' >&2 && exit 3\n")
    settings, before = _earlier_settings(home)
    command = ["eval", str(dataset), "--sources", str(dataset / "repos"), "--model", str(_model(tmp_path)),
               "--name", "tiny", "--offline", "--attempts", "1"]

    assert main([*command, "--tasks", bad]) == 2
    err = capsys.readouterr().err
    assert f"task {bad} ({recipe}): its image does not build:" in err
    assert LONG_ERROR in err  # whole: not cut mid-token
    assert settings.read_text() == before
    assert not (home / "evals" / "deepswe").exists()
    assert _dagster_runs(home) == 0

    # the whole dataset is refused too (the task would be an infra error in every attempt), naming only it
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"task {bad} ({recipe}): its image does not build:" in err and f"task {ok} " not in err
    assert settings.read_text() == before and _dagster_runs(home) == 0


def test_a_task_source_that_does_not_load_is_refused_before_any_run(home, tmp_path, capsys):
    source = tmp_path / "tasks.jsonl"
    source.write_text('{"not": "a task"}\n')
    settings, before = _earlier_settings(home)

    assert main(["eval", str(source), "--model", str(_model(tmp_path)), "--name", "tiny", "--attempts", "1"]) == 2
    assert f"posttrain eval: {source}: line 1: missing key 'instance_id'" in capsys.readouterr().err
    assert settings.read_text() == before and _dagster_runs(home) == 0


def test_the_direct_path_names_a_build_error_whole(dataset, home, capsys):
    _, _, bad = _ids(dataset)
    recipe = dataset / "tasks" / bad / "environment" / "Dockerfile"
    recipe.write_text(recipe.read_text() + f"RUN echo '{LONG_ERROR}' >&2 && exit 3\n")
    command = ["eval", str(dataset), "--sources", str(dataset / "repos"), "--agent", "oracle", "--offline",
               "--tasks", bad]

    assert main(command) == 1
    err = capsys.readouterr().err
    closing = err[err.index("1 of 1 tasks could not be built, run or graded:"):]
    assert LONG_ERROR in closing  # whole: not cut to its last 600 characters
    assert f"  {bad}: its image was not built: {recipe}: line " in closing


def test_tasks_sources_calls_no_refused_task_ready_and_counts_a_shared_repository_once(dataset, capsys):
    first, second, third = _ids(dataset)
    # two more tasks built from the first task's repository at its commit, as DeepSWE's tasks of one project are
    for copy in ("shared-a", "shared-b"):
        shutil.copytree(dataset / "tasks" / first, dataset / "tasks" / copy)
        toml = dataset / "tasks" / copy / "task.toml"
        toml.write_text(toml.read_text().replace(f'task_id = "{first}"', f'task_id = "{copy}"'))
    (dataset / "tasks" / "shared-b" / "tests" / "test.sh").unlink()  # the build refuses it: no verifier
    shutil.rmtree(dataset / "tasks" / third / "tests")  # it does not even load
    repos = dataset / "repos"

    assert main(["tasks", "sources", str(dataset), "--sources", str(repos), "--json"]) == 1
    out, err = capsys.readouterr()
    status = {r["task_id"]: r["status"] for r in json.loads(out)["rows"]}
    assert status[first] == status["shared-a"] == status[second] == "ready"
    assert status["shared-b"].startswith("fetched, but the build refuses the task: ") and "no test.sh" in status["shared-b"]
    assert status[third].startswith("not loadable: missing tests/config.json")
    # three tasks share the first repository: it is one of the two repositories, and both are fetched
    assert f"0 of 2 repositories not ready under {repos}; 2 of 5 tasks cannot be built yet" in err


@pytest.mark.slow
def test_a_run_that_fails_leaves_the_earlier_settings_and_says_no_rows_were_written(dataset, home, tmp_path, capsys):
    """The dataset is fine, the model is not (a bare config.json: the engine cannot load it), so the
    Dagster run fails after its retries (30 s, then 60 s): ``eval.json`` keeps the earlier eval's
    settings, which a backfill or the sensor's retry reads, and no rows join the checkpoint's record."""
    ok = _ids(dataset)[0]
    settings, before = _earlier_settings(home)
    command = ["eval", str(dataset), "--sources", str(dataset / "repos"), "--model", str(_model(tmp_path)),
               "--name", "tiny", "--offline", "--attempts", "1", "--max-turns", "1", "--tasks", ok, "--json"]

    assert main(command) == 1
    out, err = capsys.readouterr()
    assert settings.read_text() == before
    assert json.loads(out)["rows_path"] is None
    assert "posttrain eval: attempt rows: none written" in err
    assert "posttrain eval: the eval of tiny-step_000000 failed:" in err
    assert not list((home / "evals" / "deepswe").glob("*/*.parquet"))
    assert _dagster_runs(home) == 1
