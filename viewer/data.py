"""What the viewer shows, read from the files a run and its evals already write.

Nothing here writes: the rollout store is opened read-only (``mode=ro``; a trainer may be writing it
at the same time, which SQLite's WAL allows), eval rows are read from their Parquet files, and the
flawed lists from ``HOME/datasets/flawed``. Every function takes the posttrain home folder; a run,
step, checkpoint, task or attempt that is not there raises :class:`NotFound` naming it, which the app
answers with a 404 page.

Runs -> steps -> groups -> rollouts: a step's rollouts are those the trainer consumed (trained on, or
dropped with a zero-variance group) or discarded as stale at that step (the store's ``status_step``);
rollouts not taken yet are step ``ready``. A rollout's advantage is GRPO's: its reward minus its
group's mean (divided by the group's standard deviation when the run's trainer config says
``scale_advantages_by_std``), zero in a group whose rewards are all equal.

Checkpoints -> tasks -> attempts: each checkpoint's newest eval run by default (``run`` picks
another), compared task by task with its run's base model (``<run>-step_000000``).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd
from tokenizers import Tokenizer

from evals.flawed import load_flawed_lists
from evals.report import attempt_files, base_checkpoint, parse_key
from training.checkpoint import list_checkpoints, metrics_dir, runs_root, store_path
from training.progress import plain_advantages
from training.store import unpack_column

PLAN_FILE = "resolved-plan.json"
READY = "ready"


class NotFound(LookupError):
    """A run, step, rollout, checkpoint, task or attempt that the home folder does not hold."""


# ---------------------------------------------------------------- runs and rollouts


def run_dir(home: Path, run: str) -> Path:
    """The folder of run ``run`` under ``HOME/runs``; a name that leaves that folder is not a run."""
    root = runs_root(home)
    path = root / run
    if not run or "/" in run or run.startswith(".") or not path.is_dir():
        raise NotFound(f"no run {run!r} under {root}")
    return path


def list_runs(home: Path) -> list[dict[str, Any]]:
    """Every run folder of the home with what it holds: stored rollouts, steps, checkpoints."""
    root = runs_root(home)
    out = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not path.is_dir() or path.name.startswith("."):
            continue
        counts = {}
        if store_path(path).is_file():
            with _store(path) as conn:
                counts = dict(conn.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status").fetchall())
        steps = read_steps(path)
        out.append({"run": path.name, "rollouts": sum(counts.values()), "ready": counts.get(READY, 0),
                    "steps": len(steps), "last_step": int(steps[-1]["step"]) if steps else None,
                    "checkpoints": [c.step for c in list_checkpoints(path)],
                    "of_steps": planned_steps(path)})
    return out


class _store:
    """``with _store(run_dir) as conn``: a read-only connection to the run's rollout store."""

    def __init__(self, run_path: Path) -> None:
        self.path = store_path(run_path)

    def __enter__(self) -> sqlite3.Connection:
        if not self.path.is_file():
            raise NotFound(f"run {self.path.parent.parent.name} has no rollout store ({self.path})")
        self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30.0)
        return self.conn

    def __exit__(self, *exc: Any) -> None:
        self.conn.close()


def read_plan(run_path: Path) -> dict[str, Any]:
    path = run_path / PLAN_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def planned_steps(run_path: Path) -> int | None:
    """The run's ``trainer.steps`` from its resolved plan (None when it does not say)."""
    steps = (read_plan(run_path).get("trainer") or {}).get("steps")
    return int(steps) if isinstance(steps, (int, float)) else None


def read_steps(run_path: Path) -> list[dict[str, Any]]:
    """The trainer's step rows (``metrics/steps.parquet``), oldest first; none before the first step."""
    path = metrics_dir(run_path) / "steps.parquet"
    if not path.is_file():
        return []
    rows = pd.read_parquet(path).sort_values("step").to_dict("records")
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in rows]


# phases of an episode and of a trainer step: name -> what it measures (the viewer's legend)
EPISODE_PHASES = {
    "generation_s": "the model's calls (engine time)",
    "sandbox_s": "actions in the sandbox (the episode's time outside model calls)",
    "grading_s": "tests of the committed work in a fresh sandbox",
}
TRAINER_PHASES = {
    "wait_s": "the trainer waiting for whole groups",
    "train_s": "the GRPO step",
}


def read_audit(run_dir: Path) -> dict[str, Any] | None:
    """The run's reward audit (``audit.json``, written by ``posttrain audit``), or None when there is
    none or it is not one."""
    path = Path(run_dir) / "audit.json"
    try:
        audit = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(audit, dict) or not isinstance(audit.get("steps"), list):
        return None
    steps = [r for r in audit["steps"] if isinstance(r, dict) and {"step", "wrong_fixes", "regraded"} <= r.keys()]
    return {**audit, "steps": steps}


