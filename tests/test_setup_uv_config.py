"""``scripts/uv-pip-config.py`` hands pip's configuration to uv as scripts/setup.sh installs with it:
pip itself (``pip config list``) reads a config file and ``PIP_*`` variables, and the script's
output is uv's options, NUL-terminated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "uv-pip-config.py"


def run(mode: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), mode], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\0")[:-1]


def test_indexes_wheel_folders_and_constraints_come_from_pips_files_and_variables(tmp_path: Path) -> None:
    config = tmp_path / "pip.conf"
    config.write_text("[global]\n"
                      "index-url = https://mirror.example/simple\n"
                      "extra-index-url =\n    file:///srv/one/simple\n    file:///srv/two/simple\n"
                      "find-links = /file/wheels\n"
                      f"constraint = {tmp_path / 'constraints.txt'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": str(config), "PIP_FIND_LINKS": "/env/wheels /env/more"}

    assert run("indexes", env) == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///srv/one/simple", "--extra-index-url", "file:///srv/two/simple",
        "--find-links", "/env/wheels", "--find-links", "/env/more",  # a variable's value over a file's
    ]
    assert run("constraints", env) == ["--constraint", str(tmp_path / "constraints.txt")]


def test_a_wrong_mode_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "everything"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "indexes" in done.stderr and "constraints" in done.stderr
