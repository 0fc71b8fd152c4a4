"""Data-parallel training on the CPU with two gloo processes, against one process over the same groups.

- One GRPO step of the torch/peft backend on two ranks (``data_parallel_worker.py`` under torchrun)
  gives one process's loss, statistics, summed gradients and adapter, to float32 rounding: the loss
  within 1e-6, the gradients within 1e-5 relative, the adapter within 1e-6 (the sums only run in
  another order). A step whose only sequence leaves the second rank's shard empty too.
- The trainer (``python -m training`` under torchrun, the test environment of ``envs.py``) checkpointed
  on two ranks resumes on one, and checkpointed on one resumes on two, with the per-step losses of an
  uninterrupted one-process run within 1e-5. Its adapters: at the checkpoint of step 2 within 1e-4
  (2.7e-5 seen after two steps on two ranks), and after the two more steps the difference is under 1%
  of how far those steps moved the adapter (0.3% seen): AdamW divides each gradient by its running RMS,
  so where a gradient is near zero it turns a float32 rounding into a visible part of a step.

Megatron's data-parallel path shares the step (``training.backends.step``) and the reduction
(``training.backends.parallel``) tested here; megatron-core itself is not installed on these machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from tests.training.data_parallel_worker import BACKEND_ARGS, run_steps, step_batches
from training.backends.parallel import shard_rows
from training.backends.torch_peft import TorchPeftBackend
from training.checkpoint import checkpoint_path, complete_steps
from training.grpo import TrainBatch

REPO = Path(__file__).resolve().parents[2]


def _torchrun(ranks: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_shards_balance_tokens_and_cover_every_row_once():
    lengths = [9, 23, 14, 31, 6, 17, 12]
    batch = TrainBatch([[0] * n for n in lengths], [[1] * n for n in lengths], [[0.0] * n for n in lengths],
                       [0.0] * len(lengths))
    shards = shard_rows(batch, 2)
    assert sorted(i for s in shards for i in s) == list(range(7))
    # longest first onto the lighter rank: 31, 14, 9 (54 tokens) and 23, 17, 12, 6 (58)
    assert shards == [[0, 2, 3], [1, 4, 5, 6]]
    assert [[lengths[i] for i in s] for s in shard_rows(batch, 3)] == [[9, 31], [23, 12], [14, 6, 17]]
    assert shard_rows(batch, 3) == shard_rows(batch, 3)  # every rank computes the same split
    one = TrainBatch([[1, 2, 3]], [[0, 1, 1]], [[0.0, -1.0, -1.0]], [1.0])
    assert shard_rows(one, 2) == [[0], []]


def test_two_ranks_take_the_step_of_one_process(tmp_path: Path, tiny_model_dir: Path):
    _torchrun(2, str(REPO / "tests" / "training" / "data_parallel_worker.py"), str(tiny_model_dir), str(tmp_path))
    want = {}
    run_steps(TorchPeftBackend(tiny_model_dir, **BACKEND_ARGS), lambda step, data: want.__setitem__(step, data))
    assert len(step_batches(64)[1].input_ids) == 1  # the second step leaves rank 1 without rows
    for step in (1, 2):
        for rank in (0, 1):
            got = torch.load(tmp_path / f"rank{rank}-step{step}.pt")
            for key in ("loss", "pg_loss", "kl", "grad_norm", "mean_is_weight", "clipped_is_fraction"):
                assert got["result"][key] == pytest.approx(want[step]["result"][key], abs=1e-6), (step, rank, key)
            assert got["result"]["tokens"] == want[step]["result"]["tokens"]
            g = torch.cat([t.flatten() for t in got["grads"]])
            w = torch.cat([t.flatten() for t in want[step]["grads"]])
            assert float((g - w).norm() / w.norm()) < 1e-5, (step, rank)
            assert got["adapter"].keys() == want[step]["adapter"].keys()
            for name, value in want[step]["adapter"].items():
                assert torch.allclose(got["adapter"][name], value, rtol=0, atol=1e-6), (step, rank, name)
    # the clipping (max_grad_norm 0.05) saw the whole step's gradient norm, not a shard's
    assert want[1]["result"]["grad_norm"] > BACKEND_ARGS["max_grad_norm"] / 2


def _config(tmp_path: Path, model: Path, steps: int) -> Path:
    cfg = {
        "run_name": "data-parallel", "base_model": str(model), "steps": steps, "groups_per_step": 2, "group_size": 4,
        "max_policy_lag": 0, "producer_workers": 0, "checkpoint_every": 2, "lora_rank": 4, "learning_rate": 0.05,
        "max_new_tokens": 6, "seed": 11, "environment": "tests.training.envs:make",
    }
    path = tmp_path / f"trainer-{steps}.json"
    path.write_text(json.dumps(cfg))
    return path


def _train(ranks: int, config: Path, run_dir: Path) -> str:
    args = ["-m", "training", "--config", str(config), "--run-dir", str(run_dir)]
    if ranks == 1:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("DAGSTER_PIPES_CONTEXT", None)
        proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout
    return _torchrun(ranks, *args)


def _losses(run_dir: Path) -> list[float]:
    return pd.read_parquet(run_dir / "metrics" / "steps.parquet").sort_values("step")["loss"].tolist()


def _adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint_path(run_dir, step) / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_resume_from_two_ranks_on_one_and_from_one_on_two(tmp_path: Path, tiny_model_dir: Path):
    half, whole = _config(tmp_path, tiny_model_dir, 2), _config(tmp_path, tiny_model_dir, 4)
    straight = tmp_path / "straight"
    _train(1, whole, straight)
    want = _losses(straight)
    assert len(want) == 4 and any(abs(x) > 1e-4 for x in want)
    for first, then in ((2, 1), (1, 2)):
        run_dir = tmp_path / f"ranks-{first}-then-{then}"
        out = _train(first, half, run_dir)
        assert ("2 trainer processes" in out) == (first == 2), out
        assert complete_steps(run_dir) == [0, 2]
        out = _train(then, whole, run_dir)
        assert "resumed from checkpoint 2" in out and ("2 trainer processes" in out) == (then == 2), out
        assert complete_steps(run_dir) == [0, 2, 4]
        assert _losses(run_dir) == pytest.approx(want, abs=1e-5), (first, then)
        # Adapters at the checkpoint and two steps after: apart by under 1% of how far the straight
        # run's moved in those two steps. Not elementwise: AdamW normalises each gradient element,
        # so one whose gradient is near zero moves by up to the learning rate either way on a
        # float-rounding difference of the summed shards (an element 3e-4 apart at the checkpoint of
        # a two-rank run whose losses were 1e-5 apart).
        start, final = _adapter(straight, 2), _adapter(straight, 4)
        moved = torch.cat([(final[k] - start[k]).flatten() for k in final]).norm()
        for step, want_at in ((2, start), (4, final)):
            got = _adapter(run_dir, step)
            differs = torch.cat([(got[k] - want_at[k]).flatten() for k in want_at]).norm()
            assert float(differs / moved) < 1e-2, (first, then, step, float(differs), float(moved))
        # one optimizer state, written once, whatever the number of processes
        assert sorted(p.name for p in checkpoint_path(run_dir, 4).glob("optimizer*")) == ["optimizer.pt"]


# -- the plan and the launch ------------------------------------------------------------------------

DENSE = {"name": "dense-7b", "weights_gib": 14.2, "full_attention_layers": 28, "kv_heads": 4, "head_dim": 128,
         "kv_dtype_bytes": 2}


def _plan(trainer: dict, collection_size: int = 48):
    from training.planner import resolve

    return resolve({"model": dict(DENSE), "inference": {"gpu": "h200", "max_context_length": 8192},
                    "trainer": trainer, "async": {"group_size": 8, "collection_size": collection_size}})


def test_the_planner_splits_the_step_across_the_trainer_replicas_or_says_why_not():
    from training.planner import PlanError

    assert "trainer_uneven_shards" not in _plan({"gpus": 8}).warning_codes()  # 48 sequences, 6 per GPU
    uneven = _plan({"gpus": 5}, collection_size=48)
    advice = next(w for w in uneven.warnings if w.code == "trainer_uneven_shards")
    assert "3 train 10 sequences a step and 2 train 9" in advice.message
    # megatron: 8 GPUs at tensor parallel 4 are two replicas of 24 sequences each
    assert "trainer_uneven_shards" not in _plan({"gpus": 8, "backend": "megatron", "tensor_parallel_size": 4}).warning_codes()
    with pytest.raises(PlanError, match=r"collection_size: a step's 8 sequences cannot keep 16 data-parallel"):
        _plan({"gpus": 16}, collection_size=8)
    with pytest.raises(PlanError, match=r"tensor_parallel_size: 3 does not divide the trainer's gpus \(8\)"):
        _plan({"gpus": 8, "backend": "megatron", "tensor_parallel_size": 3})
    with pytest.raises(PlanError, match=r"tensor_parallel_size: 2 with backend 'torch_peft'"):
        _plan({"gpus": 8, "tensor_parallel_size": 2})
    assert _plan({"gpus": 2}).trainer_config()["device"] == "cuda"  # every process on its GPU
    assert "device" not in _plan({}).trainer_config()


def test_the_trainer_job_and_the_local_launch_start_one_process_per_gpu(tmp_path: Path, monkeypatch):
    from training.planner import k8s, runner

    def trainer_command(plan):
        job = next(m for m in k8s.build_manifests(plan) if m["kind"] == "Job")
        return job["spec"]["template"]["spec"]["containers"][0]["command"]

    args = ["--config", "/etc/posttrain/resolved-plan.json", "--run-dir", "/run-data/runs/run"]
    assert trainer_command(_plan({"gpus": 8})) == [
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m", "training", *args]
    assert trainer_command(_plan({"gpus": 1})) == ["python", "-m", "training", *args]
    seen = []
    monkeypatch.setattr(runner, "trainer_is_built", lambda: True)
    monkeypatch.setattr(runner.subprocess, "call", lambda cmd, **kwargs: seen.append((cmd, kwargs)) or 0)
    runner.start_local(tmp_path / "plan.json", tmp_path, gpus=2)
    cmd, kwargs = seen[0]
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "training"]
    from sandboxes.httpserver.auth import CREDENTIAL_ENV, process_credential
    assert kwargs["env"][CREDENTIAL_ENV] == process_credential().value  # every rank is given the launcher's