def episode_phases(info: dict[str, Any]) -> dict[str, float]:
    """Seconds of one episode per phase (:data:`EPISODE_PHASES`) from a rollout's ``info``: generation
    is ``generation_s`` where the rollout records it, and the rest of ``agent_s`` is the sandbox's."""
    agent = float(info.get("agent_s") or 0.0)
    generation = float(info.get("generation_s") or 0.0)
    return {"generation_s": generation, "sandbox_s": max(agent - generation, 0.0),
            "grading_s": float(info.get("grade_s") or 0.0)}


def run_phases(run_path: Path) -> dict[int, dict[str, float]]:
    """Per step, the seconds of every phase: the episodes' phases summed over the rollouts the step
    took (several episodes run at once, so these add up to more than the wall clock), and the
    trainer's own wall-clock phases from its step rows (publish time is in the step's observation
    and TensorBoard, ``publish_s``: the step rows do not keep it)."""
    out: dict[int, dict[str, float]] = {}
    if store_path(run_path).is_file():
        with _store(run_path) as conn:
            rows = conn.execute(
                "SELECT status_step, SUM(json_extract(info, '$.agent_s')), SUM(json_extract(info, '$.generation_s')), "
                "SUM(json_extract(info, '$.grade_s')) FROM rollouts WHERE status='consumed' GROUP BY status_step"
            ).fetchall()
        for step, agent, generation, grade in rows:
            out[int(step)] = episode_phases({"agent_s": agent, "generation_s": generation, "grade_s": grade})
    for row in read_steps(run_path):
        phases = out.setdefault(int(row["step"]), episode_phases({}))
        for name in TRAINER_PHASES:
            phases[name] = float(row.get(name) or 0.0)
    return dict(sorted(out.items()))


def eta_s(steps: Sequence[dict[str, Any]], of_steps: int | None, window: int = 5) -> float | None:
    """Seconds until step ``of_steps`` at the pace of the last ``window`` steps (their ``time_s``);
    None when the plan gives no step count or fewer than two steps are done."""
    times = [float(r["time_s"]) for r in steps if r.get("time_s") is not None]
    if of_steps is None or len(times) < 2:
        return None
    recent = times[-(window + 1):]
    per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
    return max(of_steps - int(steps[-1]["step"]), 0) * per_step


@dataclass(frozen=True)
class RolloutRow:
    """One rollout as a step's page lists it (no token arrays: those are read on its own page)."""

    rollout_id: str
    group_id: str
    task_id: str
    adapter_step: int
    reward: float
    total_tokens: int
    generated_tokens: int
    status: str
    status_step: int | None
    info: dict[str, Any]
    advantage: float = 0.0

    @property
    def turns(self) -> int:
        return int(self.info.get("turns") or 0)

    @property
    def signals(self) -> list[str]:
        return signal_names(self.info.get("signals"))


def signal_names(value: Any) -> list[str]:
    """A rollout's or attempt's signals, however recorded (a list, or names joined by commas)."""
    if isinstance(value, str):
        return [s for s in value.split(",") if s]
    if isinstance(value, (list, tuple)):
        return [str(s) for s in value if s]
    if isinstance(value, dict):
        return sorted(str(k) for k, v in value.items() if v)
    return []


@dataclass(frozen=True)
class GroupView:
    group_id: str
    task_id: str
    adapter_step: int
    rollouts: list[RolloutRow] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def spread(self) -> float:
        """The standard deviation of the group's rewards (0: no learning signal)."""
        return statistics.pstdev(self.rewards) if len(self.rollouts) > 1 else 0.0


def scales_by_std(run_path: Path) -> bool:
    return bool((read_plan(run_path).get("trainer") or {}).get("scale_advantages_by_std"))


_ROW = ("rollout_id, group_id, task_id, adapter_version, reward, total_tokens, generated_tokens, status, "
        "status_step, info")


def _rollout_row(r: tuple) -> RolloutRow:
    try:
        info = json.loads(r[9])
    except ValueError:
        info = {}
    return RolloutRow(r[0], r[1], r[2], int(r[3]), float(r[4]), int(r[5]), int(r[6]), r[7], r[8],
                      info if isinstance(info, dict) else {})


