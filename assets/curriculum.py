"""The ``difficulty_curriculum`` asset: task difficulty from the base model's pass rates."""


import dagster as dg

from assets._missing import not_built
from assets.images import image_cache
from dagster_project.resources import PosttrainStorage


@dg.asset(group_name="training", deps=[image_cache])
def difficulty_curriculum(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """Pass rates of the base model over k attempts per training task, the tiers from easy to hard
    they define, and the retry queue of tasks no attempt solved."""
    raise not_built("difficulty_curriculum", "the curriculum in training/")


defs = dg.Definitions(assets=[difficulty_curriculum])
