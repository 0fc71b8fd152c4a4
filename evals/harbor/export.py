"""The bundled suite written as Harbor tasks (:func:`export_harbor`, ``posttrain tasks export-harbor``),
with their repositories as git bundles, so that the whole Harbor path runs on tasks this project owns.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

from evals.actions import apply_edits
from evals.quicktest import RUNNER_FILE
from evals.sandbox import GIT_ENV
from evals.tasks import Task


EXPORT_URL = "https://posttrain.invalid/bundled/{id}.git"
REPORTS = ("/logs/verifier/base.xml", "/logs/verifier/new.xml")


def _git(repo: Path, *args: str, input: str | None = None) -> str:
    env = {**os.environ, **GIT_ENV, "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00", "GIT_CONFIG_GLOBAL": "/dev/null"}
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, input=input)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo}: {proc.stderr.strip()}")
    return proc.stdout


def _inner_test_sh(task: Task) -> str:
    """The repository's own ``test.sh`` (what test.patch adds): ``./test.sh base|new REPORT`` runs the
    task's tests with the bundled suite's own runner (:mod:`evals.quicktest`, the standard library
    only: the image needs no pytest, and its sandboxes have none) and writes a JUnit report to
    REPORT. The grader keeps the existing tests from the ``base`` report and the target tests from
    the ``new`` one (:data:`REPORTS`), as DeepSWE's verifier runs its two suites."""
    folders = sorted({t.split(".", 1)[0] for t in (*task.existing_tests, *task.target_tests)}) or ["tests"]
    run = f"python3 -S tests/{RUNNER_FILE} -q --junitxml=\"$2\" {' '.join(map(shlex.quote, folders))}"
    return ("#!/bin/bash\nset -e\ncase \"$1\" in\n"
            f"  base|new) {run} ;;\n"
            "  *) echo \"usage: ./test.sh base|new REPORT\"; exit 1 ;;\nesac\n")


def verifier_script(base_commit: str) -> str:
    """``tests/test.sh`` of an exported task: DeepSWE v1.1's verifier steps, written for this project.

    Resets the files model.patch touches to the base commit and applies it (a patch that does not
    apply writes ``reward.json`` with ``apply_failed`` and stops), resets the files test.patch
    touches and applies it, then runs ``/app/test.sh base`` and ``new`` with their JUnit reports in
    ``/logs/verifier``. Grading is posttrain's, from those reports."""
    return f"""#!/bin/bash
# Verifier of a posttrain Harbor task: apply the submission and the hidden tests, run both suites.
set -uo pipefail
cd /app || exit 6
mkdir -p /logs/verifier /logs/artifacts
base={shlex.quote(base_commit)}
touched() {{ sed -n 's|^diff --git a/.* b/\\(.*\\)$|\\1|p' "$1" | sort -u; }}
if [ -s /logs/artifacts/model.patch ]; then
  for f in $(touched /logs/artifacts/model.patch); do
    git checkout -q "$base" -- "$f" 2>/dev/null || rm -rf -- "$f"
  done
  if ! git apply --whitespace=nowarn /logs/artifacts/model.patch; then
    echo '{{"reward": 0, "apply_failed": 1}}' > /logs/verifier/reward.json
    exit 0
  fi
fi
for f in $(touched /tests/test.patch); do
  git checkout -q HEAD -- "$f" 2>/dev/null || rm -rf -- "$f"
done
git apply --whitespace=nowarn /tests/test.patch || exit 3
chmod +x /app/test.sh
bash /app/test.sh base /logs/verifier/base.xml
bash /app/test.sh new /logs/verifier/new.xml
exit 0
"""


