"""Progress of a training run: one line per step on stdout, TensorBoard event files in the run
directory, and, when ``rl_run`` launched the process, one Dagster Pipes message per step.

The per-step series are :func:`step_series` of the trainer's step row (``training.loop.RunState.train``):
the same names in TensorBoard (``RUN_DIR/metrics/tensorboard/``, open it with
``posttrain ui --tensorboard`` or ``tensorboard --logdir RUN_DIR/metrics/tensorboard``), in the Pipes
message (``{"step": row, "series": {...}, "adapter_version": ...}``) and on the ``rl_run`` asset's
observations in the Dagster UI. ``integrity_gated`` counts the attempts of the step that a gating
cheating signal flagged (the integrity gate, :class:`training.grpo.IntegrityGate`), and
``integrity_<signal>`` the attempts that raised each signal of :data:`evals.signals.ALL_SIGNALS`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, open_dagster_pipes

from evals.signals import ALL_SIGNALS
from training.checkpoint import metrics_dir, store_path

TENSORBOARD_DIR = "tensorboard"  # under the run's metrics folder

# name shown -> how it is computed from the step row; every name is a TensorBoard tag and an
# observation metadata key of rl_run
SERIES = (
    "loss", "pg_loss", "kl", "grad_norm", "reward_mean", "solve_rate", "policy_age_mean", "policy_age_max",
    "zero_variance_groups", "groups", "useful_tokens_per_s", "tokens_per_s", "wait_s", "train_s", "publish_s",
    "discarded_tokens", "discarded_token_fraction", "discarded_samples",
    "integrity_gated", *(f"integrity_{signal}" for signal in ALL_SIGNALS), "canary_pass_rate", "canary_samples",
    *(f"phase_{name}" for name in ("generation_s", "sandbox_s", "grading_s")), "step_s", "eta_s",
)
# time per phase: ``phase_generation_s`` (the model's calls), ``phase_sandbox_s`` (the rest of each
# episode: actions in its sandbox) and ``phase_grading_s`` (tests of the committed work) are summed
# over the episodes the step took, which run side by side; ``wait_s``, ``train_s`` and ``publish_s``
# are the trainer's wall clock, ``step_s`` the wall clock since the step before and ``eta_s`` the time
# to the last step at the pace of the last five.
ETA_WINDOW = 5
# distributions per step (TensorBoard histograms, and the viewer's step page)
HISTOGRAMS = ("reward", "advantage", "response_tokens", "turns", "group_reward_std")


def step_series(row: dict[str, Any], publish_s: float = 0.0, extra: dict[str, float] | None = None) -> dict[str, float]:
    """The curves of one step from the trainer's step row (and ``extra`` series the reporter measured:
    phases, ``step_s``, ``eta_s``). ``tokens_per_s`` counts every generated token taken for the step
    (used or dropped with a zero-variance group) over wait + train time; ``useful_tokens_per_s`` only
    those trained on."""
    seconds = max(float(row.get("wait_s", 0.0)) + float(row.get("train_s", 0.0)), 1e-9)
    derived = {"tokens_per_s": float(row.get("consumed_tokens", 0)) / seconds, "publish_s": float(publish_s),
               **(extra or {})}
    out: dict[str, float] = {}
    for name in SERIES:
        value = derived[name] if name in derived else row.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def plain_advantages(rewards: list[float], *, scale_by_std: bool = False, eps: float = 1e-6) -> list[float]:
    """GRPO's advantages of one group (:func:`training.grpo.group_advantages`) in plain Python, for
    readers that do not load torch (the viewer, the step histograms): reward minus the group's mean,
    divided by its standard deviation with ``scale_by_std``; all zero when the rewards are equal."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    if std <= eps:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + eps) if scale_by_std else r - mean for r in rewards]


