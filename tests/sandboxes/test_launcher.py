"""A bwrap sandbox's first host process (issue 55, fifth session): ``sandboxes/launch.c`` joins the
sandbox's cgroups and drops to the sandbox user in place of a shell and ``setpriv``, leaving bwrap
with the same credentials ``setpriv`` gave it; a launcher that cannot do its part stops before the
program runs; a host with no C compiler starts sandboxes as before."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import sandboxes
from sandboxes import launcher
from sandboxes.cgroups import Cgroup

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and a uid drop need root")

CREDENTIALS = ("Uid:", "Gid:", "Groups:", "CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "NoNewPrivs:")
SETPRIV = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]


def credentials(status: str) -> list[str]:
    return [line for line in status.splitlines() if line.startswith(CREDENTIALS)]


def test_a_bwrap_sandbox_starts_through_the_launcher_alone(repo, store, cache):
    """18f84c2 started bwrap through ``/bin/sh -c`` (the cgroup join) and ``setpriv`` (the uid drop):
    two programs more a start. The runtime's process is now the launcher become bwrap, in the
    sandbox's cgroups, as uid 1000 with no capability."""
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as sb:
        args = [str(a) for a in sb.proc.args]
        assert Path(args[0]).name.startswith("launch-") and "/bin/sh" not in args and "setpriv" not in args, args
        assert Path(args[args.index("--") + 1]).name == "bwrap"
        status = Path(f"/proc/{sb.proc.pid}/status").read_text()
        assert "Uid:\t1000\t1000\t1000\t1000" in status and "CapBnd:\t0000000000000000" in status, status
        for path in sb.cgroup.paths:
            assert sb.proc.pid in {int(x) for x in (path / "cgroup.procs").read_text().split()}
        assert sb.exec("id -u; id -G").output.split() == ["1000", "1000"]


def test_the_launcher_leaves_the_credentials_setpriv_left(tmp_path):
    """The same uids, gids, groups, capability sets and no_new_privs as ``setpriv --reuid --regid
    --clear-groups --inh-caps=-all --bounding-set=-all``, which the launcher stands for."""
    group = Cgroup(f"pt-test-launch-{os.getpid()}", cpus=1, memory_mib=64, pids=16)
    try:
        path = launcher.launcher()
        assert path is not None, "no C compiler on this host"
        by_launcher = subprocess.run([str(path), "-u", "1000", "-g", "1000", *group.procs_files, "--", "/bin/cat",
                                      "/proc/self/status"], capture_output=True, text=True, check=True).stdout
        by_setpriv = subprocess.run([*SETPRIV, "/bin/cat", "/proc/self/status"], capture_output=True, text=True,
                                    check=True).stdout
        assert credentials(by_launcher) == credentials(by_setpriv)
        assert len(credentials(by_launcher)) == len(CREDENTIALS)
        # and the process was in the sandbox's cgroups before it became the program
        seen = subprocess.run([str(path), *group.procs_files, "--", "/bin/cat", "/proc/self/cgroup"],
                                capture_output=True, text=True, check=True).stdout
        mine = [line for line in seen.splitlines() if {"cpu", "memory", "pids"} & set(line.split(":")[1].split(","))]
        assert mine and all(line.endswith(f"/posttrain/{group.paths[0].name}") for line in mine), seen
    finally:
        group.remove()


def test_a_launcher_that_cannot_join_its_cgroup_stops_before_the_program(tmp_path):
    marker = tmp_path / "ran"
    path = launcher.launcher()
    assert path is not None
    done = subprocess.run([str(path), "-u", "1000", "-g", "1000", str(tmp_path / "no-cgroup" / "cgroup.procs"),
                           "--", "/usr/bin/touch", str(marker)], capture_output=True, text=True)
    assert done.returncode == 125 and "cannot join the cgroup of" in done.stderr and "no-cgroup" in done.stderr
    assert not marker.exists()
    done = subprocess.run([str(path), "-u", "x1000", "-g", "1000", "--", "/usr/bin/touch", str(marker)],
                          capture_output=True, text=True)
    assert done.returncode == 125 and "not a number: x1000" in done.stderr and not marker.exists()


def test_a_launcher_removed_from_the_run_folder_is_built_again(tmp_path, monkeypatch):
    """A cleaner of /tmp that removes the compiled launcher does not break the next start; each
    run folder has its own (a run folder of this test's: others' sandboxes use the default one)."""
    monkeypatch.setenv("POSTTRAIN_SANDBOX_RUN_DIR", str(tmp_path / "run"))
    path = launcher.launcher()
    assert path.startswith(f"{tmp_path}/run/pxd/launch-") and os.access(path, os.X_OK)
    os.unlink(path)
    again = launcher.launcher()
    assert again == path and os.access(again, os.X_OK)


def test_without_a_launcher_a_sandbox_starts_through_sh_and_setpriv(repo, store, cache, monkeypatch):
    """A host whose compiler cannot build the launcher keeps the shell and setpriv: the same user,
    the same cgroups, the cgroup namespace rooted there."""
    monkeypatch.setattr(launcher, "launcher", lambda: None)
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as sb:
        assert sb.proc.args[0] == "/bin/sh" and "setpriv" in sb.proc.args
        assert sb.exec("id -u").output.strip() == "1000"
        for path in sb.cgroup.paths:
            assert sb.proc.pid in {int(x) for x in (path / "cgroup.procs").read_text().split()}
        seen = sb.exec("cat /proc/self/cgroup").output
        mine = [line for line in seen.splitlines() if {"cpu", "memory", "pids"} & set(line.split(":")[1].split(","))]
        assert mine and all(line.endswith(":/") for line in mine), seen
