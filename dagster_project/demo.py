"""``posttrain demo``: the whole asset graph on the embedded default, in the local instance.

Materializes ``task_dataset``, ``image_cache``, ``difficulty_curriculum`` (which builds the embedded
base model first) and ``rl_run``; adds a ``checkpoints`` partition for every checkpoint the run saved
(the base model, step 0, included), in step order, and evaluates each within its budget: one it
cannot fit is left to the checkpoint sensor (:func:`evaluate_checkpoints`, and the closing lines say
which); then builds ``eval_report`` and
prints held-out pass@1, pass@k and target scores of every checkpoint side by side. Everything lands in
the local Dagster instance, so ``posttrain ui`` shows it after and has nothing left to start.

The settings below are the demo's compute budget for a 2-core machine: the run file's defaults
(``examples/embedded.toml``: RL draws from the task stream, tasks generated and validated as the run
goes, each new to it) with the overrides of :data:`DEMO_RUN`. ``seed`` is the trainer's seed and so
the RL task stream's: runs of other seeds draw other RL tasks and are evaluated on the same held-out
tasks. The last lines printed are the result: the final checkpoint's paired change in held-out
pass@1 with its 95% interval, level 3's change, and what the task stream served.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, TextIO

import dagster as dg

from assets.evals import eval_run_config, run_eval_section
from assets.partitions import checkpoints_partitions, parse_checkpoint_partition_key
from assets.resources import PosttrainStorage
from dagster_project.sensors import complete_checkpoint_keys
from viewer import links

QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}

# The demo's budget: 44 steps of 5 groups x 8 samples (the run file's collection size), one policy
# version of lag, a checkpoint every 22 steps; the curriculum from 2 base-model attempts per RL task;
# episodes of 5 turns (the base model tests, resets and retries); the run file's partial-credit
# reward. Since a missed edit is told the closest line, retries pay and episodes run longer: 5 groups
# rather than 6 keep the demo inside 20 minutes (docs/benchmarks.md, "The closest line"). The
# learning rate is 1e-3: on the GPU proxies 2e-3 lost held-out accuracy more often than it gained,
# and 1.5e-3 lost in a demo run (docs/benchmarks.md, "Base model and RL transfer", "Test and retry",
# "Edit by content" and "Partial credit").
DEMO_TURNS = 5  # turns per episode in the curriculum, the RL run and both evaluations
DEMO_RUN: dict[str, Any] = {
    "overrides": {
        "trainer": {"steps": 44, "checkpoint_every": 22, "learning_rate": 1e-3, "max_turns": DEMO_TURNS},
        "async": {"group_size": 8, "collection_size": 40, "max_policy_lag": 1},
    },
}
# Thirty-two episodes at a time in the curriculum and the evaluations, as in the RL run: an episode
# spends most of its time waiting (on a model call, on a sandbox starting), so fewer leave the cores
# idle, and vLLM serves a batch of calls for little more than the cost of one (docs/benchmarks.md,
# "vLLM's CPU per token").
DEMO_WORKERS = 32
# With the task stream the curriculum measures the base model on 15 of the suite's RL tasks a level,
# where the stream's level weights start (90 episodes).
DEMO_CURRICULUM: dict[str, Any] = {"attempts_per_task": 2, "max_turns": DEMO_TURNS, "workers": DEMO_WORKERS,
                                   "stream_tasks_per_level": 15}
# The demo run's [eval]: two attempts at each of the suite's 450 held-out tasks per checkpoint (900
# episodes each). The paired interval of the change is set mostly by the number of tasks: in the demo
# runs the spread of per-task differences gave +-2.8 to +-3.4 points at 270 tasks (+-2.2 to +-2.6 at
# 450 for the same spread) and +-3.8 to +-4.5 at 180, while 44 steps changed pass@1 by +2.6 on average
# over the six seeds with the task stream's rule for tasks that teach, so at 270 a change of +2 showed
# an interval across zero. The 180 tasks more cost about 130 s of the two evaluations; the mid-run
# checkpoint is evaluated after them only while the budget below allows (docs/benchmarks.md,
# "`posttrain demo`" and "Held-out tasks and attempts").
DEMO_EVAL: dict[str, Any] = {"attempts": 2, "max_turns": DEMO_TURNS, "workers": DEMO_WORKERS}
# The base and the final checkpoint are always evaluated; a checkpoint between them only while the
# demo stays inside this budget (its evaluation is estimated to take as long as the last one did),
# counted from POSTTRAIN_DEMO_STARTED_AT (Unix seconds: scripts/demo.sh sets it before the set-up)
# where that is set, else from the demo's start.
DEMO_BUDGET_S = 15 * 60


def _before_demo_s() -> float:
    """Seconds spent before the demo started (the set-up of scripts/demo.sh), 0 when not told."""
    raw = os.environ.get("POSTTRAIN_DEMO_STARTED_AT", "")
    try:
        return max(0.0, time.time() - float(raw)) if raw else 0.0
    except ValueError:
        raise ValueError(f"POSTTRAIN_DEMO_STARTED_AT={raw!r}: expected Unix seconds (date +%s)") from None


def _stage(message: str, started: float) -> None:
    print(f"[demo {time.monotonic() - started:7.1f}s] {message}", flush=True)


class StepProgress(threading.Thread):
    """Prints the RL run's progress while it trains, one line per step, from the ``rl_run``
    observations the run writes into the instance (the same ones the UI plots). On a terminal the
    line is a bar redrawn in place."""

    def __init__(self, instance: dg.DagsterInstance, of_steps: int, started: float, out: TextIO | None = None,
                 poll_s: float = 1.0) -> None:
        super().__init__(name="demo-progress", daemon=True)
        self.instance, self.of_steps, self.started, self.poll_s = instance, of_steps, started, poll_s
        self.out = out or sys.stdout
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.stopped = threading.Event()
        latest = instance.fetch_observations(dg.AssetKey("rl_run"), limit=1)
        self.cursor = latest.cursor if latest.records else None
        self.steps_seen = 0

    def line(self, meta: dict[str, Any]) -> str:
        def num(name: str, fmt: str) -> str:
            value = meta.get(name)
            return format(value.value if hasattr(value, "value") else value, fmt) if value is not None else "–"

        step = int(getattr(meta.get("step"), "value", meta.get("step") or 0))
        of = self.of_steps or int(getattr(meta.get("of_steps"), "value", 0) or 0)
        stats = (f"loss {num('loss', '+.4f')}  reward {num('reward_mean', '.3f')}  solve {num('solve_rate', '.3f')}  "
                 f"age {num('policy_age_mean', '.2f')}/{num('policy_age_max', '.0f')}  tok/s {num('tokens_per_s', '.0f')}")
        if "phase_generation_s" in meta:  # episode-seconds of the step's rollouts, then the trainer's wall clock
            stats += (f"  time gen {num('phase_generation_s', '.0f')}s sandbox {num('phase_sandbox_s', '.0f')}s "
                      f"grade {num('phase_grading_s', '.0f')}s wait {num('wait_s', '.0f')}s train {num('train_s', '.0f')}s")
        if "eta_s" in meta:
            stats += f"  ETA {num('eta_s', '.0f')}s"
        elapsed = time.monotonic() - self.started
        if self.tty and of:
            width = 24
            done = min(width, round(width * step / of))
            return f"\r[demo {elapsed:7.1f}s] rl_run [{'#' * done}{'.' * (width - done)}] {step}/{of}  {stats}"
        return f"[demo {elapsed:7.1f}s] rl_run step {step}/{of or '?'}  {stats}\n"

    def poll(self) -> None:
        result = self.instance.fetch_observations(dg.AssetKey("rl_run"), limit=100, cursor=self.cursor, ascending=True)
        for record in result.records:
            observation = record.event_log_entry.asset_observation
            if observation is not None and "step" in observation.metadata:
                self.out.write(self.line(dict(observation.metadata)))
                self.out.flush()
                self.steps_seen += 1
        if result.records:
            self.cursor = result.cursor

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)
        self.poll()  # the last steps
        if self.tty and self.steps_seen:
            self.out.write("\n")
            self.out.flush()


def _execute(defs: dg.Definitions, job_name: str, instance: dg.DagsterInstance, **kwargs: Any) -> None:
    result = defs.resolve_job_def(job_name).execute_in_process(instance=instance, raise_on_error=True, **kwargs)
    if not result.success:
        raise RuntimeError(f"job {job_name} failed")


def newest_rows(storage: PosttrainStorage) -> Any:
    """Every evaluated checkpoint's attempt rows, from its newest eval run."""
    from evals.report import load_attempt_rows, newest_runs

    return newest_runs(load_attempt_rows(storage.evals_dir() / "deepswe"))