def step_rollouts(run_dir: str | Path, step: int, *, scale_by_std: bool = False) -> dict[str, Any]:
    """The rollouts step ``step`` took (the store's ``status_step``, stale ones left out), read
    read-only from the run's store: ``HISTOGRAMS`` values and the seconds of each episode phase
    (summed; ``generation_s`` where a rollout records it, the rest of ``agent_s`` the sandbox's)."""

    path = store_path(Path(run_dir))
    out: dict[str, Any] = {name: [] for name in HISTOGRAMS}
    out["phases"] = {"phase_generation_s": 0.0, "phase_sandbox_s": 0.0, "phase_grading_s": 0.0}
    if not path.is_file():
        return out
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30.0)
    try:
        rows = conn.execute("SELECT group_id, reward, generated_tokens, info FROM rollouts "
                            "WHERE status_step=? AND status='consumed' ORDER BY created_s", (int(step),)).fetchall()
    finally:
        conn.close()
    groups: dict[str, list[float]] = {}
    for group_id, reward, tokens, info_text in rows:
        info = json.loads(info_text)
        groups.setdefault(group_id, []).append(float(reward))
        out["reward"].append(float(reward))
        out["response_tokens"].append(float(tokens))
        out["turns"].append(float(info.get("turns") or 0))
        agent, generation = float(info.get("agent_s") or 0.0), float(info.get("generation_s") or 0.0)
        out["phases"]["phase_generation_s"] += generation
        out["phases"]["phase_sandbox_s"] += max(agent - generation, 0.0)
        out["phases"]["phase_grading_s"] += float(info.get("grade_s") or 0.0)
    for rewards in groups.values():
        out["advantage"] += plain_advantages(rewards, scale_by_std=scale_by_std)
        mean = sum(rewards) / len(rewards)
        out["group_reward_std"].append((sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5)
    return out


def eta_s(step_seconds: list[float], step: int, of_steps: int | None, window: int = ETA_WINDOW) -> float | None:
    """Seconds to step ``of_steps`` at the mean pace of the last ``window`` steps; None without a plan."""
    if not of_steps or not step_seconds:
        return None
    recent = step_seconds[-window:]
    return max(of_steps - step, 0) * sum(recent) / len(recent)


def tensorboard_dir(run_dir: str | Path) -> Path:
    return metrics_dir(Path(run_dir)) / TENSORBOARD_DIR


class Reporter:
    """``with Reporter(run_dir) as report``: ``info`` lines, ``step`` per trainer step, ``done`` at the end.
    Without ``run_dir`` the Pipes extra ``run_dir`` is used, if any; no run directory, no TensorBoard.
    ``of_steps`` (the run's last step) gives each step its ETA; ``scale_by_std`` how the step's
    advantages are histogrammed (the trainer config's ``scale_advantages_by_std``)."""

    def __init__(self, run_dir: str | Path | None = None, *, of_steps: int | None = None,
                 scale_by_std: bool = False) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.of_steps, self.scale_by_std = of_steps, scale_by_std
        self._last_step_at = time.monotonic()
        self._step_seconds: list[float] = []
        self._pipes = None
        self._cm = None
        self._writer = None

    def __enter__(self) -> "Reporter":

        if os.environ.get(DAGSTER_PIPES_CONTEXT_ENV_VAR):
            self._cm = open_dagster_pipes()
            self._pipes = self._cm.__enter__()
            extras = self._pipes.extras
            if self.run_dir is None and extras.get("run_dir"):
                self.run_dir = Path(extras["run_dir"])
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._cm is not None:
            self._cm.__exit__(*exc)

    def info(self, message: str) -> None:
        if self._pipes is not None:
            self._pipes.log.info(message)
        print(message, flush=True)

    def _tensorboard(self, first_step: int):
        if self._writer is None and self.run_dir is not None:
            try:
                # heavy: torch (TensorBoard's writer); only a reporter with a run folder writes events
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is a base dependency; an install without it still trains
                print(f"no TensorBoard event files: {exc}", file=sys.stderr, flush=True)
                self.run_dir = None
                return None
            # purge_step: a resumed run redoes the steps after its checkpoint; their old points go
            self._writer = SummaryWriter(str(tensorboard_dir(self.run_dir)), purge_step=first_step)
        return self._writer

    def step(self, row: dict[str, Any], published: Any) -> None:
        publish_s = float(published.http_s + published.volume_s)
        now = time.monotonic()
        self._step_seconds.append(now - self._last_step_at)
        self._last_step_at = now
        taken = step_rollouts(self.run_dir, int(row["step"]), scale_by_std=self.scale_by_std) \
            if self.run_dir is not None else {"phases": {}}
        eta = eta_s(self._step_seconds, int(row["step"]), self.of_steps)
        extra = {**taken["phases"], "step_s": self._step_seconds[-1], **({"eta_s": eta} if eta is not None else {})}
        series = step_series(row, publish_s, extra)
        line = (f"step {row['step']:4d} loss {row['loss']:+.4f} solve {row['solve_rate']:.3f} "
                f"groups {row['groups']} (zero-var {row['zero_variance_groups']}, stale {row['discarded_groups']}) "
                f"gated {row.get('integrity_gated', 0)} "
                f"age {row['policy_age_mean']:.2f}/{row['policy_age_max']} wait {row['wait_s']:.1f}s "
                f"train {row['train_s']:.1f}s publish {publish_s:.2f}s"
                + (f" eta {eta:.0f}s" if eta is not None else ""))
        print(line, flush=True)
        writer = self._tensorboard(int(row["step"]))
        if writer is not None:
            for name, value in series.items():
                writer.add_scalar(name, value, int(row["step"]))
            for name in HISTOGRAMS:  # distributions per step: TensorBoard's Histograms tab
                if taken.get(name):
                    # heavy: numpy; only a step with rewards to summarize needs it
                    import numpy as np

                    writer.add_histogram(name, np.asarray(taken[name], dtype=np.float64), int(row["step"]))
            writer.flush()  # each step is on disk for a TensorBoard that is watching
        if self._pipes is not None:
            self._pipes.report_custom_message({"step": _plain(row), "series": series,
                                               "adapter_version": published.version})
            self._pipes.log.info(line)

    def done(self, state: Any) -> None:
        rows = state.metrics.steps
        summary = {
            "steps": state.step,
            "final_solve_rate": rows[-1]["solve_rate"] if rows else None,
            # a resumed run's older rows may lack the column (NaN)
            "integrity_gated": int(sum(v for r in rows if (v := float(r.get("integrity_gated") or 0)) == v)),
            "rollouts": state.store.counts(),
        }
        print("done " + json.dumps(summary, default=str), flush=True)
        if self._pipes is not None:
            self._pipes.log.info("done " + json.dumps(summary, default=str))


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """The row with numpy scalars as Python numbers, for JSON."""
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}


