"""``deepswe_eval`` on a Harbor dataset (DeepSWE v1.1's tasks, or the bundled suite exported as Harbor
tasks): the body of the asset's Harbor branch, kept here so that ``assets/evals.py`` only picks it.

The tasks are loaded whole with their repository sources (:func:`evals.tasks.load_harbor`); their
images are built through the image cache (the store and layer cache the ``image_cache`` asset
fills: an image it built is found, a missing one is built here with the same progress lines,
:func:`assets.images.build_harbor_images`); every attempt runs DeepSWE v1.1's verifier flow
(:func:`evals.harbor.evaluate_harbor_checkpoint`, the checkpoint's model served by a replica
process). The rows have the bundled path's columns (:data:`evals.evaluate.ROW_COLUMNS`), so
``eval_report``, the flawed views and the asset's checks read them unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg

from assets.resources import PosttrainStorage


def harbor_eval_tasks(context: dg.AssetExecutionContext, dataset: str, sources: str, split: str,
                      task_ids: list[str]) -> list:
    """The Harbor tasks ``deepswe_eval`` evaluates: those of ``dataset`` buildable from ``sources``
    (each one that is not is logged with the reason), restricted to ``task_ids`` when given and to
    ``split`` when set (a task with no split, as DeepSWE's have, counts as held out)."""
    from evals.tasks import load_harbor

    if not sources:
        raise ValueError(f"deepswe_eval: harbor_dataset {dataset!r} needs harbor_sources (the folder of "
                         "repository sources its images are built from)")
    task_set = load_harbor(dataset, sources=sources)
    for item in task_set.incomplete:
        if not task_ids or item.id in task_ids:
            context.log.warning(f"deepswe_eval: Harbor task {item.id} is not evaluated: {item.reason}")
    tasks = list(task_set.tasks)
    if task_ids:
        known = {t.id for t in tasks} | {t.id for t in task_set.incomplete}
        unknown = [i for i in task_ids if i not in known]
        if unknown:
            raise ValueError(f"deepswe_eval: harbor_tasks names {', '.join(unknown)}, not a task of {dataset}")
        tasks = [t for t in tasks if t.id in set(task_ids)]
    if split:
        tasks = [t for t in tasks if t.split in (split, "")]
    if not tasks:
        raise ValueError(f"deepswe_eval: Harbor dataset {dataset} has no buildable task"
                         + (f" in split {split!r}" if split else ""))
    return tasks


def harbor_eval_rows(context: dg.AssetExecutionContext, config: Any, storage: PosttrainStorage,
                     policy: Any) -> tuple[list, list[dict[str, Any]]]:
    """Evaluate the checkpoint ``policy`` (:func:`training.checkpoint.checkpoint_policy`) on the Harbor
    dataset of ``config`` (``DeepSWEEvalConfig``); returns the tasks and one row per attempt. A task
    whose image cannot be built has one ``infra_error`` row per attempt saying why (never scored).
    Each attempt's verification (posttrain's grade beside the task's own ``reward.json``) is kept in
    ``evals/harbor/<checkpoint>/<run_id>/<task>/<attempt>/``."""
    import sandboxes
    from assets.images import build_harbor_images
    from evals.grading import INFRA_ERROR
    from evals.harbor import Verification, attempt_row, evaluate_harbor_checkpoint, harbor_sandbox_factory

    key = context.partition_key
    tasks = harbor_eval_tasks(context, config.harbor_dataset, config.harbor_sources, config.split,
                              list(config.harbor_tasks))
    store = sandboxes.ImageStore(storage.images_dir())
    budget = int(float(os.environ.get("POSTTRAIN_SANDBOX_CACHE_GIB", "20")) * 1024**3)
    cache = sandboxes.LayerCache(storage.path / "sandboxes" / "cache", budget)
    recipes = {t.id: (t.metadata["environment"], t.base_commit or "") for t in tasks}
    built, failures = build_harbor_images(context, recipes, config.harbor_sources, store, cache,
                                          network=config.harbor_network)
    ready = [t for t in tasks if t.id in built]
    rows: list[dict[str, Any]] = []
    if ready:
        rows = evaluate_harbor_checkpoint(
            ready, policy.base_model, harbor_sandbox_factory(store, cache, runtime=config.sandbox_runtime),
            checkpoint=key, adapter=policy.adapter, adapter_version=policy.adapter_version, attempts=config.attempts,
            workers=config.workers, record_dir=storage.evals_dir() / "harbor" / key / context.run_id,
            log=context.log.info, max_turns=config.max_turns, max_new_tokens=config.max_new_tokens,
            # JSON tool calls: the compact format's prompt is made from a bundled task's own metadata
            temperature=config.temperature, seed=config.seed, action_format="json",
        )
    for task in tasks:
        if task.id in failures:
            lost = Verification(INFRA_ERROR, None, notes=[f"the task's image was not built: {failures[task.id][-400:]}"])
            rows += [attempt_row(task, a, None, lost, key, policy.adapter_version) for a in range(config.attempts)]
    order = {t.id: i for i, t in enumerate(tasks)}
    rows.sort(key=lambda r: (order[r["task_id"]], r["attempt"]))
    return tasks, rows