def summarize(rows: Any, keys: list[str], k: int) -> list[dict[str, Any]]:
    """Held-out pass@1, pass@k and mean target scores of each checkpoint of ``keys`` in ``rows``."""
    from evals.report import per_task

    out = []
    for key in keys:
        if rows.empty or key not in set(rows["checkpoint"]):
            continue
        table = per_task(rows[rows["checkpoint"] == key], k)
        out.append({"checkpoint": key, "tasks": len(table), "pass@1": float(table["pass@1"].mean()),
                    f"pass@{k}": float(table[f"pass@{k}"].mean()),
                    "target_score": float(table[[c for c in table.columns if "target_score" in c][0]].mean())})
    return out


def headline_lines(rows: Any, keys: list[str]) -> list[str]:
    """The paired change in held-out pass@1 of each checkpoint of ``keys`` from the base, with its 95%
    interval, and per level (what ``eval_report`` puts first)."""
    from evals.report import headlines

    if rows.empty:
        return []
    lines = []
    for h in headlines(rows[rows["checkpoint"].isin(keys)]):
        c = h.change
        lines.append(f"{h.checkpoint}: pass@1 change over the base model {100 * c.value:+.1f} points, 95% CI "
                     f"[{100 * c.low:+.1f}, {100 * c.high:+.1f}] (paired over {c.n_tasks} tasks)")
        for lv in h.levels:
            d = lv["change"]
            lines.append(f"  level {lv['level']} ({lv['tasks']} tasks): {100 * lv['base']:.1f}% -> {100 * lv['new']:.1f}% "
                         f"({100 * d.value:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}])")
    return lines


