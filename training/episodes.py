"""The environment of an RL run: engine replicas, and groups of agent episodes on tasks.

:func:`make_environment` starts what the trainer needs around it. With ``environment = "harness"``
(the default): the training tasks (``split = "train"``) of the task source, ``replicas`` engine
processes (``python -m serving.engine`` on loopback, each serving the base model and the published
adapter versions), and a :class:`HarnessRunner` that runs each episode through the evals agent harness
(:func:`evals.harness.run_episode`: the model acts in a sandbox, its committed work is graded by the
task's tests). ``environment = "module:function"`` names another factory with the same signature
(tests use one).

A trajectory becomes a :class:`~training.rollout.Rollout` from the exact token ids the engine returned:
the sequence is the last call's input plus its output (each call's context extends the previous one
by its output and the observation's tokens), the loss mask covers every call's output tokens, and the
logprobs are the engine's. An episode lost to a sandbox failure is retried, never scored as a failure.
"""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from training.config import TrainConfig
from training.curriculum import Curriculum
from training.loop import AdapterRef, GroupRunner
from training.rollout import Rollout

INFRA_RETRIES = 2
INFRA_RETRY_WAIT_S = 2.0


@dataclass
class Environment:
    runner: GroupRunner
    curriculum: Curriculum
    receivers: list[str] = field(default_factory=list)  # replica URLs the publisher pushes to
    close: Callable[[], None] = lambda: None


def rollout_from_trajectory(traj: Any, group_id: str, adapter: AdapterRef, reward: float) -> Rollout:
    calls = traj.calls
    if not calls:
        raise ValueError(f"episode {traj.session_id}: no model call to train on")
    ids = list(calls[-1].input_ids) + list(calls[-1].output_ids)
    mask = [0] * len(ids)
    logprobs = [0.0] * len(ids)
    for call in calls:
        start = len(call.input_ids)
        if ids[:start] != list(call.input_ids) or len(call.output_logprobs) != len(call.output_ids):
            raise ValueError(f"episode {traj.session_id}: call contexts do not extend each other")
        for j, (tok, lp) in enumerate(zip(call.output_ids, call.output_logprobs)):
            assert ids[start + j] == tok
            mask[start + j] = 1
            logprobs[start + j] = lp
    return Rollout(
        rollout_id=f"{group_id}-{traj.session_id.rsplit('/', 1)[-1]}", group_id=group_id, task_id=traj.task_id,
        adapter_version=adapter.version, input_ids=ids, loss_mask=mask, serving_logprobs=logprobs, reward=reward,
        info={"stop_reason": traj.stop_reason, "turns": len(calls), "committed": traj.committed,
              "agent_s": traj.agent_s, "grade_s": traj.grade_s},
    )


