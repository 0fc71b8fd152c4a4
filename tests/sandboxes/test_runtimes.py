"""Real sandboxes (bubblewrap and gVisor) started from task repositories: the toolchain inside, a
writable workspace over a read-only root, git through pxd, limits, and cleanup."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

import sandboxes
from sandboxes.cgroups import Cgroup
from sandboxes.rootfs import run_root

from .conftest import runtime_params


@pytest.mark.parametrize("runtime", runtime_params())
def test_a_sandbox_sees_no_tool_of_posttrains_environment_unless_declared(runtime, repo, store, cache):
    """Without a declared toolchain a sandbox has the host's /usr only: no posttrain virtualenv on
    PATH or on disk, so pytest (which /usr/bin/python3 lacks here) is missing, not borrowed."""
    venv = os.path.realpath(sys.prefix)
    with sandboxes.start(repo, runtime=runtime, store=store, cache=cache) as sb:
        assert sb.exec("echo $PATH").output.strip() == "/usr/local/bin:/usr/bin:/bin"
        missing = sb.exec("command -v pytest python; python3 -m pytest -q -p no:cacheprovider", timeout_s=120)
        assert missing.exit_code != 0 and "No module named pytest" in missing.output, missing.output
        assert sb.exec(f"test -e {venv}/bin/python").exit_code != 0  # not even by its absolute path
    with sandboxes.start(repo, runtime=runtime, store=store, cache=cache, toolchains=("posttrain-python",)) as sb:
        assert sb.exec("command -v python").output.strip() == f"{sys.prefix}/bin/python"
    with pytest.raises(ValueError, match="host toolchain 'conda' is not one of posttrain-python"):
        sandboxes.start(repo, runtime=runtime, store=store, cache=cache, toolchains=("conda",))


@pytest.mark.parametrize("runtime", runtime_params())
def test_coreutils_list_and_stat_a_path(runtime, repo, store, cache):
    """``ls PATH``, ``ls -l`` and ``stat``, an agent's first commands in a repository, work in both
    runtimes: under gVisor they need the runsc that scripts/setup.sh installs (bookworm's 20221219
    refused coreutils' statx call: "Invalid argument")."""
    with sandboxes.start(repo, runtime=runtime, store=store, cache=cache) as sb:
        listed = sb.exec("ls calc.py /workspace; ls -l calc.py; stat -c '%s %U' calc.py")
        assert listed.exit_code == 0, listed.output
        lines = listed.output.splitlines()
        assert lines[0] == "calc.py" and "calc.py" in lines[1:] and "test_calc.py" in lines[1:], lines
        size = len(repo.joinpath("calc.py").read_bytes())
        assert lines[-2].startswith("-rw-") and lines[-2].endswith(" calc.py") and lines[-1] == f"{size} sandbox", lines


@pytest.mark.parametrize("runtime", runtime_params())
def test_task_tests_run_for_real(runtime, repo, store, cache):
    # the repository's tests run under pytest: the sandbox declares the host toolchain that has it
    with sandboxes.start(repo, runtime=runtime, store=store, cache=cache, toolchains=("posttrain-python",)) as sb:
        r = sb.exec("python -m pytest -q -p no:cacheprovider", timeout_s=120)
        assert r.exit_code == 0 and "1 passed" in r.output, r.output
        sb.write_file("calc.py", b"def add(a, b):\n    return a - b\n")
        r = sb.exec("python -m pytest -q -p no:cacheprovider", timeout_s=120)
        assert r.exit_code == 1 and "1 failed" in r.output
        assert [f.path for f in sb.pxd.git_status().files] == ["calc.py"]
        commit = sb.pxd.git_commit("break add")
        assert commit.committed
        assert sb.exec(["git", "log", "--format=%s"]).output == "break add\nbase\n"
        # the root is read-only, the workspace and /tmp are not
        assert sb.exec("touch /usr/x || touch /etc/x || touch /x").exit_code != 0
        assert sb.exec("touch /tmp/x $HOME/y && echo ok > new.txt").exit_code == 0
        assert sb.exec("pwd; id -u").output == "/workspace\n1000\n"  # the sandbox user, in both runtimes
        run_dir = sb.run_dir
    assert not run_dir.exists()
    assert repo.joinpath("calc.py").read_text().endswith("a + b\n")  # the source repository is untouched


@pytest.mark.parametrize("runtime", runtime_params())
def test_second_start_is_a_cache_hit_and_sandboxes_are_separate(runtime, repo, store, cache):
    image = sandboxes.build_image("calc", repo, store)
    with sandboxes.start("calc", runtime=runtime, store=store, cache=cache) as a:
        assert not a.cache_hit
        a.write_file("only-in-a.txt", b"a")
        with sandboxes.start(image, runtime=runtime, store=store, cache=cache) as b:
            assert b.cache_hit
            assert b.exec("ls -A").output.split() == [".git", ".gitignore", "calc.py", "test_calc.py"]
    assert not run_root(cache, create=False).exists()  # its last sandbox took the folder along


def test_bwrap_user_has_no_capabilities_and_limits_are_a_cgroup(repo, store, cache):
    limits = sandboxes.Limits(cpus=0.5, memory_mib=300, pids=50)
    with sandboxes.start(repo, runtime="bwrap", limits=limits, store=store, cache=cache) as sb:
        out = sb.exec("id -u; grep CapEff /proc/self/status").output.split()
        assert out == ["1000", "CapEff:", "0000000000000000"]
        cg = sb.cgroup
        assert cg is not None and len(cg.pids()) >= 2  # bwrap and pxd at least
        if os.geteuid() == 0:  # outside its namespaces too, the sandbox is an unprivileged user
            for pid in cg.pids():
                uids = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("Uid:"))
                assert uids.split()[1:] == ["1000"] * 4
        memory = [p for p in cg.paths if "memory" in str(p)] or cg.paths
        limit_file = next(f for f in ("memory.limit_in_bytes", "memory.max") if (memory[0] / f).exists())
        assert int((memory[0] / limit_file).read_text()) == 300 * 1024 * 1024
        paths = list(cg.paths)
    assert not any(p.exists() for p in paths)


