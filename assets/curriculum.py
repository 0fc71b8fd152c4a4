"""The ``difficulty_curriculum`` asset: task difficulty from the base model's pass rates."""


import json
import tomllib
from pathlib import Path
from typing import Any

import dagster as dg

from assets.images import image_cache
from dagster_project.resources import PosttrainStorage

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_RUN_FILE = PROJECT_ROOT / "examples" / "embedded.toml"
EMBEDDED_MODEL_NAME = "embedded-base"


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


def run_file_dict(storage: PosttrainStorage, run_file: str) -> tuple[dict[str, Any], str]:
    """The run TOML as a dict, with the embedded default's model and tasks placed under ``storage``."""
    path = Path(run_file) if run_file else EMBEDDED_RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"run file {path} is missing")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"run file {path}: not valid TOML: {exc}") from exc
    model = data.setdefault("model", {})
    if model.get("name") == EMBEDDED_MODEL_NAME:
        model["path"] = str(storage.path / "models" / "base")
    curriculum = data.setdefault("curriculum", {})
    curriculum.setdefault("tasks", str(storage.datasets_dir() / "bundled"))
    return data, str(path)


def ensure_embedded_base(context: dg.AssetExecutionContext, storage: PosttrainStorage, data: dict[str, Any],
                         *, sft_steps: int = 0, reuse_any: bool = False) -> Path:
    """The base model folder. The embedded default's is built from the training split unless a build
    of the same settings and data is there (``reuse_any``: any complete build is used as is)."""
    model = Path(data["model"].get("path") or "")
    if data["model"].get("name") == EMBEDDED_MODEL_NAME and not (reuse_any and (model / "build.json").is_file()):
        from evals.bundled import load_suite
        from evals.tasks import demonstration_tasks
        from training.base_model import BaseModelSpec, build_base_model

        tasks = demonstration_tasks(load_suite(data["curriculum"]["tasks"]))
        spec = BaseModelSpec(sft_steps=sft_steps) if sft_steps else BaseModelSpec()
        context.log.info(f"building (or reusing) the embedded base model at {model} from {len(tasks)} demonstrations")
        build_base_model(model, tasks, spec)
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"run file key model.path: {model} is not a Hugging Face model folder")
    return model


@dg.asset(group_name="training", deps=[image_cache])
def difficulty_curriculum(
    context: dg.AssetExecutionContext, config: RunFileConfig, storage: PosttrainStorage
) -> dg.MaterializeResult:
    """Pass rates of the base model over k attempts per RL task (the train split without the base
    model's demonstrations, :func:`evals.tasks.rl_tasks`), the tiers from easy to hard
    they define, and the retry queue of tasks no attempt solved."""
    import pandas as pd
    from transformers import AutoTokenizer

    from evals.bundled import load_suite
    from evals.evaluate import evaluate
    from evals.harness import HttpClient
    from evals.sandbox import platform_sandbox_factory
    from evals.tasks import rl_tasks
    from training.curriculum import Curriculum, tier_of
    from training.episodes import start_engine

    data, source = run_file_dict(storage, config.run_file)
    model = ensure_embedded_base(context, storage, data, sft_steps=config.sft_steps)
    attempts = config.attempts_per_task or data["curriculum"].get("attempts_per_task") or 4
    tasks = rl_tasks(load_suite(data["curriculum"]["tasks"]))
    out_dir = storage.curriculum_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    proc, url = start_engine(str(model), out_dir / "engine.log")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        context.log.info(f"base model on {len(tasks)} RL tasks x {attempts} attempts")
        rows = evaluate(
            tasks, HttpClient(url), tokenizer, platform_sandbox_factory("bwrap"), checkpoint="curriculum-base",
            attempts=attempts, max_turns=config.max_turns, max_new_tokens=config.max_new_tokens,
            temperature=config.temperature, workers=config.workers, stop_token_ids=(tokenizer.eos_token_id,),
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    frame = pd.DataFrame(rows)
    graded = frame[frame["status"] != "infra_error"]
    rates = graded.groupby("task_id")["reward"].mean().to_dict()
    missing = sorted({t.id for t in tasks} - set(rates))
    if missing:
        raise RuntimeError(f"difficulty_curriculum: every attempt of task {missing[0]!r} failed in the sandbox")
    settings = {k: data["curriculum"][k] for k in ("retry_after_steps", "open_hard_after_steps") if k in data["curriculum"]}
    curriculum = Curriculum.from_pass_rates(rates, **settings)
    tiers = curriculum.tiers()
    path = out_dir / "curriculum.json"
    tmp = path.with_name(".tmp-curriculum.json")
    tmp.write_text(json.dumps({"pass_rates": rates, "tiers": tiers, "settings": settings, "attempts_per_task": attempts,
                               "base_model": str(model), "run_file": source}, indent=1, sort_keys=True))
    tmp.replace(path)
    frame.to_parquet(out_dir / "base_attempts.parquet", index=False)
    difficulty = {t.id: t.difficulty for t in tasks}
    table = "| task | level | pass rate | tier |\n| --- | --- | --- | --- |\n" + "\n".join(
        f"| {t} | {difficulty.get(t, '')} | {rates[t]:.3f} | {tier_of(rates[t])} |"
        for name in ("easy", "medium", "hard") for t in tiers[name])
    return dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(path)),
        "tasks": len(rates),
        "attempts_per_task": attempts,
        "mean_pass_rate": float(sum(rates.values()) / len(rates)),
        **{f"tier_{name}": len(ids) for name, ids in tiers.items()},
        "retry_queue": len(tiers["hard"]),
        "pass_rates": dg.MetadataValue.md(table),
    })


defs = dg.Definitions(assets=[difficulty_curriculum])