def with_advantages(rows: Iterable[RolloutRow], scale_by_std: bool) -> list[GroupView]:
    """The rollouts put into their groups (in the order of their first rollout), advantages set."""
    groups: dict[str, list[RolloutRow]] = {}
    for row in rows:
        groups.setdefault(row.group_id, []).append(row)
    out = []
    for group_id, members in groups.items():
        adv = plain_advantages([m.reward for m in members], scale_by_std=scale_by_std)
        members = [RolloutRow(**{**m.__dict__, "advantage": a}) for m, a in zip(members, adv)]
        out.append(GroupView(group_id, members[0].task_id, members[0].adapter_step, members))
    return out


def step_groups(home: Path, run: str, step: int | str) -> list[GroupView]:
    """The groups of ``step`` (an int, or ``ready`` for rollouts no step has taken yet) with their
    rollouts and advantages, oldest group first."""
    path = run_dir(home, run)
    with _store(path) as conn:
        if step == READY:
            rows = conn.execute(f"SELECT {_ROW} FROM rollouts WHERE status='ready' ORDER BY created_s").fetchall()
        else:
            rows = conn.execute(f"SELECT {_ROW} FROM rollouts WHERE status_step=? ORDER BY created_s",
                                (int(step),)).fetchall()
    return with_advantages((_rollout_row(r) for r in rows), scales_by_std(path))


def store_steps(home: Path, run: str) -> list[dict[str, Any]]:
    """Per step of the store: rollouts and groups taken, and apart, the rollouts the step consumed
    (trained on, or dropped with a zero-variance group) and those it discarded as stale, each with
    its mean reward: the step trained on the first only, and a mean over both misreads it."""
    path = run_dir(home, run)
    if not store_path(path).is_file():
        return []
    with _store(path) as conn:
        rows = conn.execute(
            "SELECT COALESCE(status_step, -1), COUNT(*), COUNT(DISTINCT group_id), "
            "SUM(status='consumed'), AVG(CASE WHEN status='consumed' THEN reward END), "
            "SUM(status='discarded'), AVG(CASE WHEN status='discarded' THEN reward END), "
            "AVG(CASE WHEN status='consumed' THEN generated_tokens END), AVG(reward) "
            "FROM rollouts GROUP BY status_step ORDER BY status_step"
        ).fetchall()
    return [{"step": READY if s == -1 else int(s), "rollouts": n, "groups": g, "consumed": int(c or 0),
             "reward_mean_consumed": cm, "discarded": int(d or 0), "reward_mean_discarded": dm,
             "generated_tokens_mean_consumed": t, "reward_mean": m} for s, n, g, c, cm, d, dm, t, m in rows]


def filter_rollouts(groups: Sequence[GroupView], *, min_reward: float | None = None, max_reward: float | None = None,
                    signal: str = "", task: str = "", status: str = "") -> list[GroupView]:
    """The groups keeping only rollouts that match every filter given (empty groups left out)."""
    out = []
    for g in groups:
        kept = [r for r in g.rollouts
                if (min_reward is None or r.reward >= min_reward) and (max_reward is None or r.reward <= max_reward)
                and (not signal or signal in r.signals) and (not task or task in r.task_id)
                and (not status or r.status == status)]
        if kept:
            out.append(GroupView(g.group_id, g.task_id, g.adapter_step, kept))
    return out


def distributions(groups: Sequence[GroupView]) -> dict[str, list[float]]:
    """The values whose histograms a step's page draws: reward, advantage, response length
    (generated tokens), turns per rollout, and the reward spread of each group."""
    rollouts = [r for g in groups for r in g.rollouts]
    return {
        "reward": [r.reward for r in rollouts],
        "advantage": [r.advantage for r in rollouts],
        "response length (generated tokens)": [float(r.generated_tokens) for r in rollouts],
        "turns": [float(r.turns) for r in rollouts],
        "group reward spread (std)": [g.spread for g in groups],
    }


@dataclass(frozen=True)
class Segment:
    """A stretch of a rollout's tokens: the prompt, an action the model generated (trained on), or an
    observation the environment answered. ``tokens`` are ``(id, text, logprob)``."""

    kind: str  # prompt | action | observation
    turn: int
    text: str
    tokens: list[tuple[int, str, float]]


def segments(input_ids: Sequence[int], loss_mask: Sequence[int], logprobs: Sequence[float], decode) -> list[Segment]:
    """Split a rollout at its mask's edges: the first unmasked stretch is the prompt, each masked one
    an action and each later unmasked one an observation. ``decode(ids) -> str``."""
    out: list[Segment] = []
    start, turn = 0, 0
    for i in range(1, len(input_ids) + 1):
        if i == len(input_ids) or loss_mask[i] != loss_mask[start]:
            ids = list(input_ids[start:i])
            if loss_mask[start]:
                kind = "action"
            else:
                kind = "prompt" if start == 0 else "observation"
            out.append(Segment(kind, turn, decode(ids),
                               [(t, decode([t]), float(lp)) for t, lp in zip(ids, logprobs[start:i])]))
            if kind == "observation":
                turn += 1
            start = i
    return out


