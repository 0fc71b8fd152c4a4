"""``rl_run`` on Kubernetes: the run file's paths as the pods see them, and what Dagster made on the
run volume handed to the workloads' user (real files; chown needs root, as the test plane does)."""

import os
from pathlib import Path

import pytest

from assets.resources import PosttrainStorage
from assets.run_files import hand_to_workloads, on_run_volume
from training.planner.k8s import RUN_AS


def test_paths_under_the_storage_root_are_named_relative_to_the_volume_and_others_kept(tmp_path):
    storage = PosttrainStorage(root=str(tmp_path))
    data = {"model": {"path": str(tmp_path / "models" / "base")},
            "curriculum": {"tasks": str(tmp_path / "datasets" / "bundled"), "curriculum_file": "curriculum/c.json"},
            "eval": {"dataset": "bundled"}}
    named = on_run_volume(data, storage)
    assert data["model"]["path"] == "models/base" and data["curriculum"]["tasks"] == "datasets/bundled"
    assert data["curriculum"]["curriculum_file"] == "curriculum/c.json" and data["eval"]["dataset"] == "bundled"
    assert named == [tmp_path / "models" / "base", tmp_path / "datasets" / "bundled"]
    # a path already as the pods see it (the volume's mount, or the image's) stays as it is
    pods_view = {"model": {"path": "/run-data/models/olmo"}, "curriculum": {"tasks": "/opt/tasks"}}
    assert on_run_volume(pods_view, storage) == [] and pods_view["model"]["path"] == "/run-data/models/olmo"


@pytest.mark.skipif(os.geteuid() != 0 and os.environ.get("CI") != "true", reason="chown needs root")
def test_files_made_here_privately_become_the_workloads_own(tmp_path):
    model = tmp_path / "models" / "base"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"w")
    (model / "model.safetensors").chmod(0o600)  # as an atomic write leaves it
    suite_index = tmp_path / "suite.json"
    suite_index.write_text("{}")
    hand_to_workloads(model, suite_index, tmp_path / "runs" / "r")
    for path in (model, model / "model.safetensors", suite_index, tmp_path / "runs" / "r"):
        assert (os.stat(path).st_uid, os.stat(path).st_gid) == (RUN_AS, RUN_AS), path
    assert (tmp_path / "runs" / "r").is_dir()
