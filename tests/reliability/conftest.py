"""Shared helpers of the reliability tests: a tiny model, rollouts to store, and a tmpfs of a given
size for disk-full faults (mounted for real when this process may mount, else the test says why)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from serving.adapters import version_sort_key
from training.rollout import Rollout

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


class Scripted:
    """A policy that answers every call of session ``group/i`` with ``answers[order[i]]`` (SGLang's
    response shape, each token at ``logprob``): the play under test is scripted, not the model."""

    def __init__(self, tokenizer, answers: dict[str, str], order: tuple[str, ...], logprob: float = 0.0):
        self.ids = {name: tokenizer.encode(text, add_special_tokens=False) for name, text in answers.items()}
        self.order, self.logprob = order, logprob

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        ids = self.ids[self.order[int(str(rid).rsplit("/", 1)[-1]) % len(self.order)]]
        return {"output_ids": list(ids), "meta_info": {"output_token_logprobs": [[self.logprob, t, None] for t in ids]}}


def scripted_environment(cfg, plays, order: tuple[str, ...], logprob: float = 0.0):
    """The trainer's harness environment (:class:`training.episodes.HarnessRunner`, real bwrap
    sandboxes, real grading) on the suite's first RL task, whose policy plays ``plays(task)[order[i]]``
    in episode ``i`` of each group."""
    from transformers import AutoTokenizer

    from evals.bundled import default_sandbox_factory
    from training.curriculum import Curriculum
    from training.episodes import Environment, HarnessRunner, training_tasks

    tasks = training_tasks(cfg.tasks)
    task = tasks[sorted(tasks)[0]]
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    runner = HarnessRunner({task.id: task}, "http://127.0.0.1:9", tokenizer, default_sandbox_factory(), cfg,
                           episode_workers=2)
    runner.client = Scripted(tokenizer, plays(task), order, logprob)
    return Environment(runner=runner, curriculum=Curriculum.from_pass_rates({task.id: 0.5}, seed=cfg.seed),
                       receivers=[], close=runner.close)


def scripted_trainer_run(tmp_path: Path, suite: Path, environment: str, order: tuple[str, ...],
                         **settings) -> tuple[Path, str, dict[str, list[tuple[float, dict]]]]:
    """A real ``python -m training`` process on a tiny model: 2 steps of one group whose episode ``i``
    plays ``order[i]`` in ``environment`` (``module:function``). Checks that it ended at step 2 with
    its checkpoints and every rollout consumed; returns the run folder, what it printed, and each
    play's ``(reward, info)`` pairs."""
    import json
    import sqlite3
    import sys

    from serving.tiny import build_tiny_model
    from training.checkpoint import complete_steps

    cfg = {"run_name": "scripted", "base_model": str(build_tiny_model(tmp_path / "model")), "steps": 2,
           "groups_per_step": 1, "group_size": len(order), "max_policy_lag": 0, "producer_workers": 0,
           "checkpoint_every": 2, "lora_rank": 4, "max_new_tokens": 8, "max_turns": 2, "seed": 1,
           "tasks": str(suite), "environment": environment, **settings}
    config = tmp_path / "trainer.json"
    config.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    done = subprocess.run([sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step    2" in done.stdout and complete_steps(run) == [0, 2]
    conn = sqlite3.connect(run / "store" / "rollouts.sqlite")
    rows = conn.execute("SELECT rollout_id, reward, info, status FROM rollouts ORDER BY rollout_id").fetchall()
    conn.close()
    assert len(rows) == 2 * len(order) and {r[3] for r in rows} == {"consumed"}
    by_play: dict[str, list[tuple[float, dict]]] = {}
    for rollout_id, reward, info, _ in rows:
        by_play.setdefault(order[int(rollout_id.rsplit("-", 1)[-1])], []).append((reward, json.loads(info)))
    return run, done.stdout, by_play


def serves_newest(serving, newest: str) -> bool:
    """A replacement serves ``newest`` (the newest version published before it joined) or a later one:
    a version published while it joined may already have replaced it."""
    return any(version_sort_key(v) >= version_sort_key(newest) for v in serving)


def rollout(group_id: str, index: int, tokens: int = 64, adapter_step: int = 0, reward: float = 1.0) -> Rollout:
    return Rollout(f"{group_id}-{index}", group_id, "task", adapter_step, list(range(tokens)),
                   [0] + [1] * (tokens - 1), [0.0] + [-0.5] * (tokens - 1), reward)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.training.conftest import save_tiny_qwen

    return save_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen"))


def _can_mount() -> bool:
    return os.geteuid() == 0 and subprocess.run(["which", "mount"], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path):
    """A factory: ``small_disk(size_kib)`` mounts a tmpfs of that size and returns its path (root only)."""
    mounts: list[Path] = []

    def make(size_kib: int) -> Path:
        if not _can_mount():
            pytest.skip("mounting a small tmpfs needs root (the RLIMIT_FSIZE variant of this test still runs)")
        path = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield make
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