def result_lines(rows: Any, final: str, run_dir: Any) -> list[str]:
    """The demo's result: ``final``'s paired change in held-out pass@1 over the base with its 95%
    interval (and whether it lies above zero), level 3's change, and what the run's task stream served."""
    from pathlib import Path

    from evals.report import base_checkpoint, headlines
    from training.curriculum import STREAM_DIR, STREAM_SUMMARY

    out = []
    heads = [] if rows.empty else headlines(rows[rows["checkpoint"].isin([final, base_checkpoint(final)])])
    for h in heads:
        c = h.change
        where = "above zero" if c.low > 0 else ("below zero" if c.high < 0 else "includes zero")
        out.append(f"result: {final} held-out pass@1 {100 * h.base_pass_at_1:.1f}% -> {100 * h.pass_at_1:.1f}%, change "
                   f"{100 * c.value:+.1f} points, 95% CI [{100 * c.low:+.1f}, {100 * c.high:+.1f}] ({where}; "
                   f"paired over {c.n_tasks} tasks)")
        for lv in h.levels:
            if lv["level"] == 3:
                d = lv["change"]
                out.append(f"result: level 3 {100 * lv['base']:.1f}% -> {100 * lv['new']:.1f}% "
                           f"({100 * d.value:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}], {lv['tasks']} tasks)")
    summary = Path(run_dir) / STREAM_DIR / STREAM_SUMMARY
    if summary.is_file():
        import json

        s = json.loads(summary.read_text())
        levels = "/".join(str(v) for v in (s.get("drawn_by_level") or {}).values())
        out.append(f"task stream: {s['drawn']} new tasks served (L1/L2/L3 {levels}), {s['solved']} solved, "
                   f"{s['retried']} retries of unsolved ones, {s['rejected']} rejected by validation, "
                   f"{s.get('passed_over', 0)} passed over as unlikely to teach, "
                   f"{s['validation_s_per_task']} s of validation a task")
    return out


def evaluate_checkpoints(instance: dg.DagsterInstance, keys: list[str], evaluate: Callable[[str], None],
                         elapsed_s: Callable[[], float], *, budget_s: float = DEMO_BUDGET_S,
                         log: Callable[[str], None] = print) -> tuple[list[str], list[str]]:
    """Evaluate the checkpoints ``keys`` of the demo's run (``evaluate(key)`` runs ``checkpoint_eval``):
    the base and the final one always, those between while ``elapsed_s()`` and the last eval's
    length stay inside ``budget_s``. Returns the keys evaluated and those left, in step order.

    Every checkpoint's ``checkpoints`` partition is added first, in step order (the UI lists them
    so). One left out has its partition taken away again, so that it is what the checkpoint sensor
    looks for ("a complete checkpoint folder without a partition"): the sensor adds it and requests
    its eval once `posttrain ui` runs the daemon. Left a partition, as the demo once left it, it was
    hidden from the sensor for good ("no new checkpoint" on every tick). A partition whose eval was
    already requested or recorded (a daemon beside the demo) is kept and not evaluated twice."""
    saved = sorted(keys, key=parse_checkpoint_partition_key)
    known = set(instance.get_dynamic_partitions(checkpoints_partitions.name))
    instance.add_dynamic_partitions(checkpoints_partitions.name, [k for k in saved if k not in known])
    evaluated_before = instance.get_materialized_partitions(dg.AssetKey("deepswe_eval"))
    order = list(dict.fromkeys([saved[0], saved[-1], *saved[1:-1]]))
    evaluated: list[str] = []
    left: list[str] = []
    last_eval_s = 0.0
    for i, key in enumerate(order, 1):
        if i > 2 and elapsed_s() + last_eval_s > budget_s - 60:
            requested = key in evaluated_before or instance.get_runs(
                filters=dg.RunsFilter(job_name="checkpoint_eval", tags={"dagster/partition": key}), limit=1)
            if requested:
                log(f"not evaluating checkpoint {key} here: its eval was already requested (the checkpoint sensor's)")
                continue
            instance.delete_dynamic_partition(checkpoints_partitions.name, key)
            log(f"not evaluating checkpoint {key} here: it would take the demo past {budget_s / 60:.0f} minutes; "
                "the checkpoint sensor evaluates it once `posttrain ui` runs")
            left.append(key)
            continue
        log(f"evaluating checkpoint {key} ({i}/{len(order)})")
        t0 = time.monotonic()
        evaluate(key)
        last_eval_s = time.monotonic() - t0
        evaluated.append(key)
    return sorted(evaluated, key=parse_checkpoint_partition_key), left


