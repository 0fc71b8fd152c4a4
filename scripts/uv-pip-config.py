"""What pip is configured with, as uv's options (uv reads none of pip's configuration).

    python scripts/uv-pip-config.py indexes       # --index-url/--extra-index-url/--find-links pairs
    python scripts/uv-pip-config.py constraints   # --constraint pairs
    python scripts/uv-pip-config.py cert          # the CA file pip uses, if one is set

Reads ``python -m pip config list`` of the interpreter running it (pip's files and its ``PIP_*``
variables, a variable's value over a file's, a later file's over an earlier one's, as pip applies
them) and prints each option and value NUL-terminated, for ``mapfile -d ''`` in scripts/setup.sh.
A key pip takes several values of (``extra-index-url``, ``find-links``, ``constraint``) is split
on whitespace, as pip splits it.
"""

from __future__ import annotations

import ast
import subprocess
import sys

OPTIONS = {"indexes": ("index-url", "extra-index-url", "find-links"), "constraints": ("constraint",)}


def pip_config() -> dict[str, str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    files: dict[str, str] = {}
    variables: dict[str, str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        try:
            value = ast.literal_eval(value)  # pip prints each value as its repr
        except (ValueError, SyntaxError):
            continue
        name = key.rpartition(".")[2]
        (variables if key.startswith(":env:") else files)[name] = str(value)
    return files | variables


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in (*OPTIONS, "cert"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    config = pip_config()
    if argv[1] == "cert":
        if config.get("cert"):
            sys.stdout.write(config["cert"] + "\0")
        return 0
    for key in OPTIONS[argv[1]]:
        for value in config.get(key, "").split():
            sys.stdout.write(f"--{key}\0{value}\0")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
