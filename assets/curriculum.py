"""The ``difficulty_curriculum`` asset: task difficulty from the base model's pass rates."""


import dagster as dg

from assets.images import image_cache
from assets.resources import PosttrainStorage
from assets.run_files import ensure_embedded_base, run_file_dict


class RunFileConfig(dg.Config):
    """``run_file``: the run TOML (default: the embedded default, ``examples/embedded.toml``).
    ``attempts_per_task``: base-model attempts per RL task (0: the run file's value, else 4).
    ``sft_steps``: supervised steps when the embedded base model is built here (0: its default)."""

    run_file: str = ""
    attempts_per_task: int = 0
    sft_steps: int = 0
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
    they define, and the retry queue of tasks no attempt solved."""
    from evals.bundled import read_suite
    from evals.tasks import rl_tasks
    from training.curriculum import TIERS, measure_base_model, tier_of

    data, source = run_file_dict(storage, config.run_file)
    model = ensure_embedded_base(context, data, sft_steps=config.sft_steps)
    attempts = config.attempts_per_task or data["curriculum"].get("attempts_per_task") or 4
    tasks = rl_tasks(read_suite(data["curriculum"]["tasks"]))
    settings = {k: data["curriculum"][k] for k in ("retry_after_steps", "open_hard_after_steps") if k in data["curriculum"]}
    measured = measure_base_model(
        model, tasks, storage.curriculum_dir(), attempts=attempts, settings=settings, run_file=source,
        max_turns=config.max_turns, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        workers=config.workers, log=context.log.info,
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
    })


defs = dg.Definitions(assets=[difficulty_curriculum])
