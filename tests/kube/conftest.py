"""Tests against a real kube-apiserver on loopback (``scripts/kube-local.sh start``).

``scripts/test.sh`` starts the control plane (etcd and kube-apiserver, built once from Debian's
``kubernetes`` source package) in a state folder and on ports of its own, and hands its kubeconfig
over; without a plane every test here is skipped, saying why, except under ``CI=true`` (what CI
sets), where a plane that cannot start fails them: CI must not pass with the kube tests unrun.
``POSTTRAIN_KUBE_TESTS=0`` turns them off on purpose, in CI too. Run them by hand with::

    export POSTTRAIN_KUBECONFIG=$(bash scripts/kube-local.sh start | tail -1)
    .venv/bin/python -m pytest -p no:cacheprovider -q -m kube tests/kube

There is no kubelet, scheduler or controller-manager: objects are stored, validated, defaulted and
authorized by the real server, and pods stay Pending. Each test gets a namespace of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from pathlib import Path

import pytest

KUBECONFIG_VARIABLE = "POSTTRAIN_KUBECONFIG"


# How long a test that stands in for the controllers waits for tests/kube/test_node.py's module to
# give the plane back (``plane_lock``). On a machine that has built nothing yet the module builds the
# node's binaries and both images and runs an RL run as pods: in the CI run that first met it, its
# node, images and run as pods alone took 1191 s (docs/kubernetes.md, on scripts/kube-local.sh).
PLANE_WAIT_S = 45 * 60


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    # the run's per-test timeout (pytest-timeout's --timeout, else the ini's; 0: none)
    given = config.getoption("timeout", None)
    timeout_s = float(given if given is not None else config.getini("timeout") or 0)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.kube)
            if timeout_s and "no_controllers" in getattr(item, "fixturenames", ()):
                # the wait for the node's module is not the test's own time: the run's timeout plus
                # the wait's own deadline (which fails first, saying why)
                item.add_marker(pytest.mark.timeout(timeout_s + PLANE_WAIT_S + 60))


START_LOG_VARIABLE = "POSTTRAIN_KUBE_START_LOG"
# Pod Security Admission on every test namespace, as scripts/kube-local.sh labels the plane's own
# (enforced by servers >= 1.23; this 1.20 plane admits pods by PodSecurityPolicy)
POD_SECURITY_LABELS = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")}


def in_ci() -> bool:
    """``CI`` set to a true value (GitHub Actions, GitLab and most CI systems set ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def no_plane(reason: str):
    """Skip for want of an API server; fail instead under ``CI=true`` unless the kube tests were
    turned off on purpose (``POSTTRAIN_KUBE_TESTS=0``)."""
    if in_ci() and os.environ.get("POSTTRAIN_KUBE_TESTS", "1") != "0":
        pytest.fail(f"{reason} (CI=true: the kube tests must run in CI; POSTTRAIN_KUBE_TESTS=0 turns them off)",
                    pytrace=False)
    pytest.skip(reason)
START_WAIT_S = 45 * 60  # a first build on 2 busy cores, with room


def _started_in_background() -> str | None:
    """The kubeconfig of the plane scripts/test.sh is starting in the background (it writes the
    start's stderr to $POSTTRAIN_KUBE_START_LOG, its stdout to .out and its exit status to .rc),
    waited for; ``None`` when there is none; a failed start skips (fails under ``CI=true``)."""
    log = os.environ.get(START_LOG_VARIABLE)
    if not log:
        return None
    deadline = time.monotonic() + START_WAIT_S
    while not os.path.exists(f"{log}.rc"):
        if time.monotonic() > deadline:
            pytest.fail(f"scripts/kube-local.sh start did not finish within {START_WAIT_S} s; see {log}")
        time.sleep(2)
    rc = open(f"{log}.rc").read().strip()
    if rc != "0":
        tail = "".join(open(log).readlines()[-5:]).strip()
        no_plane(f"no real API server: scripts/kube-local.sh start failed (exit {rc}): {tail}")
    lines = open(f"{log}.out").read().split()
    return lines[-1] if lines else None


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    path = os.environ.get(KUBECONFIG_VARIABLE) or _started_in_background()
    if not path:
        no_plane(f"no real API server: {KUBECONFIG_VARIABLE} is not set (scripts/test.sh starts "
                 "`bash scripts/kube-local.sh start` and hands its kubeconfig over)")
    if not os.path.isfile(path):
        pytest.fail(f"{KUBECONFIG_VARIABLE}={path}: no such kubeconfig file")
    return path


@pytest.fixture(scope="session")
def admin(kubeconfig):
    """An ``ApiClient`` of the kubeconfig's user (the plane's admin, group ``system:masters``)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return client.ApiClient(configuration)


@pytest.fixture
def namespace(admin):
    """A fresh namespace with its ``default`` service account (what the controller-manager would
    add); deleted afterwards (without a namespace controller it stays Terminating, emptied of nothing)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    name = f"pt-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": name, "labels": {"posttrain.dev/test": "kube", **POD_SECURITY_LABELS}}})
    try:
        core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    except ApiException as exc:
        if exc.status != 409:  # a controller-manager (kube-local.sh start-node) made it first
            raise
    yield name
    core.delete_namespace(name)


def token_client(admin, namespace: str, account: str, seconds: int = 600):
    """An ``ApiClient`` that acts as service account ``account``: a token from the TokenRequest API,
    the same kind of token a pod of that account mounts."""
    from kubernetes import client

    core = client.CoreV1Api(admin)
    answer = core.create_namespaced_service_account_token(
        account, namespace, {"spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": seconds}})
    configuration = client.Configuration()
    configuration.host = admin.configuration.host
    configuration.ssl_ca_cert = admin.configuration.ssl_ca_cert
    configuration.api_key = {"authorization": f"Bearer {answer.status.token}"}
    return client.ApiClient(configuration)


@contextlib.contextmanager
def plane_lock(kubeconfig: str, exclusive: bool, wait_s: float | None = None):
    """A lock on the plane, across the pytest processes of one run (a file beside its kubeconfig):
    held exclusively while tests/kube/test_node.py runs a node on it, shared by each test that stands
    in for the controllers (``no_controllers``), so neither starts while the other runs, whichever
    worker of ``scripts/test.sh`` takes which file first. With ``wait_s`` the test fails, saying so,
    when the lock is not had within that many seconds; without, it waits as long as it takes."""
    path = Path(kubeconfig).resolve().parent / ".posttrain-tests.lock"
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(path, "a+") as handle:
        if wait_s is None:
            fcntl.flock(handle, mode)
        else:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(handle, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"the plane's lock ({path}) was not had within {wait_s:g} s: "
                                    "tests/kube/test_node.py's node held it for longer")
                    time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture
def no_controllers(admin, kubeconfig):
    """A plane without a node for the test's length: the test plays the part of the controllers and
    kubelet (status subresources, pods left Pending), which real ones would overwrite. It waits while
    tests/kube/test_node.py has its node up (``plane_lock``), at most ``PLANE_WAIT_S``, a wait its
    test's timeout leaves out (``pytest_collection_modifyitems``); on a plane whose node someone else
    started (``kube-local.sh start-node`` by hand) it is skipped, saying so."""
    from kubernetes import client

    with plane_lock(kubeconfig, exclusive=False, wait_s=PLANE_WAIT_S):
        nodes = client.CoreV1Api(admin).list_node().items
        if nodes:
            pytest.skip(f"this plane runs controllers and a node ({nodes[0].metadata.name}): the test stands in "
                        "for them and needs a plane without (scripts/kube-local.sh start alone)")
        yield
