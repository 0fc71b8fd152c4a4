"""The sandbox the harness and the grader act through, as a small Protocol.

``sandboxes/`` (the platform's sandbox package: runtimes, images, the in-sandbox ``pxd`` daemon and
its client) is what runs episodes. evals depends only on this narrow surface, so the harness and the
grader are written once and work with any runtime that offers it:

- ``exec(command, timeout_s, output_cap_bytes)`` runs a shell command in the task's repository
  folder and returns its exit code, merged output (capped) and whether it timed out;
- ``read_file(path)`` / ``write_file(path, data)`` with paths relative to the repository folder.

A :data:`SandboxFactory` opens a fresh sandbox of a task with its repository at the base commit, as a
context manager that tears it down on exit. :class:`InfraError` is what a runtime raises when the
sandbox itself failed (died, could not start): graders retry it and never score it.

:class:`LocalRepoSandbox` is a working copy of a bundled task's repository in a temporary folder,
with commands run as plain subprocesses. It isolates nothing: it is for code the project itself
generated (validating the bundled suite, tests) on machines where no sandbox runtime is set up.
Use the ``sandboxes/`` runtimes for anything a model wrote.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Protocol

from evals.tasks import Task


class InfraError(RuntimeError):
    """The sandbox or the grader's own machinery failed; the attempt is retried, never scored."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    output: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0


class Sandbox(Protocol):
    def exec(self, command: str, *, timeout_s: float = 60.0, output_cap_bytes: int = 65536) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes) -> None: ...


SandboxFactory = Callable[[Task], ContextManager[Sandbox]]

GIT_ENV = {
    "GIT_AUTHOR_NAME": "posttrain", "GIT_AUTHOR_EMAIL": "posttrain@localhost",
    "GIT_COMMITTER_NAME": "posttrain", "GIT_COMMITTER_EMAIL": "posttrain@localhost",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}


class LocalRepoSandbox:
    """A temporary clone of a task's local repository; see the module docstring for its limits."""

    def __init__(self, task: Task, root: Path):
        if task.repo_path is None:
            raise InfraError(f"task {task.id}: LocalRepoSandbox needs a local repository, the task names image {task.image}")
        self.task = task
        self.dir = root / "repo"
        env = {**os.environ, **GIT_ENV}
        proc = subprocess.run(
            ["git", "clone", "-q", "--no-hardlinks", task.repo_path, str(self.dir)],
            capture_output=True, text=True, env=env,
        )
        if proc.returncode != 0:
            raise InfraError(f"task {task.id}: cloning {task.repo_path} failed: {proc.stderr.strip()}")
        if task.base_commit:
            subprocess.run(["git", "-C", str(self.dir), "checkout", "-q", task.base_commit], check=True, env=env)
        self._env = {**env, "HOME": str(root), "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

    def _path(self, path: str) -> Path:
        full = (self.dir / path).resolve()
        if not full.is_relative_to(self.dir.resolve()):
            raise PermissionError(f"{path}: outside the repository")
        return full

    def exec(self, command: str, *, timeout_s: float = 60.0, output_cap_bytes: int = 65536) -> ExecResult:
        import time

        started = time.monotonic()
        proc = subprocess.Popen(
            ["bash", "-c", command], cwd=self.dir, env=self._env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            timed_out = True
        truncated = len(out) > output_cap_bytes
        return ExecResult(
            exit_code=proc.returncode if not timed_out else 124,
            output=out[:output_cap_bytes].decode(errors="replace"),
            timed_out=timed_out,
            truncated=truncated,
            duration_s=time.monotonic() - started,
        )

    def read_file(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    def write_file(self, path: str, data: bytes) -> None:
        full = self._path(path)
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(data)


@contextlib.contextmanager
def local_repo_sandbox(task: Task) -> Iterator[LocalRepoSandbox]:
    """A :class:`LocalRepoSandbox` of ``task`` in a temporary folder, removed on exit."""
    root = Path(tempfile.mkdtemp(prefix=f"posttrain-{task.id[:40]}-"))
    try:
        yield LocalRepoSandbox(task, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
