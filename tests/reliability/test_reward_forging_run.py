"""A real trainer run whose policy forges the reward: the two tricks that scored 1.0 on 1ec7686 with no
signal score 0 inside ``python -m training``, through :class:`training.episodes.HarnessRunner`, the
rollout store and the GRPO batch, and the run finishes.

- ``table``: the module answers the visible tests' inputs from a table (the agent saw every assert
  in its episode) and returns a constant anywhere else;
- ``forge``: the module, when imported for grading, writes the visible tests' values and a closing
  record to every pipe it can find (its own descriptors and its parent's through ``/proc``), then
  SIGKILLs its own process so that no other call is made;
- ``solve``: the reference fix, which must keep its 1.0 (so the groups have reward variance).

The policy is scripted (the attack is under test, not the model); the sandboxes (bubblewrap) and the
trainer process on a tiny random model are real. Each attack is written as the compact actions a
model would emit: line 1 of the module becomes ``exec(<the attacked module's source>)`` and every other
line is emptied, then ``commit``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.evals.test_call_checks import STREAM_FORGE
from tests.reliability.conftest import REPO
from tests.reliability.test_hostile_episodes import Scripted

ORDER = ("table", "forge", "solve")  # episode i of a group plays ORDER[i]


def _rewrite(task, source: str) -> str:
    """Compact actions that turn the task's module into ``source`` and commit it."""
    module = task.metadata["module_file"]
    count = len((Path(task.repo_path) / module).read_text().splitlines())
    lines = [f"replace {module}:1 exec({source!r})", *(f"replace {module}:{n} " for n in range(2, count + 1))]
    return "\n".join([*lines, "commit"]) + "\n"


def attacks(task) -> dict[str, str]:
    from evals.actions import demonstration
    from evals.call_checks import call_checks
    from evals.call_probe import encode

    base = (Path(task.repo_path) / task.metadata["module_file"]).read_text()
    visible = call_checks(task)
    table = {}
    for check in visible:
        table.setdefault(check.function, {})[check.args] = check.expected
    lookup = "".join(
        f"\n_answers_{f} = {answers!r}\n"
        f"def {f}(*args):\n    return _answers_{f}.get(repr(args), 0)\n"
        for f, answers in table.items())
    forged = {(c.function, c.args): encode(c.expected) for c in visible}
    forge = STREAM_FORGE.replace("{{", "{").replace("}}", "}").replace("{TABLE}", repr(forged))
    return {"table": _rewrite(task, base + lookup), "forge": _rewrite(task, base + forge),
            "solve": demonstration(task)[1]}


def forging_env(cfg, run_dir: Path):
    """The trainer's harness environment (real bwrap sandboxes, real grading) with the scripted forgers
    as its policy, on the suite's first RL task."""
    from transformers import AutoTokenizer

    from evals.bundled import default_sandbox_factory
    from training.curriculum import Curriculum
    from training.episodes import Environment, HarnessRunner, training_tasks

    tasks = training_tasks(cfg.tasks)
    task = tasks[sorted(tasks)[0]]
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    runner = HarnessRunner({task.id: task}, "http://127.0.0.1:9", tokenizer, default_sandbox_factory(), cfg,
                           episode_workers=2)
    runner.client = Scripted(tokenizer, attacks(task), ORDER)
    curriculum = Curriculum.from_pass_rates({task.id: 0.5}, seed=cfg.seed)
    return Environment(runner=runner, curriculum=curriculum, receivers=[], close=runner.close)


@pytest.fixture(scope="module")
def suite(rl_suite):
    return rl_suite


def test_table_and_stream_forge_episodes_score_zero_in_a_real_run(tmp_path: Path, suite):
    from serving.tiny import build_tiny_model
    from training.checkpoint import complete_steps

    model = build_tiny_model(tmp_path / "model")
    cfg = {
        "run_name": "reward-forging", "base_model": str(model), "steps": 2, "groups_per_step": 1,
        "group_size": len(ORDER), "max_policy_lag": 0, "producer_workers": 0, "checkpoint_every": 2, "lora_rank": 4,
        "max_new_tokens": 8, "max_turns": 2, "seed": 1, "tasks": str(suite), "reuse_grading": False,
        "environment": "tests.reliability.test_reward_forging_run:forging_env",
    }
    config = tmp_path / "trainer.json"
    config.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    done = subprocess.run([sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step    2" in done.stdout and complete_steps(run) == [0, 2]
    assert not (run / "logs" / "lost-episodes.jsonl").exists()
    conn = sqlite3.connect(run / "store" / "rollouts.sqlite")
    rows = conn.execute("SELECT rollout_id, reward, info, status FROM rollouts ORDER BY rollout_id").fetchall()
    conn.close()
    assert len(rows) == 2 * len(ORDER) and {r[3] for r in rows} == {"consumed"}
    for rollout_id, reward, info, _ in rows:
        play, info = ORDER[int(rollout_id.rsplit("-", 1)[-1])], json.loads(info)
        assert info["stop_reason"] == "commit" and info["grade_status"] == "graded", (play, info)
        if play == "solve":
            assert reward == 1.0 and info["score"] == 1.0, info
        else:
            assert reward == 0.0 and info["score"] == 0.0, (play, info)
        assert info["patch"], play  # kept for `posttrain audit`
