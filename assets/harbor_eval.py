"""``deepswe_eval`` on a Harbor dataset (DeepSWE v1.1's tasks, or the bundled suite exported as Harbor
tasks): the body of the asset's Harbor branch, kept here so that ``assets/evals.py`` only picks it.

The tasks are loaded whole with their repository sources (:func:`evals.tasks.load_harbor`); their
images are built through the image cache (the store and layer cache the ``image_cache`` asset
fills: an image it built is found, a missing one is built here with the same progress lines,
:func:`sandboxes.harbor.build_harbor_images`); with ``environment_check`` the reference solution runs
once per image (:func:`evals.harbor.check_environments`, recorded under the datasets folder), so
that strict credit spares the existing tests it fails here; every attempt runs DeepSWE v1.1's
verifier flow (:func:`evals.harbor.evaluate_harbor`, the checkpoint's model served by a replica
process: :func:`evals.evaluate.evaluate_checkpoint`). The rows are :class:`evals.attempts.AttemptRow` rows, as the bundled path's, so
``eval_report``, the flawed views and the asset's checks read them unchanged.

A task the eval names (``task_ids``) that cannot be built, or whose image fails to build, has one
``infra_error`` row per attempt saying why: it is counted by the asset's checks and by ``posttrain
eval``'s exit status, never scored. The dataset's other unbuildable tasks are summed up in one line.
"""

from __future__ import annotations

import functools
from typing import Any

import dagster as dg

from assets.resources import PosttrainStorage
from evals.attempts import INFRA_ERROR, attempt_row
from evals.evaluate import evaluate_checkpoint
from evals.harbor import (
    check_environments, eval_split, evaluate_harbor, harbor_sandbox_factory, with_environment_records,
)
from evals.settings import EvalSection
from evals.tasks import load_harbor
from sandboxes.cache import node_cache
from sandboxes.harbor import build_harbor_images
from sandboxes.images import ImageStore


def harbor_eval_tasks(context: dg.AssetExecutionContext, dataset: str, sources: str, split: str,
                      task_ids: list[str]) -> tuple[list, list]:
    """The Harbor tasks ``deepswe_eval`` evaluates, and those it names that cannot be built (each an
    :class:`~evals.tasks.IncompleteTask` with the reason). Without ``task_ids``: every task of ``dataset`` buildable from ``sources``, of ``split``
    when set (a task with no split, as DeepSWE's have, counts as held out); the others are logged in
    one line (their reasons at debug level). With ``task_ids``: those tasks, in that order; an id
    that names no task folder of the dataset, or a task outside ``split``, raises ``ValueError``."""
    if not sources:
        raise ValueError(f"deepswe_eval: the Harbor dataset {dataset!r} needs sources (the folder of repository "
                         "sources its images are built from; [eval] sources in the run file)")
    task_set = load_harbor(dataset, sources=sources)
    split = eval_split(split)

    def in_split(task) -> bool:
        return not split or task.split in (split, "")

    if task_ids:
        buildable = {t.id: t for t in task_set.tasks}
        broken = {t.id: t.reason for t in task_set.incomplete}
        unknown = [i for i in task_ids if i not in buildable and i not in broken]
        if unknown:
            raise ValueError(f"deepswe_eval: task_ids names {', '.join(unknown)}, not a task of {dataset}")
        for task_id in task_ids:
            if task_id in broken:
                context.log.warning(f"deepswe_eval: Harbor task {task_id} cannot be evaluated: {broken[task_id]}")
        outside = [i for i in task_ids if i in buildable and not in_split(buildable[i])]
        if outside:
            raise ValueError(f"deepswe_eval: task_ids names {', '.join(outside)}, not in split {split!r} (split "
                             "'all' takes every task)")
        incomplete = {t.id: t for t in task_set.incomplete}
        return [buildable[i] for i in task_ids if i in buildable], [incomplete[i] for i in task_ids if i in incomplete]
    if task_set.incomplete:
        context.log.info(f"deepswe_eval: {len(task_set.incomplete)} of {len(task_set.tasks) + len(task_set.incomplete)} "
                         f"tasks of {dataset} cannot be built from {sources} and are left out")
        for item in task_set.incomplete:
            context.log.debug(f"deepswe_eval: left out {item.id}: {item.reason}")
    tasks = [t for t in task_set.tasks if in_split(t)]
    if not tasks:
        raise ValueError(f"deepswe_eval: Harbor dataset {dataset} has no buildable task"
                         + (f" in split {split!r}" if split else ""))
    return tasks, []


def harbor_eval_rows(context: dg.AssetExecutionContext, section: EvalSection, storage: PosttrainStorage,
                     policy: Any) -> tuple[list, list[dict[str, Any]]]:
    """Evaluate the checkpoint ``policy`` (:func:`training.checkpoint.checkpoint_policy`) on the Harbor
    dataset of ``section`` (the asset's ``[eval]``, handed whole to the evaluation, which reads its
    run keys); returns the tasks and one row per attempt. A task that cannot be built has one
    ``infra_error`` row per attempt saying why (never scored). Each attempt's verification
    (posttrain's grade beside the task's own ``reward.json``) is kept in
    ``evals/harbor/<checkpoint>/<run_id>/<task>/<attempt>/``."""
    key = context.partition_key
    tasks, unbuildable = harbor_eval_tasks(context, section.dataset, section.sources, section.split, list(section.task_ids))
    store = ImageStore(storage.images_dir())
    cache = node_cache(storage.path)
    recipes = {t.id: (t.metadata["environment"], t.base_commit or "") for t in tasks}
    built, failures = build_harbor_images(recipes, section.sources, store, cache, network=section.network,
                                          log=context.log.info, warn=context.log.warning, build_log=context.log.debug)
    ready = [t for t in tasks if t.id in built]
    factory = harbor_sandbox_factory(store, cache, runtime=section.sandbox_runtime)
    records = check_environments(ready, factory, storage.path, {i: b.key for i, b in built.items()},
                                 run_missing=section.environment_check, workers=section.workers, log=context.log.info)
    ready = with_environment_records(ready, records)
    rows: list[dict[str, Any]] = []
    if ready:
        record_dir = storage.evals_dir() / "harbor" / key / context.run_id
        rows = evaluate_checkpoint(  # evaluate_harbor is handed the section's run keys (EvalSection.run_settings)
            ready, policy.base_model, factory, section,
            checkpoint=key, adapter=policy.adapter, adapter_version=policy.adapter_version,
            evaluate_served=functools.partial(evaluate_harbor, record_dir=record_dir, log=context.log.info),
            engine_log=record_dir / "engine.log", log=context.log.info,
            # JSON tool calls: the compact format's prompt is made from a bundled task's own metadata
            action_format="json",
        )
    lost = {**{t.id: (t, f"the task's image was not built: {failures[t.id][-400:]}") for t in tasks if t.id in failures},
            **{t.id: (t, f"cannot be built: {t.reason}") for t in unbuildable}}
    for task, why in lost.values():
        rows += [attempt_row(task, a, None, checkpoint=key, adapter_version=policy.adapter_version, status=INFRA_ERROR,
                             scores=None, detail=why).to_row() for a in range(section.attempts)]
    evaluated = [*tasks, *unbuildable]
    order = {t.id: i for i, t in enumerate(evaluated)}
    rows.sort(key=lambda r: (order[r["task_id"]], r["attempt"]))
    return evaluated, rows
