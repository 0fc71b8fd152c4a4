"""``preexec_fn``s that start a child the way a test runner, a shell or a supervisor may: SIGTERM
ignored, or blocked. A server must still stop on SIGTERM (tests/serving/test_foreground_signals.py,
tests/viewer/test_researcher_view.py)."""

import signal


def ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def block_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
