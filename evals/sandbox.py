"""The sandbox the harness and the grader act through, as a small Protocol.

``sandboxes/`` (the platform's sandbox package: runtimes, images, the in-sandbox ``pxd`` daemon and
its client) is what runs episodes. evals depends only on this narrow surface, so the harness and the
grader are written once and work with any runtime that offers it (:class:`EpisodeSandbox`; its
answers are :class:`sandboxes.client.ExecResult`):

- ``exec(command, timeout_s, output_cap_bytes, env, results_fd, kill_others)`` runs a shell command
  in the task's repository folder and returns its exit code, merged output (capped) and whether it
  timed out; with ``results_fd`` also what it wrote to that descriptor, and with ``kill_others``
  nothing else in the sandbox outlives it;
- ``read_file(path)`` / ``write_file(path, data)`` with paths relative to the repository folder.

A :data:`SandboxFactory` opens a fresh sandbox of a task with its repository at the base commit, as a
context manager that tears it down on exit. :class:`InfraError` is what a runtime raises when the
sandbox itself failed (died, could not start): graders retry it and never score it.
:class:`AgentFault` is what the grader raises when the agent broke what it controls (its repository,
its sandbox): the attempt scores 0 and is not retried.

Between the two, :class:`SandboxBroken`: a sandbox that had started and answered, then failed for a
reason inside it (:meth:`sandboxes.runtimes.Sandbox.end_cause`: its wall-time, memory or process
limit reached, its runtime or gVisor's kernel ending by itself, its daemon starved at its CPU or
memory limit), with the evidence (the runtime's exit status, what its cgroup counted). Only the code
that ran in the sandbox can have caused it, so whoever knows whose code that was decides: the
harness scores it as the agent's failed attempt once the agent's commands have run there
(:mod:`evals.harness`); the grader, which runs the agent's patch with the task's tests, treats it
as the sandbox failing and lets a control run of the unpatched task decide (:mod:`evals.grading`).
It is an :class:`InfraError` to code that does not know of it. Failures from outside the sandbox
(it could not start: image missing, runtime not installed or failing, the host's disk full while
making its root; it was killed from the host) stay a plain :class:`InfraError`.

:func:`platform_sandbox_factory` is the implementation: each sandbox is a ``sandboxes`` sandbox
(bubblewrap or gVisor, ``pxd`` inside) wrapped in :class:`PlatformSandbox`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol

import sandboxes
from evals.tasks import Task
from sandboxes.client import ExecResult, PxdConnectionError, PxdError
from sandboxes.images import WORKDIR, tar_directory
from sandboxes.pool import PoolClient
from sandboxes.runtimes import SandboxError


class InfraError(RuntimeError):
    """The sandbox or the grader's own machinery failed; the attempt is retried, never scored."""


class AgentFault(Exception):
    """The agent broke what it controls (its repository, its sandbox): its attempt scores 0, no retry.

    ``label`` names what broke, a stable name: ``agent_broke_repo`` (git cannot read the agent's
    repository: garbage in ``.git/HEAD``, missing objects), ``agent_patch_too_large`` (a committed
    patch over the grader's cap), ``agent_broke_sandbox`` (the patched tests killed the grading
    sandbox while the unpatched task runs there), and the labels of :data:`AGENT_LABELS` (the
    agent's commands ran its own sandbox into a failure, :class:`SandboxBroken`). The message gives
    the evidence.
    """

    def __init__(self, label: str, evidence: str = ""):
        super().__init__(f"{label}: {evidence}" if evidence else label)
        self.label = label
        self.evidence = evidence


class SandboxBroken(InfraError):
    """A started sandbox failed for a reason inside it (see the module docstring): ``label`` is the
    stable name an agent's failed attempt takes (:data:`AGENT_LABELS`), ``evidence`` what the host saw."""

    def __init__(self, label: str, evidence: str, message: str):
        super().__init__(message)
        self.label = label
        self.evidence = evidence


# the label of each inside cause of sandboxes.runtimes.SandboxEnd, as an agent's failed attempt
AGENT_LABELS = {
    "wall_time": "agent_wall_time",
    "memory_limit": "agent_memory_limit",
    "pids_limit": "agent_pids_limit",
    "killed_from_inside": "agent_killed_sandbox",
    "runtime_exited": "agent_broke_sandbox",
    "unresponsive": "agent_stalled_sandbox",
}


class EpisodeSandbox(Protocol):
    """``exec``'s ``env`` adds variables; ``results_fd`` gives the command a pipe at that descriptor
    whose content comes back in ``ExecResult.results``; ``kill_others`` kills every other process of
    the sandbox once the command ends, before the answer. A sandbox offering the last two sets
    ``supports_results = True``; the grader then streams pytest's results (:mod:`evals.grading`)."""

    def exec(self, command: str, *, timeout_s: float = 60.0, output_cap_bytes: int = 65536,
             env: dict[str, str] | None = None, results_fd: int | None = None,
             kill_others: bool = False) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes) -> None: ...


