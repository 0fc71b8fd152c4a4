"""Shared fixtures: a small bundled suite built for real (generated, written, validated by running
its tests), and the path of the DeepSWE v1.1 copy."""

from __future__ import annotations

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
