"""The reaper takes down the mounts a killed harness left in its sandboxes' run folders, and only those.

Real mounts (tmpfs, as root) in run folders made the way a sandbox makes them, owned by a real
process that holds the folder's lock; the owner is killed with SIGKILL, as a harness is. Each test
has a run base of its own (``$POSTTRAIN_SANDBOX_RUN_DIR``), so the machine's other sandboxes are
never in reach."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sandboxes
from sandboxes.reaping import reap_stale_sandboxes
from sandboxes.rootfs import umount

# CI runs as root: there the tests run (and fail without root) rather than skip
pytestmark = pytest.mark.skipif(os.geteuid() != 0 and os.environ.get("CI", "").strip().lower() not in ("true", "1", "yes"),
                                reason="mounting a tmpfs needs root")

# a harness's sandbox, reduced to what the reaper sees: the run folder, its held lock, its mounts
# (the overlay's place, the writable layer and a mount deeper in it, and one more, as gVisor's
# bundle folder would be), and a file on a mount that removing the folder must not reach through
OWNER = textwrap.dedent("""
    import fcntl, os, sys, time
    from pathlib import Path
    import sandboxes
    from sandboxes.rootfs import make_run_dir, mount
    cache = sandboxes.LayerCache(sys.argv[1])
    run_dir = make_run_dir(cache, sys.argv[2])
    fd = os.open(run_dir / "lock.new", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(run_dir / "lock.new", run_dir / "lock")
    for name in ("root", "rw", "rw/dev", "bundle"):
        (run_dir / name).mkdir()
        mount("tmpfs", run_dir / name, "tmpfs", "size=1m")
    (run_dir / "bundle" / "kept.txt").write_text("a file on a mount")
    print(run_dir, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def run_base(tmp_path, monkeypatch) -> Path:
    base = tmp_path / "run"
    monkeypatch.setenv("POSTTRAIN_SANDBOX_RUN_DIR", str(base))
    yield base
    for point in sorted((p for p in mount_points() if p.startswith(f"{base}/")), key=len, reverse=True):
        umount(Path(point))  # whatever a failing test left


def _start_owner(cache_root: Path, sandbox_id: str) -> tuple[subprocess.Popen, Path]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(cache_root), sandbox_id], stdout=subprocess.PIPE,
                             text=True, cwd=Path(sandboxes.__file__).parent.parent, env=dict(os.environ))
    line = owner.stdout.readline().strip()
    assert line, f"the owner did not make its run folder (exit {owner.poll()})"
    return owner, Path(line)


def _kill(owner: subprocess.Popen) -> None:
    owner.send_signal(signal.SIGKILL)
    owner.wait(60)
    owner.stdout.close()


def mount_points() -> list[str]:
    """The mount points of /proc/self/mountinfo (read here, not by the reaper's own reader)."""
    with open("/proc/self/mountinfo") as f:
        return [line.split(" ")[4].replace("\\040", " ") for line in f]


def _mounts_in(folder: Path) -> list[str]:
    return [p for p in mount_points() if p == str(folder) or p.startswith(f"{folder}/")]


def test_a_dead_owners_mounts_are_taken_down_before_its_folder_goes(run_base, tmp_path):
    """16da9b8 unmounted only ``root`` and ``rw`` and then removed the folder through whatever else
    was mounted in it: the file on the ``bundle`` mount was deleted, the mount and the folder stayed."""
    cache = sandboxes.LayerCache(tmp_path / "cache")
    dead, dead_dir = _start_owner(cache.root, "pt-0000000000aa")
    alive, alive_dir = _start_owner(cache.root, "pt-0000000000bb")
    try:
        assert len(_mounts_in(dead_dir)) == 4 and len(_mounts_in(alive_dir)) == 4
        _kill(dead)
        assert reap_stale_sandboxes(cache) == ["pt-0000000000aa"]
        assert _mounts_in(dead_dir) == [] and not dead_dir.exists()
        # the live owner's folder: its lock is held, so nothing of it is touched
        assert len(_mounts_in(alive_dir)) == 4 and (alive_dir / "bundle" / "kept.txt").read_text() == "a file on a mount"
    finally:
        if alive.poll() is None:
            _kill(alive)
    assert reap_stale_sandboxes(cache) == ["pt-0000000000bb"] and _mounts_in(alive_dir) == []


def test_the_sweep_reaches_caches_no_process_uses_again(run_base, tmp_path):
    """A killed harness's cache was a temporary folder, gone since: no start() will reap its run
    folder, the sweep of the whole run base does. Mounts outside the run folders (the toolchain's
    binds) are not the reaper's."""
    cache = sandboxes.LayerCache(tmp_path / "gone-cache")
    owner, run_dir = _start_owner(cache.root, "pt-0000000000cc")
    toolchain = run_base / "toolchain" / "0123456789ab"
    toolchain.mkdir(parents=True)
    sandboxes.rootfs.mount("tmpfs", toolchain, "tmpfs", "size=1m")
    try:
        _kill(owner)
        unmounted: list[int] = []
        assert reap_stale_sandboxes(None, unmounted=unmounted) == ["pt-0000000000cc"] and unmounted == [4]
        assert _mounts_in(run_dir) == [] and not run_dir.parent.exists()  # the cache's run folder too
        assert _mounts_in(toolchain) == [str(toolchain)]
    finally:
        umount(toolchain)


def test_a_folder_without_a_lock_is_left_while_young(run_base, tmp_path):
    """A run folder with no ``lock`` is one being made (the lock appears only once held): the sweep
    leaves it until it is ``min_age_s`` old, then takes its mounts down."""
    cache = sandboxes.LayerCache(tmp_path / "cache")
    owner, run_dir = _start_owner(cache.root, "pt-0000000000dd")
    _kill(owner)
    (run_dir / "lock").unlink()
    assert reap_stale_sandboxes(cache, min_age_s=3600) == [] and len(_mounts_in(run_dir)) == 4
    assert reap_stale_sandboxes(cache, min_age_s=0) == ["pt-0000000000dd"] and _mounts_in(run_dir) == []


def test_a_run_base_named_through_a_link_is_reaped_by_its_real_mounts(tmp_path, monkeypatch):
    """The mount table names real paths: a run base given through a symbolic link must still find
    the mounts, and so never remove a folder through one of them."""
    real = tmp_path / "real-run"
    real.mkdir()
    (tmp_path / "run-link").symlink_to(real)
    monkeypatch.setenv("POSTTRAIN_SANDBOX_RUN_DIR", str(tmp_path / "run-link"))
    cache = sandboxes.LayerCache(tmp_path / "cache")
    owner, run_dir = _start_owner(cache.root, "pt-0000000000ee")
    try:
        _kill(owner)
        assert reap_stale_sandboxes(cache) == ["pt-0000000000ee"]
        assert _mounts_in(real) == [] and not run_dir.exists()
    finally:
        for point in sorted(_mounts_in(real), key=len, reverse=True):
            umount(Path(point))
