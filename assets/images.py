"""The ``image_cache`` asset: zstd-compressed task images and the node-local layer cache."""

import json
import os

import dagster as dg
import pandas as pd

from assets.resources import PosttrainStorage
from assets.tasks import task_dataset
import sandboxes
from sandboxes.cache import DEFAULT_BUDGET_GIB, node_cache
from sandboxes.harbor import build_harbor_images


class ImageCacheConfig(dg.Config):
    """``compression``: ``zstd`` (default) or ``gzip`` (for comparison). ``cache_budget_gib``: the
    disk budget of this node's cache of unpacked layers (least recently used layers go first).
    ``harbor_sources``: the folder of repository sources Harbor tasks are built from;
    ``harbor_network``: let their recipes' RUN steps reach the package registries (with the date
    cutoff)."""

    compression: str = "zstd"
    cache_budget_gib: float = DEFAULT_BUDGET_GIB
    harbor_sources: str = ""
    harbor_network: bool = True


@dg.asset(group_name="sandboxes", deps=[task_dataset], kinds={"zstd"})
def image_cache(context: dg.AssetExecutionContext, config: ImageCacheConfig, storage: PosttrainStorage) -> dg.MaterializeResult:
    """Sandbox images for every task of the dataset, as content-addressed zstd layers (a base layer
    shared by all tasks, one layer with the task's repository), and the node-local cache of unpacked
    layers that sandboxes start from. Harbor tasks (DeepSWE) are built from their environment recipe
    (repository at its base commit, dependency layer installed with the date cutoff; see
    ``sandboxes.harbor``), one log line per task. Tasks whose image could not be built are listed,
    not dropped; tasks that name a registry image (SWE-bench) are pulled by the cluster, not built here."""
    parquet = storage.datasets_dir() / "tasks.parquet"
    if not parquet.is_file():
        raise FileNotFoundError(f"image_cache: {parquet} is missing; materialize task_dataset first")
    tasks = pd.read_parquet(parquet)
    for column in ("id", "repo_path"):
        if column not in tasks.columns:
            raise ValueError(f"image_cache: {parquet} has no column {column!r}")
    repos = {row["id"]: row["repo_path"] for _, row in tasks.iterrows() if isinstance(row["repo_path"], str) and row["repo_path"]}
    recipes = _harbor_recipes(tasks)
    registry_only = sorted(set(tasks["id"]) - set(repos) - set(recipes))
    store = sandboxes.ImageStore(storage.images_dir())
    cache = node_cache(storage.path, config.cache_budget_gib)
    report = sandboxes.build_image_cache(repos, store, cache, compression=config.compression)
    harbor = _build_harbor(context, recipes, config, store, cache, report)
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
        "harbor_images": dg.MetadataValue.md(harbor),
        "store": dg.MetadataValue.path(str(store.root)),
        "cache": dg.MetadataValue.path(report["cache_dir"]),
        "index": dg.MetadataValue.path(report["index"]),
    })


def _harbor_recipes(tasks) -> dict[str, tuple[str, str]]:
    """Harbor tasks with an environment recipe: ``task id -> (Dockerfile, base commit)``."""
    out = {}
    if "metadata" not in tasks.columns:
        return out
    for _, row in tasks.iterrows():
        try:
            meta = json.loads(row["metadata"]) if isinstance(row["metadata"], str) else {}
        except ValueError:
            continue
        if row.get("source") == "harbor" and meta.get("environment"):
            out[row["id"]] = (meta["environment"], row.get("base_commit") or "")
    return out


def _build_harbor(context, recipes, config: ImageCacheConfig, store, cache, report) -> str:
    """Build every Harbor task's image from its recipe, logging progress; failures join the report's."""
    if recipes and not config.harbor_sources:
        for task_id in recipes:
            report["failures"][task_id] = "a Harbor task: set harbor_sources (the repository sources folder) to build it"
        return ""
    built, failures = build_harbor_images(recipes, config.harbor_sources, store, cache, network=config.harbor_network,
                                          compression=config.compression, log=context.log.info,
                                          warn=context.log.warning, build_log=context.log.debug)
    report["failures"].update(failures)
    report["images"] += len(built)
    lines = ["| task | image | size (MB) | build (s) |", "|---|---|---|---|"]
    lines += [f"| {task_id} | {b.image.name} | {b.image.size_bytes / 1e6:.1f} | {b.build_s:.1f} |"
              for task_id, b in sorted(built.items())]
    if built:  # the index maps task ids to image names: add the Harbor ones
        index_path = store.root / "index.json"
        index = json.loads(index_path.read_text()) if index_path.is_file() else {}
        index.update({task_id: b.image.name for task_id, b in built.items()})
        tmp = store.root / f".index.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
        os.replace(tmp, index_path)
    return "\n".join(lines)


defs = dg.Definitions(assets=[image_cache])
