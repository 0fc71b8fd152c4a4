"""Shared fixtures: a small bundled suite built for real (generated, written, validated by running
its tests), and the path of the DeepSWE v1.1 copy."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

DEEPSWE = Path("/work/shared/datasets/deepswe-1.1")


@pytest.fixture(scope="session", autouse=True)
def sandbox_dir(tmp_path_factory):
    """Sandbox images and layer cache of these tests live in a temporary folder, not the user's."""
    import os

    path = tmp_path_factory.mktemp("sandboxes")
    old = os.environ.get("POSTTRAIN_SANDBOX_DIR")
    os.environ["POSTTRAIN_SANDBOX_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("POSTTRAIN_SANDBOX_DIR", None)
    else:
        os.environ["POSTTRAIN_SANDBOX_DIR"] = old


@pytest.fixture(scope="session")
def small_suite(tmp_path_factory) -> Path:
    from evals.bundled import build_suite

    out = tmp_path_factory.mktemp("suite") / "bundled"
    build_suite(out, per_level=2, extra_eval_per_level=0, workers=2)  # per level: held out, demonstration, RL
    return out


@pytest.fixture(scope="session")
def small_tasks(small_suite):
    from evals.tasks import load_bundled

    return list(load_bundled(small_suite).tasks)


@pytest.fixture(scope="session")
def tokenizer():
    from serving.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


class CountingFactory:
    """A bwrap sandbox factory that counts the sandboxes it starts."""

    def __init__(self):
        from evals.sandbox import platform_sandbox_factory

        self.base = platform_sandbox_factory("bwrap")
        self.starts = 0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, task):
        with self.lock:
            self.starts += 1
        with self.base(task) as box:
            yield box


@pytest.fixture
def no_kept_answers(monkeypatch):
    """The hidden answers this process keeps (``evals.call_checks``, per task content and factory,
    and ``platform_sandbox_factory`` of a runtime is one per process) emptied for one test: a test
    that counts sandboxes or commands must not find the answers another test in its worker kept for
    the same task."""
    from collections import OrderedDict

    from evals import call_checks

    monkeypatch.setattr(call_checks, "_answers", OrderedDict())


@pytest.fixture
def commands(monkeypatch, no_kept_answers):
    """The commands run in sandboxes (``PlatformSandbox.exec``, wrapped only to record them), in order."""
    from evals.sandbox import PlatformSandbox

    real = PlatformSandbox.exec
    seen: list[str] = []

    def recording(self, command, **kwargs):
        seen.append(command)
        return real(self, command, **kwargs)

    monkeypatch.setattr(PlatformSandbox, "exec", recording)
    return seen
