"""``posttrain eval`` as a research team meets it, on Harbor tasks this project owns (the bundled
suite exported as Harbor tasks, built by the recipe builder, run in real bwrap sandboxes through
DeepSWE v1.1's verifier flow): honest exit statuses and a quiet summary of what is left out; a
verifier sandbox that lacks pytest fails rather than borrowing posttrain's; strict credit that spares
the existing tests the reference solution fails in this environment; Node at the version an image
declares (that test fetches Node from the npm registry and skips, saying so, where it is unreachable)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sandboxes
from dagster_project.cli import main
from evals.grading import Status, score
from evals.harbor import (
    build_task_image, check_environments, environment_record_path, export_harbor, harbor_sandbox_factory,
    read_environment_record, run_attempt, with_environment_records,
)
from evals.tasks import load_bundled, load_harbor
from sandboxes.harbor import harbor_image_runtimes, node_version, parse_dockerfile

NODE = "24.12.0"  # the Node DeepSWE's base image ships (sandboxes.harbor.BASE_IMAGE_RUNTIMES)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Three bundled tasks (one per level) built for real, exported as a Harbor dataset."""
    from evals.bundled import build_suite

    root = tmp_path_factory.mktemp("eval-command")
    build_suite(root / "suite", per_level=1, rl_per_level=0, extra_eval_per_level=0, workers=2)
    export_harbor(list(load_bundled(root / "suite").tasks), root / "dataset")
    return root / "dataset"


@pytest.fixture
def dataset(exported, tmp_path):
    """A copy of the export that a test may break."""
    shutil.copytree(exported, tmp_path / "dataset")
    return tmp_path / "dataset"


def _ids(dataset: Path) -> list[str]:
    return sorted(p.name for p in (dataset / "tasks").iterdir())


def test_eval_exits_1_naming_each_task_it_could_not_build_run_or_grade_and_2_on_bad_input(dataset, tmp_path,
                                                                                          capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / "home"))
    ok, no_config, bad_recipe = _ids(dataset)
    (dataset / "tasks" / no_config / "tests" / "config.json").unlink()
    recipe = dataset / "tasks" / bad_recipe / "environment" / "Dockerfile"
    recipe.write_text(recipe.read_text() + "RUN echo no such dependency >&2 && exit 3\n")
    repos = str(dataset / "repos")
    base = ["eval", str(dataset), "--sources", repos, "--agent", "oracle", "--offline"]

    # the whole dataset: the task that cannot be loaded is left out in one line; the image that did not
    # build is a task not run, named at the end with why, and the status is 1
    assert main(base) == 1
    out, err = capsys.readouterr()
    assert f"1 of 3 tasks cannot be built from {repos} and are left out (--verbose lists them)" in err
    assert no_config not in err
    assert f"1 of 2 tasks could not be built, run or graded:\n  {bad_recipe}: its image was not built:" in err
    assert "exit 3: no such dependency" in err
    assert "| all | 0 | 1 | 1 | 0 | 1.000 |" in out  # the task that ran is scored
    assert main([*base, "--verbose"]) == 1
    assert f"left out {no_config}: missing tests/config.json" in capsys.readouterr().err

    # tasks asked for by name: each one that could not be had is in the closing list
    assert main([*base, "--tasks", f"{ok},{no_config},{bad_recipe}", "--json"]) == 1
    out, err = capsys.readouterr()
    assert [r["task_id"] for r in json.loads(out)["rows"]] == [ok]
    closing = err[err.index("2 of 3 tasks could not be built, run or graded:"):]
    assert f"  {no_config}: missing tests/config.json" in closing and f"  {bad_recipe}: its image was not built" in closing
    assert main([*base, "--tasks", ok]) == 0
    capsys.readouterr()

    # bad input: status 2, naming what is wrong, before anything runs
    assert main([*base, "--tasks", "no-such-task"]) == 2
    assert "--tasks: no-such-task: no such task in" in capsys.readouterr().err
    assert main([*base, "--attempts", "0"]) == 2
    assert "[eval] attempts: expected a positive value, got 0" in capsys.readouterr().err
    assert main(["eval", str(dataset), "--agent", "oracle"]) == 2
    assert "a Harbor dataset needs --sources" in capsys.readouterr().err


