"""A server run in the foreground (``python -m serving.router`` and the other ``__main__``s) stops on
SIGTERM even when it inherited SIGTERM ignored or blocked from whatever started it (a test runner, a
shell, a supervisor): a fleet's stop or a pod's deletion must not leave it running."""

import subprocess
import sys

import pytest

from serving.replica import free_port
from tests.inherited_signals import block_sigterm, ignore_sigterm


@pytest.mark.parametrize("inherited", [ignore_sigterm, block_sigterm], ids=["ignored", "blocked"])
def test_a_router_stops_on_sigterm_whatever_it_inherited(inherited):
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "serving.router", "--host", "127.0.0.1", "--port", str(port),
                               "--worker", "http://127.0.0.1:1"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=inherited)
    try:
        assert router.stdout.readline().startswith("router (kv_headroom) on http://127.0.0.1:")
        router.terminate()
        assert router.wait(timeout=30) == 0
    finally:
        router.kill()
        router.wait()