class HarnessRunner:
    """Groups of episodes through the evals harness against an engine URL."""

    def __init__(self, tasks: dict[str, Any], engine_url: str, tokenizer: Any, sandbox_factory: Any,
                 cfg: TrainConfig, episode_workers: int = 4) -> None:
        from evals.harness import HttpClient

        self.tasks = tasks
        self.client = HttpClient(engine_url)
        self.tokenizer = tokenizer
        self.sandbox_factory = sandbox_factory
        self.cfg = cfg
        self.pool = ThreadPoolExecutor(max_workers=episode_workers, thread_name_prefix="episode")

    def episode(self, task_id: str, adapter: AdapterRef, group_id: str, index: int, seed: int) -> Rollout:
        from evals.harness import run_episode

        task = self.tasks[task_id]
        for retry in range(INFRA_RETRIES + 1):
            if retry:
                time.sleep(INFRA_RETRY_WAIT_S * retry)  # give a restarting router or a dead sandbox's node time
            traj = run_episode(
                task, self.client, self.tokenizer, self.sandbox_factory, adapter_version=adapter.name,
                session_id=f"{group_id}/{index}", action_format="compact", max_turns=self.cfg.max_turns,
                max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                seed=seed + 7919 * index + 104729 * retry,
            )
            if not traj.infra_error:
                return rollout_from_trajectory(traj, group_id, adapter, float(traj.reward or 0.0))
        raise RuntimeError(f"task {task_id}: {INFRA_RETRIES + 1} attempts failed in the sandbox: {traj.error}")

    def run_group(self, task_id: str, adapter: AdapterRef, group_id: str, size: int, seed: int) -> Iterator[Rollout]:
        futures = [self.pool.submit(self.episode, task_id, adapter, group_id, i, seed) for i in range(size)]
        for fut in as_completed(futures):
            yield fut.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model: str, log_path: Path, torch_threads: int = 1,
                 timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """One engine replica as a local process; returns it and its URL once it answers /health.

    It starts on the base model alone: the trainer pushes the adapter version it resumes from."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.engine", "--model", model, "--port", str(port),
         "--torch-threads", str(torch_threads)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    from serving.client import EngineClient

    client = EngineClient(url, timeout_s=5)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine replica exited with {proc.returncode}; see {log_path}")
        if client.health():
            return proc, url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"engine replica on {url} did not become healthy in {timeout_s:.0f}s; see {log_path}")


def load_curriculum(cfg: TrainConfig, task_ids: list[str]) -> Curriculum:
    """The curriculum from ``cfg.curriculum`` (the ``difficulty_curriculum`` asset's file), else every
    training task at an unknown pass rate (0.5)."""
    if cfg.curriculum:
        path = Path(cfg.curriculum)
        if not path.is_file():
            raise FileNotFoundError(f"trainer config key 'curriculum': {path} is missing")
        data = json.loads(path.read_text())
        rates = data.get("pass_rates") if isinstance(data, dict) else None
        if not isinstance(rates, dict):
            raise ValueError(f"curriculum {path}: expected an object with key 'pass_rates'")
        unknown = sorted(set(rates) - set(task_ids))
        if unknown:
            raise ValueError(f"curriculum {path}: task {unknown[0]!r} is not a training task of {cfg.tasks}")
        return Curriculum.from_pass_rates(rates, seed=cfg.seed, **data.get("settings", {}))
    return Curriculum.from_pass_rates({t: 0.5 for t in task_ids}, seed=cfg.seed)


def training_tasks(source: str) -> dict[str, Any]:
    """The ``train`` split of ``source``: a built bundled suite folder is read as it is (the
    ``task_dataset`` asset built it); anything else goes through the evals loaders."""
    from evals.bundled import default_suite_dir
    from evals.tasks import load_bundled, load_tasks

    path = Path(source) if source else default_suite_dir()
    if (path / "suite.json").is_file():
        task_set = load_bundled(path)
    elif not path.exists():
        raise FileNotFoundError(f"trainer config key 'tasks': {path} does not exist (materialize task_dataset first)")
    else:
        task_set = load_tasks(path)
    tasks = {t.id: t for t in task_set.tasks if t.split == "train"}
    if not tasks:
        raise ValueError(f"task source {source or 'bundled suite'}: no task with split 'train'")
    return tasks


def harness_environment(cfg: TrainConfig, run_dir: Path) -> Environment:
    from transformers import AutoTokenizer

    from evals.bundled import default_sandbox_factory

    tasks = training_tasks(cfg.tasks)
    proc, url = start_engine(cfg.base_model, run_dir / "logs" / "engine-0.log")
    runner = HarnessRunner(tasks, url, AutoTokenizer.from_pretrained(cfg.base_model), default_sandbox_factory(), cfg)

    def close() -> None:
        runner.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()

    return Environment(runner=runner, curriculum=load_curriculum(cfg, sorted(tasks)), receivers=[url], close=close)


def make_environment(cfg: TrainConfig, run_dir: Path) -> Environment:
    if cfg.environment == "harness":
        return harness_environment(cfg, Path(run_dir))
    module_name, _, func = cfg.environment.partition(":")
    if not func:
        raise ValueError(f"trainer config key 'environment': {cfg.environment!r} is neither 'harness' nor 'module:function'")
    return getattr(importlib.import_module(module_name), func)(cfg, Path(run_dir))