def base_model_folder(run_path: Path) -> Path | None:
    """The run's base model folder: a checkpoint's ``base_model``, else the plan's trainer table."""
    for ckpt in reversed(list_checkpoints(run_path)):
        folder = ckpt.metadata().get("base_model")
        if folder and Path(folder).is_dir():
            return Path(folder)
    folder = (read_plan(run_path).get("trainer") or {}).get("base_model")
    return Path(folder) if folder and Path(folder).is_dir() else None


@lru_cache(maxsize=8)
def _tokenizer(path: str):
    return Tokenizer.from_file(path)


def decoder_for(run_path: Path):
    """``decode(ids) -> str`` with the run's tokenizer (``tokenizer.json`` of its base model); without
    one, the ids themselves as text, so a rollout still shows which tokens were trained on."""
    folder = base_model_folder(run_path)
    if folder is not None and (folder / "tokenizer.json").is_file():
        tok = _tokenizer(str(folder / "tokenizer.json"))
        return lambda ids: tok.decode(list(ids), skip_special_tokens=False)
    return lambda ids: " ".join(f"[{i}]" for i in ids) + " "


def rollout_detail(home: Path, run: str, rollout_id: str) -> dict[str, Any]:
    """One rollout with everything stored about it: its row, its group's rewards and its advantage,
    and its tokens split into prompt, actions and observations (:func:`segments`)."""
    path = run_dir(home, run)
    with _store(path) as conn:
        row = conn.execute(f"SELECT {_ROW}, input_ids, loss_mask, serving_logprobs, created_s FROM rollouts "
                           "WHERE rollout_id=?", (rollout_id,)).fetchone()
        if row is None:
            raise NotFound(f"run {run}: no rollout {rollout_id!r} in {store_path(path)}")
        mates = conn.execute(f"SELECT {_ROW} FROM rollouts WHERE group_id=? ORDER BY created_s", (row[1],)).fetchall()
    (group,) = with_advantages((_rollout_row(r) for r in mates), scales_by_std(path))
    me = next(r for r in group.rollouts if r.rollout_id == rollout_id)
    ids, mask, logprobs = unpack_column(row[10], "i"), unpack_column(row[11], "b"), unpack_column(row[12], "f")
    return {"rollout": me, "group": group, "created_s": row[13],
            "segments": segments(ids, mask, logprobs, decoder_for(path)),
            "trained_tokens": sum(mask), "tokens": len(ids)}


# ---------------------------------------------------------------- checkpoints, tasks and attempts


def evals_folder(home: Path) -> Path:
    return Path(home) / "evals" / "deepswe"


def eval_runs(home: Path) -> dict[str, list[tuple[str, Path, float]]]:
    """Per checkpoint, its eval runs ``(run_id, path, written_s)``, newest first, checkpoints in
    (run, step) order."""
    out: dict[str, list[tuple[str, Path, float]]] = {}
    for checkpoint, run_id, path in attempt_files(evals_folder(home)):
        out.setdefault(checkpoint, []).append((run_id, path, path.stat().st_mtime))
    order = sorted(out, key=lambda c: parse_key(c) or (c, -1))
    return {c: sorted(out[c], key=lambda r: -r[2]) for c in order}


def read_rows(path: Path, columns: Sequence[str] | None = None) -> Any:
    """The attempt rows of one Parquet file; with ``columns``, only those it has (the transcripts and
    diffs are most of a file: a table of 450 tasks does not need them)."""
    if columns is None:
        return pd.read_parquet(path)
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    return pd.read_parquet(path, columns=[c for c in columns if c in names])


def attempt_rows(home: Path, checkpoint: str, run_id: str = "", *, columns: Sequence[str] | None = None,
                 runs: dict[str, list[tuple[str, Path, float]]] | None = None) -> tuple[str, Any]:
    """``(run_id, frame)``: the attempt rows of one eval run of ``checkpoint`` (its newest by default);
    ``columns`` as :func:`read_rows`; ``runs`` is :func:`eval_runs` when the caller has it already."""
    mine = (runs if runs is not None else eval_runs(home)).get(checkpoint)
    if not mine:
        raise NotFound(f"no eval rows of checkpoint {checkpoint!r} under {evals_folder(home)}")
    chosen = [r for r in mine if r[0] == run_id] if run_id else mine[:1]
    if not chosen:
        raise NotFound(f"checkpoint {checkpoint}: no eval run {run_id!r} (runs: {', '.join(r[0] for r in mine)})")
    return chosen[0][0], read_rows(chosen[0][1], columns)


