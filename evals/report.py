"""The evaluation report: per-checkpoint scores with intervals, the paired comparison with the base
model, every score with each flawed-task list dropped, Markdown tables and matplotlib plots.

Input is the per-attempt rows of :mod:`evals.evaluate` for any number of checkpoints (a DataFrame).
Rows with ``status == "infra_error"`` are left out of every score (they were never graded). Per task,
pass@k uses the unbiased estimator over that task's graded attempts; target scores are averaged over
a task's attempts first, so every task weighs the same. Intervals bootstrap over tasks
(:mod:`evals.metrics`). The base model of checkpoint ``<run>-step_NNNNNN`` is ``<run>-step_000000``
(the platform's partition convention); the paired comparison uses the tasks both were graded on.

Attempts with a cheating signal (the ``signals`` column, :mod:`evals.signals`) are *flagged*: they are
scored as graded (``results_tampered`` ones were already graded 0), each table says how many there
are, and when any exist every score is also given without them (subset ``without flagged
attempts``); ``exclude_flagged`` leaves them out of every score instead.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from evals.flawed import FlawedList
from evals.attempts import APPLY_FAILED, INFRA_ERROR, STATUSES
from evals.metrics import Estimate, bootstrap, paired_attempt_difference, paired_difference, pass_at_k
from evals.signals import split_signals

_KEY = re.compile(r"^(?P<run>.+)-step_(?P<step>\d{6})$")


def base_checkpoint(key: str) -> str | None:
    """``<run>-step_000000`` for a checkpoint key ``<run>-step_NNNNNN``; None for other keys."""
    match = _KEY.match(key)
    return f"{match['run']}-step_000000" if match else None


def parse_key(key: str) -> tuple[str, int] | None:
    """``(run, step)`` of a checkpoint key ``<run>-step_NNNNNN``; None for other keys."""
    match = _KEY.match(key)
    return (match["run"], int(match["step"])) if match else None


def checkpoint_step(key: str) -> int | None:
    match = _KEY.match(key)
    return int(match["step"]) if match else None


def flagged_mask(rows: pd.DataFrame) -> pd.Series:
    """True for each attempt with at least one cheating signal (rows without a ``signals`` column have none)."""
    if "signals" not in rows.columns:
        return pd.Series(False, index=rows.index)
    return rows["signals"].map(lambda value: bool(split_signals(value))).astype(bool)


def signal_counts(rows: pd.DataFrame) -> dict[str, int]:
    """How many attempts carry each signal, by name (sorted)."""
    counts: Counter[str] = Counter()
    if "signals" in rows.columns:
        for value in rows["signals"]:
            counts.update(set(split_signals(value)))
    return dict(sorted(counts.items()))


def per_task(rows: pd.DataFrame, k: int) -> pd.DataFrame:
    """One row per task: graded attempts ``n``, passes ``c``, pass@1, pass@k and mean target scores."""
    graded = rows[rows["status"] != INFRA_ERROR]
    out = []
    for task_id, group in graded.groupby("task_id", sort=True):
        n = len(group)
        c = int((group["reward"] >= 1.0).sum())
        out.append({
            "task_id": task_id, "n": n, "c": c,
            "pass@1": pass_at_k(n, c, 1),
            f"pass@{k}": pass_at_k(n, c, k) if n >= k else math.nan,
            "target_score": float(group["target_score"].mean()),
            "strict_target_score": float(group["strict_target_score"].mean()),
            "partial": float(group["partial"].mean()),
        })
    # with k == 1 the two pass columns are one (a repeated name would make a two-column selection)
    pass_columns = list(dict.fromkeys(["pass@1", f"pass@{k}"]))
    return pd.DataFrame(out, columns=["task_id", "n", "c", *pass_columns, "target_score", "strict_target_score",
                                      "partial"])


def graded_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The attempts that were scored: every row but the infrastructure's losses."""
    return rows[rows["status"] != INFRA_ERROR]


