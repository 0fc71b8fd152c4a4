"""The ``image_cache`` asset in a real (temporary) Dagster instance, over a task_dataset parquet
written here with repositories made here (the same columns ``task_dataset`` writes)."""

from __future__ import annotations

import json

import dagster as dg
import pandas as pd
import pytest

import sandboxes
from assets.images import image_cache
from assets.resources import PosttrainStorage

from .conftest import make_repo


def write_dataset(home, rows):
    out = home / "datasets"
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(out / "tasks.parquet", index=False)


def test_image_cache_builds_every_task_and_warms_the_cache(posttrain_home, tmp_path):
    rows = [{"id": f"calc-{i}", "repo_path": str(make_repo(tmp_path / f"r{i}", {"m.py": f"X = {i}\n"})), "image": None}
            for i in range(3)]
    rows.append({"id": "bundled/odd id", "repo_path": str(make_repo(tmp_path / "odd")), "image": None})
    rows.append({"id": "gone", "repo_path": str(tmp_path / "missing"), "image": None})
    rows.append({"id": "swe-1", "repo_path": None, "image": "registry/swe-1:latest"})
    write_dataset(posttrain_home, rows)
    storage = PosttrainStorage(root=str(posttrain_home))
    with dg.instance_for_test() as instance:
        result = dg.materialize([image_cache], instance=instance, resources={"storage": storage})
    assert result.success
    [mat] = result.asset_materializations_for_node("image_cache")
    md = {k: v.value for k, v in mat.metadata.items()}
    assert md["images"] == 4
    assert list(md["failures"]) == ["gone"] and "does not exist" in md["failures"]["gone"]
    assert md["registry_images_not_built"] == ["swe-1"]
    assert md["distinct_layers"] == 5  # one shared base layer + four task layers
    assert md["cached_layers"] == 5 and 0 < md["cache_bytes"]
    assert md["store_bytes"] < md["uncompressed_bytes"]
    index = json.loads((posttrain_home / "images" / "index.json").read_text())
    assert index["calc-1"] == "calc-1" and index["bundled/odd id"].startswith("bundled-odd-id-")
    # a sandbox starts from a built image by task id, from the asset's store
    store = sandboxes.ImageStore(posttrain_home / "images")
    cache = sandboxes.LayerCache(posttrain_home / "sandboxes" / "cache")
    with sandboxes.start("calc-2", store=store, cache=cache) as sb:
        assert sb.cache_hit and sb.exec("cat m.py").output == "X = 2\n"


def test_image_cache_without_a_dataset_names_the_file(posttrain_home):
    with dg.instance_for_test() as instance:
        with pytest.raises(FileNotFoundError, match=r"datasets/tasks\.parquet is missing; materialize task_dataset"):
            dg.materialize([image_cache], instance=instance,
                           resources={"storage": PosttrainStorage(root=str(posttrain_home))})
