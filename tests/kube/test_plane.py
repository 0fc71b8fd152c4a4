"""The test plane itself: planes of two callers on one machine, and CI that cannot pass without it.

``scripts/kube-local.sh`` keeps a plane's data, pids and ports in its state folder and picks free
ports at a plane's first start, so two callers with two state folders (two checkouts, or two runs
of ``scripts/test.sh``, each of which makes a folder of its own) each get a plane, and stopping one
leaves the other serving. Under ``CI=true`` the kube tests fail, not skip, when there is no plane.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kube-local.sh"


def kube_local(state: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSTTRAIN_KUBE")}
    env["POSTTRAIN_KUBE_STATE"] = str(state)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def ready(kubeconfig: str) -> str:
    """``GET /readyz`` of the plane a kubeconfig names, as its admin."""
    config = yaml.safe_load(Path(kubeconfig).read_text())
    server = config["clusters"][0]["cluster"]["server"]
    context = ssl.create_default_context(cafile=config["clusters"][0]["cluster"]["certificate-authority"])
    request = urllib.request.Request(server + "/readyz", headers={"Authorization": f"Bearer {config['users'][0]['user']['token']}"})
    with urllib.request.urlopen(request, timeout=30, context=context) as answer:
        return answer.read().decode()


def test_two_callers_get_two_planes_and_one_stopping_leaves_the_other(kubeconfig, tmp_path):
    """Needs the built apiserver (``kubeconfig``: a plane started, so the build is there)."""
    states = [tmp_path / "first", tmp_path / "second"]
    try:
        configs = []
        for state in states:
            started = kube_local(state, "start")
            assert started.returncode == 0, started.stderr[-2000:]
            configs.append(started.stdout.split()[-1])
        ports = [(state / "ports").read_text().split() for state in states]
        print("ports (apiserver, etcd, etcd peers):", ports)
        assert not set(ports[0]) & set(ports[1])  # nothing shared
        assert [ready(c) for c in configs] == ["ok", "ok"]

        stopped = kube_local(states[0], "stop")
        assert stopped.returncode == 0, stopped.stderr
        with pytest.raises(OSError):
            ready(configs[0])
        assert ready(configs[1]) == "ok"  # the other caller's plane is still there
        assert "apiserver: running" in kube_local(states[1], "status").stdout
        assert "apiserver: stopped" in kube_local(states[0], "status").stdout

        again = kube_local(states[0], "start")  # its ports are kept: the same kubeconfig works again
        assert again.returncode == 0, again.stderr[-2000:]
        assert (states[0] / "ports").read_text().split() == ports[0] and ready(configs[0]) == "ok"
    finally:
        for state in states:
            kube_local(state, "stop")


@pytest.mark.parametrize("ci", ["true", ""])
def test_without_a_plane_the_kube_tests_fail_in_ci_and_skip_elsewhere(ci):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSTTRAIN_KUBE") and k != "CI"}
    env["CI"] = ci
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           "tests/kube/test_pool_rbac.py"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    summary = done.stdout.strip().splitlines()[-1]
    print(f"CI={ci!r}: exit {done.returncode}: {summary}")
    if ci:
        assert done.returncode == 1 and "error" in summary and "skipped" not in summary, done.stdout[-3000:]
        assert "the kube tests must run in CI" in done.stdout
    else:
        assert done.returncode == 0 and "skipped" in summary and "error" not in summary, done.stdout[-3000:]
    # turned off on purpose: skipped, in CI too
    env["POSTTRAIN_KUBE_TESTS"] = "0"
    off = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/kube/test_pool_rbac.py"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    last = off.stdout.strip().splitlines()[-1]
    assert off.returncode == 0 and "skipped" in last and "error" not in last, off.stdout[-3000:]