def status_counts(rows: pd.DataFrame) -> dict[str, int]:
    """How many attempts have each status of :data:`evals.attempts.STATUSES` (empty with no rows)."""
    return {s: int((rows["status"] == s).sum()) for s in STATUSES} if len(rows) else {}


def infra_error_share(rows: pd.DataFrame) -> float:
    """The share of attempts lost to the infrastructure (0 with no rows)."""
    return float((rows["status"] == INFRA_ERROR).mean()) if len(rows) else 0.0


def run_summary(rows: pd.DataFrame, k: int) -> dict[str, Any]:
    """The headline numbers of one eval run's attempt rows: tasks' mean pass@1 and pass@k
    (:func:`per_task`), graded attempts' mean partial and target scores, the share of attempts that
    committed, the counts of infra errors, apply failures and flagged attempts, and ``signals``
    (:func:`signal_counts`). Means over nothing are NaN."""
    table = per_task(rows, k)
    graded = graded_rows(rows)

    def mean(frame: pd.DataFrame, column: str) -> float:
        return float(frame[column].mean()) if len(frame) else float("nan")

    return {
        "attempts": len(rows),
        "infra_errors": int((rows["status"] == INFRA_ERROR).sum()),
        "apply_failed": int((rows["status"] == APPLY_FAILED).sum()),
        "pass@1": mean(table, "pass@1"),
        f"pass@{k}": mean(table, f"pass@{k}"),
        "partial": mean(graded, "partial"),
        "mean_target_score": mean(graded, "target_score"),
        "mean_strict_target_score": mean(graded, "strict_target_score"),
        "committed_share": float(rows["committed"].mean()) if len(rows) else 0.0,
        "flagged_attempts": int(flagged_mask(graded).sum()),
        "signals": signal_counts(graded),
    }


