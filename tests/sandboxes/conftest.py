"""Fixtures of the sandbox tests: a tiny task repository, an image store and a layer cache in tmp_path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sandboxes
from sandboxes.runtimes import compiled_pxd

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]

CALC = "def add(a, b):\n    return a + b\n"
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def make_repo(path: Path, files: dict[str, str] | None = None) -> Path:
    """A git repository with one commit: a module and its pytest test, unless ``files`` says otherwise."""
    path.mkdir(parents=True)
    for name, text in (files or {"calc.py": CALC, "test_calc.py": TEST_CALC, ".gitignore": "__pycache__/\n"}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    subprocess.run([*GIT, "init", "-q"], cwd=path, check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=path, check=True)
    subprocess.run([*GIT, "commit", "-qm", "base"], cwd=path, check=True)
    return path


@pytest.fixture
def repo(tmp_path) -> Path:
    return make_repo(tmp_path / "repo")


@pytest.fixture
def store(tmp_path) -> sandboxes.ImageStore:
    return sandboxes.ImageStore(tmp_path / "images")


@pytest.fixture
def cache(tmp_path) -> sandboxes.LayerCache:
    return sandboxes.LayerCache(tmp_path / "cache", budget_bytes=256 * 1024 * 1024)


def runtime_params():
    """bwrap and gVisor, each skipped (with the reason) only where its binary is not installed, and
    never under CI=true (scripts/setup.sh installs both there: a missing one is a failure)."""
    return [pytest.param(name, marks=pytest.mark.skipif(not installed(binary), reason=f"{binary} not installed"))
            for name, binary in (("bwrap", "bwrap"), ("gvisor", "runsc"))]


def installed(binary: str) -> bool:
    """Whether ``binary`` is on PATH; under CI=true always True, so the test runs and fails if it is not."""
    return shutil.which(binary) is not None or os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture
def pxd_proc(tmp_path):
    """pxd as a plain process on a scratch repository (the daemon's own logic, without a sandbox)."""
    ws = make_repo(tmp_path / "ws")
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(compiled_pxd(sys.executable)),
                             "--workspace", str(ws), "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    client = sandboxes.PxdClient.over_fds(proc.stdout.fileno(), proc.stdin.fileno())
    client.wait_ready(10)
    yield client, ws
    proc.stdin.close()
    proc.wait(10)
    proc.stdout.close()