SandboxFactory = Callable[[Task], ContextManager[EpisodeSandbox]]

GIT_ENV = {
    "GIT_AUTHOR_NAME": "posttrain", "GIT_AUTHOR_EMAIL": "posttrain@localhost",
    "GIT_COMMITTER_NAME": "posttrain", "GIT_COMMITTER_EMAIL": "posttrain@localhost",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}


class PlatformSandbox:
    """An :class:`EpisodeSandbox` over a running ``sandboxes`` sandbox (pxd inside, reached through its client).

    Translates the runtime's failures into the grader's terms: a daemon that is gone is
    :class:`SandboxBroken` when the sandbox's own doing ended it, else :class:`InfraError`; a
    command the daemon could not start because the sandbox is at its process or memory limit is
    :class:`SandboxBroken` too; a path the daemon reports missing is ``FileNotFoundError``.
    """

    def __init__(self, sandbox):
        self.sandbox = sandbox
        # results_fd and kill_others need a pxd that is PID 1 of its sandbox (bwrap, gVisor), never
        # the unisolated debug runtime, where killing "every other process" would mean the host's
        runtime = getattr(getattr(sandbox, "runtime", None), "name", None)
        try:
            accepts = "results_fd" in inspect.signature(sandbox.exec).parameters
        except (TypeError, ValueError):
            accepts = False
        self.supports_results = accepts and runtime in ("bwrap", "gvisor", "kata")

    def exec(self, command: str, *, timeout_s: float = 60.0, output_cap_bytes: int = 65536,
             env: dict[str, str] | None = None, results_fd: int | None = None,
             kill_others: bool = False) -> ExecResult:
        kwargs: dict = {"env": env} if env else {}
        if self.supports_results:
            kwargs.update(results_fd=results_fd, kill_others=kill_others)
        try:
            r = self.sandbox.exec(command, timeout_s=timeout_s, output_cap_bytes=output_cap_bytes, **kwargs)
        except PxdConnectionError as exc:
            raise self._lost(exc) from exc
        except PxdError as exc:
            raise self._refused(exc) from exc
        if isinstance(r, ExecResult):
            return r
        return ExecResult(r.exit_code, r.output, "", r.truncated, r.timed_out, r.duration_s,
                          results=getattr(r, "results", None),
                          results_truncated=bool(getattr(r, "results_truncated", False)))

    def _lost(self, exc: PxdConnectionError) -> InfraError:
        """The error of a daemon that is gone: :class:`SandboxBroken` when the sandbox says its own
        doing ended it (``end_cause``; a pod of the cluster's pool does not say), else
        :class:`InfraError`; the evidence is in the message either way."""
        message = f"sandbox {self.sandbox.id}: {exc}"
        end_cause = getattr(self.sandbox, "end_cause", None)
        end = end_cause() if callable(end_cause) else None
        if end is None:
            return InfraError(message)
        if end.evidence not in message:
            message += f"; {end.evidence}"
        if end.inside:
            return SandboxBroken(AGENT_LABELS.get(end.cause, "agent_broke_sandbox"), end.evidence, message)
        return InfraError(message)

    def _refused(self, exc: PxdError) -> InfraError:
        """A command the daemon did not start: :class:`SandboxBroken` when the sandbox is at its own
        process or memory limit (``limits_reached``), else :class:`InfraError` (the harness built
        the request)."""
        limits_reached = getattr(self.sandbox, "limits_reached", None)
        reached = limits_reached() if callable(limits_reached) else None
        if reached is not None:
            evidence = f"its daemon could not start a command ({exc.message}): {reached.evidence}"
            return SandboxBroken(AGENT_LABELS[reached.cause], evidence, f"sandbox {self.sandbox.id}: {evidence}")
        return InfraError(f"sandbox {self.sandbox.id} refused a command: {exc}")

    def read_file(self, path: str) -> bytes:
        try:
            return self.sandbox.read_file(path)
        except PxdConnectionError as exc:
            raise self._lost(exc) from exc
        except PxdError as exc:
            if exc.status == 404:
                raise FileNotFoundError(path) from exc
            raise ValueError(f"{path}: {exc.message}") from exc

    def write_file(self, path: str, data: bytes) -> None:
        try:
            self.sandbox.write_file(path, data)
        except PxdConnectionError as exc:
            raise self._lost(exc) from exc
        except PxdError as exc:
            raise ValueError(f"{path}: {exc.message}") from exc


POOL_URL_VARIABLE = "POSTTRAIN_SANDBOX_POOL_URL"
SANDBOX_IMAGE_VARIABLE = "POSTTRAIN_SANDBOX_IMAGE"
_WORKSPACE_TAR = ".posttrain-workspace.tar"  # in the workspace (pxd writes nowhere else), removed once unpacked


