"""The bwrap sandbox's start path (issue 55, third session): its ``/dev`` is a folder the host made on
the sandbox's own tmpfs, bound by bwrap in one mount. What a task sees of ``/dev`` stays what bwrap's
``--dev`` gave (the same devices, links, a pty, a writable ``/dev/shm``), held to the sandbox's disk
limit and no longer writable elsewhere; every process of the sandbox is in its cgroup, which is its
cgroup namespace's root; a bwrap whose set-up fails is an error naming why."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import sandboxes
from sandboxes.runtimes import BwrapRuntime

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's own /dev and cgroup need root")


def test_dev_has_the_devices_links_a_pty_and_shared_memory(repo, store, cache):
    """The devices and links of bwrap's --dev, usable by the sandbox user: null, zero, full, random,
    urandom, tty, the fd links, a pty from /dev/ptmx, POSIX shared memory (a multiprocessing lock)."""
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as sb:
        r = sb.exec("ls /dev | tr '\\n' ' '; echo; head -c 4 /dev/zero | od -An -tx1; echo x > /dev/null && "
                    "head -c 8 /dev/urandom | wc -c; echo hi > /dev/stderr", timeout_s=30)
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        assert set(lines[0].split()) == {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr",
                                         "stdin", "stdout", "tty", "urandom", "zero"}
        assert lines[1].split() == ["00"] * 4 and lines[2] == "8" and "hi" in lines
        r = sb.exec(["python3", "-c", "import os, pty, multiprocessing as m\n"
                     "master, slave = pty.openpty(); os.write(slave, b'ping\\n'); print(os.read(master, 10))\n"
                     "lock = m.Lock(); lock.acquire(); lock.release(); print(os.listdir('/dev/pts'))"], timeout_s=30)
        assert r.exit_code == 0, r.output
        assert "b'ping\\r\\n'" in r.output and "'0'" in r.output


def test_dev_is_not_the_sandbox_users_and_shm_is_held_to_the_disk_limit(repo, store, cache):
    """The sandbox user may write only /dev/shm (as on a host), and what it writes there counts
    against the sandbox's disk limit: ENOSPC at the limit, not memory the host must find. (bwrap's
    --dev gave the sandbox user a tmpfs /dev of its own, held to no size.)"""
    limits = sandboxes.Limits(disk_mib=8, memory_mib=512)
    with sandboxes.start(repo, runtime="bwrap", limits=limits, store=store, cache=cache) as sb:
        r = sb.exec("touch /dev/new 2>&1; mkdir /dev/d 2>&1; echo end", timeout_s=30)
        assert r.output.count("Permission denied") == 2, r.output
        r = sb.exec("head -c 32M /dev/zero > /dev/shm/fill; echo status $?", timeout_s=60)
        assert "No space left on device" in r.output and "status 1" in r.output, r.output
        r = sb.exec("rm /dev/shm/fill && echo x > /dev/shm/small && cat /dev/shm/small", timeout_s=30)
        assert r.output == "x\n"


def test_dev_and_its_pty_instance_go_with_the_sandbox(repo, store, cache):
    """Each sandbox has its own /dev (its shm files are not the next one's) and closing it unmounts its
    devpts instance with the rest."""
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as first:
        assert first.exec("echo secret > /dev/shm/left").exit_code == 0
        dev = first.run_dir / "rw" / "dev"
        assert (dev / "pts").is_mount()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(first.run_dir) not in mounts
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as second:
        assert second.exec("ls -A /dev/shm").output == ""


def test_every_process_of_the_sandbox_is_in_its_cgroup_and_that_cgroup_is_its_namespaces_root(repo, store, cache):
    """bwrap and pxd (the sandbox's PID 1) are in the sandbox's cgroup, in every hierarchy, by the time
    pxd answers, and the sandbox's cgroup namespace is rooted there: a command sees its own cgroup as
    "/" and nothing of the host's tree. (Moving bwrap's processes in after bwrap made the namespace,
    as bwrap's --info-fd and --block-fd would allow, roots it at the harness's cgroup instead: the
    sandbox then reads its id and the host's cgroup paths in /proc/self/cgroup.)"""
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as sb:
        children = Path(f"/proc/{sb.proc.pid}/task/{sb.proc.pid}/children").read_text().split()
        assert len(children) == 1
        pxd = int(children[0])
        for path in sb.cgroup.paths:
            procs = {int(x) for x in (path / "cgroup.procs").read_text().split()}
            assert {sb.proc.pid, pxd} <= procs, (path, procs)
        r = sb.exec("cat /proc/self/cgroup", timeout_s=30)
        mine = [line for line in r.output.splitlines() if {"cpu", "memory", "pids"} & set(line.split(":")[1].split(","))]
        assert len(mine) == 3 and all(line.endswith(":/") for line in mine), r.output


def test_a_bwrap_that_fails_its_set_up_is_an_error_naming_why_and_leaves_nothing(repo, store, cache, monkeypatch):
    """bwrap's set-up failing after its child started (a bind whose source is missing) is a
    SandboxError with bwrap's own message, and its cgroup, mounts and run folder are gone."""
    command = BwrapRuntime.command

    def broken(self, sb):
        argv = command(self, sb)
        at = argv.index("--remount-ro")
        return [*argv[:at], "--bind", "/nonexistent-h55", "/missing", *argv[at:]]

    monkeypatch.setattr(BwrapRuntime, "command", broken)
    before = set(os.listdir("/sys/fs/cgroup/pids/posttrain")) if os.path.isdir("/sys/fs/cgroup/pids/posttrain") else set()
    with pytest.raises(sandboxes.SandboxError, match="nonexistent-h55"):
        sandboxes.start(repo, runtime="bwrap", store=store, cache=cache)
    after = set(os.listdir("/sys/fs/cgroup/pids/posttrain")) if os.path.isdir("/sys/fs/cgroup/pids/posttrain") else set()
    assert not {n for n in after - before if n.startswith("pt-")}
    run_root = sandboxes.runtimes.run_root(cache, create=False)
    assert str(run_root) not in Path("/proc/self/mountinfo").read_text()
    assert not list(run_root.glob("pt-*"))
