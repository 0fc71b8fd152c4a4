"""The ``task_dataset`` asset: the tasks a run trains and evaluates on."""


import json
import os
from pathlib import Path

import dagster as dg

from assets.resources import PosttrainStorage
from evals.flawed import install_published_lists
from evals.tasks import TaskSet, load_bundled, load_tasks, rl_tasks, summarize
from training.curriculum import stream_summaries


class TaskDatasetConfig(dg.Config):
    """Which task sources to load: ``bundled`` (the generated suite, built and validated under the
    datasets folder), a Harbor/DeepSWE folder, or a SWE-bench ``.jsonl``/``.parquet`` file.
    ``harbor_sources``: a folder of repository sources (git folders or bundles named by repository)
    Harbor tasks are built from; with it, a Harbor task that cannot be built is reported incomplete
    with the reason."""

    sources: list[str] = ["bundled"]
    build_workers: int = 0  # tasks of the bundled suite built at once; 0: four per core, at most 32
    harbor_sources: str = ""
    # The bundled suite's size: demonstration and held-out tasks per level, as many RL tasks as
    # demonstrations, and 135 more held out after them (evals.bundled.generate; 60 gives 720 tasks,
    # 450 held out: a +3-point gain shows a paired 95% interval above zero more often than not).
    bundled_per_level: int = 60
    # RL tasks per level (the curriculum and the RL loop draw from them alone); 0: as many as there
    # are demonstrations, 45 a level at 60. The held-out tasks generated after the RL ones come from
    # the same random stream, so another count gives other extra held-out tasks: compare runs
    # evaluated on one suite. A run file with `[curriculum] task_stream = true` draws its RL tasks
    # from the task stream instead (a generator of its own), which leaves this suite as it is.
    bundled_rl_per_level: int = 0
    # Held-out tasks per level generated after the RL ones; 0: nine quarters of bundled_per_level
    # (135 at 60: evals.bundled.default_extra_eval_per_level says why).
    bundled_extra_eval_per_level: int = 0


@dg.asset(group_name="tasks", kinds={"parquet"})
def task_dataset(
    context: dg.AssetExecutionContext, config: TaskDatasetConfig, storage: PosttrainStorage
) -> dg.MaterializeResult:
    """Tasks loaded from every configured source (the bundled suite, Harbor/DeepSWE folders,
    SWE-bench JSONL/Parquet) into one schema, with train and held-out eval splits. The bundled suite
    is generated and every task validated by running its tests in a sandbox; tasks a source lists but
    that cannot be loaded (or, given repository sources, built) are reported as incomplete. A
    dataset's published flawed-task lists (``flawed/lists.json``) are installed under
    ``datasets/flawed/``. RL runs that draw from the task stream (tasks generated and validated as
    they train, apart from this suite) are listed with how many tasks each drew, solved and retried."""
    # heavy: pandas and evals.bundled (numpy); the code location loads every asset module, this asset's body only when it runs
    import pandas as pd
    from evals.bundled import ensure_suite

    out_dir = storage.datasets_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    combined = TaskSet(())
    per_source = {}
    for source in config.sources:
        if source == "bundled":
            if config.bundled_per_level < 1:
                raise ValueError(f"task_dataset: config key 'bundled_per_level' must be >= 1, got {config.bundled_per_level}")
            if config.bundled_rl_per_level < 0:
                raise ValueError("task_dataset: config key 'bundled_rl_per_level' must be >= 0 (0: as many as the "
                                 f"demonstrations), got {config.bundled_rl_per_level}")
            if config.build_workers < 0:
                raise ValueError("task_dataset: config key 'build_workers' must be >= 0 (0: four per core, at most 32), "
                                 f"got {config.build_workers}")
            if config.bundled_extra_eval_per_level < 0:
                raise ValueError("task_dataset: config key 'bundled_extra_eval_per_level' must be >= 0 (0: the "
                                 f"default), got {config.bundled_extra_eval_per_level}")
            path = ensure_suite(out_dir / "bundled", workers=config.build_workers, per_level=config.bundled_per_level,
                                rl_per_level=config.bundled_rl_per_level or None,
                                extra_eval_per_level=config.bundled_extra_eval_per_level or None)
            loaded = load_bundled(path)
        else:
            loaded = load_tasks(source, sources=config.harbor_sources or None)
            published = Path(source) / "flawed" / "lists.json"
            if published.is_file():  # a dataset's published flawed lists, where the report reads lists

                for path in install_published_lists(published, storage.path):
                    context.log.info(f"{source}: flawed list {path.name}")
        context.log.info(f"{source}: {len(loaded.tasks)} tasks, {len(loaded.incomplete)} incomplete")
        per_source[source] = len(loaded.tasks)
        combined = combined + loaded
    ids = [t.id for t in combined.tasks]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"task_dataset: task id {dupes[0]!r} appears in more than one source")

    parquet = out_dir / "tasks.parquet"
    tmp = parquet.with_name(f".tasks.parquet.tmp-{os.getpid()}")
    pd.DataFrame([t.to_row() for t in combined.tasks]).to_parquet(tmp, index=False)
    tmp.replace(parquet)
    incomplete = [{"id": t.id, "source": t.source, "path": t.path, "reason": t.reason} for t in combined.incomplete]
    (out_dir / "incomplete.json").write_text(json.dumps(incomplete, indent=1) + "\n")
    for item in incomplete:
        context.log.warning(f"incomplete task {item['id']} ({item['path']}): {item['reason']}")

    summary = summarize(combined)
    splits = {s or "(none)": sum(t.split == s for t in combined.tasks) for s in sorted({t.split for t in combined.tasks})}
    levels = {str(d): sum(t.difficulty == d for t in combined.tasks) for d in sorted({t.difficulty for t in combined.tasks})}
    table = "| source | tasks |\n|---|---|\n" + "\n".join(f"| {s} | {n} |" for s, n in per_source.items())
    return dg.MaterializeResult(metadata={
        "tasks": summary["tasks"],
        "incomplete": dg.MetadataValue.json(incomplete),
        "by_language": dg.MetadataValue.json(summary["by_language"]),
        "splits": dg.MetadataValue.json(splits),
        # train tasks the embedded base model learns from by demonstration, and those RL draws from
        "train_roles": dg.MetadataValue.json({
            "demonstrations": sum(t.split == "train" and t.metadata.get("demonstration") is True for t in combined.tasks),
            "rl": len(rl_tasks(combined.tasks))}),
        "by_difficulty": dg.MetadataValue.json(levels),
        "median_target_tests": summary["median_target_tests"],
        "median_existing_tests": summary["median_existing_tests"],
        "sources": dg.MetadataValue.md(table),
        "path": dg.MetadataValue.path(str(parquet)),
        **stream_metadata(stream_summaries(storage.runs_dir())),
    })


def stream_metadata(summaries: dict[str, dict]) -> dict[str, object]:
    """The RL task stream of each run that drew from one (:mod:`training.curriculum`), in all: tasks
    drawn, solved and retried, beside this dataset's tasks, which the stream never serves."""
    if not summaries:
        return {}
    total = {k: sum(int(s.get(k) or 0) for s in summaries.values()) for k in ("drawn", "solved", "retried", "rejected")}
    return {f"task_stream_{k}": v for k, v in total.items()} | {
        "task_stream_runs": dg.MetadataValue.json({run: {k: s.get(k) for k in ("step", "drawn", "solved", "retried", "rejected")}
                                                   for run, s in summaries.items()})}


defs = dg.Definitions(assets=[task_dataset])
