"""The ``deepswe_eval`` asset (per checkpoint) and the ``eval_report`` asset (all checkpoints)."""


import dagster as dg

from assets._missing import not_built
from assets.training import checkpoints
from dagster_project.partitions import checkpoints_partitions
from dagster_project.resources import PosttrainStorage


@dg.asset(group_name="evals", deps=[checkpoints], partitions_def=checkpoints_partitions, kinds={"parquet"})
def deepswe_eval(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """DeepSWE-style evaluation of one checkpoint on the held-out tasks: several attempts per task,
    only committed work graded, per-attempt rows (reward, f2p, p2p, partial, target scores) in Parquet."""
    raise not_built("deepswe_eval", "the agent harness and grader in evals/")


@dg.asset(group_name="evals", deps=[deepswe_eval])
def eval_report(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """pass@1 and pass@k per checkpoint with confidence intervals, target scores, the paired
    comparison with the base model, and every score with each flawed-task list dropped."""
    raise not_built("eval_report", "the metrics and reports in evals/")


defs = dg.Definitions(assets=[deepswe_eval, eval_report])
