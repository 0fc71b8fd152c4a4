"""Shared test settings: every test gets its own posttrain home, never the user's."""

import os
import secrets
import subprocess

import pytest

# Two cores on CI: keep torch from oversubscribing them in every test process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The test session's trainer credential, set at its boundary: the test process is started as if
# its shell had exported $POSTTRAIN_TRAINER_CREDENTIAL (unless it was, or a credential file was
# named). This is the one place the tests put it in an environment; the project's modules never do
# (sandboxes.httpserver.auth; tests/test_credential_boundary.py). The project's servers and clients
# in this process read it once (process_credential), and the processes the tests start with a copy
# of this environment, or that the project's code starts with the credential it passes them
# explicitly, all hold the same one, so the tests' calls into them authenticate.
if not (os.environ.get("POSTTRAIN_TRAINER_CREDENTIAL") or os.environ.get("POSTTRAIN_TRAINER_CREDENTIAL_FILE")):
    os.environ["POSTTRAIN_TRAINER_CREDENTIAL"] = secrets.token_hex(32)


@pytest.fixture
def posttrain_home(tmp_path, monkeypatch):
    """A fresh POSTTRAIN_HOME (and DAGSTER_HOME inside it) for one test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))
    return home


@pytest.fixture(scope="session")
def rl_suite(tmp_path_factory):
    """A built bundled suite of one task a level and one RL task a level (validated for real in
    bubblewrap sandboxes), shared by the trainer-run tests of a test process."""
    from evals.bundled import build_suite

    os.environ.setdefault("POSTTRAIN_SANDBOX_DIR", str(tmp_path_factory.mktemp("sandboxes")))
    out = tmp_path_factory.mktemp("rl-suite") / "bundled"
    build_suite(out, per_level=1, rl_per_level=1, extra_eval_per_level=0, workers=2)
    return out


def node_binaries_built() -> bool:
    """Whether the kube plane and its node start without building anything (``scripts/kube-local.sh
    built``: kube-apiserver, the kubelet and the controllers already in the build cache)."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "kube-local.sh")
    try:
        return all(subprocess.run(["bash", script, "built", *what], capture_output=True, timeout=30).returncode == 0
                   for what in ([], ["node"]))
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first, the end-to-end demo first of all: with the files shared out
    among workers (scripts/test.sh), the long ones start early and the workers end together.

    The kube tests go last: they wait for the kube-apiserver scripts/test.sh starts in the
    background, the first time on a machine after a build of several minutes. tests/kube/test_node.py
    (its node started by the tests, ``POSTTRAIN_KUBE_NODE=1``) goes first of all instead where that
    build is done already: its module holds the plane's node for about ten minutes (the run's images
    built and imported, an RL run and an evaluation as pods), and the kube tests that stand in for
    the controllers wait for it to end (tests/kube/conftest.py, ``plane_lock``). Last, it left the
    other worker waiting on that lock with no other file to take; first, the other worker runs the
    rest of the suite meanwhile. Where it cannot go first, it goes after the other kube files, so
    that those which stand in for the controllers are handed out before it: on a machine that had
    built nothing, a test of them that started just after the node module waited out its timeout."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    node_first = (os.environ.get("POSTTRAIN_KUBE_NODE") == "1" and os.environ.get("POSTTRAIN_KUBE_TESTS", "1") != "0"
                  and any(item.path.name == "test_node.py" and item.path.parent.name == "kube" for item in items)
                  and node_binaries_built())

    def rank(item) -> int:
        if item.path.parent.name == "kube":
            if item.path.name == "test_node.py":
                return -1 if node_first else 4
            return 3
        if item.path not in slow_files:
            return 2
        return 0 if item.path.parent.name == "e2e" else 1

    items.sort(key=rank)  # stable: within a rank, collection order