def test_a_verifier_that_needs_pytest_fails_in_an_image_without_it_and_borrows_nothing(dataset, tmp_path):
    """The verifier's sandbox sees the host's /usr and the task's image, never posttrain's virtualenv:
    a verifier that runs pytest in an image that has none gets "No module named pytest" and writes no
    report, so every test counts as failed (the oracle's too), as it would in the task's container."""
    task_id = _ids(dataset)[0]
    verifier = dataset / "tasks" / task_id / "tests" / "test.sh"
    script = verifier.read_text()
    for suite in ("base", "new"):
        script = script.replace(f"bash /app/test.sh {suite} /logs/verifier/{suite}.xml",
                                f'echo "PATH=$PATH"; python3 -m pytest -q --junitxml=/logs/verifier/{suite}.xml tests')
    verifier.write_text(script)
    [task] = [t for t in load_harbor(dataset, sources=dataset / "repos").tasks if t.id == task_id]
    store, cache = sandboxes.ImageStore(tmp_path / "store"), sandboxes.LayerCache(tmp_path / "cache", 1 << 30)
    build_task_image(task, dataset / "repos", store, network=False)
    run, result = run_attempt(task, "oracle", harbor_sandbox_factory(store, cache))
    assert "No module named pytest" in result.output
    assert "PATH=/usr/local/bin:/usr/bin:/bin\n" in result.output and sys.prefix not in result.output
    assert [n.split(";")[0] for n in result.notes] == ["report missing: /logs/verifier/base.xml",
                                                        "report missing: /logs/verifier/new.xml"]
    assert (result.scores.reward, result.scores.f2p, result.scores.p2p) == (0.0, 0.0, 0.0)


def test_strict_credit_spares_the_existing_tests_the_reference_fails_in_this_environment(dataset, tmp_path):
    """An existing test no attempt can pass here (as adaptix's Python 3.12-only tests on the host's
    3.11): without the environment record strict credit is 0 for every attempt, the reference's
    included; the record (the reference run once per image) spares that test, and only that one."""
    task_id = _ids(dataset)[0]
    config_path = dataset / "tasks" / task_id / "tests" / "config.json"
    config = json.loads(config_path.read_text())
    ghost = config["p2p_node_ids"][0].rsplit(".", 1)[0] + ".test_only_on_python_3_12"  # never collected here
    config["p2p_node_ids"].append(ghost)
    config_path.write_text(json.dumps(config))
    [task] = [t for t in load_harbor(dataset, sources=dataset / "repos").tasks if t.id == task_id]
    store, cache = sandboxes.ImageStore(tmp_path / "store"), sandboxes.LayerCache(tmp_path / "cache", 1 << 30)
    build = build_task_image(task, dataset / "repos", store, network=False)
    factory = harbor_sandbox_factory(store, cache)

    _, unspared = run_attempt(task, "oracle", factory)
    assert (unspared.scores.reward, unspared.scores.target_score, unspared.scores.strict_target_score) == (0.0, 1.0, 0.0)

    home = tmp_path / "home"
    records = check_environments([task], factory, home, {task.id: build.key})
    assert records[task.id].broken_existing == (ghost,) and records[task.id].broken_target == ()
    assert json.loads(environment_record_path(home, task.id).read_text())["broken_existing"] == [ghost]
    assert read_environment_record(home, task.id, "another-build") is None  # a rebuilt image is checked again
    assert check_environments([task], factory, home, {task.id: build.key}, run_missing=False) == records

    [spared_task] = with_environment_records([task], records)
    _, spared = run_attempt(spared_task, "oracle", factory)
    # reward keeps DeepSWE's definition (what the task's own grader writes); strict spares the ghost
    assert (spared.scores.reward, spared.scores.strict_target_score) == (0.0, 1.0)
    _, nop = run_attempt(spared_task, "nop", factory)
    assert nop.scores.strict_target_score == 0.0

    # breaking an existing test the reference passes still zeroes strict credit
    real = config["p2p_node_ids"][0]
    statuses = {t: Status.PASSED for t in config["f2p_node_ids"] + config["p2p_node_ids"] if t != ghost}
    assert score(config["f2p_node_ids"], config["p2p_node_ids"], statuses, [ghost]).strict_target_score == 1.0
    statuses[real] = Status.FAILED
    assert score(config["f2p_node_ids"], config["p2p_node_ids"], statuses, [ghost]).strict_target_score == 0.0


def test_the_node_an_image_declares():
    """DeepSWE's recipes start FROM mars-base, which ships Node 24.12.0; ENV NODE_VERSION says
    otherwise; a recipe with no Node step needs none."""
    def recipe(tmp: Path, text: str):
        (tmp / "Dockerfile").write_text(text)
        return parse_dockerfile(tmp / "Dockerfile")

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        clone = "WORKDIR /app\nRUN git clone https://github.com/o/r .\n"
        assert node_version(recipe(Path(tmp), f"FROM public.ecr.aws/x8v8d7g8/mars-base:latest\n{clone}")) == NODE
        assert node_version(recipe(Path(tmp), f"FROM public.ecr.aws/x8v8d7g8/mars-base\nENV NODE_VERSION=v22.7.0\n{clone}")) == "22.7.0"
        assert node_version(recipe(Path(tmp), f"FROM debian:bookworm\n{clone}")) == ""