def copy_workspace(box: Any, repo: str | Path) -> None:
    """Unpack the task repository ``repo`` into the workspace of the fresh sandbox ``box`` (a pod of
    the cluster's pool, whose image has an empty ``/workspace``), as its own user, before any agent
    command runs there. A failure here is the infrastructure's: nothing of the agent ran yet."""
    try:
        # the images' own deterministic tar (no setuid bits, no devices), under one top folder that
        # tar strips: the workspace's mount point is not the sandbox user's to change
        box.write_file(_WORKSPACE_TAR, tar_directory(Path(repo), "repo"))
        unpacked = box.exec(f"tar -xof {_WORKSPACE_TAR} -C {WORKDIR} --strip-components=1; status=$?; "
                            f"rm -f {_WORKSPACE_TAR}; exit $status", timeout_s=120)
    except (PxdError, OSError) as exc:
        raise SandboxError(f"copying the repository {repo} into sandbox {getattr(box, 'id', '?')}: {exc}") from exc
    if unpacked.exit_code != 0:
        raise SandboxError(f"copying the repository {repo} into sandbox {getattr(box, 'id', '?')}: tar exited "
                           f"{unpacked.exit_code}: {unpacked.output[-2000:]}")


def platform_sandbox_factory(runtime: str = "bwrap", **start_kwargs) -> SandboxFactory:
    """A :data:`SandboxFactory` that starts a ``sandboxes`` sandbox per call: ``bwrap`` or ``gvisor``
    on this machine, or ``k8s``: a pod of the cluster's sandbox pool (``python -m sandboxes.pool``),
    reached at ``pool_url`` or ``$POSTTRAIN_SANDBOX_POOL_URL`` (the trainer pod's manifest sets it).

    A task with a local repository is started from that folder (built into a cached image on the
    fly); a task with an image name from that image in the store (on the cluster, the image every
    pod of the task runs). On the cluster a task with a repository folder and no image (the bundled
    suite, the task stream's tasks) runs in the sandbox image ``base_image`` (default
    ``$POSTTRAIN_SANDBOX_IMAGE``, the run file's ``[sandbox] image``: python3, git, tar and pxd,
    nothing of posttrain's), its repository copied in before the sandbox is handed out
    (:func:`copy_workspace`), so a folder made while the run goes needs no image build. The
    task's resource limits become the sandbox's (CPU, memory, wall time from the agent timeout plus
    the test timeout).

    Called with a local runtime and no other argument, it returns that runtime's one factory of the
    process: what is computed once per factory (the hidden inputs' answers,
    :func:`evals.call_checks.hidden_checks`) is then computed once for the trainer's episodes and
    the task stream that validates their tasks (:class:`training.curriculum.TaskStream`), which
    otherwise answered every new task twice, in a sandbox each.
    """
    shared = runtime in ("bwrap", "gvisor") and not start_kwargs
    if shared:
        with _shared_lock:
            if runtime not in _shared_factories:
                _shared_factories[runtime] = _make_factory(runtime)
            return _shared_factories[runtime]
    return _make_factory(runtime, **start_kwargs)


_shared_factories: dict[str, SandboxFactory] = {}
_shared_lock = threading.Lock()


def _make_factory(runtime: str, **start_kwargs) -> SandboxFactory:
    pool = None
    base_image = ""
    if runtime == "k8s":
        url = start_kwargs.pop("pool_url", None) or os.environ.get(POOL_URL_VARIABLE)
        base_image = start_kwargs.pop("base_image", None) or os.environ.get(SANDBOX_IMAGE_VARIABLE, "")
        if not url:
            raise ValueError(f"sandbox runtime 'k8s' needs the sandbox pool's URL: set {POOL_URL_VARIABLE} "
                             "(the trainer's pod has it) or pass pool_url")
        pool = PoolClient(url)

    @contextlib.contextmanager
    def factory(task: Task) -> Iterator[PlatformSandbox]:
        limits = sandboxes.Limits(
            cpus=max(task.limits.cpus, 0.01), memory_mib=max(task.limits.memory_mb, 64),
            wall_s=task.limits.agent_timeout_s + task.limits.test_timeout_s + 60.0,
        )
        source = task.repo_path or task.image
        try:
            if pool is not None:
                image = task.image or (base_image if task.repo_path else "")
                if not image:
                    raise SandboxError(
                        f"task {task.id} names no image, and " + (
                            f"no sandbox image is set for its repository folder ([sandbox] image, {SANDBOX_IMAGE_VARIABLE})"
                            if task.repo_path else "has no repository folder either"))
                box = pool.start(image, task_id=task.id, episode=uuid.uuid4().hex, limits=limits)
                if not task.image:
                    try:
                        copy_workspace(box, task.repo_path)
                    except BaseException:
                        box.close()
                        raise
            else:
                box = sandboxes.start(source, runtime=runtime, limits=limits, **start_kwargs)
        except (SandboxError, OSError) as exc:
            raise InfraError(f"task {task.id}: the {runtime} sandbox did not start: {exc}") from exc
        with box:
            yield PlatformSandbox(box)

    return factory
