"""The ``deepswe_eval`` asset (per checkpoint) and the ``eval_report`` asset (all checkpoints)."""


import base64
from pathlib import Path

import dagster as dg

from assets.partitions import checkpoints_partitions
from assets.resources import PosttrainStorage
from assets.training import checkpoints
from training.checkpoint import checkpoint_policy


class DeepSWEEvalConfig(dg.Config):
    """How a checkpoint is evaluated. ``tasks``: a task source (``bundled`` is the suite under the
    datasets folder); ``split``: which of its tasks (empty: all)."""

    tasks: str = "bundled"
    split: str = "eval"
    attempts: int = 8
    max_turns: int = 4
    max_new_tokens: int = 48
    temperature: float = 1.0
    seed: int = 0
    workers: int = 2
    sandbox_runtime: str = "bwrap"


@dg.asset(group_name="evals", deps=[checkpoints], partitions_def=checkpoints_partitions, kinds={"parquet"})
def deepswe_eval(
    context: dg.AssetExecutionContext, config: DeepSWEEvalConfig, storage: PosttrainStorage
) -> dg.MaterializeResult:
    """DeepSWE-style evaluation of one checkpoint on the held-out tasks: several attempts per task,
    only committed work graded, per-attempt rows (reward, f2p, p2p, partial, target scores) in Parquet.
    The checkpoint's base model (and adapter, if any) is served by a local engine in this process;
    episodes run in sandboxes; attempts lost to sandbox failures are retried, never scored.
    ``flagged_attempts`` counts graded attempts with a cheating signal and ``signals`` how many
    carry each one (a forged results stream, a rewritten report, a patch touching the tests, an
    always-equal comparison...); flagged attempts are scored as graded."""
    import pandas as pd

    from evals.evaluate import evaluate_checkpoint, load_eval_tasks, write_rows
    from evals.report import flagged_mask, per_task, signal_counts
    from evals.sandbox import platform_sandbox_factory

    key = context.partition_key
    policy = checkpoint_policy(storage.checkpoint_dir(key), name=key)
    tasks = load_eval_tasks(config.tasks, config.split, bundled_dir=storage.datasets_dir() / "bundled")
    rows = evaluate_checkpoint(
        tasks, policy.base_model, platform_sandbox_factory(config.sandbox_runtime), checkpoint=key,
        adapter=policy.adapter, adapter_version=policy.adapter_version, attempts=config.attempts,
        max_turns=config.max_turns, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        seed=config.seed, workers=config.workers, log=context.log.info,
    )
    path = write_rows(rows, storage.evals_dir() / "deepswe" / f"{key}.parquet")

    frame = pd.DataFrame(rows)
    table = per_task(frame, config.attempts)
    graded = frame[frame["status"] != "infra_error"]
    metadata = {
        "path": dg.MetadataValue.path(str(path)),
        "tasks": len(tasks),
        "attempts": len(frame),
        "infra_errors": int((frame["status"] == "infra_error").sum()),
        "apply_failed": int((frame["status"] == "apply_failed").sum()),
        "pass@1": float(table["pass@1"].mean()) if len(table) else float("nan"),
        f"pass@{config.attempts}": float(table[f"pass@{config.attempts}"].mean()) if len(table) else float("nan"),
        "mean_target_score": float(graded["target_score"].mean()) if len(graded) else float("nan"),
        "mean_strict_target_score": float(graded["strict_target_score"].mean()) if len(graded) else float("nan"),
        "committed_share": float(frame["committed"].mean()) if len(frame) else 0.0,
        "flagged_attempts": int(flagged_mask(graded).sum()),
        "signals": dg.MetadataValue.json(signal_counts(graded)),
        "adapter_version": policy.adapter_version or "base",
    }
    return dg.MaterializeResult(metadata=metadata)


class EvalReportConfig(dg.Config):
    """``flawed_dir``: folder of flawed-task lists (default: ``<datasets>/flawed``); ``k``: the k of pass@k;
    ``exclude_flagged``: leave attempts with a cheating signal out of every score (by default they are
    scored, and the report also gives every score without them)."""

    flawed_dir: str = ""
    k: int = 8
    resamples: int = 2000
    exclude_flagged: bool = False


def _png_md(path: Path, title: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f"![{title}](data:image/png;base64,{data})"


@dg.asset(group_name="evals", deps=[deepswe_eval])
def eval_report(
    context: dg.AssetExecutionContext, config: EvalReportConfig, storage: PosttrainStorage
) -> dg.MaterializeResult:
    """pass@1 and pass@k per checkpoint with confidence intervals, target scores, the paired
    comparison with the base model, every score with each flawed-task list dropped, and the count
    of flagged attempts (a cheating signal) with every score also given without them."""
    import pandas as pd

    from evals.flawed import load_flawed_lists
    from evals.report import (
        build_report, flagged_mask, markdown_tables, plot_pass_at_1, plot_pass_at_k, plot_target_scores,
        report_rows, signal_counts,
    )

    files = sorted((storage.evals_dir() / "deepswe").glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"eval_report: no evaluated checkpoint under {storage.evals_dir() / 'deepswe'}")
    rows = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    flawed_dir = Path(config.flawed_dir) if config.flawed_dir else storage.datasets_dir() / "flawed"
    lists = load_flawed_lists(flawed_dir)
    report = build_report(rows, lists, k=config.k, resamples=config.resamples, exclude_flagged=config.exclude_flagged)
    graded = rows[rows["status"] != "infra_error"]
    flagged_attempts = int(flagged_mask(graded).sum())
    if config.exclude_flagged:
        rows = rows[~flagged_mask(rows)]
    out = storage.reports_dir()
    out.mkdir(parents=True, exist_ok=True)
    tables = markdown_tables(report, k=config.k)
    (out / "eval_report.md").write_text("# Evaluation report\n\n" + tables)
    report_rows(report).to_csv(out / "eval_report.csv", index=False)
    p1 = plot_pass_at_1(report, out / "pass_at_1.png")
    pk = plot_pass_at_k(rows, out / "pass_at_k.png", k_max=config.k)
    ts = plot_target_scores(report, out / "target_scores.png")
    return dg.MaterializeResult(metadata={
        "checkpoints": int(rows["checkpoint"].nunique()),
        "attempts": len(rows),
        "flagged_attempts": flagged_attempts,
        "flagged_excluded": config.exclude_flagged,
        "signals": dg.MetadataValue.json(signal_counts(graded)),
        "flawed_lists": dg.MetadataValue.json({fl.name: sorted(fl.ids) for fl in lists}),
        "scores": dg.MetadataValue.md(tables),
        "pass@1 per checkpoint": dg.MetadataValue.md(_png_md(p1, "pass@1 per checkpoint")),
        "pass@k curves": dg.MetadataValue.md(_png_md(pk, "pass@k curves")),
        "target scores": dg.MetadataValue.md(_png_md(ts, "target scores")),
        "report": dg.MetadataValue.path(str(out / "eval_report.md")),
    })


defs = dg.Definitions(assets=[deepswe_eval, eval_report])