def flip_counts(task_rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many tasks a checkpoint ``gained`` (solved now, never by its base model) and ``lost``, from
    the per-task rows of :func:`viewer.data.checkpoint_tasks`."""
    return {flip: sum(r["flip"] == flip for r in task_rows) for flip in ("gained", "lost")}


@dataclass
class CheckpointScores:
    checkpoint: str
    subset: str  # "all" or "without <list>"
    n_tasks: int
    attempts: int
    infra_errors: int
    flagged: int = 0  # graded attempts with a cheating signal
    estimates: dict[str, Estimate] = field(default_factory=dict)
    vs_base: dict[str, Estimate] = field(default_factory=dict)


METRICS = ("pass@1", "partial", "target_score", "strict_target_score")


def score_checkpoint(rows: pd.DataFrame, *, k: int = 8, resamples: int = 2000, seed: int = 0,
                     base_rows: pd.DataFrame | None = None, subset: str = "all") -> CheckpointScores:
    """Scores of one checkpoint's rows (and, given ``base_rows``, the paired differences to the base)."""
    checkpoint = str(rows["checkpoint"].iloc[0]) if len(rows) else ""
    table = per_task(rows, k)
    graded = rows["status"] != INFRA_ERROR
    result = CheckpointScores(checkpoint, subset, len(table), int(graded.sum()), int((~graded).sum()),
                              int((flagged_mask(rows) & graded).sum()))
    if table.empty:
        return result
    for metric in dict.fromkeys((*METRICS, f"pass@{k}")):
        values = table[metric].dropna()
        if len(values):
            result.estimates[metric] = bootstrap(values.to_numpy(), resamples=resamples, seed=seed)
    if base_rows is not None and len(base_rows):
        base_table = per_task(base_rows, k).set_index("task_id")
        new_table = table.set_index("task_id")
        for metric in dict.fromkeys((*METRICS, f"pass@{k}")):
            try:
                result.vs_base[metric] = paired_difference(new_table[metric].dropna().to_dict(),
                                                           base_table[metric].dropna().to_dict(),
                                                           resamples=resamples, seed=seed)
            except ValueError:
                pass
    return result


FLAGGED_SUBSET = "without flagged attempts"
UNION_SUBSET = "without the union of all lists"


def build_report(rows: pd.DataFrame, flawed_lists: Sequence[FlawedList] = (), *, k: int = 8,
                 resamples: int = 2000, seed: int = 0, exclude_flagged: bool = False) -> list[CheckpointScores]:
    """Scores of every checkpoint in ``rows`` on all tasks, without each flawed list's tasks (and,
    with several lists, without the tasks of any of them), and
    (when any attempt is flagged) without the flagged attempts; ``exclude_flagged`` drops flagged
    attempts from every score instead."""
    if rows.empty:
        return []
    out = []
    checkpoints = sorted(rows["checkpoint"].unique(), key=lambda c: (checkpoint_step(c) or 0, c))
    flagged = flagged_mask(rows)
    if exclude_flagged:
        rows = rows[~flagged]
    subsets: list[tuple[str, pd.DataFrame]] = [("all", rows)]
    subsets += [(f"without {fl.name}", rows[~rows["task_id"].isin(fl.ids)]) for fl in flawed_lists]
    if len(flawed_lists) > 1:
        union = frozenset().union(*(fl.ids for fl in flawed_lists))
        subsets.append((UNION_SUBSET, rows[~rows["task_id"].isin(union)]))
    if flagged.any() and not exclude_flagged:
        subsets.append((FLAGGED_SUBSET, rows[~flagged]))
    for name, kept in subsets:
        for ckpt in checkpoints:
            mine = kept[kept["checkpoint"] == ckpt]
            base = base_checkpoint(ckpt)
            base_rows = kept[kept["checkpoint"] == base] if base and base != ckpt else None
            out.append(score_checkpoint(mine, k=k, resamples=resamples, seed=seed, base_rows=base_rows, subset=name))
    return out


@dataclass
class Headline:
    """The change in held-out pass@1 from a run's base model to one of its checkpoints, paired on the
    tasks both were graded on, overall and per difficulty level."""

    checkpoint: str
    base: str
    base_pass_at_1: float
    pass_at_1: float
    change: Estimate  # new - base, paired bootstrap over tasks of their attempt means
    levels: list[dict[str, Any]] = field(default_factory=list)  # level, tasks, base, new, change (Estimate)


def _attempt_rewards(rows: pd.DataFrame) -> dict[str, list[float]]:
    graded = rows[rows["status"] != INFRA_ERROR]
    return {t: (g["reward"] >= 1.0).astype(float).tolist() for t, g in graded.groupby("task_id", sort=True)}


def headlines(rows: pd.DataFrame, *, resamples: int = 2000, seed: int = 0) -> list[Headline]:
    """For every checkpoint with its run's base model (step 0) in ``rows``: held-out pass@1 of both,
    the paired change with its 95% interval (bootstrap over tasks of their attempt means), and the
    same per ``difficulty`` level where rows carry one."""
    out = []
    checkpoints = sorted(rows["checkpoint"].unique(), key=lambda c: (checkpoint_step(c) or 0, c)) if len(rows) else []
    for ckpt in checkpoints:
        base = base_checkpoint(ckpt)
        if not base or base == ckpt or base not in set(checkpoints):
            continue
        mine, theirs = rows[rows["checkpoint"] == ckpt], rows[rows["checkpoint"] == base]
        new_r, base_r = _attempt_rewards(mine), _attempt_rewards(theirs)
        common = sorted(set(new_r) & set(base_r))
        if not common:
            continue
        mean = lambda d, ids: float(np.mean([np.mean(d[t]) for t in ids]))  # noqa: E731
        head = Headline(ckpt, base, mean(base_r, common), mean(new_r, common),
                        paired_attempt_difference(new_r, base_r, resamples=resamples, seed=seed))
        if "difficulty" in mine.columns:
            level_of = mine.drop_duplicates("task_id").set_index("task_id")["difficulty"].to_dict()
            for level in sorted({level_of[t] for t in common if pd.notna(level_of.get(t))}):
                ids = [t for t in common if level_of.get(t) == level]
                head.levels.append({
                    "level": int(level) if float(level).is_integer() else level, "tasks": len(ids),
                    "base": mean(base_r, ids), "new": mean(new_r, ids),
                    "change": paired_attempt_difference({t: new_r[t] for t in ids}, {t: base_r[t] for t in ids},
                                                        resamples=resamples, seed=seed),
                })
        out.append(head)
    return out


def headline_markdown(heads: Sequence[Headline]) -> str:
    """The headlines as Markdown, in points of pass@1: the overall change with its interval and a
    table per level."""
    parts = []
    for h in heads:
        c = h.change
        parts.append(f"**{h.checkpoint}**: held-out pass@1 {100 * h.base_pass_at_1:.1f}% -> {100 * h.pass_at_1:.1f}%, "
                     f"change **{100 * c.value:+.1f} points**, 95% CI [{100 * c.low:+.1f}, {100 * c.high:+.1f}] "
                     f"(paired over {c.n_tasks} tasks against {h.base}; paired bootstrap over tasks)\n")
        if h.levels:
            parts.append("| level | tasks | base pass@1 | pass@1 | change (points) | 95% CI |\n|---|---|---|---|---|---|")
            for lv in h.levels:
                d = lv["change"]
                parts.append(f"| {lv['level']} | {lv['tasks']} | {100 * lv['base']:.1f}% | {100 * lv['new']:.1f}% | "
                             f"{100 * d.value:+.1f} | [{100 * d.low:+.1f}, {100 * d.high:+.1f}] |")
            parts.append("")
    return "\n".join(parts) if parts else "_no checkpoint evaluated beside its run's base model yet_\n"


def markdown_tables(report: Sequence[CheckpointScores], k: int = 8) -> str:
    """The report as Markdown: one table per subset, estimates as ``value [low, high]`` (95% bootstrap
    intervals over tasks; the deltas are paired over the tasks both checkpoints were graded on)."""
    lines: list[str] = []
    subsets = list(dict.fromkeys(r.subset for r in report))
    for subset in subsets:
        lines += [f"### {subset} tasks" if subset == "all" else f"### {subset}", ""]
        header = ["checkpoint", "tasks", "attempts", "infra errors", "pass@1", f"pass@{k}", "partial",
                  "strict target score", "Δ pass@1 vs base", f"Δ pass@{k} vs base", "Δ partial vs base",
                  "Δ strict vs base", "flagged"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for r in (r for r in report if r.subset == subset):
            def cell(d: dict[str, Estimate], key: str) -> str:
                return d[key].fmt() if key in d else "–"
            lines.append("| " + " | ".join([
                r.checkpoint, str(r.n_tasks), str(r.attempts), str(r.infra_errors), cell(r.estimates, "pass@1"),
                cell(r.estimates, f"pass@{k}"), cell(r.estimates, "partial"),
                cell(r.estimates, "strict_target_score"), cell(r.vs_base, "pass@1"), cell(r.vs_base, f"pass@{k}"),
                cell(r.vs_base, "partial"), cell(r.vs_base, "strict_target_score"), str(r.flagged),
            ]) + " |")
        lines.append("")
    return "\n".join(lines)


def checkpoint_summary(rows: pd.DataFrame, k: int = 8) -> list[dict[str, Any]]:
    """Plain means per checkpoint (no intervals): tasks, graded attempts, infra errors, flagged
    attempts, pass@1, pass@k (NaN where no task has k graded attempts; with k = 1 it is pass@1, one
    key), target score, strict target score and partial, as ``posttrain score`` prints them."""
    out = []
    for ckpt in sorted(rows["checkpoint"].unique(), key=lambda c: (checkpoint_step(c) or 0, c)):
        mine = rows[rows["checkpoint"] == ckpt]
        graded = mine["status"] != INFRA_ERROR
        table = per_task(mine, k)
        passk = table[f"pass@{k}"].dropna() if len(table) else table.get(f"pass@{k}", pd.Series(dtype=float))
        out.append({
            "checkpoint": str(ckpt), "tasks": len(table), "attempts": int(graded.sum()),
            "infra_errors": int((~graded).sum()), "flagged": int((flagged_mask(mine) & graded).sum()),
            "pass@1": float(table["pass@1"].mean()) if len(table) else math.nan,
            f"pass@{k}": float(passk.mean()) if len(passk) else math.nan,
            "target_score": float(table["target_score"].mean()) if len(table) else math.nan,
            "strict_target_score": float(table["strict_target_score"].mean()) if len(table) else math.nan,
            "partial": float(table["partial"].mean()) if len(table) else math.nan,
        })
    return out


def report_rows(report: Sequence[CheckpointScores]) -> pd.DataFrame:
    """The report flattened to one row per (subset, checkpoint) for Parquet/CSV."""
    out: list[dict[str, Any]] = []
    for r in report:
        row: dict[str, Any] = {"subset": r.subset, "checkpoint": r.checkpoint, "tasks": r.n_tasks,
                               "attempts": r.attempts, "infra_errors": r.infra_errors, "flagged": r.flagged}
        for key, est in r.estimates.items():
            row[key], row[f"{key}_low"], row[f"{key}_high"] = est.value, est.low, est.high
        for key, est in r.vs_base.items():
            row[f"delta_{key}"], row[f"delta_{key}_low"], row[f"delta_{key}_high"] = est.value, est.low, est.high
        out.append(row)
    return pd.DataFrame(out)


def plot_pass_at_1(report: Sequence[CheckpointScores], path: str | Path) -> Path:
    """pass@1 per checkpoint with its interval, one line per run (subset ``all``)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in report if r.subset == "all" and "pass@1" in r.estimates]
    runs: dict[str, list[CheckpointScores]] = {}
    for r in rows:
        runs.setdefault(_KEY.match(r.checkpoint)["run"] if _KEY.match(r.checkpoint) else r.checkpoint, []).append(r)
    for run, items in sorted(runs.items()):
        xs = [checkpoint_step(r.checkpoint) or 0 for r in items]
        est = [r.estimates["pass@1"] for r in items]
        ys = np.array([e.value for e in est])
        err = np.array([[e.value - e.low for e in est], [e.high - e.value for e in est]])
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=run)
    ax.set_xlabel("step")
    ax.set_ylabel("pass@1 (95% bootstrap CI)")
    ax.set_ylim(0, 1)
    ax.set_title("pass@1 per checkpoint")
    if runs:
        ax.legend()
    return _save(fig, path)


def plot_pass_at_k(rows: pd.DataFrame, path: str | Path, k_max: int = 8) -> Path:
    """pass@k for k = 1..k_max, one curve per checkpoint, over all graded tasks."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    graded = rows[rows["status"] != INFRA_ERROR]
    for ckpt in sorted(graded["checkpoint"].unique(), key=lambda c: (checkpoint_step(c) or 0, c)):
        counts = graded[graded["checkpoint"] == ckpt].groupby("task_id")["reward"].agg(["count", "sum"])
        ks = list(range(1, k_max + 1))
        ys = []
        for k in ks:
            vals = [pass_at_k(int(n), int(c), k) for n, c in zip(counts["count"], counts["sum"]) if n >= k]
            ys.append(float(np.mean(vals)) if vals else np.nan)
        ax.plot(ks, ys, marker=".", label=ckpt)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1)
    ax.set_title("pass@k curves")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_target_scores(report: Sequence[CheckpointScores], path: str | Path) -> Path:
    """Mean target score and strict target score per checkpoint, with intervals (subset ``all``)."""
    plt = _pyplot()

    rows = [r for r in report if r.subset == "all" and "target_score" in r.estimates]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.8), 4))
    x = np.arange(len(rows))
    for offset, metric in ((-0.2, "target_score"), (0.2, "strict_target_score")):
        est = [r.estimates[metric] for r in rows]
        ys = np.array([e.value for e in est])
        err = np.array([[e.value - e.low for e in est], [e.high - e.value for e in est]]) if est else None
        ax.bar(x + offset, ys, width=0.4, yerr=err, capsize=3, label=metric.replace("_", " "))
    ax.set_xticks(x, [r.checkpoint for r in rows], rotation=30, ha="right", fontsize="small")
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean over tasks (95% CI)")
    ax.set_title("target scores per checkpoint")
    ax.legend()
    return _save(fig, path)


