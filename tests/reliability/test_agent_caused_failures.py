"""Failures an agent causes inside its own sandbox are its 0, never an infrastructure error: a fork
bomb or a memory hog started by its command or by its tests, on bubblewrap and on gVisor, ends the
episode as ``agent_fault`` with zero scores and the evidence (the runtime's exit status, what the
sandbox's cgroup counted), and the trainer's runner does not retry it. The other side of the line:
a sandbox that cannot start (no such image, no runtime) and gVisor's kernel killed from the host stay
infrastructure errors. Promise: evals/harness.py, evals/sandbox.py, sandboxes/runtimes.py.

The sandboxes, their limits, the grading and the runner are real; the policy is scripted (the
attack is what is under test, not the model)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import threading
from pathlib import Path

import pytest

from evals.harness import run_episode
from evals.sandbox import platform_sandbox_factory
from sandboxes.cgroups import Cgroup

RUNTIMES = [
    pytest.param("bwrap", marks=pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")),
    pytest.param("gvisor", marks=pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc not installed")),
]

# every process forks until the sandbox's process limit refuses, then keeps trying: the limit stays
# reached. In a session of its own, so the end of the command that started it does not end it.
FORK_BOMB = ("import os, time\n"
             "while True:\n"
             "    try:\n"
             "        os.fork()\n"
             "    except OSError:\n"
             "        time.sleep(0.05)\n")
START_FORK_BOMB = f"setsid python3 -c {shlex.quote(FORK_BOMB)} >/dev/null 2>&1 </dev/null & sleep 3; echo started"
MEMORY_HOG = "python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 20))'"
# tmpfs pages belong to no process, so the OOM killer cannot free them: everything in the sandbox goes
FILL_TMPFS = "head -c 250M /dev/zero > /tmp/fill; head -c 250M /dev/zero > $HOME/fill; echo filled"


def bash(command: str) -> dict:
    return {"tool": "bash", "args": {"command": command}}


def answer(*calls: dict) -> str:
    return "\n".join(json.dumps(call) for call in calls)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from evals.bundled import build_suite
    from evals.tasks import load_bundled, rl_tasks

    os.environ.setdefault("POSTTRAIN_SANDBOX_DIR", str(tmp_path_factory.mktemp("sandboxes")))
    out = tmp_path_factory.mktemp("suite") / "bundled"
    build_suite(out, per_level=1, rl_per_level=1, extra_eval_per_level=0, workers=2)
    return sorted(rl_tasks(load_bundled(out).tasks), key=lambda t: t.id)[0]


@pytest.fixture(scope="module")
def tokenizer():
    from serving.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


class Scripted:
    """Answers every call with the same text (SGLang's response shape); stands in for the model."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer.encode(text, add_special_tokens=False)

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        return {"output_ids": list(self.ids), "meta_info": {"output_token_logprobs": [[0.0, t, None] for t in self.ids]}}


def counting(factory):
    """``factory`` that counts the sandboxes it opened."""
    opened = [0]

    @contextlib.contextmanager
    def count(task):
        opened[0] += 1
        with factory(task) as box:
            yield box

    return count, opened


def episode(task, tokenizer, text: str, factory, max_turns: int = 2):
    return run_episode(task, Scripted(tokenizer, text), tokenizer, factory, session_id="g/0", action_format="json",
                       max_turns=max_turns)


def with_memory(task, memory_mb: int):
    return dataclasses.replace(task, limits=dataclasses.replace(task.limits, memory_mb=memory_mb))


def assert_agents_zero(traj, label: str) -> None:
    assert not traj.infra_error, traj.error
    assert traj.stop_reason == label, (traj.stop_reason, traj.error)
    assert traj.reward == 0.0 and traj.grade.status == "agent_fault"
    assert traj.grade.detail.startswith(label)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_fork_bomb_left_running_by_a_command_is_the_agents_zero(task, tokenizer, runtime):
    """bwrap: the bomb holds the sandbox at its process limit, so pxd cannot start the next command
    (it answered a refusal: an infra error before). gVisor: gVisor's kernel cannot make a thread
    and exits with status 2 (an infra error before, retried and then the group dropped)."""
    factory, opened = counting(platform_sandbox_factory(runtime))
    traj = episode(task, tokenizer, answer(bash(START_FORK_BOMB), bash("echo still here"), {"tool": "commit"}), factory)
    assert_agents_zero(traj, "agent_pids_limit")
    assert "pids.max refused" in traj.grade.detail and "process limit" in traj.grade.detail
    if runtime == "gvisor":
        assert "the gvisor runtime exited with code" in traj.grade.detail
    assert opened[0] == 1  # the agent's sandbox only: no grading sandbox, no retry


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
def test_fork_bomb_still_running_when_the_committed_work_is_read_is_the_agents_zero(task, tokenizer):
    """bwrap: the bomb's command answered and the agent's last action is an edit (pxd writes it, no
    fork); the episode ends at its last turn and reading the committed patch cannot start git.
    The sandbox's failure is the agent's though no command of its was running then."""
    module = task.metadata["module_file"]
    text = answer(bash(START_FORK_BOMB), {"tool": "write_file", "args": {"path": module, "content": "x = 1\n"}})
    traj = episode(task, tokenizer, text, platform_sandbox_factory("bwrap"), max_turns=1)
    assert [s.action["tool"] for s in traj.steps] == ["bash", "write_file"]
    assert_agents_zero(traj, "agent_pids_limit")
    assert "could not start a command" in traj.grade.detail


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_fork_bomb_in_the_agents_tests_is_the_agents_zero(task, tokenizer, runtime):
    """The agent's module starts the bomb when the tests import it; the agent runs ``test``, then
    commits."""
    module = task.metadata["module_file"]
    source = (Path(task.repo_path) / module).read_text()
    bomb = ("import subprocess, time\n"
            f"subprocess.Popen(['python3', '-c', {FORK_BOMB!r}], start_new_session=True,\n"
            "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "time.sleep(3)  # the bomb reaches the limit while the tests run\n")
    text = answer({"tool": "write_file", "args": {"path": module, "content": bomb + source}}, {"tool": "test"},
                  {"tool": "commit"})
    traj = episode(task, tokenizer, text, platform_sandbox_factory(runtime))
    assert_agents_zero(traj, "agent_pids_limit")
    assert [s.action["tool"] for s in traj.steps][:2] == ["write_file", "test"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_memory_hog_in_a_command_is_the_agents_zero(task, tokenizer, runtime):
    """bwrap: the OOM killer ends the hog, the sandbox lives on and the episode is graded (0: nothing
    fixed). gVisor: the memory limit covers gVisor's kernel, which the OOM killer ends; runsc exits
    137, and the cgroup shows the OOM kill at the limit (before: a guess from the exit status,
    ``agent_killed_sandbox``, which a SIGKILL from the host gave as well)."""
    small = with_memory(task, 256)
    traj = episode(small, tokenizer, answer(bash(MEMORY_HOG), bash("echo still here"), {"tool": "commit"}),
                   platform_sandbox_factory(runtime))
    if runtime == "bwrap":
        assert traj.stop_reason == "commit" and not traj.infra_error
        assert traj.steps[0].observation.startswith("exit 137")  # the hog, killed; pxd answered
        assert traj.reward == 0.0 and traj.grade.status == "graded"
    else:
        assert_agents_zero(traj, "agent_memory_limit")
        assert "the OOM killer ended" in traj.grade.detail and "exited with code 137" in traj.grade.detail


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_filling_tmpfs_past_the_memory_limit_is_the_agents_zero(task, tokenizer, runtime):
    """``/tmp`` and ``$HOME`` are tmpfs counted as the sandbox's memory: filled past its limit, the
    OOM killer ends everything it can, pxd (bwrap) or gVisor's kernel included."""
    small = with_memory(task, 200)
    traj = episode(small, tokenizer, answer(bash(FILL_TMPFS), bash("echo still here"), {"tool": "commit"}),
                   platform_sandbox_factory(runtime))
    assert_agents_zero(traj, "agent_memory_limit")
    assert "memory limit" in traj.grade.detail


def test_the_trainers_runner_scores_a_fork_bomb_without_retrying_it(task, tokenizer):
    """training/episodes.py: an infra error is retried and, when it persists, drops the episode's
    group (training/loop.py). A fork bomb the agent's module starts when its tests import it is the
    agent's 0: one rollout with reward 0, one sandbox (no retry, no grading sandbox)."""
    from training.config import TrainConfig
    from training.episodes import HarnessRunner
    from training.loop import AdapterRef

    factory, opened = counting(platform_sandbox_factory("bwrap"))
    runner = HarnessRunner({task.id: task}, "http://127.0.0.1:9", tokenizer, factory,
                           TrainConfig(base_model="unused", max_turns=2), episode_workers=1)
    # the compact format the trainer uses has no bash: the bomb is a statement on the module's first
    # line (its first function joined onto line 2), started when ``test`` imports it
    module = task.metadata["module_file"]
    lines = (Path(task.repo_path) / module).read_text().splitlines()
    bomb = (f"import subprocess; subprocess.Popen(['python3', '-c', {FORK_BOMB!r}], start_new_session=True, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); import time; time.sleep(3)")
    runner.client = Scripted(tokenizer, f"replace {module}:1 {bomb}\nreplace {module}:2 {lines[0]} {lines[1].strip()}\n"
                                        "test\ncommit\n")
    try:
        rollouts = list(runner.run_group(task.id, AdapterRef(0, None, None), "g0", size=1, seed=0))
    finally:
        runner.close()
    assert len(rollouts) == 1 and rollouts[0].reward == 0.0
    assert rollouts[0].info["stop_reason"] == "agent_pids_limit"
    assert opened[0] == 1


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_sandbox_that_cannot_start_stays_an_infra_error(task, tokenizer, runtime, monkeypatch):
    """Outside the sandbox: an image that is not in the store, and a runtime that is not installed
    (``PATH`` without it), are infra errors with no reward, before any agent code ran."""
    ghost = dataclasses.replace(task, repo_path=None, image="ghost-image-that-was-never-built")
    traj = episode(ghost, tokenizer, answer(bash(START_FORK_BOMB)), platform_sandbox_factory(runtime))
    assert traj.stop_reason == "infra_error" and traj.reward is None and traj.grade is None
    assert "no image 'ghost-image-that-was-never-built'" in traj.error

    monkeypatch.setenv("PATH", "/nonexistent")
    traj = episode(task, tokenizer, answer(bash("echo hi")), platform_sandbox_factory(runtime))
    assert traj.stop_reason == "infra_error" and traj.reward is None and traj.grade is None
    assert "did not start" in traj.error or "not installed" in traj.error


@pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc not installed")
def test_gvisors_kernel_killed_from_the_host_stays_an_infra_error(task, tokenizer):
    """The sandbox's processes on the host (gVisor's kernel, its gofer, its stubs) SIGKILLed from
    outside, as a host's OOM killer or an operator would, while ``runsc run`` lives: runsc exits
    137 with no OOM kill at the sandbox's limit. Nothing inside can send that, so it is the host's:
    an infra error (before: ``agent_killed_sandbox``, from the exit status alone)."""
    real = platform_sandbox_factory("gvisor")

    def kill_the_sandbox(box) -> None:
        for pid in Cgroup.existing(box.id).pids():  # the cgroup runsc put its sandbox in
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @contextlib.contextmanager
    def factory(t):
        with real(t) as sb:
            original = sb.exec

            def exec_then_die(command, **kw):
                threading.Timer(1.0, kill_the_sandbox, args=(sb.sandbox,)).start()
                return original(command, **kw)

            sb.exec = exec_then_die
            yield sb

    traj = episode(task, tokenizer, answer(bash("sleep 30")), factory)
    assert traj.stop_reason == "infra_error" and traj.reward is None and traj.grade is None, traj.error
    assert "exited with code 137" in traj.error and "sent from the host" in traj.error
