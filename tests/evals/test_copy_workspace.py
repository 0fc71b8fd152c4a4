"""A task that is a folder, in a sandbox whose image holds none of it: on the cluster the bundled
suite's and the task stream's tasks run in the run's sandbox image, their repository copied in by
:func:`evals.sandbox.copy_workspace` before the episode starts. Here the sandbox is a real bubblewrap
one started from an empty folder (the same empty ``/workspace`` a pod of that image has)."""

import os
import subprocess

import pytest

import sandboxes
from evals.sandbox import InfraError, SandboxError, copy_workspace, platform_sandbox_factory
from evals.tasks import ResourceLimits, Task

GIT = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t"}


def make_task_repo(path):
    (path / "pkg").mkdir(parents=True)
    (path / "scores.py").write_text("def score(x):\n    return x + 1\n")
    (path / "pkg" / "data.bin").write_bytes(bytes(range(256)) * 4)
    (path / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (path / "run.sh").chmod(0o755)
    (path / "link").symlink_to("scores.py")
    subprocess.run(["git", "init", "-q", str(path)], check=True, env=GIT)
    subprocess.run(["git", "-C", str(path), "add", "-A"], check=True, env=GIT)
    subprocess.run(["git", "-C", str(path), "commit", "-q", "-m", "base"], check=True, env=GIT)
    return path


@pytest.fixture
def empty_box(tmp_path):
    (tmp_path / "empty").mkdir()
    store, cache = sandboxes.ImageStore(tmp_path / "images"), sandboxes.LayerCache(tmp_path / "cache")
    with sandboxes.start(tmp_path / "empty", runtime="bwrap", store=store, cache=cache) as box:
        yield box


def test_the_repository_arrives_whole_with_its_history_modes_and_links(tmp_path, empty_box):
    repo = make_task_repo(tmp_path / "repo")
    assert empty_box.exec("ls -A | wc -l").output.strip() == "0"
    copy_workspace(empty_box, repo)
    r = empty_box.exec("git status --porcelain && git log --oneline | wc -l && ./run.sh && readlink link "
                       "&& python3 -c 'import scores; print(scores.score(1))' && id -u && stat -c %u scores.py")
    assert r.exit_code == 0, r.output
    assert r.output.split() == ["1", "ran", "scores.py", "2", str(sandboxes.images.SANDBOX_UID),
                                str(sandboxes.images.SANDBOX_UID)]
    assert empty_box.read_file("pkg/data.bin") == (repo / "pkg" / "data.bin").read_bytes()
    # the tar is gone (git status above is empty): nothing of the copy is left beside the repository
    assert empty_box.exec("ls -A").output.split() == [".git", "link", "pkg", "run.sh", "scores.py"]


def test_a_failed_unpack_is_the_infrastructures_and_says_which_repository(tmp_path, empty_box):
    repo = make_task_repo(tmp_path / "repo")
    # a non-empty folder where the repository has a file: tar cannot put the file there
    empty_box.exec("mkdir -p pkg/data.bin/kept")
    with pytest.raises(SandboxError, match=f"copying the repository {repo}.*tar exited"):
        copy_workspace(empty_box, repo)


def test_a_cluster_task_without_an_image_or_a_sandbox_image_is_refused_naming_the_task(tmp_path, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_SANDBOX_IMAGE", raising=False)
    task = Task(id="bundled-l1-000-x", source="bundled", language="python", instruction="", target_tests=[],
                existing_tests=[], test_command="true", report_format="junit", report_paths=(), base_commit="HEAD",
                repo_path=str(tmp_path), limits=ResourceLimits())
    # the pool is never asked: the refusal comes first (nothing listens at this address)
    factory = platform_sandbox_factory("k8s", pool_url="http://127.0.0.1:9")
    with pytest.raises(InfraError, match=r"task bundled-l1-000-x names no image.*\[sandbox\] image, POSTTRAIN_SANDBOX_IMAGE"):
        with factory(task):
            pass
