"""The Harbor path on tasks this project owns: the bundled suite exported as Harbor tasks, built into
images by the recipe builder, attempted by the oracle and nop agents in real bwrap sandboxes, run
through DeepSWE v1.1's verifier flow and graded; the loader, the builder's rules and the flawed lists."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import sandboxes
from dagster_project.cli import main
from evals.flawed import flawed_views, install_published_lists, load_flawed_list, load_flawed_lists, load_published_lists
from evals.harbor import (
    APPLY_FAILED, GRADED, build_task_image, environment_check, export_harbor, harbor_sandbox_factory,
    record_verification, run_attempt, verify, write_environment_flawed,
)
from evals.tasks import load_bundled, load_harbor
from sandboxes.harbor import RecipeError, build_harbor_image, checkout_at_base, checkout_submodules, parse_dockerfile

DEEPSWE_LISTS = Path("/work/shared/datasets/deepswe-1.1/flawed/lists.json")
GIT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
       "GIT_CONFIG_GLOBAL": "/dev/null", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Three bundled tasks (one per level) built for real, exported as a Harbor dataset."""
    from evals.bundled import build_suite

    root = tmp_path_factory.mktemp("harbor")
    build_suite(root / "suite", per_level=1, rl_per_level=0, extra_eval_per_level=0, workers=2)
    tasks = list(load_bundled(root / "suite").tasks)
    summary = export_harbor(tasks, root / "dataset")
    assert summary["tasks"] == 3
    return root / "dataset"


@pytest.fixture(scope="module")
def built(exported, tmp_path_factory):
    """The exported tasks loaded with their sources, their images built, and a sandbox factory."""
    root = tmp_path_factory.mktemp("images")
    store, cache = sandboxes.ImageStore(root / "store"), sandboxes.LayerCache(root / "cache", 1 << 30)
    task_set = load_harbor(exported, sources=exported / "repos")
    assert not task_set.incomplete
    builds = {t.id: build_task_image(t, exported / "repos", store, network=False) for t in task_set.tasks}
    return task_set.tasks, builds, store, harbor_sandbox_factory(store, cache)


def test_an_exported_task_is_a_whole_harbor_task(exported):
    task_dir = next((exported / "tasks").iterdir())
    for rel in ("task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh", "tests/test.patch",
                "tests/config.json", "solution/solution.patch"):
        assert (task_dir / rel).is_file(), rel
    config = json.loads((task_dir / "tests" / "config.json").read_text())
    assert config["grade"]["reports"] == ["/logs/verifier/base.xml", "/logs/verifier/new.xml"]
    assert "+++ b/test.sh" in (task_dir / "tests" / "test.patch").read_text()
    [task] = load_harbor(task_dir).tasks
    assert task.metadata["solution_patch"].endswith("solution/solution.patch")
    assert {"test.sh", "test.patch", "config.json"} <= set(task.metadata["test_files"])
    assert task.target_tests == tuple(config["f2p_node_ids"]) and task.base_commit == config["base_commit"]


@pytest.mark.slow
def test_oracle_reward_1_and_nop_reward_0_through_the_verifier(built):
    tasks, builds, store, factory = built
    for task in tasks:
        assert [l.compression for l in builds[task.id].image.layers] == ["zstd"] * 3  # base, Harbor, repository
        _, oracle = run_attempt(task, "oracle", factory)
        assert oracle.status == GRADED and oracle.scores.reward == 1.0, (oracle.notes, oracle.output)
        assert oracle.scores.f2p_passed == len(task.target_tests) and oracle.scores.p2p == 1.0
        _, nop = run_attempt(task, "nop", factory)
        assert nop.status == GRADED and nop.scores.reward == 0.0 and nop.scores.f2p_passed == 0
        assert nop.scores.p2p_passed == len(task.existing_tests)  # the existing tests still pass
        assert set(nop.statuses) == set(task.target_tests) | set(task.existing_tests)