def flawed_marks(home: Path) -> dict[str, list[str]]:
    """Task id -> the names of the flawed lists (``HOME/datasets/flawed``) that name it."""
    marks: dict[str, list[str]] = {}
    for fl in load_flawed_lists(Path(home) / "datasets" / "flawed"):
        for task_id in fl.ids:
            marks.setdefault(task_id, []).append(fl.name)
    return marks


STATS_COLUMNS = ("task_id", "status", "reward", "difficulty", "signals")  # what a per-task table reads


def _task_stats(frame: Any) -> dict[str, dict[str, Any]]:
    """Per task: graded attempts, passes (reward 1), pass@1, level and flagged attempts, in one
    grouped pass over the rows (a loop over 450 task groups took seconds)."""
    if frame is None or not len(frame):
        return {}
    graded = frame["status"] != "infra_error"
    parts = pd.DataFrame({
        "task_id": frame["task_id"].astype(str), "graded": graded, "passed": graded & (frame["reward"] >= 1.0),
        "flagged": frame["signals"].fillna("").astype(str).str.len() > 0 if "signals" in frame else False,
        "difficulty": frame["difficulty"] if "difficulty" in frame else 0,
    })
    agg = parts.groupby("task_id", sort=True).agg(attempts=("graded", "sum"), passes=("passed", "sum"),
                                                   flagged=("flagged", "sum"), difficulty=("difficulty", "first"))
    return {task_id: {"attempts": int(a), "passes": int(p), "pass@1": p / a if a else math.nan,
                      "difficulty": _level(d), "flagged": int(f)}
            for task_id, a, p, f, d in zip(agg.index, agg["attempts"], agg["passes"], agg["flagged"], agg["difficulty"])}


def _level(value: Any) -> int:
    """A task's difficulty level; 0 where the source gives none (NaN or None in the rows)."""
    try:
        return int(value) if value == value and value is not None else 0
    except (TypeError, ValueError):
        return 0


def flip(base: dict[str, Any] | None, mine: dict[str, Any] | None) -> str:
    """``gained`` when the checkpoint solved a task (at least one passing attempt) that its base
    model never did, ``lost`` the other way round, '' otherwise or without both."""
    if not base or not mine or not base["attempts"] or not mine["attempts"]:
        return ""
    if mine["passes"] and not base["passes"]:
        return "gained"
    if base["passes"] and not mine["passes"]:
        return "lost"
    return ""


