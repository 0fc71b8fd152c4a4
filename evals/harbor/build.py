"""Harbor tasks' images and sandboxes.

Which eval datasets are Harbor's (:func:`is_harbor_dataset`); each task's image, built from its
``environment/Dockerfile`` by :func:`sandboxes.harbor.build_harbor_image` (:func:`build_task_image`);
and the sandboxes an agent and the verifier run in, started from that image with the task's limits
and environment (:func:`harbor_sandbox_factory`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from evals.sandbox import InfraError, PlatformSandbox, SandboxFactory
from evals.tasks import Task
import sandboxes
from sandboxes.harbor import build_harbor_image, harbor_env, harbor_limits
from sandboxes.harbor import harbor_image_name as image_name_of
from sandboxes.runtimes import SandboxError, default_cache, default_store


def is_harbor_dataset(dataset: str | Path) -> bool:
    """Whether an eval's ``dataset`` is a Harbor dataset folder (DeepSWE's ``tasks/``, an export, or
    one task folder), not ``bundled``, a built suite folder (``suite.json``) or a SWE-bench file."""
    path = Path(dataset)
    return str(dataset) != "bundled" and path.is_dir() and not (path / "suite.json").is_file()



def harbor_image_name(task: Task) -> str:
    return image_name_of(task.id)


def build_task_image(task: Task, sources: str | Path, store, *, network: bool = True, log=None, rebuild: bool = False):
    """Build (or find) the image of a Harbor task from its ``environment/Dockerfile``
    (:func:`sandboxes.harbor.build_harbor_image`); returns the :class:`~sandboxes.harbor.HarborBuild`."""
    dockerfile = task.metadata.get("environment")
    if not dockerfile:
        raise InfraError(f"task {task.id}: no environment/Dockerfile")
    return build_harbor_image(harbor_image_name(task), dockerfile, task.base_commit or "", sources, store,
                              network=network, log=log, rebuild=rebuild)


def harbor_sandbox_factory(store=None, cache=None, runtime: str = "bwrap") -> SandboxFactory:
    """Sandboxes of Harbor tasks: the task's built image (:func:`build_task_image`), its limits from
    ``task.toml`` (:func:`sandboxes.harbor.harbor_limits`), its environment
    (:func:`sandboxes.harbor.harbor_env`: the task's virtual environment first, plugins autoloaded),
    and a writable root where the task needs one (``metadata["writable_root"]``, decided by
    :func:`evals.tasks.needs_writable_root`: a verifier that installs into ``/opt/venv``), for the
    agent's sandbox and the verifier's alike, as in the task's container."""
    store = store or default_store()
    cache = cache or default_cache()

    @contextlib.contextmanager
    def factory(task: Task) -> Iterator[PlatformSandbox]:
        name = harbor_image_name(task)
        limits = harbor_limits(task.limits.cpus, task.limits.memory_mb, task.limits.storage_mb,
                               task.limits.agent_timeout_s + task.limits.test_timeout_s + 120.0)
        try:
            image = store.load_image(name)
            box = sandboxes.start(image, runtime=runtime, limits=limits, store=store, cache=cache,
                                  env=harbor_env(store, name),
                                  writable_root=bool(task.metadata.get("writable_root", False)))
        except (SandboxError, OSError) as exc:
            raise InfraError(f"task {task.id}: the {runtime} sandbox of image {name} did not start: {exc}") from exc
        with box:
            yield PlatformSandbox(box)

    return factory
