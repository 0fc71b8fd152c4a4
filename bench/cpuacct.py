"""Exact CPU of a process tree, short-lived processes and sandboxes included: a cgroup v1 ``cpuacct``
group (or a v2 group's ``cpu.stat``) that the tree's root joins before it starts anything.

A sandbox moves its processes into cgroups of its own in the ``cpu``, ``memory`` and ``pids``
hierarchies (:mod:`sandboxes.cgroups`); where ``cpuacct`` is a hierarchy of its own (cgroup v1 with
the controllers mounted apart, as on this machine) the sandbox's processes stay in the group their
parent was in, so its ``cpuacct.usage`` counts them too: every process the trainer or the grader
started, however briefly it lived, in nanoseconds, and nothing of other work on the machine. On
cgroup v2 a sandbox leaves the group; there the figure is the host side's only and :func:`open_group`
says so (``Group.counts_sandboxes``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
UNIFIED = Path("/sys/fs/cgroup")


@dataclass
class Group:
    path: Path
    counts_sandboxes: bool

    def join(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def cpu_s(self) -> float:
        usage = self.path / "cpuacct.usage"
        if usage.is_file():
            return int(usage.read_text()) / 1e9
        for line in (self.path / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
        raise OSError(f"{self.path}: no cpuacct.usage nor cpu.stat usage_usec")

    def close(self) -> None:
        """Move what is left back to the parent group and remove this one."""
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.path.parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass


def open_group(name: str) -> Group | None:
    """A fresh accounting group ``name`` (None without root or a place for it)."""
    if os.geteuid() != 0:
        return None
    if (CPUACCT / "cpuacct.usage").is_file():
        base, whole = CPUACCT, True
    elif (UNIFIED / "cgroup.controllers").is_file():
        base, whole = UNIFIED, False
    else:
        return None
    path = base / f"{name}-{os.getpid()}"
    try:
        path.mkdir()
    except FileExistsError:
        pass
    except OSError:
        return None
    return Group(path, whole)
