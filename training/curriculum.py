"""The difficulty curriculum: which task to train on next.

Built from the base model's pass rates (k attempts per training task): tasks are ordered easy to hard
and cut into tiers (``easy``: pass rate >= 0.5, ``medium``: above 0, ``hard``: no passing attempt).
Training starts on the easy and medium tiers; the hard tier opens after ``open_hard_after_steps``.
Within the open tiers a task is drawn with weight p(1-p)+floor on its running pass-rate estimate, so
tasks the policy always or never solves (groups with no reward variance, hence no gradient) are drawn
less. A task whose whole group failed goes into the retry queue and comes back ``retry_after_steps``
later. The whole state (estimates, queue, step, random generator) is plain JSON, saved in every
checkpoint.

:func:`measure_base_model` measures those pass rates (the core of the ``difficulty_curriculum``
asset, usable without Dagster) and writes ``curriculum.json``, the file a run file's
``[curriculum] curriculum_file`` names::

    measured = measure_base_model(model_dir, rl_tasks(read_suite(suite)), out_dir, attempts=4)
    measured.curriculum.tiers()
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

CURRICULUM_FILE = "curriculum.json"
BASE_ATTEMPTS_FILE = "base_attempts.parquet"

TIERS = ("easy", "medium", "hard")


def tier_of(pass_rate: float) -> str:
    if pass_rate >= 0.5:
        return "easy"
    return "medium" if pass_rate > 0 else "hard"


@dataclass
class Curriculum:
    pass_rates: dict[str, float]  # base model, fixed
    estimates: dict[str, float]  # running estimate under the current policy
    retry_due: dict[str, int] = field(default_factory=dict)  # task -> step it comes back at
    step: int = 0
    open_hard_after_steps: int = 10
    retry_after_steps: int = 8
    floor: float = 0.05
    ema: float = 0.5
    rng_state: Any = None

    @classmethod
    def from_pass_rates(cls, pass_rates: Mapping[str, float], *, seed: int = 0, **kwargs: Any) -> "Curriculum":
        if not pass_rates:
            raise ValueError("curriculum: no training task has a pass rate")
        for task, rate in pass_rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"curriculum: task {task!r} has pass rate {rate}, expected 0..1")
        cur = cls(pass_rates=dict(pass_rates), estimates=dict(pass_rates), **kwargs)
        cur.rng_state = random.Random(seed).getstate()
        return cur

    def tiers(self) -> dict[str, list[str]]:
        """Task ids per tier, each ordered easy to hard (then by id)."""
        out: dict[str, list[str]] = {t: [] for t in TIERS}
        for task in sorted(self.pass_rates, key=lambda t: (-self.pass_rates[t], t)):
            out[tier_of(self.pass_rates[task])].append(task)
        return out

    def open_tasks(self) -> list[str]:
        tiers = self.tiers()
        names = ["easy", "medium"] + (["hard"] if self.step >= self.open_hard_after_steps else [])
        tasks = [t for name in names for t in tiers[name] if self.retry_due.get(t, -1) <= self.step]
        if not tasks:  # everything open is waiting in the retry queue: take the soonest due
            tasks = sorted(self.retry_due, key=lambda t: (self.retry_due[t], t))[:1] or sorted(self.pass_rates)
        return tasks

    def next_tasks(self, n: int) -> list[str]:
        """``n`` tasks for the next groups (drawn without replacement while enough are open)."""
        rng = random.Random()
        rng.setstate(_to_state(self.rng_state))
        tasks = self.open_tasks()
        chosen: list[str] = []
        pool = list(tasks)
        for _ in range(n):
            if not pool:
                pool = list(tasks)
            weights = [self.estimates[t] * (1 - self.estimates[t]) + self.floor for t in pool]
            pick = rng.choices(pool, weights=weights, k=1)[0]
            pool.remove(pick)
            chosen.append(pick)
        self.rng_state = rng.getstate()
        return chosen

    def record(self, task_id: str, rewards: list[float]) -> None:
        """Fold one finished group's rewards (1.0 = solved) into the estimates and the retry queue."""
        if task_id not in self.estimates:
            raise KeyError(f"curriculum: unknown task {task_id!r}")
        rate = sum(1.0 for r in rewards if r >= 1.0) / max(len(rewards), 1)
        self.estimates[task_id] = (1 - self.ema) * self.estimates[task_id] + self.ema * rate
        if rate == 0.0:
            self.retry_due[task_id] = self.step + self.retry_after_steps
        else:
            self.retry_due.pop(task_id, None)

    def advance(self, step: int) -> None:
        self.step = step

    # -- state ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "pass_rates": self.pass_rates, "estimates": self.estimates, "retry_due": self.retry_due,
            "step": self.step, "open_hard_after_steps": self.open_hard_after_steps,
            "retry_after_steps": self.retry_after_steps, "floor": self.floor, "ema": self.ema,
            "rng_state": _from_state(self.rng_state),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "curriculum state") -> "Curriculum":
        try:
            return cls(
                pass_rates=dict(data["pass_rates"]), estimates=dict(data["estimates"]),
                retry_due={k: int(v) for k, v in data["retry_due"].items()}, step=int(data["step"]),
                open_hard_after_steps=int(data["open_hard_after_steps"]),
                retry_after_steps=int(data["retry_after_steps"]), floor=float(data["floor"]),
                ema=float(data["ema"]), rng_state=data["rng_state"],
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing key {exc.args[0]!r}") from exc

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: Path) -> "Curriculum":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"curriculum state {path} is missing")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"curriculum state {path}: not valid JSON: {exc}") from exc
        return cls.from_json(data, str(path))


