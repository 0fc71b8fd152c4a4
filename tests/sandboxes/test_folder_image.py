"""Starting a sandbox from a task's folder (what every episode and grading does) makes the folder's
image only when the folder changed: tarring and hashing it again cost about 4 ms of the harness's
CPU a start, checking its entries about 0.5 ms. A change to the folder, even one that keeps every
size and modification time, is seen."""

from __future__ import annotations

import os
import shutil

import pytest

import sandboxes

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")


def _manifests(store) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (store.root / "images").glob("*.json")}


def test_an_unchanged_folder_is_not_built_again_and_a_changed_one_is(repo, store, cache):
    with sandboxes.start(repo, store=store, cache=cache) as sb:
        assert sb.read_file("calc.py").decode().endswith("a + b\n")
    built = _manifests(store)
    assert len(built) == 1
    with sandboxes.start(repo, store=store, cache=cache) as sb:
        assert sb.read_file("calc.py").decode().endswith("a + b\n")
    assert _manifests(store) == built  # the image was not written again

    # same size, same modification time: only the change time (which no user sets) tells
    path = repo / "calc.py"
    st = path.stat()
    path.write_text(path.read_text().replace("a + b", "a - b"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with sandboxes.start(repo, store=store, cache=cache) as sb:
        assert sb.read_file("calc.py").decode().endswith("a - b\n")

    (repo / "new.py").write_text("x = 1\n")
    with sandboxes.start(repo, store=store, cache=cache) as sb:
        assert sb.read_file("new.py") == b"x = 1\n"