def test_pxd_dies_with_its_bwrap(repo, store, cache):
    """bwrap killed from the host takes pxd with it: no process of the sandbox lives on, re-parented
    to the host's init and answering on the sandbox's pipes; the next call names the runtime's exit."""
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as sb:
        assert sb.exec("echo up").output == "up\n"
        assert len(sb.cgroup.pids()) == 2  # bwrap and pxd
        os.kill(sb.proc.pid, signal.SIGKILL)
        sb.proc.wait(10)
        deadline = time.monotonic() + 10
        while sb.cgroup.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sb.cgroup.pids() == []
        with pytest.raises(sandboxes.PxdConnectionError, match="the bwrap runtime exited with code -9"):
            sb.exec("echo again", timeout_s=10)


def test_wall_time_limit_ends_the_sandbox(repo, store, cache):
    sb = sandboxes.start(repo, runtime="bwrap", limits=sandboxes.Limits(wall_s=1.0), store=store, cache=cache)
    with pytest.raises(sandboxes.PxdConnectionError, match="wall-time limit of 1 s"):
        sb.exec("sleep 60", timeout_s=120)
    assert sb.closed and not sb.run_dir.exists()


def test_unisolated_needs_the_explicit_flag(repo, store, cache):
    with pytest.raises(sandboxes.SandboxError, match="allow_unisolated=True"):
        sandboxes.start(repo, runtime="unisolated", store=store, cache=cache)
    with sandboxes.start(repo, runtime="unisolated", allow_unisolated=True, store=store, cache=cache,
                         toolchains=("posttrain-python",)) as sb:
        assert sb.exec("python -m pytest -q -p no:cacheprovider").exit_code == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="runtime 'docker'"):
        sandboxes.start("x", runtime="docker")
    with pytest.raises(ValueError, match=r"Limits\.memory_mib must be a number >= 16"):
        sandboxes.Limits(memory_mib=1)
    with pytest.raises(ValueError, match=r"Limits\.cpus"):
        sandboxes.Limits(cpus="2")


def test_missing_image_names_the_store(store, cache):
    with pytest.raises(sandboxes.ImageError, match="no image 'ghost'"):
        sandboxes.start("ghost", store=store, cache=cache)


