"""A posttrain home with a real run and real evals for the viewer to read.

Every episode is real: a bundled task built and validated for real, actions run in bubblewrap
sandboxes, committed work graded by running the task's tests in a fresh sandbox. A scripted policy
stands in for the model (a trained model cannot run here); it answers in the tiny tokenizer's tokens
with logprob 0. The rollouts go into the run's store through ``training.store.RolloutStore`` (and
the step takes them with ``take_groups``), the attempts into Parquet through ``evals.evaluate``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

RUN = "r"
WRONG_MARK = "# checked, unchanged"


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


def wrong_answer(task) -> str:
    """An edit that applies and commits but fixes nothing: the first buggy line, a comment added."""
    path, line, _ = task.metadata["reference_edits"][0]
    original = str(task.metadata["source_text"]).split("\n")[int(line) - 1]
    return f"replace {path}:{line} {original}  {WRONG_MARK}\ncommit\n"


def right_answer(task) -> str:
    from evals.actions import demonstration

    return demonstration(task)[1]


class ScriptedPolicy:
    """Answers each episode (by its session id) with the text ``answer(session_id)`` gives, in the
    engine's response shape, every token at logprob 0."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        text = self.answer(rid or "")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"text": text, "output_ids": ids,
                "meta_info": {"output_token_logprobs": [[0.0, t, None] for t in ids]}}


@pytest.fixture(scope="session")
def viewer_home(tmp_path_factory):
    """``(home, facts)``: run ``r`` (step 0 checkpoint naming the tokenizer's folder, two groups taken
    by step 1: one solved once of twice, one never; two step rows) and evals of ``r-step_000000``
    (every attempt wrong) and ``r-step_000001`` (attempt 0 right, attempt 1 wrong) on two tasks, and a
    flawed list naming the second task."""
    from evals.bundled import build_suite, default_sandbox_factory
    from evals.evaluate import evaluate, write_rows
    from evals.harness import run_episode
    from evals.tasks import load_bundled
    from serving.tiny import build_tiny_tokenizer
    from training.checkpoint import metrics_dir, run_path, store_path, write_checkpoint
    from training.episodes import rollout_from_trajectory
    from training.loop import AdapterRef
    from training.metrics import MetricsWriter
    from training.store import RolloutStore

    root = tmp_path_factory.mktemp("viewer")
    home = root / "home"
    suite = root / "suite"
    build_suite(suite, per_level=1, extra_eval_per_level=0, workers=2)
    tasks = [t for t in load_bundled(suite).tasks if t.metadata.get("reference_edits")][:2]
    assert len(tasks) == 2, "the bundled suite gives two tasks with a reference solution"
    tokenizer = build_tiny_tokenizer()
    tok_dir = root / "tokenizer"
    tokenizer.save_pretrained(tok_dir)
    factory = default_sandbox_factory()

    run_dir = run_path(home, RUN)
    write_checkpoint(run_dir, 0, lambda tmp: None, {"base_model": str(tok_dir), "adapter": None})
    store = RolloutStore(store_path(run_dir))
    adapter = AdapterRef(0, None, None)
    rollouts = {}
    for g, (task, answers) in enumerate(((tasks[0], [right_answer, wrong_answer]), (tasks[1], [wrong_answer] * 2))):
        group_id = f"g{g}"
        store.add_group(group_id, task.id, 0, len(answers))
        for i, answer in enumerate(answers):
            policy = ScriptedPolicy(tokenizer, lambda rid, a=answer, t=task: a(t))
            traj = run_episode(task, policy, tokenizer, factory, session_id=f"{group_id}/{i}", max_turns=2,
                               max_new_tokens=256)
            rollout = rollout_from_trajectory(traj, group_id, adapter, float(traj.reward or 0.0))
            store.put(rollout)
            rollouts[rollout.rollout_id] = rollout
    take = store.take_groups(2, step=1, min_adapter_step=0)
    assert len(take.groups) == 2
    store.close()
    writer = MetricsWriter(metrics_dir(run_dir))
    now = time.time()
    for step in (1, 2):
        writer.record({"step": step, "time_s": now + 10 * step, "loss": 0.1 / step, "reward_mean": 0.25 * step,
                       "solve_rate": 0.25 * step, "groups": 2, "zero_variance_groups": 1, "discarded_samples": 0,
                       "policy_age_mean": 0.0, "policy_age_max": 0, "wait_s": 4.0, "train_s": 1.5,
                       "useful_tokens_per_s": 100.0, "useful_tokens": 550, "consumed_tokens": 1000, "discarded_tokens": 0,
                       "samples": 4, "discarded_groups": 0}, [])
    (run_dir / "resolved-plan.json").write_text(json.dumps({"trainer": {"steps": 6, "base_model": str(tok_dir)}}))

    def answers_for(checkpoint):
        def answer(rid: str) -> str:
            _, task_id, attempt, _ = rid.split("/")
            task = next(t for t in tasks if t.id == task_id)
            right = checkpoint.endswith("step_000001") and attempt == "0" and task is tasks[0]
            return right_answer(task) if right else wrong_answer(task)
        return answer

    for checkpoint in ("r-step_000000", "r-step_000001"):
        rows = evaluate(tasks, ScriptedPolicy(tokenizer, answers_for(checkpoint)), tokenizer, factory,
                        checkpoint=checkpoint, attempts=2, max_turns=2, max_new_tokens=256)
        write_rows(rows, home / "evals" / "deepswe" / checkpoint / "run-1.parquet")
    flawed = home / "datasets" / "flawed"
    flawed.mkdir(parents=True)
    (flawed / "audit.jsonl").write_text(json.dumps({"id": tasks[1].id, "reason": "under-specified", "source": "test"}) + "\n")
    facts = {"tasks": [t.id for t in tasks], "rollouts": rollouts, "tokenizer_dir": tok_dir}
    return home, facts


@pytest.fixture
def served(viewer_home):
    """The viewer over ``viewer_home``, served by uvicorn on a free loopback port: its base URL."""
    from viewer.app import serve_in_thread

    home, _ = viewer_home
    with serve_in_thread(home) as url:
        yield url
