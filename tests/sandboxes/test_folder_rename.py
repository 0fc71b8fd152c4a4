"""A task folder renamed keeps its image: a suite is built in a temporary folder and then moved into
place, and each task's image was tarred, hashed and compressed again for the new path."""

from __future__ import annotations

import shutil

import sandboxes
from sandboxes import runtimes

from .conftest import make_repo


def test_a_renamed_folder_is_not_built_again_and_a_changed_one_is(tmp_path, monkeypatch):
    builds = []
    real_build = runtimes.build_image

    def counted(name, path, store, *args, **kwargs):
        builds.append(str(path))
        return real_build(name, path, store, *args, **kwargs)

    monkeypatch.setattr(runtimes, "build_image", counted)
    store = sandboxes.ImageStore(tmp_path / "images")
    built = make_repo(tmp_path / "staging" / "task")
    first = runtimes._folder_image(built, store)
    moved = tmp_path / "suite" / "task"
    moved.parent.mkdir()
    built.rename(moved)
    again = runtimes._folder_image(moved, store)
    assert builds == [str(built)]  # 16da9b8 built it again for its new path
    assert again.layers == first.layers and again.name != first.name
    assert store.load_image(again.name) == again  # saved under its new name, as a build saves it
    # what the key still protects: a changed file, and a copy (new inodes), are built again
    (moved / "a.py").write_text("changed = True\n")
    changed = runtimes._folder_image(moved, store)
    assert builds == [str(built), str(moved)] and changed.layers != first.layers
    copy = tmp_path / "copy"
    shutil.copytree(moved, copy, symlinks=True)
    assert runtimes._folder_image(copy, store).layers == changed.layers and builds[-1] == str(copy)
