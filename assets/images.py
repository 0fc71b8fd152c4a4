"""The ``image_cache`` asset: zstd-compressed task images and the node-local layer cache."""


import dagster as dg

from assets.resources import PosttrainStorage
from assets.tasks import task_dataset


class ImageCacheConfig(dg.Config):
    """``compression``: ``zstd`` (default) or ``gzip`` (for comparison). ``cache_budget_gib``: the
    disk budget of this node's cache of unpacked layers (least recently used layers go first)."""

    compression: str = "zstd"
    cache_budget_gib: float = 20.0


@dg.asset(group_name="sandboxes", deps=[task_dataset], kinds={"zstd"})
def image_cache(context: dg.AssetExecutionContext, config: ImageCacheConfig, storage: PosttrainStorage) -> dg.MaterializeResult:
    """Sandbox images for every task of the dataset, as content-addressed zstd layers (a base layer
    shared by all tasks, one layer with the task's repository), and the node-local cache of unpacked
    layers that sandboxes start from. Tasks whose image could not be built are listed, not dropped;
    tasks that name a registry image (SWE-bench) are pulled by the cluster, not built here."""
    import pandas as pd

    import sandboxes

    parquet = storage.datasets_dir() / "tasks.parquet"
    if not parquet.is_file():
        raise FileNotFoundError(f"image_cache: {parquet} is missing; materialize task_dataset first")
    tasks = pd.read_parquet(parquet)
    for column in ("id", "repo_path"):
        if column not in tasks.columns:
            raise ValueError(f"image_cache: {parquet} has no column {column!r}")
    repos = {row["id"]: row["repo_path"] for _, row in tasks.iterrows() if isinstance(row["repo_path"], str) and row["repo_path"]}
    registry_only = sorted(set(tasks["id"]) - set(repos))
    store = sandboxes.ImageStore(storage.images_dir())
    cache = sandboxes.LayerCache(storage.path / "sandboxes" / "cache", int(config.cache_budget_gib * 1024**3))
    report = sandboxes.build_image_cache(repos, store, cache, compression=config.compression)
    for task_id, why in report["failures"].items():
        context.log.warning(f"task {task_id}: no image: {why}")
    largest = "| task | image | size (kB) |\n|---|---|---|\n" + "\n".join(
        f"| {r['task']} | {r['image']} | {r['size_bytes'] / 1e3:.1f} |" for r in report["largest_images"])
    return dg.MaterializeResult(metadata={
        "images": report["images"],
        "failures": dg.MetadataValue.json(report["failures"]),
        "registry_images_not_built": dg.MetadataValue.json(registry_only),
        "compression": report["compression"],
        "store_bytes": report["store_bytes"],
        "uncompressed_bytes": report["tar_bytes"],
        "compression_ratio": report["compression_ratio"],
        "distinct_layers": report["distinct_layers"],
        "cache_bytes": report["cache_bytes"],
        "cache_budget_bytes": report["cache_budget_bytes"],
        "cached_layers": report["cached_layers"],
        "largest_images": dg.MetadataValue.md(largest),
        "store": dg.MetadataValue.path(str(store.root)),
        "cache": dg.MetadataValue.path(report["cache_dir"]),
        "index": dg.MetadataValue.path(report["index"]),
    })


defs = dg.Definitions(assets=[image_cache])
