"""The processes behind ``posttrain ui``, started and stopped as one.

Each command runs in a session of its own, so that everything it starts (``dagster dev``'s
webserver, daemon and code servers, the runs the daemon launches) shares its process group. On
Ctrl-C, SIGTERM or SIGHUP to ``posttrain ui``, or when one of them exits, every group gets SIGINT
(what ``dagster dev`` stops cleanly on, as from a terminal), then SIGTERM, and whatever is still
alive after ``grace_s`` seconds, in the groups or below them, gets SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Sequence


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_seconds(pids: Sequence[int]) -> dict[int, tuple[str, float]]:
    """(name, user + system CPU seconds so far) of each of ``pids`` still alive, from ``/proc``."""
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        out[pid] = (text[text.index("(") + 1:text.rindex(")")], (int(fields[11]) + int(fields[12])) / hz)
    return out


def session_members(sid: int) -> set[int]:
    """Live processes of session ``sid``."""
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                members.add(int(entry.name))
    return members


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Supervisor:
    """Starts commands in their own sessions; :meth:`wait` returns once they are all stopped."""

    def __init__(self, grace_s: float = 20.0) -> None:
        self.grace_s = grace_s
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.stop_requested = threading.Event()
        self.reason = ""

    def start(self, name: str, command: Sequence[str]) -> subprocess.Popen:
        proc = subprocess.Popen(list(command), start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.reason = signal.Signals(signum).name
        self.stop_requested.set()

    def wait(self) -> int:
        """Until a signal arrives or a process exits; then stop them all. The exit status is 0 after
        a signal, else the first exited process's."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        status = 0
        while not self.stop_requested.wait(0.5):
            exited = [(name, proc) for name, proc in self.procs if proc.poll() is not None]
            if exited:
                name, proc = exited[0]
                self.reason, status = f"{name} exited with {proc.returncode}", proc.returncode or 0
                break
        print(f"stopping ({self.reason}): {', '.join(name for name, _ in self.procs)}", flush=True)
        self.stop()
        return status

    def stop(self) -> None:
        members = set()
        for _, proc in self.procs:
            members |= {proc.pid} | descendants(proc.pid) | session_members(proc.pid)
        for _, proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.grace_s
        term_at = time.monotonic() + self.grace_s / 2
        termed = False
        while time.monotonic() < deadline:
            for _, proc in self.procs:
                proc.poll()
            alive = {pid for pid in members if _alive(pid)} | set().union(*(session_members(p.pid) for _, p in self.procs))
            if not alive:
                break
            if not termed and time.monotonic() > term_at:
                _signal(alive, signal.SIGTERM)
                termed = True
            time.sleep(0.2)
        for _, proc in self.procs:
            left = session_members(proc.pid) | {pid for pid in members if _alive(pid)}
            _signal(left, signal.SIGKILL)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