@dataclass(frozen=True)
class BaseMeasurement:
    """What :func:`measure_base_model` measured and wrote."""

    curriculum: Curriculum
    attempts_per_task: int
    path: Path  # curriculum.json
    attempts_path: Path  # one row per attempt (evals.evaluate rows), Parquet


def measure_base_model(
    model: str | Path,
    tasks: Sequence[Any],
    out_dir: str | Path,
    *,
    attempts: int,
    settings: Mapping[str, Any] | None = None,
    run_file: str = "",
    max_turns: int = 4,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    workers: int = 2,
    sandbox_runtime: str = "bwrap",
    log: Callable[[str], None] = print,
) -> BaseMeasurement:
    """The base model's pass rate on each of ``tasks`` (``evals.tasks.Task``) over ``attempts``
    attempts, served by one engine replica process (vLLM unless ``POSTTRAIN_ENGINE`` says otherwise;
    its log: ``out_dir/engine.log``), and the
    curriculum they define with ``settings`` (``retry_after_steps``, ``open_hard_after_steps``).

    Writes ``out_dir/curriculum.json`` (pass rates, tiers, settings, attempts, base model, run file;
    atomically) and ``out_dir/base_attempts.parquet``. Attempts lost to sandbox failures are left
    out of the rates; a task with no graded attempt at all is an error naming it and what failed.
    """
    import pandas as pd
    from transformers import AutoTokenizer

    from evals.evaluate import evaluate
    from evals.harness import HttpClient, episode_context
    from evals.sandbox import platform_sandbox_factory
    from serving.fleet import start_engine, stop_replica

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = dict(settings or {})
    proc, url = start_engine(str(model), out_dir / "engine.log")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        log(f"base model on {len(tasks)} RL tasks x {attempts} attempts")
        rows = evaluate(
            tasks, HttpClient(url), tokenizer, platform_sandbox_factory(sandbox_runtime), checkpoint="curriculum-base",
            attempts=attempts, max_turns=max_turns, max_new_tokens=max_new_tokens,
            temperature=temperature, workers=workers, stop_token_ids=(tokenizer.eos_token_id,),
            **episode_context(model),
        )
    finally:
        stop_replica(proc)
    frame = pd.DataFrame(rows)
    graded = frame[frame["status"] != "infra_error"]
    rates = graded.groupby("task_id")["reward"].mean().to_dict()
    missing = sorted({t.id for t in tasks} - set(rates))
    if missing:
        why = frame.loc[frame["task_id"] == missing[0], "detail"].iloc[-1]  # every task has attempts >= 1 rows
        raise RuntimeError(f"curriculum: no attempt of task {missing[0]!r} could be graded "
                           f"({len(missing)} of {len(tasks)} tasks alike); the last one's infrastructure error: {why}")
    curriculum = Curriculum.from_pass_rates(rates, **settings)
    path = out_dir / CURRICULUM_FILE
    tmp = path.with_name(f".tmp-{CURRICULUM_FILE}")
    tmp.write_text(json.dumps({"pass_rates": rates, "tiers": curriculum.tiers(), "settings": settings,
                               "attempts_per_task": attempts, "base_model": str(model), "run_file": run_file},
                              indent=1, sort_keys=True))
    tmp.replace(path)
    attempts_path = out_dir / BASE_ATTEMPTS_FILE
    frame.to_parquet(attempts_path, index=False)
    return BaseMeasurement(curriculum, attempts, path, attempts_path)


def _from_state(state: Any) -> Any:
    if state is None:
        return None
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _to_state(state: Any) -> Any:
    if state is None:
        return random.Random(0).getstate()
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