def _pyplot():
    """matplotlib's pyplot on the file backend. Imported here, not with the module: it takes about a
    second, and only the plots need it (the viewer and the CLI import this module for its numbers)."""
    import matplotlib  # heavy: about a second (see above)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display backend is looked for

    return plt


def _save(fig, path: str | Path) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


# -- attempt rows of every eval run -----------------------------------------------------------------


def attempt_files(folder: str | Path) -> list[tuple[str, str, Path]]:
    """``(checkpoint, run_id, path)`` of every attempt-row file under ``folder``: one file per eval run,
    ``<checkpoint>/<run_id>.parquet``; a file ``<checkpoint>.parquet`` (the earlier layout, one run
    per checkpoint) is read as run ``earlier``."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(p.parent.name, p.stem, p) for p in folder.glob("*/*.parquet") if not p.name.startswith(".")]
    found += [(p.stem, "earlier", p) for p in folder.glob("*.parquet") if not p.name.startswith(".")]
    return sorted(found)


def load_attempt_rows(folder: str | Path) -> pd.DataFrame:
    """Every eval run's attempt rows under ``folder``, with ``run_id`` and ``written_s`` (the file's
    modification time) added, so repeats of one checkpoint stay apart."""
    frames = []
    for checkpoint, run_id, path in attempt_files(folder):
        frame = pd.read_parquet(path)
        frame["checkpoint"] = checkpoint
        frame["run_id"] = run_id
        frame["written_s"] = path.stat().st_mtime
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def newest_runs(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of each checkpoint's newest eval run (by ``written_s``)."""
    if rows.empty or "run_id" not in rows.columns:
        return rows
    newest = rows.groupby("checkpoint")["written_s"].transform("max")
    return rows[rows["written_s"] == newest]