def _npm_registry_reachable() -> bool:
    try:
        return subprocess.run(["npm", "view", f"node@{NODE}", "version"], capture_output=True, text=True,
                              timeout=60).stdout.strip() == NODE
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_a_harbor_image_runs_the_node_its_base_image_declares_with_corepack_working(dataset, tmp_path):
    """A TypeScript task's recipe starts FROM DeepSWE's base image: its sandboxes run Node 24.12.0 from
    npm's node package (not the host's), and `corepack enable` works while building (it writes its
    shims beside that node, in the image's /opt/node/bin), with the package manager it fetched kept in
    the image for the offline sandboxes. Needs the npm registry (skipped where it is unreachable)."""
    if not _npm_registry_reachable():
        pytest.skip(f"the npm registry does not answer `npm view node@{NODE}`: Node cannot be fetched here")
    task_id = _ids(dataset)[0]
    recipe = dataset / "tasks" / task_id / "environment" / "Dockerfile"
    text = recipe.read_text().replace("FROM posttrain-base", "FROM public.ecr.aws/x8v8d7g8/mars-base:latest")
    recipe.write_text(text + "RUN printf '{\"name\":\"t\",\"packageManager\":\"pnpm@9.15.0\"}' > /opt/pm.json && "
                      "corepack enable && cd /opt && cp pm.json package.json && pnpm --version && rm package.json\n")
    [task] = [t for t in load_harbor(dataset, sources=dataset / "repos").tasks if t.id == task_id]
    store, cache = sandboxes.ImageStore(tmp_path / "store"), sandboxes.LayerCache(tmp_path / "cache", 1 << 30)
    build = build_task_image(task, dataset / "repos", store, network=True)
    runtimes = harbor_image_runtimes(store, build.image.name)
    assert runtimes["node"] == {"path": "/opt/node/bin/node", "version": NODE, "from": (
        f"npm package node@{NODE} (declared by public.ecr.aws/x8v8d7g8/mars-base:latest)")}
    assert runtimes["python"]["path"] == "/usr/bin/python3"
    with harbor_sandbox_factory(store, cache)(task) as box:
        run = box.exec("node --version; command -v node; cd /tmp && cp /opt/pm.json package.json && pnpm --version",
                       timeout_s=120)
    assert run.exit_code == 0 and run.output.split() == [f"v{NODE}", "/opt/node/bin/node", "9.15.0"], run.output


def test_tasks_sources_lists_what_to_fetch_submodules_included(dataset, tmp_path, capsys):
    """`posttrain tasks sources` names, for each task, the repositories its image is built from (its
    own and each submodule's at the commit the base records) and what the sources folder lacks."""
    ids = _ids(dataset)
    assert main(["tasks", "sources", str(dataset), "--sources", str(dataset / "repos"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["task_id"], r["status"]) for r in rows] == [(i, "ready") for i in ids]
    assert main(["tasks", "sources", str(dataset), "--sources", str(tmp_path), "--tasks", ids[0]]) == 1
    out, err = capsys.readouterr()
    assert f"| {ids[0]} | https://posttrain.invalid/bundled/{ids[0]}.git | . |" in out and "| not fetched |" in out
    assert f"1 of 1 repositories not ready under {tmp_path}" in err

    from sandboxes.harbor import needed_sources

    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_CONFIG_GLOBAL": "/dev/null", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}

    def git(repo: Path, *args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                              env=env).stdout.strip()

    sources = tmp_path / "sources"
    sub, top = sources / "o+data" / "repo", sources / "o+app" / "repo"
    for repo in (sub, top):
        repo.mkdir(parents=True)
        git(repo, "init", "-q")
        (repo / "README").write_text(repo.parent.name)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", "first")
    pinned = git(sub, "rev-parse", "HEAD")
    (top / ".gitmodules").write_text('[submodule "data"]\n\tpath = vendor/data\n\turl = https://github.com/o/data\n')
    git(top, "update-index", "--add", "--cacheinfo", f"160000,{pinned},vendor/data")
    git(top, "add", ".gitmodules")
    git(top, "commit", "-qm", "vendor data")
    base = git(top, "rev-parse", "HEAD")
    needed = needed_sources("https://github.com/o/app", base, sources)
    assert [(n.path, n.commit, n.ready) for n in needed] == [("", base, True), ("vendor/data", pinned, True)]
    shutil.rmtree(sub)  # a snapshot of the submodule's repository without the pinned commit
    sub.mkdir()
    git(sub, "init", "-q")
    (sub / "README").write_text("another history")
    git(sub, "add", "-A")
    git(sub, "commit", "-qm", "other")
    assert [(n.path, n.source, n.has_commit) for n in needed_sources("https://github.com/o/app", base, sources)] == [
        ("", str(top), True), ("vendor/data", str(sub), False)]
    shutil.rmtree(sources / "o+data")  # not fetched at all
    assert [(n.path, n.source, n.ready) for n in needed_sources("https://github.com/o/app", base, sources)] == [
        ("", str(top), True), ("vendor/data", "", False)]