# panels of the curves figure: title -> series drawn in it
PANELS = (
    ("loss", ("loss",)),
    ("reward and solve rate", ("reward_mean", "solve_rate")),
    ("policy age (steps)", ("policy_age_mean", "policy_age_max")),
    ("zero-variance groups", ("zero_variance_groups",)),
    ("tokens/s", ("tokens_per_s", "useful_tokens_per_s")),
    ("wait and train time (s)", ("wait_s", "train_s")),
    ("discarded tokens", ("discarded_tokens",)),
    ("discarded token fraction", ("discarded_token_fraction",)),
    ("canaries passed (cheating rate)", ("canary_pass_rate",)),
)


def plot_curves(runs: dict[str, list[dict[str, Any]]], path: str | Path, title: str = "training curves") -> Path:
    """One panel per :data:`PANELS` entry, x = step, one line per run and series, saved as PNG.

    ``runs`` maps a run name to its step rows (each with ``step`` and :func:`step_series` names);
    several runs on one figure compare them side by side."""
    # heavy: matplotlib; only plotting needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display backend is looked for

    fig, axes = plt.subplots(2, 4, figsize=(13, 6))
    for ax, (panel, names) in zip(axes.flat, PANELS):
        for run, rows in sorted(runs.items()):
            for name in names:
                points = [(r["step"], r[name]) for r in rows if name in r and r[name] == r[name]]
                if points:
                    xs, ys = zip(*sorted(points))
                    label = (f"{run}" if len(names) == 1 else f"{run} {name}") if len(runs) > 1 else name
                    ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label)
        ax.set_title(panel, fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines and (len(names) > 1 or len(runs) > 1):
            ax.legend(fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=75)
    plt.close(fig)
    tmp.replace(path)
    return path


def rows_from_steps_parquet(path: str | Path) -> list[dict[str, Any]]:
    """A run's step rows (``metrics/steps.parquet``) as :func:`step_series` rows with their step."""
    # heavy: pandas (and pyarrow); only reading the Parquet rows needs it
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        return []
    return [{"step": int(r["step"]), **step_series(r)} for r in pd.read_parquet(path).to_dict("records")]
