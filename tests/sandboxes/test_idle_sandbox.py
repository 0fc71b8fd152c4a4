"""A sandbox that runs nothing costs the machine nothing: pxd wakes when a child ends (SIGCHLD), not
on a timer. Its reaper used to poll /proc four times a second (about 1 ms of CPU a sandbox-second
under bwrap, 7 ms under gVisor's ptrace platform, bench/sandbox_start.py's neighbour
measurements in docs/benchmarks.md), while a sandbox mostly waits for the model.

bwrap only: gVisor's pxd is a thread of gVisor's kernel, not a host process whose wakeups the host
can count. Orphans are still reaped (tests/sandboxes/test_hostile_pxd.py checks it on both)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import sandboxes

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")


def _pxd_host_pid(sb) -> int:
    """pxd's pid on the host: the child of the runtime process (bwrap runs it as the namespace's init)."""
    runtime = sb.proc.pid
    children = Path(f"/proc/{runtime}/task/{runtime}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _children(pid: int) -> list[str]:
    """The children (zombies included) of every thread of ``pid``."""
    return [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _wakeups(pid: int) -> int:
    """Context switches of every thread of ``pid`` so far: each time one of them ran after sleeping."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def test_an_idle_sandbox_daemon_does_not_wake(repo, store, cache):
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as sb:
        assert sb.exec("(sleep 0.01 &); true").exit_code == 0  # an orphan: reaped, then nothing to do
        pid = _pxd_host_pid(sb)
        for _ in range(200):  # the orphan's end and its reaping, however loaded the machine
            if not _children(pid):
                break
            time.sleep(0.05)
        assert not _children(pid)
        time.sleep(0.3)  # the reaper back at its pipe after the last SIGCHLD
        before = _wakeups(pid)
        time.sleep(1.5)  # a polling reaper (every 0.25 s) wakes six times meanwhile
        assert _wakeups(pid) == before
        # and it still answers, and still reaps what a command leaves behind
        assert sb.exec("(sleep 0.01 &); exit 3").exit_code == 3
        states = ("import os, time\n"
                  "def others():\n"
                  "    return [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid())]\n"
                  "for _ in range(100):\n"
                  "    if not others():\n"
                  "        break\n"
                  "    time.sleep(0.05)\n"
                  "print(others())")
        assert sb.exec(["python3", "-c", states]).stdout == "[]\n"