def test_the_agent_sees_the_base_commit_only_and_no_hidden_tests(built):
    tasks, builds, store, factory = built
    task = tasks[0]
    with factory(task) as box:
        head = box.exec("git rev-parse HEAD").output.strip()
        assert head == task.base_commit
        later = box.exec(f"git rev-list --all ^{task.base_commit}")
        assert later.exit_code == 0 and later.output.strip() == ""
        assert box.exec("test -e tests").exit_code != 0  # the tests are hidden: test.patch adds them for the verifier
        assert box.exec("test -e /tests/test.sh").exit_code != 0 and box.exec("test -d /app/.git").exit_code == 0
        # real tasks need their pytest plugins: the sandbox does not switch autoloading off
        env = box.exec("python3 -c 'import os; print(repr(os.environ.get(\"PYTEST_DISABLE_PLUGIN_AUTOLOAD\")))'")
        assert env.output.strip() == "''"


def test_a_patch_that_does_not_apply_is_recorded_beside_the_tasks_reward_json(built, tmp_path):
    tasks, builds, store, factory = built
    task = tasks[0]
    bogus = ("diff --git a/nothere.py b/nothere.py\n--- a/nothere.py\n+++ b/nothere.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    result = verify(task, bogus, factory)
    assert result.status == APPLY_FAILED and result.scores.reward == 0.0 and result.scores.p2p_passed == 0
    assert result.task_reward == {"reward": 0, "apply_failed": 1} and result.agrees is True
    record_verification(tmp_path / "rec", result)
    assert json.loads((tmp_path / "rec" / "reward.json").read_text())["apply_failed"] == 1
    assert json.loads((tmp_path / "rec" / "posttrain-grade.json").read_text())["scores"]["reward"] == 0.0


@pytest.mark.slow
def test_environment_check_lists_flawed_tasks_with_the_tests_apart_from_published_lists(built, exported, tmp_path):
    tasks, builds, store, factory = built
    good, broken = tasks[0], tasks[1]
    # a task whose reference solution changes nothing that matters, and whose target is an existing test
    bad_dir = tmp_path / "tasks" / broken.id
    shutil.copytree(broken.metadata["task_dir"], bad_dir)
    (bad_dir / "solution" / "solution.patch").write_text(
        "diff --git a/NOTES.md b/NOTES.md\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES.md\n@@ -0,0 +1 @@\n+notes\n")
    config = json.loads((bad_dir / "tests" / "config.json").read_text())
    config["f2p_node_ids"] = config["f2p_node_ids"] + config["p2p_node_ids"][:1]
    (bad_dir / "tests" / "config.json").write_text(json.dumps(config))
    [bad] = load_harbor(bad_dir, sources=exported / "repos").tasks
    flaws, rows = environment_check([good, bad], factory)
    assert [r["flawed"] for r in rows] == [False, True]
    by_agent = {f.agent: f for f in flaws}
    assert set(by_agent) == {"oracle", "nop"} and all(f.id == broken.id for f in flaws)
    assert set(by_agent["oracle"].tests) == set(broken.target_tests)  # the reference leaves the bug in
    assert by_agent["nop"].tests == tuple(config["p2p_node_ids"][:1])  # passes with no change at all
    path = write_environment_flawed(flaws, tmp_path / "home", "bundled-harbor")
    assert path.parent.name == "environment-flawed"
    assert load_flawed_list(path).ids == {broken.id}
    assert load_flawed_lists(tmp_path / "home" / "datasets" / "flawed") == []
    # a check of another task keeps this entry; a check that finds the task clean now removes it
    assert write_environment_flawed([], tmp_path / "home", "bundled-harbor", checked=[good.id]) == path
    assert load_flawed_list(path).ids == {broken.id}
    write_environment_flawed([], tmp_path / "home", "bundled-harbor", checked=[broken.id])
    assert load_flawed_list(path).ids == set()
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bundled-harbor\.jsonl: line 1 is not an environment-flawed entry"):
        write_environment_flawed(flaws, tmp_path / "home", "bundled-harbor")
    assert path.read_text() == "not json\n"  # nothing was written


def test_loader_reports_each_task_that_cannot_be_built_with_the_reason(exported, tmp_path):
    dataset = tmp_path / "ds"
    shutil.copytree(exported / "tasks", dataset / "tasks")
    names = sorted(p.name for p in (dataset / "tasks").iterdir())
    (dataset / "tasks" / names[0] / "environment" / "Dockerfile").unlink()
    docker = dataset / "tasks" / names[1] / "environment" / "Dockerfile"
    docker.write_text(docker.read_text().replace(f"bundled/{names[1]}.git", "nobody/missing-repo.git"))
    config = dataset / "tasks" / names[2] / "tests" / "config.json"
    data = json.loads(config.read_text())
    data["base_commit"] = "0" * 40
    config.write_text(json.dumps(data))
    task_set = load_harbor(dataset, sources=exported / "repos")
    reasons = {t.id: t.reason for t in task_set.incomplete}
    assert not task_set.tasks and len(reasons) == 3
    assert "no environment/Dockerfile" in reasons[names[0]]
    assert "no source for repository https://posttrain.invalid/nobody/missing-repo.git" in reasons[names[1]]
    assert "does not hold the base commit 0000000000" in reasons[names[2]]
    assert reasons[names[1]].startswith("cannot be built: ") and reasons[names[2]].startswith("cannot be built: ")
    # without sources the tasks with a recipe load (their metadata is all there)
    assert sorted(t.id for t in load_harbor(dataset).tasks) == names[1:]


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=GIT).stdout.strip()


