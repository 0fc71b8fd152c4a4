"""40% of the trainer's engine replicas SIGKILLed mid-step, inside ``python -m training``. Promises
(training/episodes.py, serving/fleet.py, serving/router/): the run goes on and finishes every step;
the dead replicas are replaced and each replacement joins serving the newest published adapter; the
calls in flight on them are retried elsewhere; no finished rollout is lost (every group in the store
is whole and every rollout is trained on); each session keeps one adapter version when it moves.

The replicas are real engine processes (``python -m serving.local_engine`` on a tiny random Qwen2, real LoRA
versions published by the trainer); the episodes are multi-turn sessions instead of sandboxed agents
(``tests/reliability/fleet_env.py``). The run and its step-time report are ``bench/trainer_replica_faults.py``'s;
``pytest -s`` prints the report."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

from serving.adapters import newest_adapter, publish_to_volume
from tests.reliability.conftest import REPO, serves_newest


def _bench():
    spec = importlib.util.spec_from_file_location("trainer_replica_faults", REPO / "bench" / "trainer_replica_faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_forty_percent_of_the_trainers_replicas_sigkilled_mid_step(tmp_path: Path, tiny_model_dir: Path):
    """5 replicas, 14 steps of 3 groups x 8 three-turn sessions; in step 4, once its first rollouts are
    stored, the 2 replicas with calls in flight are SIGKILLed (over a minute: seven engine processes).
    They are frozen for 50 ms before the kill, so that a call seen in flight is still in flight when the
    kill lands (unfrozen, a call of the tiny model could end first, and nothing would be retried)."""
    bench = _bench()
    steps, fault_step, groups, size = 14, 4, 3, 8
    r = bench.run(tmp_path, tiny_model_dir, steps=steps, fault_step=fault_step, groups_per_step=groups, group_size=size)
    text = "\n".join(r["lines"])
    print("\n" + bench.report(r, fault_step))
    assert r["returncode"] == 0, text

    # Every step ran, the fault step's and those after it too.
    assert sorted(r["step_s"]) == list(range(1, steps + 1)), text

    # The killed replicas were replaced; each replacement joined serving the newest published version.
    assert len(r["victims"]) == 2
    assert sorted(x["dead"] for x in r["replaced"]) == sorted(r["victims"]), text
    for x in r["replaced"]:
        assert x["returncode"] == -signal.SIGKILL and serves_newest(x["serving"], x["newest"]), x

    # No finished rollout lost: every group whole, every rollout trained on, none left over or discarded.
    assert r["counts"] == {"ready": 0, "consumed": steps * groups * size, "discarded": 0, "groups": steps * groups}
    assert all(n == group_size == size for _, group_size, n in r["group_sizes"]), r["group_sizes"]

    # The calls in flight on the killed replicas were retried elsewhere and their sessions moved; a
    # session answered by two replicas began on a killed one; every session kept one adapter version.
    assert r["caught_calls"] >= 1
    assert r["retried_calls"] >= 1 and r["moved_sessions"] >= 1, r["router"]
    spanning = [i for i in r["infos"] if len(set(i["replicas"])) > 1]
    assert all(i["replicas"][0] in r["victims"] for i in spanning), spanning[:3]
    assert all(len(set(i["weight_versions"])) == 1 for i in r["infos"])
    # Whether a replacement gets sessions before the run ends is the policy's choice and the join's
    # timing: the report prints it, the test does not assert it.


def test_newest_adapter_never_picks_a_copy_still_being_written(tmp_path: Path):
    """A replica joining reads the newest version on the volume; the trainer's own output folder
    (``.out-step_N``) and ``publish_to_volume``'s copy in progress (``.step_N.*``) hold both adapter
    files before they are whole, and carry a higher step number: neither is a version. (Found by the
    test above: a replacement loaded ``.out-step_000009`` and failed to start.)"""
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "adapter_config.json").write_text('{"r": 4}')
    (src / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    volume = tmp_path / "adapters"
    publish_to_volume(src, volume, "step_000003")
    for hidden in (".out-step_000004", ".step_000004.x1y2"):
        (volume / hidden).mkdir()
        (volume / hidden / "adapter_config.json").write_text('{"r": 4}')
        (volume / hidden / "adapter_model.safetensors").write_bytes(b"")
    assert newest_adapter(volume) == ("step_000003", str(volume / "step_000003"))
