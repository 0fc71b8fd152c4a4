"""The init container of a sandbox pod copies the image's /workspace into the pod's volume as the
sandbox user (:data:`sandboxes.k8s.COPY_WORKSPACE`). Run here with this machine's sh and GNU cp, as
uid 1000 (setpriv, then an unprivileged bubblewrap namespace binding the two folders where the pod
has them), onto a mount point that user does not own (the pod volume's). Needs root (CI is)."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from sandboxes.k8s import COPY_WORKSPACE, pod_spec

BWRAP = shutil.which("bwrap")


def run_as_sandbox_user(command: list[str], src, dest, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    binds = [a for d in ("/usr", "/bin", "/lib", "/lib64", "/etc") if os.path.exists(d) for a in ("--ro-bind", d, d)]
    sets = [a for k, v in (env or {}).items() for a in ("--setenv", k, v)]
    return subprocess.run(["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", BWRAP, *binds, *sets, "--proc", "/proc", "--dev", "/dev", "--bind", str(src), "/workspace",
                           "--bind", str(dest), "/mnt/workspace", "--unshare-user",
                           *command], capture_output=True, text=True, timeout=60)


@pytest.fixture
def tmp_path():
    """A folder uid 1000 can walk to (pytest's own is root's, mode 700)."""
    path = Path(tempfile.mkdtemp(prefix="posttrain-copy-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def folders(tmp_path):
    src, dest = tmp_path / "image-workspace", tmp_path / "volume"
    (src / "pkg").mkdir(parents=True)
    (src / "calc.py").write_text("print(2 + 2)\n")
    (src / ".hidden").write_text("x")
    (src / "..odd").write_text("y")
    (src / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    (src / "link").symlink_to("calc.py")
    dest.mkdir()
    dest.chmod(0o777)  # writable by the sandbox user, owned by another (the volume's mount point)
    return src, dest


@pytest.mark.skipif((BWRAP is None or os.geteuid() != 0) and os.environ.get("CI") != "true",
                    reason="needs bubblewrap and root")
def test_the_workspace_is_copied_whole_onto_a_mount_point_the_user_does_not_own(folders):
    src, dest = folders
    spec = pod_spec(run="r", task_id="t", episode="e", image="registry.local/task:1")
    command = spec["spec"]["initContainers"][0]["command"]
    assert command == ["/bin/sh", "-c", COPY_WORKSPACE]
    done = run_as_sandbox_user(command, src, dest)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["..odd", ".hidden", "calc.py", "link", "pkg"]
    assert os.readlink(dest / "link") == "calc.py" and os.access(dest / "pkg" / "run.sh", os.X_OK)
    # the copy the pods made before: GNU cp fails on the mount point's own times
    before = run_as_sandbox_user(["/bin/cp", "-a", "/workspace/.", "/mnt/workspace/"], src, dest)
    assert before.returncode != 0 and "preserving times" in before.stderr


@pytest.mark.skipif((BWRAP is None or os.geteuid() != 0) and os.environ.get("CI") != "true",
                    reason="needs bubblewrap and root")
def test_an_empty_workspace_copies_nothing_and_succeeds(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "dest").mkdir(mode=0o777)
    (tmp_path / "dest").chmod(0o777)
    done = run_as_sandbox_user(["/bin/sh", "-c", COPY_WORKSPACE], tmp_path / "src", tmp_path / "dest")
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "dest").iterdir()) == []


@pytest.mark.skipif((BWRAP is None or os.geteuid() != 0) and os.environ.get("CI") != "true",
                    reason="needs bubblewrap and root")
def test_git_works_in_the_copied_repository_with_the_pods_environment(tmp_path):
    """The mount point is root's, the repository the sandbox user's: without the pod's git setting
    git refuses the repository (every commit and every grader's `git apply` failed on the node)."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    (src / "calc.py").write_text("x = 1\n")
    git = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(src), "commit", "-q", "-m", "base"], check=True, env={**os.environ, **git})
    shutil.chown(src, 1000, 1000)
    for path in src.rglob("*"):
        os.lchown(path, 1000, 1000)
    dest.mkdir()
    dest.chmod(0o777)  # root's, as the volume's mount point is
    container = pod_spec(run="r", task_id="t", episode="e", image="registry.local/task:1")["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    script = ["/bin/sh", "-c", COPY_WORKSPACE + "; cd /mnt/workspace && echo y >> calc.py && git add -A && "
              "git commit -q -m fix && git log --oneline | wc -l"]
    done = run_as_sandbox_user(script, src, dest, {**env, **git, "GIT_CONFIG_VALUE_0": "/mnt/workspace"})
    assert done.returncode == 0 and done.stdout.split()[-1] == "2", done.stderr
    # without it (the pods before): git refuses the repository
    again = tmp_path / "dest2"
    again.mkdir()
    again.chmod(0o777)
    before = run_as_sandbox_user(script, src, again, git)
    assert before.returncode != 0 and "dubious ownership" in before.stderr
