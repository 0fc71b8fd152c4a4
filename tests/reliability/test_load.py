"""Load, scaled down to run in CI (the full runs are bench/load_router.py, bench/load_pxd.py and
bench/load_store.py, whose figures docs/reliability.md records): nothing lost, duplicated or crossed
under concurrency. No timing is asserted; figures are printed by the benches."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from tests.reliability.conftest import REPO


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_router_with_hundreds_of_concurrent_sessions_loses_and_duplicates_nothing():
    """400 sessions opened at once, 2 turns each, router and 8 simulated replicas in their own processes;
    every call answered with its tokens, and the replicas captured each session's calls exactly once."""
    r = _bench("load_router").run(sessions=400, turns=2, replicas=8)
    assert r["errors"] == []
    assert r["answered"] == r["calls"] == 800 and r["lost"] == 0
    assert r["duplicated_sessions"] == 0 and r["captured_calls"] == 800


def test_pxd_socket_under_concurrent_clients_answers_each_its_own():
    r = _bench("load_pxd").run_socket(clients=24, commands=10)
    assert r["errors"] == [] and r["crossed"] == 0 and r["answered"] == 240 and r["files_ok"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
def test_pxd_in_a_sandbox_shared_by_concurrent_threads_crosses_no_answer():
    r = _bench("load_pxd").run_sandbox(clients=16, commands=10)
    assert r["errors"] == [] and r["crossed"] == 0 and r["answered"] == 160 and r["files_ok"]


def test_store_with_concurrent_writer_processes_and_a_trainer(tmp_path):
    r = _bench("load_store").run(writers=3, groups=20, size=4, tokens=256, workdir=tmp_path)
    assert r["stored"] == r["rollouts"] == 240
    assert r["taken_groups"] == 60 and r["taken_twice"] == 0 and r["left_ready"] == 0