def run_demo(run_name: str, rl_run_config: dict[str, Any] | None = None, *,
             curriculum_config: dict[str, Any] | None = None, eval_config: dict[str, Any] | None = None,
             dataset_config: dict[str, Any] | None = None, seed: int = 0) -> int:
    from dagster_project.definitions import defs

    started = time.monotonic()
    before_s = _before_demo_s()
    storage = PosttrainStorage()
    rl_config = {"run_name": run_name, **(DEMO_RUN if rl_run_config is None else rl_run_config)}
    overrides = dict(rl_config.get("overrides") or {})
    if seed:
        overrides["trainer"] = {**(overrides.get("trainer") or {}), "seed": seed}
    # the run's [eval]: its plan keeps it, and every checkpoint is evaluated as it says
    overrides["eval"] = {**DEMO_EVAL, **(overrides.get("eval") or {}), **(eval_config or {})}
    rl_config["overrides"] = overrides
    with dg.DagsterInstance.get() as instance:
        _stage(f"Dagster instance at {instance.root_directory}; files under {storage.path}", started)
        if before_s:
            _stage(f"set-up took {before_s:.0f} s; the demo's {DEMO_BUDGET_S // 60} minutes count it", started)
        _stage("materializing task_dataset, image_cache, difficulty_curriculum (builds the base model), rl_run", started)
        run_config: dict[str, Any] = dict(QUIET_LOGS)
        run_config["ops"] = {
            "rl_run": {"config": rl_config},
            "difficulty_curriculum": {"config": {**DEMO_CURRICULUM, **(curriculum_config or {})}},
        }
        if dataset_config:
            run_config["ops"]["task_dataset"] = {"config": dataset_config}
        of_steps = int(((rl_config.get("overrides") or {}).get("trainer") or {}).get("steps") or 0)
        progress = StepProgress(instance, of_steps, started)
        progress.start()
        try:
            _execute(defs, "rl_pipeline", instance, run_config=run_config)
        finally:
            progress.stop()

        keys = [k for k in complete_checkpoint_keys(storage) if parse_checkpoint_partition_key(k)[0] == run_name]
        if not keys:
            raise RuntimeError(f"run {run_name!r} saved no checkpoint under {storage.run_dir(run_name)}")
        section = run_eval_section(storage, run_name)
        evaluated, left = evaluate_checkpoints(
            instance, keys,
            lambda key: _execute(defs, "checkpoint_eval", instance, partition_key=key,
                                 run_config={**QUIET_LOGS, **eval_run_config(section)}),
            lambda: before_s + time.monotonic() - started, log=lambda m: _stage(m, started))

        k = section.attempts
        _stage("building eval_report", started)
        _execute(defs, "eval_report_job", instance,
                 run_config={**QUIET_LOGS, "ops": {"eval_report": {"config": {"k": k}}}})
        evaluated_rows = newest_rows(storage)
        rows = summarize(evaluated_rows, evaluated, k)
        for row in rows:
            _stage(f"{row['checkpoint']}: held-out pass@1 {100 * row['pass@1']:.1f}%  pass@{k} "
                   f"{100 * row[f'pass@{k}']:.1f}%  target score {row['target_score']:.3f}  ({row['tasks']} tasks)", started)
        for line in headline_lines(evaluated_rows, evaluated):
            _stage(line, started)
        for line in result_lines(evaluated_rows, evaluated[-1], storage.run_dir(run_name)):
            _stage(line, started)
        _stage(f"checkpoints evaluated here: {', '.join(evaluated)}", started)
        if left:
            _stage(f"checkpoints left to the checkpoint sensor: {', '.join(left)} (their partitions taken away again: "
                   "the sensor adds and evaluates each within 30 s of `posttrain ui` starting the daemon; the UI "
                   "shows the run under Runs, eval_report refreshes after it)", started)
        _stage(f"done. Report: {storage.reports_dir()}; run: {storage.run_dir(run_name)}", started)
        _stage("open the UI with `posttrain ui` to browse every asset and its metadata; the viewer links in it "
               f"point to {links.viewer_url()} (the viewer last served for this home, else the default port)", started)
    return 0