def repeat_spread(rows: pd.DataFrame, k: int = 8) -> list[dict[str, Any]]:
    """Per checkpoint, pass@1 of each eval run (newest first) and the spread between them."""
    out = []
    if rows.empty or "run_id" not in rows.columns:
        return out
    for ckpt in sorted(rows["checkpoint"].unique(), key=lambda c: (checkpoint_step(c) or 0, c)):
        mine = rows[rows["checkpoint"] == ckpt]
        runs = []
        for run_id, group in sorted(mine.groupby("run_id"), key=lambda item: -item[1]["written_s"].max()):
            table = per_task(group, k)
            runs.append({"run_id": str(run_id), "pass@1": round(float(table["pass@1"].mean()), 3) if len(table) else None})
        values = [r["pass@1"] for r in runs if r["pass@1"] is not None]
        out.append({"checkpoint": str(ckpt), "runs": len(runs), "newest_run": runs[0]["run_id"],
                    "pass@1 per run": [r["pass@1"] for r in runs],
                    "spread": round(max(values) - min(values), 3) if len(values) > 1 else 0.0})
    return out


def spread_markdown(spread: Sequence[dict[str, Any]]) -> str:
    lines = ["| checkpoint | eval runs | newest run | pass@1 per run (newest first) | spread (max - min) |",
             "|---|---|---|---|---|"]
    for r in spread:
        values = ", ".join("–" if v is None else f"{v:.3f}" for v in r["pass@1 per run"])
        lines.append(f"| {r['checkpoint']} | {r['runs']} | {r['newest_run']} | {values} | {r['spread']:.3f} |")
    return "\n".join(lines) + "\n"