def task_table(frame: Any, base_frame: Any, marks: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One row per task of the checkpoint's rows: level, the base model's and the checkpoint's passes
    out of graded attempts and pass@1, the change, the flip (:func:`flip`), flagged attempts and the
    flawed lists that name the task. Tasks only the base model was evaluated on are left out."""
    mine, base = _task_stats(frame), _task_stats(base_frame)
    rows = []
    for task_id, stats in mine.items():
        b = base.get(task_id)
        rows.append({
            "task_id": task_id, "level": stats["difficulty"],
            "base_passes": b["passes"] if b else None, "base_attempts": b["attempts"] if b else None,
            "base_pass@1": b["pass@1"] if b else math.nan,
            "passes": stats["passes"], "attempts": stats["attempts"], "pass@1": stats["pass@1"],
            "change": stats["pass@1"] - b["pass@1"] if b else math.nan,
            "flip": flip(b, stats), "flagged": stats["flagged"], "flawed": marks.get(task_id, []),
        })
    return rows


def pass_at_1_summary(rows: Sequence[dict[str, Any]], *, resamples: int = 2000) -> dict[str, Any]:
    """pass@1 of the checkpoint and of the one it is compared with over the table's ``rows``, each a
    mean over tasks of their attempt means with a 95% bootstrap interval over tasks, and the change
    paired on the tasks both were graded on (the paired bootstrap ``eval_report`` uses); the same
    per level. ``None`` where there is nothing to estimate."""
    from evals.metrics import bootstrap, paired_difference

    def estimate(values: list[float]):
        return bootstrap(values, resamples=resamples) if values else None

    def part(subset: Sequence[dict[str, Any]]) -> dict[str, Any]:
        mine = {r["task_id"]: r["pass@1"] for r in subset if r["attempts"]}
        theirs = {r["task_id"]: r["base_pass@1"] for r in subset if r["base_attempts"]}
        common = sorted(set(mine) & set(theirs))
        return {"tasks": len(subset), "paired_tasks": len(common),
                "pass@1": estimate(list(mine.values())), "against_pass@1": estimate(list(theirs.values())),
                "change": paired_difference(mine, theirs, resamples=resamples) if common else None}

    levels = sorted({r["level"] for r in rows})
    return {**part(rows), "levels": [{"level": lv, **part([r for r in rows if r["level"] == lv])} for lv in levels]}


def checkpoint_tasks(home: Path, checkpoint: str, run_id: str = "", against: str | None = None,
                     against_run: str = "") -> dict[str, Any]:
    """The per-task table of one checkpoint against another (``against``; by default its run's base
    model), with pass@1 of both and their paired change (:func:`pass_at_1_summary`). The key
    ``base`` names the checkpoint compared with (None when it has no eval rows)."""
    runs = eval_runs(home)
    chosen, frame = attempt_rows(home, checkpoint, run_id, columns=STATS_COLUMNS, runs=runs)
    other = base_checkpoint(checkpoint) if against is None else against
    if against and against not in runs:
        raise NotFound(f"no eval rows of checkpoint {against!r} (to compare with) under {evals_folder(home)}")
    base_frame, base_run = None, ""
    if other and other in runs and (other != checkpoint or against):
        base_run, base_frame = attempt_rows(home, other, against_run, columns=STATS_COLUMNS, runs=runs)
    rows = task_table(frame, base_frame, flawed_marks(home))
    return {"checkpoint": checkpoint, "run_id": chosen, "base": other if base_frame is not None else None,
            "base_run_id": base_run, "runs": [r[0] for r in runs[checkpoint]], "rows": rows,
            "checkpoints": list(runs), "summary": pass_at_1_summary(rows)}


def decode_json(value: Any, default: Any) -> Any:
    if not isinstance(value, str) or not value:
        return default
    try:
        return json.loads(value)
    except ValueError:
        return default


def task_attempts(home: Path, checkpoint: str, task_id: str, run_id: str = "") -> dict[str, Any]:
    """Every attempt of one task at ``checkpoint`` (and at its base model), as plain dicts."""
    chosen, frame = attempt_rows(home, checkpoint, run_id)
    mine = frame[frame["task_id"] == task_id]
    if not len(mine):
        raise NotFound(f"checkpoint {checkpoint} (eval run {chosen}): no attempt of task {task_id!r}")
    base_key = base_checkpoint(checkpoint)
    base: list[dict[str, Any]] = []
    if base_key and base_key != checkpoint and base_key in eval_runs(home):
        _, bf = attempt_rows(home, base_key)
        base = [_plain(r) for r in bf[bf["task_id"] == task_id].sort_values("attempt").to_dict("records")]
    return {"checkpoint": checkpoint, "run_id": chosen, "task_id": task_id, "base": base_key, "base_attempts": base,
            "attempts": [_plain(r) for r in mine.sort_values("attempt").to_dict("records")],
            "flawed": flawed_marks(home).get(task_id, [])}


def attempt_detail(home: Path, checkpoint: str, task_id: str, attempt: int, run_id: str = "") -> dict[str, Any]:
    """One attempt: its row, its tests with their outcomes (failing first), its transcript and diff."""
    chosen, frame = attempt_rows(home, checkpoint, run_id)
    match = frame[(frame["task_id"] == task_id) & (frame["attempt"].astype(int) == int(attempt))]
    if not len(match):
        raise NotFound(f"checkpoint {checkpoint} (eval run {chosen}): no attempt {attempt} of task {task_id!r}")
    row = _plain(match.iloc[-1].to_dict())
    tests = decode_json(row.get("test_outcomes"), [])
    tests = sorted(tests, key=lambda t: (t.get("outcome") == "passed", t.get("kind") != "target"))
    return {"checkpoint": checkpoint, "run_id": chosen, "task_id": task_id, "attempt": int(attempt), "row": row,
            "tests": tests, "transcript": decode_json(row.get("transcript"), []),
            "diff": row.get("diff") or "", "flawed": flawed_marks(home).get(task_id, []),
            "signals": signal_names(row.get("signals"))}


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        v = v.item() if hasattr(v, "item") else v
        out[k] = None if isinstance(v, float) and math.isnan(v) else v
    return out


# ---------------------------------------------------------------- a run's live state, its curves, search


LEVEL_IN_ID = re.compile(r"-l(\d+)-")  # bundled and stream task ids carry their level: bundled-l3-000-payroll


def run_finished(steps: Sequence[dict[str, Any]], of_steps: int | None) -> bool:
    """Whether the run has trained every step its plan asked for."""
    return bool(of_steps) and bool(steps) and int(steps[-1]["step"]) >= int(of_steps)


def run_version(home: Path, run: str) -> str:
    """A token that changes whenever the run writes a step, a rollout or a checkpoint: the sizes and
    modification times of its step rows, its store (and the store's write-ahead log) and its
    checkpoints folder. A live page polls it and reloads when it moves."""
    path = run_dir(home, run)
    parts = []
    for f in (metrics_dir(path) / "steps.parquet", store_path(path), Path(f"{store_path(path)}-wal"),
              path / "checkpoints", path / "audit.json"):
        try:
            st = f.stat()
            parts.append(f"{st.st_mtime_ns}:{st.st_size}")
        except OSError:
            parts.append("-")
    return "/".join(parts)


def rollout_curves(home: Path, run: str, max_points: int = 4000) -> dict[str, Any]:
    """From the store, over the rollouts each step consumed: solve rate per step and level (the level
    read from the task id, :data:`LEVEL_IN_ID`; none when ids carry none), and ``(response tokens,
    reward)`` of each rollout (every ``n``-th past ``max_points``) for reward against response length."""
    path = run_dir(home, run)
    if not store_path(path).is_file():
        return {"levels": {}, "length_reward": []}
    with _store(path) as conn:
        rows = conn.execute("SELECT status_step, task_id, reward, generated_tokens FROM rollouts "
                            "WHERE status='consumed' ORDER BY status_step").fetchall()
    by_level: dict[int, dict[int, list[float]]] = {}
    for step, task_id, reward, _ in rows:
        m = LEVEL_IN_ID.search(str(task_id))
        if m and step is not None:
            by_level.setdefault(int(m.group(1)), {}).setdefault(int(step), []).append(1.0 if reward >= 1.0 else 0.0)
    levels = {lv: [(s, sum(v) / len(v)) for s, v in sorted(steps.items())] for lv, steps in sorted(by_level.items())}
    every = max(1, math.ceil(len(rows) / max_points))
    return {"levels": levels, "length_reward": [(float(t), float(r)) for _, _, r, t in rows[::every]]}


class BadPattern(ValueError):
    """A search pattern that does not compile; the message names it and why."""


def _matcher(pattern: str, regex: bool):
    if not pattern:
        raise BadPattern("query parameter 'q': give the text (or, with regex=1, the regular expression) to find")
    if regex:
        try:
            compiled = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise BadPattern(f"query parameter 'q': {pattern!r} is not a regular expression: {exc}") from None
    else:
        compiled = re.compile(re.escape(pattern), re.IGNORECASE)
    return compiled


def _snippet(text: str, m: re.Match, width: int = 80) -> str:
    start, end = max(0, m.start() - width), min(len(text), m.end() + width)
    return ("…" if start else "") + text[start:end] + ("…" if end < len(text) else "")


SEARCH_LIMIT = 500  # hits a search returns; the page says when there were more


def search_rollouts(home: Path, run: str, pattern: str, *, regex: bool = False, step: int | None = None,
                    status: str = "", task: str = "", min_reward: float | None = None,
                    max_reward: float | None = None, limit: int = SEARCH_LIMIT) -> dict[str, Any]:
    """Rollouts of run ``run`` whose text (every token decoded: prompt, actions, observations) or
    ``info`` (stop reason, signals...) matches ``pattern`` (case-insensitive; ``regex`` for a regular
    expression), filtered by step, status, task id (substring) and reward. Returns the hits (rollout
    id, step, status, task, reward, where it matched, a snippet) and how many rollouts were searched."""
    matcher = _matcher(pattern, regex)
    path = run_dir(home, run)
    where, params = ["1=1"], []
    if step is not None:
        where.append("status_step=?")
        params.append(int(step))
    if status:
        where.append("status=?")
        params.append(status)
    if task:
        where.append("instr(task_id, ?) > 0")
        params.append(task)
    if min_reward is not None:
        where.append("reward>=?")
        params.append(min_reward)
    if max_reward is not None:
        where.append("reward<=?")
        params.append(max_reward)
    decode = decoder_for(path)
    hits, searched, more = [], 0, False
    with _store(path) as conn:
        cursor = conn.execute(f"SELECT rollout_id, status_step, status, task_id, reward, info, input_ids FROM rollouts "
                              f"WHERE {' AND '.join(where)} ORDER BY created_s", params)
        for rid, st, stat, task_id, reward, info, ids in cursor:
            searched += 1
            for field_name, text in (("info", info or ""), ("text", decode(unpack_column(ids, "i")))):
                m = matcher.search(text)
                if m:
                    if len(hits) >= limit:
                        more = True
                        break
                    hits.append({"rollout_id": rid, "step": st, "status": stat, "task_id": task_id,
                                 "reward": float(reward), "matched": field_name, "snippet": _snippet(text, m)})
                    break
            if more:
                break
    return {"hits": hits, "searched": searched, "more": more}


ATTEMPT_TEXT = ("transcript", "diff", "test_output", "detail", "stop_reason", "signals")  # what a search reads


def transcript_text(value: Any) -> str:
    """A transcript (JSON text) as a reader sees it on the attempt's page: each message's text, each
    action (tool and arguments as written) and what the sandbox answered, one per line."""
    lines = []
    for m in decode_json(value, []):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "action":
            action = m.get("action") or {}
            lines.append(f"{action.get('tool', '')} {json.dumps(action.get('args', {}), ensure_ascii=False)}")
            lines.append(str(m.get("observation", "")))
        else:
            lines.append(str(m.get("text", "")))
    return "\n".join(lines)


def search_attempts(home: Path, pattern: str, *, regex: bool = False, checkpoint: str = "", run_id: str = "",
                    status: str = "", task: str = "", min_reward: float | None = None,
                    max_reward: float | None = None, limit: int = SEARCH_LIMIT) -> dict[str, Any]:
    """Eval attempts whose transcript, diff, test output, detail, stop reason or signals match
    ``pattern`` (as :func:`search_rollouts`), in one checkpoint's eval run (its newest by default)
    or, without ``checkpoint``, in every checkpoint's newest run; filtered by status, task and reward."""
    matcher = _matcher(pattern, regex)
    runs = eval_runs(home)
    if checkpoint and checkpoint not in runs:
        raise NotFound(f"no eval rows of checkpoint {checkpoint!r} under {evals_folder(home)}")
    hits, searched, more = [], 0, False
    for ckpt in [checkpoint] if checkpoint else list(runs):
        chosen, frame = attempt_rows(home, ckpt, run_id if checkpoint else "", runs=runs)
        if status:
            frame = frame[frame["status"] == status]
        if task:
            frame = frame[frame["task_id"].astype(str).str.contains(task, regex=False)]
        if min_reward is not None:
            frame = frame[frame["reward"].fillna(-math.inf) >= min_reward]
        if max_reward is not None:
            frame = frame[frame["reward"].fillna(math.inf) <= max_reward]
        searched += len(frame)
        for row in frame.to_dict("records"):
            for field_name in ATTEMPT_TEXT:
                text = transcript_text(row.get(field_name)) if field_name == "transcript" else row.get(field_name)
                m = matcher.search(text) if isinstance(text, str) and text else None
                if m:
                    if len(hits) >= limit:
                        more = True
                        break
                    reward = row.get("reward")
                    hits.append({"checkpoint": ckpt, "run_id": chosen, "task_id": str(row["task_id"]),
                                 "attempt": int(row["attempt"]), "status": row["status"],
                                 "reward": None if reward is None or reward != reward else float(reward),
                                 "matched": field_name, "snippet": _snippet(text, m)})
                    break
            if more:
                break
        if more:
            break
    return {"hits": hits, "searched": searched, "more": more}


@lru_cache(maxsize=2)
def _suite_tasks(suite_json: str, mtime_ns: int) -> dict[str, Any]:
    from evals.bundled import read_suite

    return {t.id: t for t in read_suite(Path(suite_json).parent)}


def shown_prompt(home: Path, task_id: str) -> str:
    """The first context an eval episode of bundled task ``task_id`` showed the model (the compact
    prompt: the instruction, the numbered file, the failing tests' output), rendered again from the
    task in ``HOME/datasets/bundled``; '' when the home holds no such task (a Harbor or SWE-bench
    task: its prompt is the instruction the transcript keeps). The rows keep the instruction only."""
    from evals.actions import COMPACT, render_prompt

    suite = Path(home) / "datasets" / "bundled" / "suite.json"
    if not suite.is_file():
        return ""
    try:
        task = _suite_tasks(str(suite), suite.stat().st_mtime_ns).get(task_id)
    except Exception:  # noqa: BLE001 - a suite that does not load leaves the transcript as recorded
        return ""
    return render_prompt(task, COMPACT) if task is not None else ""

VIEWER_TEXT = ("diff", "test_outcomes", "test_output", "transcript")  # an attempt's long columns
