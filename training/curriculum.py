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

A run file with ``[curriculum] task_stream = true`` (the embedded default) draws from a
:class:`TaskStream` instead: tasks generated and validated as the run goes, each new to it, levels
opening easy to hard, unsolved ones retried later, with the same interface to the loop
(``next_tasks``, ``record``, ``advance``, ``save``); ``curriculum.json`` then carries the stream's
settings (key ``task_stream``) and :func:`open_task_stream` opens it under the run directory.
"""

from __future__ import annotations

import json
import random
import threading
import time
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
        if isinstance(data, dict) and data.get("kind") == TaskStream.KIND:  # a run that drew from the task stream
            return TaskStream.from_json(data, str(path))  # type: ignore[return-value]
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
    task_stream: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> BaseMeasurement:
    """The base model's pass rate on each of ``tasks`` (``evals.tasks.Task``) over ``attempts``
    attempts, served by one engine replica process (vLLM unless ``POSTTRAIN_ENGINE`` says otherwise;
    its log: ``out_dir/engine.log``), and the
    curriculum they define with ``settings`` (``retry_after_steps``, ``open_hard_after_steps``).

    Writes ``out_dir/curriculum.json`` (pass rates, tiers, settings, attempts, base model, run file;
    atomically) and ``out_dir/base_attempts.parquet``. With ``task_stream`` (the stream's settings),
    ``curriculum.json`` also says RL draws from the task stream (key ``task_stream``: those settings
    and ``level_rates``, the base model's pass rate per level, where the stream's level weights start). Attempts lost to sandbox failures are left
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
    proc, url = start_engine(str(model), out_dir / "engine.log", max_loras=0)  # the base model alone: no LoRA layers
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
    written = {"pass_rates": rates, "tiers": curriculum.tiers(), "settings": settings,
               "attempts_per_task": attempts, "base_model": str(model), "run_file": run_file}
    if task_stream is not None:
        written["task_stream"] = {**task_stream, "level_rates": level_rates(rates, tasks)}
    tmp.write_text(json.dumps(written, indent=1, sort_keys=True))
    tmp.replace(path)
    attempts_path = out_dir / BASE_ATTEMPTS_FILE
    frame.to_parquet(attempts_path, index=False)
    return BaseMeasurement(curriculum, attempts, path, attempts_path)


def level_rates(pass_rates: Mapping[str, float], tasks: Sequence[Any]) -> dict[str, float]:
    """The mean pass rate of the tasks of each difficulty level (``evals.tasks.Task.difficulty``)."""
    by_level: dict[str, list[float]] = {}
    for task in tasks:
        if task.id in pass_rates and task.difficulty:
            by_level.setdefault(str(task.difficulty), []).append(pass_rates[task.id])
    return {lv: round(sum(v) / len(v), 4) for lv, v in sorted(by_level.items())}


def open_task_stream(settings: Mapping[str, Any], run_dir: str | Path, suite: str | Path, *, seed: int = 0,
                     sandbox_runtime: str = "bwrap", source: str = "curriculum.json") -> TaskStream:
    """The task stream of the run in ``run_dir`` from ``settings`` (``curriculum.json``'s
    ``task_stream`` object: :class:`TaskStream`'s keyword settings and ``level_rates``), drawing
    apart from the bundled suite at ``suite``; an unknown key or a suite that is not a built bundled
    suite is an error naming it."""
    if not isinstance(settings, Mapping):
        raise ValueError(f"{source}: key 'task_stream' must be an object, got {type(settings).__name__}")
    allowed = {"level_rates", "open_hard_after_steps", "retry_after_steps", "max_retries", "retry_share",
               "buffer_per_level", "workers", "floor", "ema", "by_kind", "min_accept", "kind_ema"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ValueError(f"{source}: key 'task_stream.{unknown[0]}' is not a task stream setting "
                         f"(known: {', '.join(sorted(allowed))})")
    if not (Path(suite) / "suite.json").is_file():
        raise ValueError(f"{source}: key 'task_stream' needs the bundled suite as the task source "
                         f"(trainer config key 'tasks'), and {suite} is not a built bundled suite")
    return TaskStream(Path(run_dir) / STREAM_DIR, suite, seed=seed, sandbox_runtime=sandbox_runtime, **settings)


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


# -- the RL task stream -----------------------------------------------------------------------------

STREAM_DIR = "task_stream"  # under the run directory: tasks/, served.jsonl, state.json
STREAM_LEDGER = "served.jsonl"
STREAM_SUMMARY = "state.json"
LEVELS = (1, 2, 3)


class StreamTasks(Mapping[str, Any]):
    """The stream's tasks by id, read from ``folder/<id>/task.json`` on first use: every stream of a
    run (one resumed from a checkpoint too) writes a task there before serving it, so a group runner
    holding this mapping finds whatever any of them serves."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._cache: dict[str, Any] = {}

    def __getitem__(self, task_id: str) -> Any:
        task = self._cache.get(task_id)
        if task is None:
            from evals.tasks import task_from_json

            path = self.folder / task_id / "task.json"
            if not path.is_file():
                raise KeyError(task_id)
            task = self._cache[task_id] = task_from_json(json.loads(path.read_text()), path.parent, str(path))
        return task

    def __iter__(self):
        return iter(sorted(p.name for p in self.folder.glob("*") if (p / "task.json").is_file()))

    def __len__(self) -> int:
        return sum(1 for _ in self)


UNSEEN_KIND_TEACHES = 0.5  # the share of groups that teach assumed for a bug kind not yet seen


class TaskStream:
    """RL tasks generated, validated and served on the fly, each new to the run.

    A task is :func:`evals.bundled.stream_task` of the run's ``seed`` (a generator of its own, so the
    suite's held-out tasks never depend on RL), built and validated in a sandbox by
    :func:`evals.bundled.build_task` before it is served; one that fails validation (the unfixed code
    passes, or the reference solution fails) is never served. A background thread keeps
    ``buffer_per_level`` validated tasks ready per open level, validating ``workers`` at once, so the
    loop does not wait on validation.

    Order, easy to hard: level 1 is open from the start, level 2 from ``open_hard_after_steps // 2``,
    level 3 from ``open_hard_after_steps``; among the open levels a new task's level is drawn with
    weight p(1-p)+floor on the level's running solve rate (started from the base model's,
    ``level_rates``). Within a level, tasks come in stream order. A task whose group solved no
    attempt comes back ``retry_after_steps`` later (at most ``max_retries`` times); a draw takes a
    due retry with probability ``retry_share``. Nothing else is ever served twice.

    Which tasks teach (``by_kind``, on by default): GRPO learns from a group only if its rewards are
    not all equal, and whether a bundled task's group is all failed, all solved or mixed is set
    mostly by its bug kinds (:data:`evals.bundled.KINDS`): in a demo run of the stream without this,
    60% of the groups were all failed or all solved, and the kinds of levels 1 and 2 taught in 9% to
    91% of their groups (docs/benchmarks.md, "Groups that teach"). So the
    stream keeps, per level and bug kind, the share of recent groups that held both outcomes
    (``kind_estimates``: each finished group of a task folds 1 or 0 into each of its kinds at rate
    ``kind_ema``; a kind not yet seen starts at 0.5), and a new task, before it is validated, is
    kept with probability ``max(min_accept, mean of its kinds' shares)``. A task passed over is
    never served (nor validated); the draw is a random number of (seed, level, index), so the same
    estimates pass over the same tasks. A due retry is served by the same chance, and otherwise
    dropped (``retries_dropped``). ``min_accept`` keeps every kind in the stream, so a kind the
    policy learns to solve (or stops failing) is noticed.

    State: the plain JSON of :meth:`to_json` (saved in every checkpoint as ``curriculum.json``,
    loaded back by :meth:`Curriculum.load`) and, under ``root`` (``RUN_DIR/task_stream``), the built
    tasks and ``served.jsonl``, one line per task as it is served. A stream restored from a checkpoint
    skips every task that line says was served after it, so a restart serves nothing twice;
    ``state.json`` is a summary for the assets (drawn, solved, retried, rejected, validation time),
    rewritten after every step.
    """

    KIND = "task_stream"

    def __init__(self, root: str | Path, suite: str | Path, *, seed: int = 0,
                 level_rates: Mapping[Any, float] | None = None, open_hard_after_steps: int = 10,
                 retry_after_steps: int = 8, max_retries: int = 2, retry_share: float = 0.25,
                 buffer_per_level: int = 4, workers: int = 2, floor: float = 0.05, ema: float = 0.5,
                 sandbox_runtime: str = "bwrap", by_kind: bool = True, min_accept: float = 0.1,
                 kind_ema: float = 0.25, canary_share: float = 0.05,
                 generate: Callable[..., Any] | None = None, sandbox_factory: Any = None) -> None:
        for name, value, low in (("open_hard_after_steps", open_hard_after_steps, 0),
                                 ("retry_after_steps", retry_after_steps, 1), ("max_retries", max_retries, 0),
                                 ("buffer_per_level", buffer_per_level, 1), ("workers", workers, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"task stream: key {name!r} must be an integer >= {low}, got {value!r}")
        for name, value in (("retry_share", retry_share), ("floor", floor), ("ema", ema), ("min_accept", min_accept),
                            ("kind_ema", kind_ema), ("canary_share", canary_share)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"task stream: key {name!r} must lie in 0..1, got {value!r}")
        if not isinstance(by_kind, bool):
            raise ValueError(f"task stream: key 'by_kind' must be true or false, got {by_kind!r}")
        self.root = Path(root).resolve()
        self.suite = Path(suite).resolve()
        self.seed = int(seed)
        self.open_hard_after_steps, self.retry_after_steps = open_hard_after_steps, retry_after_steps
        self.max_retries, self.retry_share, self.buffer_per_level = max_retries, float(retry_share), buffer_per_level
        self.workers = workers
        self.floor, self.ema, self.sandbox_runtime = float(floor), float(ema), sandbox_runtime
        self.by_kind, self.min_accept = by_kind, float(min_accept)
        self.kind_ema = float(kind_ema)
        self.canary_share = float(canary_share)
        self.canaries: list[str] = []  # canaries served (never trained on)
        self.canary_groups = self.canary_passed = 0  # canary groups recorded, and their attempts that passed
        self.canary_attempts = 0
        rates = {int(k): float(v) for k, v in (level_rates or {}).items()}
        for level, rate in rates.items():
            if level not in LEVELS or not 0.0 <= rate <= 1.0:
                raise ValueError(f"task stream: key 'level_rates' maps levels 1-3 to rates in 0..1, got {level}: {rate}")
        self.level_estimates = {lv: rates.get(lv, 0.5) for lv in LEVELS}
        # what was served: state, saved with every checkpoint
        self.next_index = {lv: 0 for lv in LEVELS}  # the stream index after the last served, per level
        self.served: list[str] = []
        self.solved: set[str] = set()
        self.retries: dict[str, int] = {}  # task -> times served again
        self.retry_due: dict[str, int] = {}
        self.rejected: list[str] = []  # failed validation, never served
        self.skipped: list[str] = []  # served after the checkpoint this stream was restored from
        self.kind_estimates: dict[str, float] = {}  # "<level>:<kind>" -> running share of groups that teach
        self.task_kinds: dict[str, list[str]] = {}  # a kept task's bug kinds, by id
        self.passed_over = 0  # new tasks not kept: their groups would likely all score alike
        self.retries_dropped = 0  # due retries not served, for the same reason
        self.validated = 0
        self.validation_s = 0.0
        self.step = 0
        self.rng_state: Any = random.Random(f"task-stream-{self.seed}").getstate()
        self.tasks = StreamTasks(self.root / "tasks")
        self._generate = generate
        self._factory = sandbox_factory
        self._cond = threading.Condition()
        self._buffers: dict[int, list[tuple[int, Any]]] = {lv: [] for lv in LEVELS}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._error: BaseException | None = None

    # -- serving ----------------------------------------------------------------------------------

    def open_levels(self, ahead_steps: int = 0) -> list[int]:
        """The levels open at this step (or ``ahead_steps`` later)."""
        opens = {1: 0, 2: self.open_hard_after_steps // 2, 3: self.open_hard_after_steps}
        return [lv for lv in LEVELS if self.step + ahead_steps >= opens[lv]]

    def next_tasks(self, n: int) -> list[str]:
        """``n`` task ids for the next groups: due retries (each with probability ``retry_share``)
        and new tasks, each new one validated and written under ``root/tasks`` before it is returned."""
        self.start()
        rng = random.Random()
        rng.setstate(_to_state(self.rng_state))
        chosen: list[str] = []
        for _ in range(n):
            if self.canary_share and self.served and rng.random() < self.canary_share:
                chosen.append(self._serve_canary(rng))
                continue
            due = sorted((d, t) for t, d in self.retry_due.items() if d <= self.step and t not in chosen)
            if due and rng.random() < self.retry_share:
                task = due[0][1]
                del self.retry_due[task]
                if self._keeps_retry(task, rng):
                    self.retries[task] = self.retries.get(task, 0) + 1
                    chosen.append(task)
                    continue
                self.retries_dropped += 1
            levels = self.open_levels()
            weights = [self.level_estimates[lv] * (1 - self.level_estimates[lv]) + self.floor for lv in levels]
            chosen.append(self._serve(rng.choices(levels, weights=weights, k=1)[0]))
        self.rng_state = rng.getstate()
        return chosen

    def _serve(self, level: int) -> str:
        with self._cond:
            while not self._buffers[level]:
                if self._error is not None:
                    raise RuntimeError(f"task stream: generating level {level} tasks failed: {self._error}") from self._error
                self._cond.wait(0.5)
            index, task = self._buffers[level].pop(0)
            self._cond.notify_all()
        self.next_index[level] = index + 1
        self.served.append(task.id)
        with open(self.root / STREAM_LEDGER, "a") as ledger:
            ledger.write(json.dumps({"id": task.id, "level": level, "index": index, "step": self.step}) + "\n")
        return task.id

    def _serve_canary(self, rng: random.Random) -> str:
        """An impossible variant (:func:`evals.bundled.build_canary`) of a task this stream served: its
        attempts measure cheating and are never trained on (``canary_share`` of the draws)."""
        from evals.bundled import build_canary
        from evals.sandbox import platform_sandbox_factory

        originals = [t for t in self.served if not is_canary(t)]
        task = self.tasks[originals[rng.randrange(len(originals))]]
        factory = self._factory or platform_sandbox_factory(self.sandbox_runtime)
        canary = build_canary(task, self.root / "tasks", factory)
        self.canaries.append(canary.id)
        with open(self.root / STREAM_LEDGER, "a") as ledger:
            ledger.write(json.dumps({"id": canary.id, "canary": True, "step": self.step}) + "\n")
        return canary.id

    def record(self, task_id: str, rewards: list[float]) -> None:
        """Fold one finished group's rewards (1.0 = solved) into its level's solve rate and the retry
        queue: a group with no solved attempt brings its task back later. A canary's group is only
        counted (``canary_groups``, ``canary_passed``): it teaches the stream nothing."""
        if is_canary(task_id):
            self.canary_groups += 1
            self.canary_attempts += len(rewards)
            self.canary_passed += sum(1 for r in rewards if r >= 1.0)
            return
        level = level_of(task_id)
        rate = sum(1.0 for r in rewards if r >= 1.0) / max(len(rewards), 1)
        teaches = 1.0 if len(set(rewards)) > 1 else 0.0
        with self._cond:  # the generator thread reads the kind estimates
            for kind in self.task_kinds.get(task_id, ()):
                key = f"{level}:{kind}"
                before = self.kind_estimates.get(key, UNSEEN_KIND_TEACHES)
                self.kind_estimates[key] = (1 - self.kind_ema) * before + self.kind_ema * teaches
        self.level_estimates[level] = (1 - self.ema) * self.level_estimates[level] + self.ema * rate
        if rate > 0:
            self.solved.add(task_id)
            self.retry_due.pop(task_id, None)
        elif task_id not in self.solved and self.retries.get(task_id, 0) < self.max_retries:
            self.retry_due[task_id] = self.step + self.retry_after_steps
        else:
            self.retry_due.pop(task_id, None)

    def advance(self, step: int) -> None:
        self.step = step
        self.write_summary()

    def teach_chance(self, level: int, kinds: Sequence[str]) -> float:
        """The estimated chance that a group of a task of ``level`` with bug ``kinds`` holds both
        outcomes: the mean of its kinds' running shares (a kind not seen yet: 0.5)."""
        shares = [self.kind_estimates.get(f"{level}:{kind}", UNSEEN_KIND_TEACHES) for kind in kinds]
        return sum(shares) / len(shares) if shares else UNSEEN_KIND_TEACHES

    def _keep_chance(self, level: int, kinds: Sequence[str]) -> float:
        """The probability a task of ``level`` with bug ``kinds`` is served (1 without ``by_kind``)."""
        if not self.by_kind or not kinds:
            return 1.0
        with self._cond:  # record() updates the estimates from the trainer's thread
            return max(self.min_accept, self.teach_chance(level, kinds))

    def _keeps_retry(self, task_id: str, rng: random.Random) -> bool:
        """Whether a due retry is served, by the same chance as a new task of its kinds."""
        chance = self._keep_chance(level_of(task_id), self.task_kinds.get(task_id, ()))
        return chance >= 1.0 or rng.random() < chance

    def keeps(self, level: int, index: int, kinds: Sequence[str]) -> bool:
        """Whether the stream's ``index``-th task of ``level`` is kept (see the class docstring)."""
        chance = self._keep_chance(level, kinds)
        return chance >= 1.0 or random.Random(f"task-stream-keep-{self.seed}-{level}-{index}").random() < chance

    # -- generation -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the generator thread (the first :meth:`next_tasks` does it too)."""
        if self._thread is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for line in (self.root / STREAM_LEDGER).read_text().splitlines() if (self.root / STREAM_LEDGER).is_file() else ():
            entry = json.loads(line)  # served by this run before, maybe after the checkpoint restored
            if entry.get("canary"):
                continue  # a canary is built from a served task, not drawn from the stream
            if entry["index"] >= self.next_index[entry["level"]]:
                self.next_index[entry["level"]] = entry["index"] + 1
                if entry["id"] not in self.served:
                    self.skipped.append(entry["id"])
        self._thread = threading.Thread(target=self._fill, name="task-stream", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _fill(self) -> None:
        """Generate tasks in stream order (cheap, and in order, so each level's draws are the same
        every time) and validate ``workers`` at once; a level's validated tasks join its buffer in
        stream order. A validation that fails for the sandbox's sake (not the task's) is tried
        again, twice; a third failure stops the stream with that error."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        from evals.bundled import SuiteBuildError, build_task, stream_task
        from evals.tasks import load_bundled

        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="task-stream-validate")

        def validate(gen: Any, factory: Any) -> tuple[Any, float]:
            started = time.perf_counter()
            for attempt in range(3):
                try:
                    return build_task(gen, self.root / "tasks", factory), time.perf_counter() - started
                except SuiteBuildError:
                    raise
                except Exception:
                    if attempt == 2:
                        raise
                    time.sleep(1.0)
            raise AssertionError("unreachable")

        try:
            generate = self._generate or stream_task
            factory = self._factory
            if factory is None:
                from evals.sandbox import platform_sandbox_factory

                factory = platform_sandbox_factory(self.sandbox_runtime)
            suite_texts = {t.metadata.get("source_text") for t in load_bundled(self.suite).tasks}
            taken = {lv: set(suite_texts) for lv in LEVELS}
            frontier = dict(self.next_index)
            rejected = set(self.rejected)
            for lv in LEVELS:  # the tasks before the frontier, so later draws avoid their modules
                for index in range(frontier[lv]):
                    gen = generate(self.seed, lv, index, taken[lv])
                    taken[lv].add(gen.files[f"{gen.module}.py"])
            pending: dict[int, Any] = {lv: deque() for lv in LEVELS}  # (index, task id, future), stream order
            while not self._stopped.is_set():
                with self._cond:
                    for lv in LEVELS:
                        while pending[lv] and pending[lv][0][2].done():
                            index, task_id, future = pending[lv].popleft()
                            try:
                                task, took = future.result()
                            except SuiteBuildError:
                                self.rejected.append(task_id)
                                continue
                            self.validated += 1
                            self.validation_s += took
                            self._buffers[lv].append((index, task))
                            self._cond.notify_all()
                    # the levels open or opening within two steps, so none waits when it opens
                    short = [lv for lv in self.open_levels(ahead_steps=2)
                             if len(self._buffers[lv]) + len(pending[lv]) < self.buffer_per_level]
                    busy = sum(len(p) for p in pending.values())
                    if not short or busy >= self.workers:
                        self._cond.wait(0.05 if busy else 0.5)
                        continue
                    level = min(short, key=lambda lv: (len(self._buffers[lv]) + len(pending[lv]), lv))
                index = frontier[level]
                frontier[level] += 1
                try:
                    gen = generate(self.seed, level, index, taken[level])
                except SuiteBuildError:
                    continue
                taken[level].add(gen.files[f"{gen.module}.py"])
                if gen.id in rejected:
                    continue
                kinds = list(getattr(gen, "bug_kinds", ()))
                if not self.keeps(level, index, kinds):
                    with self._cond:
                        self.passed_over += 1
                    continue
                with self._cond:
                    self.task_kinds[gen.id] = kinds
                future = pool.submit(validate, gen, factory)
                future.add_done_callback(lambda _: self._wake())
                with self._cond:
                    pending[level].append((index, gen.id, future))
        except BaseException as exc:  # surfaced by the next draw that waits on this thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- state ------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """How many tasks were served (``drawn``), solved, served again (``retried``: draws, and
        ``tasks_retried``), rejected by validation, and what validation cost a task."""
        by_level = {str(lv): sum(level_of(t) == lv for t in self.served) for lv in LEVELS}
        return {
            "seed": self.seed, "step": self.step, "drawn": len(self.served), "drawn_by_level": by_level,
            "solved": len(self.solved), "retried": sum(self.retries.values()), "tasks_retried": len(self.retries),
            "retry_queue": len(self.retry_due), "rejected": len(self.rejected), "skipped_after_restart": len(self.skipped),
            "validated": self.validated,
            "validation_s_per_task": round(self.validation_s / self.validated, 3) if self.validated else None,
            "level_solve_rates": {str(lv): round(r, 4) for lv, r in self.level_estimates.items()},
            "passed_over": self.passed_over, "retries_dropped": self.retries_dropped,
            "kind_teach_shares": {k: round(v, 4) for k, v in sorted(self.kind_estimates.items())},
            "canaries": len(self.canaries), "canary_groups": self.canary_groups,
            "canary_pass_rate": round(self.canary_passed / self.canary_attempts, 4) if self.canary_attempts else None,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.KIND, "root": str(self.root), "suite": str(self.suite), "seed": self.seed,
            "open_hard_after_steps": self.open_hard_after_steps, "retry_after_steps": self.retry_after_steps,
            "max_retries": self.max_retries, "retry_share": self.retry_share, "buffer_per_level": self.buffer_per_level,
            "workers": self.workers, "floor": self.floor, "ema": self.ema, "sandbox_runtime": self.sandbox_runtime,
            "by_kind": self.by_kind, "min_accept": self.min_accept,
            "kind_ema": self.kind_ema, "kind_estimates": dict(self.kind_estimates), "task_kinds": dict(self.task_kinds),
            "passed_over": self.passed_over, "retries_dropped": self.retries_dropped,
            "level_estimates": {str(k): v for k, v in self.level_estimates.items()},
            "next_index": {str(k): v for k, v in self.next_index.items()}, "served": list(self.served),
            "solved": sorted(self.solved), "retries": dict(self.retries), "retry_due": dict(self.retry_due),
            "rejected": list(self.rejected), "skipped": list(self.skipped), "validated": self.validated,
            "validation_s": round(self.validation_s, 4), "step": self.step, "rng_state": _from_state(self.rng_state),
            "canary_share": self.canary_share, "canaries": list(self.canaries), "canary_groups": self.canary_groups,
            "canary_attempts": self.canary_attempts, "canary_passed": self.canary_passed,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "task stream state") -> "TaskStream":
        try:
            stream = cls(data["root"], data["suite"], seed=int(data["seed"]),
                         level_rates=data["level_estimates"], open_hard_after_steps=int(data["open_hard_after_steps"]),
                         retry_after_steps=int(data["retry_after_steps"]), max_retries=int(data["max_retries"]),
                         retry_share=float(data["retry_share"]), buffer_per_level=int(data["buffer_per_level"]),
                         workers=int(data.get("workers", 2)), floor=float(data["floor"]), ema=float(data["ema"]),
                         sandbox_runtime=data["sandbox_runtime"],
                         # a state saved before kinds were weighed resumes as it ran
                         by_kind=bool(data.get("by_kind", False)), min_accept=float(data.get("min_accept", 0.1)),
                         kind_ema=float(data.get("kind_ema", 0.25)),
                         canary_share=float(data.get("canary_share", 0.0)))  # a state from before canaries: none
            stream.canaries = [str(t) for t in data.get("canaries", [])]
            stream.canary_groups = int(data.get("canary_groups", 0))
            stream.canary_attempts = int(data.get("canary_attempts", 0))
            stream.canary_passed = int(data.get("canary_passed", 0))
            stream.kind_estimates = {str(k): float(v) for k, v in data.get("kind_estimates", {}).items()}
            stream.task_kinds = {str(k): [str(x) for x in v] for k, v in data.get("task_kinds", {}).items()}
            stream.passed_over = int(data.get("passed_over", 0))
            stream.retries_dropped = int(data.get("retries_dropped", 0))
            stream.next_index = {int(k): int(v) for k, v in data["next_index"].items()}
            stream.served = list(data["served"])
            stream.solved = set(data["solved"])
            stream.retries = {k: int(v) for k, v in data["retries"].items()}
            stream.retry_due = {k: int(v) for k, v in data["retry_due"].items()}
            stream.rejected, stream.skipped = list(data["rejected"]), list(data["skipped"])
            stream.validated, stream.validation_s = int(data["validated"]), float(data["validation_s"])
            stream.step, stream.rng_state = int(data["step"]), data["rng_state"]
        except KeyError as exc:
            raise ValueError(f"{source}: missing key {exc.args[0]!r}") from exc
        return stream

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        self.write_summary()

    def write_summary(self) -> None:
        """``root/state.json``: :meth:`summary`, rewritten after every step and checkpoint (the assets
        show it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{STREAM_SUMMARY}.tmp"
        tmp.write_text(json.dumps(self.summary(), indent=1, sort_keys=True) + "\n")
        tmp.replace(self.root / STREAM_SUMMARY)


def is_canary(task_id: str) -> bool:
    """Whether ``task_id`` is a canary of the stream (:func:`evals.bundled.build_canary`)."""
    from evals.bundled import CANARY_SUFFIX

    return task_id.endswith(CANARY_SUFFIX)


def level_of(task_id: str) -> int:
    """The level of a stream task from its id (``stream-l<level>-...``)."""
    head = task_id.split("-")
    if len(head) < 3 or head[0] != "stream" or head[1] not in ("l1", "l2", "l3"):
        raise KeyError(f"task stream: {task_id!r} is not a stream task id")
    return int(head[1][1:])


def stream_summaries(runs_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The task stream summary of every run under ``runs_dir`` that drew from one, by run name."""
    out = {}
    for path in sorted(Path(runs_dir).glob(f"*/{STREAM_DIR}/{STREAM_SUMMARY}")):
        try:
            out[path.parent.parent.name] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return out
