"""One cgroup per sandbox: its CPU, memory and process-count limits, and killing all it runs.

cgroup v2 where the host has it (``/sys/fs/cgroup/posttrain/<sandbox id>``), else the v1 ``cpu``,
``memory`` and ``pids`` controllers (``/sys/fs/cgroup/<controller>/posttrain/<sandbox id>``).
Creating one needs root or a delegated cgroup.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path

from sandboxes.errors import SandboxError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _hierarchies(name: str) -> list[Path]:
    """Where ``posttrain/<name>`` is in cgroup v2 and in each v1 hierarchy."""
    return [CGROUP_ROOT / "posttrain" / name, *CGROUP_ROOT.glob(f"*/posttrain/{name}")]


class Cgroup:
    """One cgroup per sandbox for CPU, memory and process count (cgroup v2, or the v1 controllers)."""

    def __init__(self, name: str, *, cpus: float, memory_mib: int, pids: int):
        self.paths: list[Path] = []
        base = CGROUP_ROOT
        period = 100_000
        quota = max(1000, int(cpus * period))
        memory = memory_mib * 1024 * 1024
        try:
            if (base / "cgroup.controllers").exists():
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
                for ctl, settings in (
                    ("memory", {"memory.limit_in_bytes": memory}),
                    ("pids", {"pids.max": pids}),
                    ("cpu", {"cpu.cfs_period_us": period, "cpu.cfs_quota_us": quota}),
                ):
                    p = base / ctl / "posttrain" / name
                    p.mkdir(parents=True)
                    self.paths.append(p)
                    for key, value in settings.items():
                        (p / key).write_text(str(value))
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
        return self

    @property
    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` preceded by a shell that moves itself into the cgroup, then becomes ``argv``."""
        files = " ".join(shlex.quote(f) for f in self.procs_files)
        return ["/bin/sh", "-c", f'for f in {files}; do echo $$ > "$f" || exit 125; done; exec "$@"', "sh", *argv]

    def pids(self) -> list[int]:
        out = set()
        for f in self.procs_files:
            try:
                out.update(int(x) for x in Path(f).read_text().split())
            except OSError:
                pass
        return sorted(out)

    def peak_memory_bytes(self) -> int | None:
        for p in self.paths:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    return int((p / name).read_text())
                except OSError:
                    continue
        return None

    def oom_kills(self) -> int:
        """How many processes the cgroup's OOM killer ended (0 when the kernel does not say)."""
        for p in self.paths:
            for name in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
                try:
                    text = (p / name).read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        return int(value)
        return 0

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