def test_debris_of_a_killed_harness_is_reaped(repo, store, cache):
    """A harness killed with SIGKILL leaves its sandbox's mounts, cgroup and run folder behind;
    the next process to start a sandbox on the same cache removes them (and only them)."""
    import subprocess
    import sys

    from sandboxes.reaping import reap_stale_sandboxes

    script = (
        "import os, sys, sandboxes\n"
        f"store = sandboxes.ImageStore({str(store.root)!r}); cache = sandboxes.LayerCache({str(cache.root)!r})\n"
        f"sb = sandboxes.start({str(repo)!r}, store=store, cache=cache)\n"
        "print(sb.id, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    dead_id = out.stdout.strip()
    assert out.returncode == -9 and dead_id.startswith("pt-"), out.stderr
    run_dir = run_root(cache) / dead_id
    assert run_dir.exists() and str(run_dir) in Path("/proc/mounts").read_text()
    with sandboxes.start(repo, runtime="bwrap", store=store, cache=cache) as alive:
        assert reap_stale_sandboxes(cache) in ([], [dead_id])  # start() reaps once per process and cache
        assert not run_dir.exists() and str(run_dir) not in Path("/proc/mounts").read_text()
        assert reap_stale_sandboxes(cache) == []  # the live sandbox is left alone
        assert alive.exec("echo ok").output == "ok\n"
    assert not list(Path("/sys/fs/cgroup").glob(f"*/posttrain/{dead_id}"))


def test_run_folders_survive_their_root_being_removed_by_a_closing_sandbox(tmp_path, monkeypatch):
    """A sandbox's close removes the cache's run root when it was the last one; a sandbox starting
    at that moment in another thread must still get its run folder (seen as ``FileExistsError`` from
    the root's ``mkdir`` while suites were validated in parallel)."""
    import threading

    from sandboxes.rootfs import make_run_dir

    monkeypatch.setenv("POSTTRAIN_SANDBOX_RUN_DIR", str(tmp_path / "run"))
    cache = sandboxes.LayerCache(tmp_path / "cache")
    errors: list[BaseException] = []

    def churn(worker: int) -> None:
        try:
            for i in range(300):
                folder = make_run_dir(cache, f"pt-{worker}-{i}")
                assert folder.is_dir()
                folder.rmdir()
                try:
                    folder.parent.rmdir()  # what Sandbox.close does
                except OSError:
                    pass
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("runtime", runtime_params())
def test_pxd_starts_compiled_and_the_sandbox_cannot_change_it(runtime, repo, store, cache):
    """Sandboxes start the daemon from its compiled file, bound read-only; the file matches the
    source it was compiled from, and the sandbox user can neither rewrite nor replace it."""
    from sandboxes.runtimes import PXD_COMPILED_IN_SANDBOX, compiled_pxd

    with sandboxes.start(repo, runtime=runtime, store=store, cache=cache) as sb:
        cmdline = sb.exec("tr '\\0' ' ' < /proc/1/cmdline").output
        assert PXD_COMPILED_IN_SANDBOX in cmdline, cmdline
        assert sb.exec(f"echo x >> {PXD_COMPILED_IN_SANDBOX} || rm -f {PXD_COMPILED_IN_SANDBOX} || "
                       f"mv {PXD_COMPILED_IN_SANDBOX} /tmp/p").exit_code != 0
        digest = hashlib.sha256(compiled_pxd().read_bytes()).hexdigest()
        assert sb.exec(f"sha256sum {PXD_COMPILED_IN_SANDBOX}").output.split()[0] == digest


def test_a_compiled_pxd_that_others_could_write_is_replaced(tmp_path, monkeypatch):
    from sandboxes import runtimes

    monkeypatch.setenv("POSTTRAIN_SANDBOX_RUN_DIR", str(tmp_path / "run"))
    first = runtimes.compiled_pxd()
    assert first.stat().st_mode & 0o777 == 0o644 and (tmp_path / "run" / "pxd").stat().st_mode & 0o777 == 0o711
    assert runtimes.compiled_pxd() == first
    first.write_bytes(b"planted")
    first.chmod(0o666)
    assert runtimes.compiled_pxd() == first
    assert first.read_bytes() != b"planted" and first.stat().st_mode & 0o777 == 0o644
