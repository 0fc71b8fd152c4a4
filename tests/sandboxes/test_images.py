"""Images (zstd and gzip layers, content addressed) and the node-local LRU layer cache."""

from __future__ import annotations

import filecmp
from pathlib import Path
import json

import pytest

import sandboxes
from sandboxes.images import base_layer_tar, tar_directory, unpack_layer
from sandboxes.programs import shipped_source

from .conftest import make_repo


def _same_tree(a, b) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    return all(_same_tree(a / d, b / d) for d in cmp.common_dirs)


def test_tar_is_deterministic_and_content_addressed(tmp_path, repo, store):
    assert tar_directory(repo, "workspace") == tar_directory(repo, "workspace")
    a = sandboxes.build_image("task-a", repo, store)
    b = sandboxes.build_image("task-b", repo, store)
    assert a.layers == b.layers  # same files, same layers
    (repo / "calc.py").write_text("changed = True\n")
    c = sandboxes.build_image("task-c", repo, store)
    assert c.layers[0] == a.layers[0] and c.layers[1].diff_id != a.layers[1].diff_id  # base layer shared
    assert store.load_image("task-a") == a
    assert store.image_names() == ["task-a", "task-b", "task-c"]


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_layers_unpack_to_the_source_tree(tmp_path, repo, store, compression):
    (repo / "pkg").mkdir()
    (repo / "pkg" / "data.bin").write_bytes(bytes(range(256)) * 100)
    (repo / "run.sh").write_text("#!/bin/sh\necho run\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "alias.py").symlink_to("calc.py")
    image = sandboxes.build_image("t", repo, store, compression=compression)
    layer = image.layers[1]
    assert store.blob_path(layer).name.endswith(".tar.zst" if compression == "zstd" else ".tar.gz")
    unpack_layer(store.blob_path(layer), compression, tmp_path / "out")
    out = tmp_path / "out" / "workspace"
    assert _same_tree(repo, out)
    assert (out / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (out / "alias.py").is_symlink() and (out / "alias.py").readlink().as_posix() == "calc.py"


def test_zstd_layers_are_smaller_than_the_tar(repo, store):
    (repo / "big.txt").write_text("the same line again\n" * 5000)
    layer = sandboxes.build_image("t", repo, store).layers[1]
    assert layer.size_bytes < layer.tar_bytes / 10


def test_bad_inputs_name_the_file(tmp_path, store):
    with pytest.raises(sandboxes.ImageError, match="does not exist"):
        sandboxes.build_image("t", tmp_path / "nope", store)
    with pytest.raises(sandboxes.ImageError, match="image name"):
        sandboxes.build_image("../evil", tmp_path, store)
    with pytest.raises(sandboxes.ImageError, match="no image 'ghost'"):
        store.load_image("ghost")
    (store.root / "images" / "broken.json").write_text(json.dumps({"name": "broken"}))
    with pytest.raises(sandboxes.ImageError, match=r"broken\.json: malformed image manifest"):
        store.load_image("broken")
    with pytest.raises(sandboxes.ImageError, match="compression 'lz4'"):
        store.put_layer(b"x", "lz4")


def test_build_images_reports_failures(tmp_path, store):
    repos = {"ok-1": make_repo(tmp_path / "r1"), "ok-2": make_repo(tmp_path / "r2", {"a.py": "A = 2\n"}),
             "missing": tmp_path / "nowhere"}
    report = sandboxes.build_images(repos, store)
    assert [i.name for i in report.images] == ["ok-1", "ok-2"]
    assert list(report.failures) == ["missing"] and "does not exist" in report.failures["missing"]
    distinct = {l.digest: l for i in report.images for l in i.layers}
    assert len(distinct) == 3  # one shared base layer + two task layers
    assert report.store_bytes == sum(l.size_bytes for l in distinct.values())


def test_cache_hits_and_lru_eviction_within_budget(tmp_path, store):
    images = []
    for i in range(4):
        repo = make_repo(tmp_path / f"r{i}", {"blob.txt": f"{i}\n" + "x" * 200_000})
        images.append(sandboxes.build_image(f"t{i}", repo, store))
    cache = sandboxes.LayerCache(tmp_path / "cache", budget_bytes=10**9)
    first = cache.acquire(images[0], store)
    assert (first.hits, first.misses) == (0, 2)
    first.release()
    again = cache.acquire(images[0], store)
    assert (again.hits, again.misses) == (2, 0) and again.hit
    assert (again.layer_dirs[1] / "workspace" / "blob.txt").exists()
    again.release()
    for image in images[1:]:
        cache.acquire(image, store).release()
    sizes = {c["diff_id"]: c["size_bytes"] for c in cache.contents()}
    assert len(sizes) == 5  # base + 4 task layers
    # image 0 was used longest ago after the base layer was reused: it goes first
    base = images[0].layers[0].diff_id
    keep = cache.acquire(images[3], store)  # held: must survive any eviction
    budget = sizes[base] + sizes[images[3].layers[1].diff_id] + sizes[images[2].layers[1].diff_id]
    evicted = cache.evict(budget)
    assert set(evicted) == {images[0].layers[1].diff_id, images[1].layers[1].diff_id}
    assert cache.usage_bytes() <= budget
    evicted = cache.evict(1)  # nothing fits: only the layers no sandbox holds go
    assert set(evicted) == {images[2].layers[1].diff_id}
    assert {c["diff_id"] for c in cache.contents()} == {base, images[3].layers[1].diff_id}
    keep.release()
    assert len(cache.evict(1)) == 2 and cache.contents() == []
    miss = cache.acquire(images[0], store)  # evicted layers unpack again from the store
    assert miss.misses == 2
    miss.release()


def test_a_miss_measures_the_cache_only_when_this_process_may_have_passed_its_budget(tmp_path, store, monkeypatch):
    images = []
    for i in range(5):
        repo = make_repo(tmp_path / f"r{i}", {"blob.txt": f"{i}\n" + "x" * 200_000})
        images.append(sandboxes.build_image(f"t{i}", repo, store))
    probe = sandboxes.LayerCache(tmp_path / "probe", budget_bytes=10**9)
    probe.acquire(images[0], store).release()
    sizes = {c["diff_id"]: c["size_bytes"] for c in probe.contents()}
    base, task = images[0].layers[0].diff_id, images[0].layers[1].diff_id
    scans = []
    real_contents = sandboxes.LayerCache.contents
    monkeypatch.setattr(sandboxes.LayerCache, "contents", lambda self: scans.append(1) or real_contents(self))
    budget = sizes[base] + 2 * sizes[task] + sizes[task] // 2  # the base layer and two task layers
    root = tmp_path / "cache"
    for i, image in enumerate(images):
        # a new LayerCache on the same folder, as each sandbox start opens one
        sandboxes.LayerCache(root, budget_bytes=budget).acquire(image, store).release()
        real = sum(c["size_bytes"] for c in real_contents(sandboxes.LayerCache(root)))
        assert real <= budget, f"after image {i}: {real} bytes in a cache of {budget}"
    # measured at the first miss, then only when the running total passed the budget (images 2, 3, 4)
    assert len(scans) == 4
    held = sandboxes.LayerCache(root, budget_bytes=budget)
    assert held.acquire(images[4], store).hit  # a hit measures nothing
    assert len(scans) == 4


def test_base_layer_has_the_skeleton(tmp_path, store):
    layer = store.put_layer(base_layer_tar())
    unpack_layer(store.blob_path(layer), "zstd", tmp_path / "root")
    root = tmp_path / "root"
    assert "sandbox:x:1000" in (root / "etc/passwd").read_text()
    assert (root / "bin").is_symlink() and (root / "workspace").is_dir()
    assert (root / "tmp").stat().st_mode & 0o7777 == 0o1777
    assert (root / "opt/pxd/pxd.py").read_bytes() == shipped_source(Path(sandboxes.__file__).with_name("pxd.py"))