def export_task(task: Task, out: Path) -> Path:
    """Write one bundled task as a Harbor task under ``out/tasks/<id>/``, its repository (the base
    without the tests, which become hidden) as ``out/repos/<id>.bundle``."""
    task_dir = out / "tasks" / task.id
    test_file = task.metadata["test_file"]
    module = task.metadata["module_file"]
    with tempfile.TemporaryDirectory(prefix="posttrain-export-") as tmp:
        repo = Path(tmp) / "repo"
        _git(Path(tmp), "clone", "-q", "--no-hardlinks", task.repo_path, str(repo))
        _git(repo, "checkout", "-q", "-B", "main", task.base_commit)
        test_text = (repo / test_file).read_text()
        _git(repo, "rm", "-q", "-r", "--cached", "tests")
        (repo / test_file).unlink()
        _git(repo, "commit", "-q", "-m", f"{task.id}: base without its hidden tests")
        base = _git(repo, "rev-parse", "HEAD").strip()
        # solution: the reference edits, as a patch of the module
        source = (repo / module).read_text()
        edits = [(line, text) for _, line, text in task.metadata["reference_edits"]]
        (repo / module).write_text(apply_edits(source, edits))
        solution = _git(repo, "diff", "--binary", "--", module)
        _git(repo, "checkout", "-q", "--", module)
        # test.patch: the repository's test.sh and the hidden tests
        (repo / "test.sh").write_text(_inner_test_sh(task))
        os.chmod(repo / "test.sh", 0o755)
        (repo / test_file).parent.mkdir(parents=True, exist_ok=True)
        (repo / test_file).write_text(test_text)
        _git(repo, "add", "-A")
        test_patch = _git(repo, "diff", "--cached", "--binary")
        _git(repo, "reset", "-q", "--hard", "HEAD")
        for ref in _git(repo, "for-each-ref", "--format=%(refname)").split():
            if ref != "refs/heads/main":
                _git(repo, "update-ref", "-d", ref)
        (out / "repos").mkdir(parents=True, exist_ok=True)
        _git(repo, "bundle", "create", "-q", str((out / "repos" / f"{task.id}.bundle").resolve()), "main")
    files = {
        "task.toml": _task_toml(task, base),
        "instruction.md": task.instruction.rstrip("\n") + "\n\nCommit your work when you are done.\n",
        "environment/Dockerfile": _dockerfile(task, base),
        "tests/test.sh": verifier_script(base),
        "tests/test.patch": test_patch,
        "tests/config.json": json.dumps({
            "base_commit": base, "f2p_node_ids": list(task.target_tests), "p2p_node_ids": list(task.existing_tests),
            "grade": {"format": "junit", "tool_label": "pytest-junitxml", "reports": list(REPORTS)}}, indent=1) + "\n",
        "solution/solution.patch": solution,
        "solution/solve.sh": ("#!/bin/bash\ncd /app\ngit apply --whitespace=nowarn /solution/solution.patch\n"
                              "git checkout -q -b feature/solution 2>/dev/null || true\ngit add -A\n"
                              "git -c user.name=oracle -c user.email=oracle@local commit -q --no-verify -m 'Apply reference solution'\n"),
    }
    for rel, text in files.items():
        path = task_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            os.chmod(path, 0o755)
    return task_dir


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def _task_toml(task: Task, base: str) -> str:
    lim = task.limits
    return f"""schema_version = "1.3"
artifacts = ["/logs/artifacts/model.patch"]
[task]
name = {_toml_str("posttrain/" + task.id)}
description = ""
[metadata]
task_id = {_toml_str(task.id)}
language = "python"
category = "bugfix"
repository_url = {_toml_str(EXPORT_URL.format(id=task.id))}
base_commit_hash = {_toml_str(base)}
split = {_toml_str(task.split)}
difficulty = {task.difficulty}
[verifier]
network_mode = "no-network"
timeout_sec = {float(lim.test_timeout_s) * 2}
[agent]
network_mode = "no-network"
timeout_sec = {float(lim.agent_timeout_s)}
[environment]
build_timeout_sec = 600.0
os = "linux"
cpus = {float(lim.cpus)}
memory_mb = {max(int(lim.memory_mb), 1024)}
storage_mb = {max(int(lim.storage_mb), 256)}
gpus = 0
"""


def _dockerfile(task: Task, base: str) -> str:
    return f"""# The repository of a posttrain bundled task at its base commit (no later history).
FROM posttrain-base
WORKDIR /app
ARG BASE_SHA={base}
RUN git clone {EXPORT_URL.format(id=task.id)} . && git checkout -B main "$BASE_SHA"
# commit hooks are not task content
RUN git config core.hooksPath /dev/null
"""


def export_harbor(tasks: Sequence[Task], out: str | Path) -> dict[str, Any]:
    """Write ``tasks`` (bundled tasks) as a Harbor dataset under ``out``: ``dataset.toml``,
    ``tasks/<id>/`` (task.toml, instruction.md, environment/Dockerfile, tests/test.sh,
    tests/test.patch, tests/config.json, solution/solution.patch and solve.sh) and ``repos/<id>.bundle``
    (the sources folder to build them from). Returns a summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [export_task(task, out).name for task in tasks]
    lines = ['[dataset]\nname = "posttrain/bundled-harbor"\ndescription = "The posttrain bundled suite as Harbor tasks"\n']
    lines += [f'\n[[tasks]]\nname = {_toml_str("posttrain/" + t)}\n' for t in written]
    (out / "dataset.toml").write_text("".join(lines))
    return {"tasks": len(written), "path": str(out), "sources": str(out / "repos"),
            "digest": hashlib.sha256("".join(sorted(written)).encode()).hexdigest()[:12]}
