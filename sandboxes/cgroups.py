"""One cgroup per sandbox: its CPU, memory and process-count limits, and killing all it runs.

cgroup v2 where the host has it (``/sys/fs/cgroup/posttrain/<sandbox id>``), else the v1 ``cpu``,
``memory`` and ``pids`` controllers (``/sys/fs/cgroup/<controller>/posttrain/<sandbox id>``).
Creating one needs root or a delegated cgroup.

The kernel counts, per cgroup, each time a limit stopped the sandbox's processes
(:meth:`Cgroup.limit_events`): a fork refused at ``pids.max`` (``pids.events``), the memory limit
reached (v2 ``memory.events`` ``max``, v1 ``memory.failcnt``) and processes its OOM killer ended
(``oom_kill``), CPU periods throttled at the quota (``cpu.stat``). A host that sees a sandbox die
reads them to tell a sandbox that ran into its own limits from one that was killed from outside
(:meth:`sandboxes.runtimes.Sandbox.end_cause`).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from sandboxes.errors import SandboxError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _hierarchies(name: str) -> list[Path]:
    """Where ``posttrain/<name>`` is in cgroup v2 and in each v1 hierarchy."""
    return [CGROUP_ROOT / "posttrain" / name, *CGROUP_ROOT.glob(f"*/posttrain/{name}")]


@dataclass(frozen=True)
class LimitEvents:
    """What the kernel counted against one sandbox's limits so far (each counter only grows; the
    difference of two readings, :meth:`since`, is what happened between them). Zero where the
    kernel does not say."""

    pids_max: int = 0  # forks refused because the cgroup was at pids.max
    memory_max: int = 0  # times the memory use reached the limit (v2 memory.events max, v1 failcnt)
    oom_kills: int = 0  # processes the OOM killer ended (v2 memory.events oom_kill, v1 oom_control)
    cpu_throttled: int = 0  # CPU periods in which the cgroup used its whole quota and waited
    pids_now: int = 0  # processes (tasks) in the cgroup when read
    memory_now_bytes: int = 0  # memory charged to the cgroup when read

    def since(self, before: "LimitEvents | None") -> "LimitEvents":
        """The counters' growth since ``before`` (None: since the cgroup was made); the current
        figures stay as read."""
        if before is None:
            return self
        return LimitEvents(max(0, self.pids_max - before.pids_max), max(0, self.memory_max - before.memory_max),
                           max(0, self.oom_kills - before.oom_kills), max(0, self.cpu_throttled - before.cpu_throttled),
                           self.pids_now, self.memory_now_bytes)

    @property
    def memory_limit_kills(self) -> bool:
        """The OOM killer ended a process while the cgroup was at its own memory limit (a kill by the
        host's global OOM killer, with the cgroup under its limit, is not one)."""
        return self.oom_kills > 0 and self.memory_max > 0

    def describe(self) -> str:
        """The counters as evidence: ``"pids.max refused 12 forks (64 tasks now); ..."``."""
        parts = []
        if self.pids_max:
            parts.append(f"pids.max refused {self.pids_max} fork(s) ({self.pids_now} tasks now)")
        if self.memory_max:
            parts.append(f"memory use reached its limit {self.memory_max} time(s) "
                         f"({self.memory_now_bytes / 2**20:.0f} MiB now)")
        if self.oom_kills:
            parts.append(f"the OOM killer ended {self.oom_kills} process(es)")
        if self.cpu_throttled:
            parts.append(f"its CPU quota was used up in {self.cpu_throttled} period(s)")
        return "; ".join(parts) or "no limit of its cgroup was reached"


def _counters(text: str) -> dict[str, int]:
    """``key value`` lines (``memory.events``, ``pids.events``, ``cpu.stat``, ``memory.oom_control``)."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _read_small(path: str) -> str | None:
    """A cgroup interface file's text (a few hundred bytes), or None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536).decode()
    except OSError:
        return None
    finally:
        os.close(fd)


def _write_small(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


_unified_host: list[bool] = []
# interface file name -> index in a made cgroup's paths of the hierarchy that has it (None: none)
_LAYOUT: dict[str, int | None] = {}


def _unified() -> bool:
    """Whether the host has cgroup v2 (asked once per process)."""
    if not _unified_host:
        _unified_host.append((CGROUP_ROOT / "cgroup.controllers").exists())
    return _unified_host[0]


class Cgroup:
    """One cgroup per sandbox for CPU, memory and process count (cgroup v2, or the v1 controllers)."""

    def __init__(self, name: str, *, cpus: float, memory_mib: int, pids: int):
        self.paths: list[Path] = []
        self._made = True  # its hierarchies in the order every made cgroup has them (_read's layout)
        base = CGROUP_ROOT
        period = 100_000
        quota = max(1000, int(cpus * period))
        memory = memory_mib * 1024 * 1024
        try:
            if _unified():
                parent = base / "posttrain"
                parent.mkdir(exist_ok=True)
                (base / "cgroup.subtree_control").write_text("+cpu +memory +pids")
                (parent / "cgroup.subtree_control").write_text("+cpu +memory +pids")
                p = parent / name
                p.mkdir()
                self.paths.append(p)
                (p / "memory.max").write_text(str(memory))
                (p / "memory.swap.max").write_text("0") if (p / "memory.swap.max").exists() else None
                (p / "pids.max").write_text(str(pids))
                (p / "cpu.max").write_text(f"{quota} {period}")
            else:
                # os calls on strings: a sandbox's start makes three folders and writes four files
                # here, and pathlib's objects cost more CPU than the system calls
                for ctl, settings in (
                    ("memory", (("memory.limit_in_bytes", memory),)),
                    ("pids", (("pids.max", pids),)),
                    ("cpu", (("cpu.cfs_period_us", period), ("cpu.cfs_quota_us", quota))),
                ):
                    p = f"{base}/{ctl}/posttrain/{name}"
                    try:
                        os.mkdir(p)
                    except FileNotFoundError:  # the hierarchy's posttrain folder, made once
                        os.makedirs(p)
                    self.paths.append(Path(p))
                    for key, value in settings:
                        _write_small(f"{p}/{key}", str(value))
        except OSError as exc:
            self.remove()
            raise SandboxError(f"cannot create the sandbox's cgroup under {base} ({exc}); CPU, memory and "
                               "process limits need root or a delegated cgroup") from None

    @classmethod
    def existing(cls, name: str) -> "Cgroup":
        """The cgroup ``posttrain/<name>`` of a sandbox started earlier, in every hierarchy where it
        exists (a dead harness's sandbox, or one runsc made from its OCI spec), to kill or remove."""
        self = cls.__new__(cls)
        self.paths = [p for p in _hierarchies(name) if p.is_dir()]
        self._made = False
        return self

    @property
    def procs_files(self) -> list[str]:
        return [f"{p}/cgroup.procs" for p in self.paths]

    def pids(self) -> list[int]:
        out = set()
        for f in self.procs_files:
            text = _read_small(f)
            if text is not None:
                out.update(int(x) for x in text.split())
        return sorted(out)

    def peak_memory_bytes(self) -> int | None:
        for p in self.paths:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    return int((p / name).read_text())
                except OSError:
                    continue
        return None

    def _read(self, name: str) -> str | None:
        """The interface file ``name`` of whichever hierarchy has it (None where none does). Read
        after every answer of the sandbox's daemon (:meth:`limit_events`), so where each file is, or
        that it is nowhere, is found once: a cgroup's interface files are there from its creation."""
        where = self.__dict__.setdefault("_where", {})
        if name not in where and getattr(self, "_made", False) and name in _LAYOUT and self.paths:
            # every cgroup made here has its hierarchies in one order: found once per process
            index = _LAYOUT[name]
            where[name] = None if index is None else f"{self.paths[index]}/{name}"
        if name in where:
            path = where[name]
            return None if path is None else _read_small(path)
        for index, p in enumerate(self.paths):
            text = _read_small(f"{p}/{name}")
            if text is not None:
                where[name] = f"{p}/{name}"
                if getattr(self, "_made", False):
                    _LAYOUT[name] = index
                return text
        if self.paths:
            where[name] = None
            if getattr(self, "_made", False):
                _LAYOUT[name] = None
        return None

    def limit_events(self) -> LimitEvents:
        """What the kernel counted against this cgroup's limits so far (:class:`LimitEvents`), from
        cgroup v2's ``pids.events``, ``memory.events``, ``cpu.stat`` or v1's ``pids.events``,
        ``memory.failcnt``, ``memory.oom_control``, ``cpu.stat``."""
        def number(name: str) -> int:
            text = self._read(name)
            return int(text) if text is not None and text.strip().isdigit() else 0

        pids = _counters(self._read("pids.events") or "")
        memory = _counters(self._read("memory.events") or "")
        if memory:  # cgroup v2
            memory_max, oom_kills = memory.get("max", 0), memory.get("oom_kill", 0)
            memory_now = number("memory.current")
        else:
            memory_max = number("memory.failcnt")
            oom_kills = _counters(self._read("memory.oom_control") or "").get("oom_kill", 0)
            memory_now = number("memory.usage_in_bytes")
        return LimitEvents(pids_max=pids.get("max", 0), memory_max=memory_max, oom_kills=oom_kills,
                           cpu_throttled=_counters(self._read("cpu.stat") or "").get("nr_throttled", 0),
                           pids_now=number("pids.current"), memory_now_bytes=memory_now)

    def kill(self) -> None:
        """SIGKILL every process of the sandbox (a fork bomb's too: it is one pass over a frozen list
        only if new children cannot appear, so repeat until the cgroup is empty)."""
        for _ in range(200):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        self.kill()
        for p in self.paths:
            for _ in range(250):
                try:
                    p.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # the last processes are still exiting
                    time.sleep(0.002)
        self.paths = []


def remove_empty_cgroups(name: str) -> None:
    """Remove ``posttrain/<name>`` under every cgroup hierarchy where it exists and is empty."""
    for p in _hierarchies(name):
        try:
            p.rmdir()
        except OSError:
            pass


def remove_stale_empty_cgroups(min_age_s: float) -> None:
    """Remove sandbox cgroups (``posttrain/pt-*``) that are empty and older than ``min_age_s`` (a
    cgroup of a live sandbox always holds its processes, except for the instant between its
    creation and the runtime's start: hence the age)."""
    for group in [*CGROUP_ROOT.glob("posttrain/pt-*"), *CGROUP_ROOT.glob("*/posttrain/pt-*")]:
        try:
            if not (group / "cgroup.procs").read_text().strip() and time.time() - group.stat().st_mtime > min_age_s:
                group.rmdir()
        except OSError:
            pass
