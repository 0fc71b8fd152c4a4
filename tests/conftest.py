"""Shared test settings: every test gets its own posttrain home, never the user's."""

import os
import secrets

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


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first, the end-to-end demo first of all: with the files shared out
    among workers (scripts/test.sh), the long ones start early and the workers end together."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        if item.path.parent.name == "kube":
            return 3  # last: they wait for the kube-apiserver scripts/test.sh starts in the background
        if item.path not in slow_files:
            return 2
        return 0 if item.path.parent.name == "e2e" else 1

    items.sort(key=rank)  # stable: within a rank, collection order
