"""The ``image_cache`` asset: zstd-compressed task images and the node-local layer cache."""


import dagster as dg

from assets._missing import not_built
from assets.tasks import task_dataset
from dagster_project.resources import PosttrainStorage


@dg.asset(group_name="sandboxes", deps=[task_dataset], kinds={"zstd"})
def image_cache(context: dg.AssetExecutionContext, storage: PosttrainStorage) -> dg.MaterializeResult:
    """Sandbox images for every task of the dataset, as content-addressed zstd layers, and the
    node-local cache of unpacked layers that sandboxes start from."""
    raise not_built("image_cache", "the image builder in sandboxes/")


defs = dg.Definitions(assets=[image_cache])