def test_checkout_drops_future_history_and_takes_submodules_from_their_sources(tmp_path):
    sources = tmp_path / "sources"
    sub = sources / "other+data"
    sub.mkdir(parents=True)
    _git(sub, "init", "-q", "-b", "main")
    (sub / "case.txt").write_text("one\n")
    _git(sub, "add", "-A")
    _git(sub, "commit", "-q", "-m", "data 1")
    sub_commit = _git(sub, "rev-parse", "HEAD")
    (sub / "case.txt").write_text("two\n")
    _git(sub, "commit", "-q", "-am", "data 2")
    repo = sources / "owner+proj"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "trunk")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    _git(repo, "tag", "v0")
    _git(repo, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "vendor/data")
    subprocess.run(["git", "-C", str(repo / "vendor" / "data"), "checkout", "-q", sub_commit], check=True, env=GIT)
    _git(repo, "config", "-f", ".gitmodules", "submodule.vendor/data.url", "https://example.com/other/data.git")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "vendor data")
    base = _git(repo, "rev-parse", "HEAD")
    (repo / "a.py").write_text("x = 2  # the solution\n")
    _git(repo, "commit", "-q", "-am", "the solution")
    _git(repo, "tag", "v1")
    _git(repo, "branch", "feature")
    dest = tmp_path / "app"
    checkout_at_base(repo, base, dest)
    assert _git(dest, "rev-parse", "HEAD") == base and _git(dest, "branch", "--show-current") == "trunk"
    assert _git(dest, "rev-list", "--all", f"^{base}") == "" and _git(dest, "tag") == "v0"
    assert _git(dest, "branch", "--format=%(refname:short)") == "trunk" and _git(dest, "remote") == ""
    assert "the solution" not in _git(dest, "log", "--all", "--format=%s")
    assert checkout_submodules(dest, base, sources) == ["vendor/data"]
    assert (dest / "vendor" / "data" / "case.txt").read_text() == "one\n"
    with pytest.raises(RecipeError, match="does not hold the base commit"):
        checkout_at_base(repo, "1" * 40, tmp_path / "app2")


