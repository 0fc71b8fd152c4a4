"""The ``task_dataset`` asset: the tasks a run trains and evaluates on."""


import dagster as dg

from assets._missing import not_built
from dagster_project.resources import PosttrainStorage


@dg.asset(group_name="tasks", kinds={"parquet"})
def task_dataset(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """Tasks loaded from every configured source (the bundled suite, Harbor/DeepSWE folders,
    SWE-bench JSONL/Parquet) into one schema, with train and held-out eval splits."""
    raise not_built("task_dataset", "the task loaders in evals/")


defs = dg.Definitions(assets=[task_dataset])
