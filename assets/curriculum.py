"""The ``difficulty_curriculum`` asset: task difficulty from the base model's pass rates."""


import dagster as dg

from assets.images import image_cache
from assets.resources import PosttrainStorage
from assets.run_files import ensure_embedded_base, run_file_dict
from evals.bundled import read_suite
from evals.tasks import rl_tasks
from training.curriculum import TIERS, level_rates, measure_base_model, stream_summaries, tier_of


class RunFileConfig(dg.Config):
    """``run_file``: the run TOML (default: the embedded default, ``examples/embedded.toml``).
    ``attempts_per_task``: base-model attempts per RL task (0: the run file's value, else 4).
    ``sft_steps``: supervised steps when the embedded base model is built here (0: its default).
    ``stream_tasks_per_level``: with ``[curriculum] task_stream`` (RL draws generated tasks, not the
    suite's), the base model is measured on this many of the suite's RL tasks a level, for the
    stream's starting level weights."""

    run_file: str = ""
    attempts_per_task: int = 0
    sft_steps: int = 0
    stream_tasks_per_level: int = 15
    max_turns: int = 4
    max_new_tokens: int = 48
    temperature: float = 1.0
    workers: int = 2


@dg.asset(group_name="training", deps=[image_cache])
def difficulty_curriculum(
    context: dg.AssetExecutionContext, config: RunFileConfig, storage: PosttrainStorage
) -> dg.MaterializeResult:
    """Pass rates of the base model over k attempts per RL task (the train split without the base
    model's demonstrations, :func:`evals.tasks.rl_tasks`), the tiers from easy to hard
    they define, and the retry queue of tasks no attempt solved.

    With ``[curriculum] task_stream = true`` RL draws from the task stream instead (tasks generated
    and validated as the run goes, each new to it: :class:`training.curriculum.TaskStream`): the
    base model is measured on a sample of each level, where the stream's level weights start, and
    the metadata shows each run's stream (tasks drawn, solved, retried, rejected by validation)."""
    data, source = run_file_dict(storage, config.run_file)
    if config.stream_tasks_per_level < 1:
        raise ValueError("difficulty_curriculum: config key 'stream_tasks_per_level' must be >= 1, "
                         f"got {config.stream_tasks_per_level}")
    model = ensure_embedded_base(context, data, sft_steps=config.sft_steps)
    attempts = config.attempts_per_task or data["curriculum"].get("attempts_per_task") or 4
    tasks = rl_tasks(read_suite(data["curriculum"]["tasks"]))
    settings = {k: data["curriculum"][k] for k in ("retry_after_steps", "open_hard_after_steps") if k in data["curriculum"]}
    stream = dict(settings) if data["curriculum"].get("task_stream") else None
    if stream is not None:
        tasks = [t for lv in (1, 2, 3) for t in [t for t in tasks if t.difficulty == lv][:config.stream_tasks_per_level]]
    measured = measure_base_model(
        model, tasks, storage.curriculum_dir(), attempts=attempts, settings=settings, run_file=source,
        max_turns=config.max_turns, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        workers=config.workers, task_stream=stream, log=context.log.info,
    )
    rates, tiers = measured.curriculum.pass_rates, measured.curriculum.tiers()
    difficulty = {t.id: t.difficulty for t in tasks}
    table = "| task | level | pass rate | tier |\n| --- | --- | --- | --- |\n" + "\n".join(
        f"| {t} | {difficulty.get(t, '')} | {rates[t]:.3f} | {tier_of(rates[t])} |"
        for name in TIERS for t in tiers[name])
    return dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(measured.path)),
        "tasks": len(rates),
        "attempts_per_task": attempts,
        "mean_pass_rate": float(sum(rates.values()) / len(rates)),
        **{f"tier_{name}": len(ids) for name, ids in tiers.items()},
        "retry_queue": len(tiers["hard"]),
        "pass_rates": dg.MetadataValue.md(table),
        **stream_metadata(stream is not None, stream_summaries(storage.runs_dir())),
        **({"task_stream_level_rates": dg.MetadataValue.json(level_rates(rates, tasks))} if stream is not None else {}),
    })


def stream_metadata(enabled: bool, summaries: dict[str, dict]) -> dict[str, object]:
    """Whether RL draws from the task stream, and the state of each run's stream (tasks drawn,
    solved, retried, rejected by validation, validation seconds a task) as of its last step."""
    table = "| run | step | drawn (L1/L2/L3) | solved | retried (draws) | retry queue | rejected | validation s/task |\n" \
            "| --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(
                f"| {run} | {s.get('step')} | {s.get('drawn')} ({'/'.join(str(v) for v in (s.get('drawn_by_level') or {}).values())}) "
                f"| {s.get('solved')} | {s.get('retried')} | {s.get('retry_queue')} | {s.get('rejected')} "
                f"| {s.get('validation_s_per_task')} |" for run, s in summaries.items())
    out: dict[str, object] = {"task_stream": enabled}
    if summaries:
        out["task_stream_runs"] = dg.MetadataValue.md(table)
        out["task_stream_drawn"] = sum(int(s.get("drawn") or 0) for s in summaries.values())
        out["task_stream_solved"] = sum(int(s.get("solved") or 0) for s in summaries.values())
        out["task_stream_retried"] = sum(int(s.get("retried") or 0) for s in summaries.values())
    return out


defs = dg.Definitions(assets=[difficulty_curriculum])