def test_recipe_rules_and_run_steps_with_the_date_cutoff(exported, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM x\nWORKDIR /app\nRUN git clone https://h/o/r .\nCOPY . /app\n")
    with pytest.raises(RecipeError, match=r"Dockerfile: line 4: COPY from a build context is not supported"):
        parse_dockerfile(bad)
    bad.write_text("FROM x\nRUN echo no clone\n")
    with pytest.raises(RecipeError, match="no 'RUN git clone URL .' step"):
        parse_dockerfile(bad)
    # RUN steps run as written in the build sandbox (offline here); apt is recorded, not installed
    task_dir = next((exported / "tasks").iterdir())
    recipe = (task_dir / "environment" / "Dockerfile").read_text()
    steps = ('ENV GREETING=hello\n'
             'RUN apt-get update; apt-get install -y graphviz; \\\n'
             '    mkdir -p /opt/data && echo "$PIP_UPLOADED_PRIOR_TO $npm_config_before $GREETING" > /opt/data/cutoff\n')
    (tmp_path / "Dockerfile").write_text(recipe + steps)
    base = json.loads((task_dir / "tests" / "config.json").read_text())["base_commit"]
    store = sandboxes.ImageStore(tmp_path / "store")
    build = build_harbor_image("recipe-test", tmp_path / "Dockerfile", base, exported / "repos", store, network=False)
    assert build.env["GREETING"] == "hello" and len(build.image.layers) == 4  # base, Harbor, /opt, repository
    assert any("install -y graphviz" in n for n in build.notes)
    cache = sandboxes.LayerCache(tmp_path / "cache", 1 << 30)
    with sandboxes.start(build.image, store=store, cache=cache) as sb:
        assert sb.exec("cat /opt/data/cutoff").output.strip() == "2026-06-14T00:00:00Z 2026-06-14T00:00:00Z hello"
        assert sb.exec("test -e /opt/.posttrain-apt-requests").exit_code != 0
    again = build_harbor_image("recipe-test", tmp_path / "Dockerfile", base, exported / "repos", store, network=False)
    assert again.cached and again.image == build.image


def test_published_flawed_lists_are_read_as_ids_with_source_and_url(tmp_path):
    lists = load_published_lists(DEEPSWE_LISTS)
    assert len(lists) == 6 and [len(fl.tasks) for fl in lists] == [23, 4, 1, 3, 17, 24]
    assert len(set().union(*(fl.ids for fl in lists))) == 54
    assert all(fl.url.startswith("https://") and t.source == fl.url for fl in lists for t in fl.tasks)
    raw = json.loads(DEEPSWE_LISTS.read_text())
    theirs = {r for entry in raw["lists"] for r in entry.get("reasons", {}).values()}
    assert not any(t.reason in theirs for fl in lists for t in fl.tasks)  # the sources' wording is not shipped
    written = install_published_lists(DEEPSWE_LISTS, tmp_path)
    assert [p.parent for p in written] == [tmp_path / "datasets" / "flawed"] * 6
    assert {fl.name: fl.ids for fl in load_flawed_lists(tmp_path / "datasets" / "flawed")} == {
        fl.name: fl.ids for fl in lists}


def test_flawed_views_show_every_score_with_and_without_each_list_and_their_union():
    from evals.flawed import FlawedList, FlawedTask

    def row(task, reward, partial, status="graded"):
        return {"task_id": task, "status": status, "reward": reward, "target_score": reward, "strict_target_score": reward,
                "partial": partial}

    rows = [row("a", 1.0, 1.0), row("a", 0.0, 0.5), row("b", 0.0, 0.0), row("c", 1.0, 1.0),
            row("c", None, None, "infra_error")]
    lists = [FlawedList("one", "", (FlawedTask("a", "r", "s"),)), FlawedList("two", "", (FlawedTask("b", "r", "s"),))]
    views = {v["view"]: v for v in flawed_views(rows, lists, k=2)}
    assert list(views) == ["all", "without one", "without two", "without the union of all lists"]
    assert views["all"]["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3) and views["all"]["infra_errors"] == 1
    assert views["all"]["partial"] == pytest.approx((0.75 + 0 + 1) / 3)
    assert views["without one"]["pass@1"] == pytest.approx(0.5) and views["without one"]["excluded"] == 1
    assert views["without the union of all lists"]["tasks"] == 1 and views["without the union of all lists"]["pass@1"] == 1.0
    assert views["all"]["pass@2"] == pytest.approx(1.0)  # only a has 2 graded attempts; it passes in one of them


def test_posttrain_eval_cli_runs_the_oracle_on_an_exported_dataset(exported, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    ids = sorted(p.name for p in (exported / "tasks").iterdir())[:1]
    code = main(["eval", str(exported), "--sources", str(exported / "repos"), "--agent", "oracle", "--offline",
                 "--tasks", ids[0], "--out", str(tmp_path / "rows.parquet"), "--record", str(tmp_path / "rec"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["reward"] for r in out["rows"]] == [1.0] and out["views"][0]["pass@1"] == 1.0
    import pandas as pd

    from evals.evaluate import ROW_COLUMNS

    assert list(pd.read_parquet(tmp_path / "rows.parquet").columns) == list(ROW_COLUMNS)
    assert (tmp_path / "rec" / ids[0] / "0" / "posttrain-grade.json").is_file()
    assert main(["eval", str(exported), "--sources", str(exported / "repos"), "--agent", "model"]) == 2
    assert "--agent model needs --model" in capsys.readouterr().err
