"""A sandbox killed mid-command, and the model server gone mid-episode. Promise (evals/harness.py,
training/episodes.py): the episode ends as an infrastructure failure (no reward), it is retried, and it
is never scored as a model failure. The sandboxes are real (bubblewrap, SIGKILLed for real); the model
is scripted (the fault under test is not in the model)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time

import pytest

from evals.harness import run_episode
from evals.sandbox import platform_sandbox_factory

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from evals.bundled import build_suite
    from evals.tasks import load_bundled

    os.environ.setdefault("POSTTRAIN_SANDBOX_DIR", str(tmp_path_factory.mktemp("sandboxes")))
    out = tmp_path_factory.mktemp("suite") / "bundled"
    build_suite(out, per_level=1, extra_eval_per_level=0, workers=2)
    return load_bundled(out).tasks[0]


@pytest.fixture(scope="module")
def tokenizer():
    from serving.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


class Scripted:
    """Answers every call with fixed text (SGLang's response shape); stands in for the model."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.calls = 0

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        self.calls += 1
        return {"output_ids": list(self.ids), "meta_info": {"output_token_logprobs": [[0.0, t, None] for t in self.ids]}}


def sigkill_sandbox(box) -> None:
    """SIGKILL every process of the sandbox (its cgroup: bwrap, pxd inside, the command), as the OOM
    killer or a lost node would."""
    pids = box.cgroup.pids() if box.cgroup is not None else []
    for pid in [box.proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def killing_factory(kill_first: int, after_s: float = 0.5):
    """Real bwrap sandboxes; each of the first ``kill_first`` is SIGKILLed ``after_s`` after its first
    command starts (the whole sandbox process tree: bwrap and pxd inside it)."""
    real = platform_sandbox_factory("bwrap")
    opened = [0]

    @contextlib.contextmanager
    def factory(task):
        with real(task) as sb:
            opened[0] += 1
            if opened[0] <= kill_first:
                original = sb.exec

                def exec_then_die(command, **kw):
                    threading.Timer(after_s, sigkill_sandbox, args=(sb.sandbox,)).start()
                    return original(command, **kw)

                sb.exec = exec_then_die
            yield sb

    return factory, opened


def test_sandbox_sigkilled_mid_command_is_an_infra_error_not_a_score(task, tokenizer):
    factory, _ = killing_factory(kill_first=1)
    model = Scripted(tokenizer, '{"tool": "bash", "args": {"command": "sleep 30"}}')
    started = time.monotonic()
    traj = run_episode(task, model, tokenizer, factory, action_format="json", max_turns=2, grade=True)
    assert traj.stop_reason == "infra_error" and traj.infra_error
    assert traj.reward is None and traj.grade is None  # not scored: neither 0 nor 1
    assert "sandbox" in traj.error
    assert time.monotonic() - started < 25, "the dead sandbox was noticed, not waited out"


def test_harness_runner_retries_an_episode_whose_sandbox_died(task, tokenizer):
    """The producer's runner: the first sandbox is killed mid-command, the retry runs in a fresh one and
    the rollout carries a real grade of the committed work."""
    from evals.actions import demonstration
    from training.config import TrainConfig
    from training.episodes import HarnessRunner
    from training.loop import AdapterRef

    factory, opened = killing_factory(kill_first=1, after_s=0.0)
    cfg = TrainConfig(base_model="unused", max_turns=2)
    runner = HarnessRunner({task.id: task}, "http://127.0.0.1:9", tokenizer, factory, cfg, episode_workers=1)
    _, answer = demonstration(task)
    runner.client = Scripted(tokenizer, answer)
    try:
        rollouts = list(runner.run_group(task.id, AdapterRef(0, None, None), "g0", size=1, seed=0))
    finally:
        runner.close()
    assert len(rollouts) == 1 and rollouts[0].reward == 1.0 and rollouts[0].info["committed"]
    assert opened[0] >= 3  # the killed one, the retry's agent sandbox, its grading sandbox


def test_model_server_unreachable_is_an_infra_error(task, tokenizer):
    """A router that is restarting (nothing listens on its port): infra error, not a model failure."""
    from serving.client import EngineClient
    from serving.http import JsonServer

    gone = JsonServer({}, port=0)  # bind a free loopback port, then close it: nothing listens there
    port = gone.port
    gone.shutdown()
    traj = run_episode(task, EngineClient(f"http://127.0.0.1:{port}", timeout_s=5), tokenizer,
                       platform_sandbox_factory("bwrap"), max_turns=1)
    assert traj.stop_reason == "infra_error" and traj.reward is None and "unreachable" in traj.error


def test_a_call_the_engine_refuses_is_an_infra_error(task, tokenizer, tmp_path):
    """A replica that does not hold the episode's adapter version (it joined after the version was
    published) refuses the call with a 4xx: the episode is an infra error, not an exception that
    would stop the producer, and not a failure of the model."""
    from serving.client import EngineClient
    from serving.local_engine import LocalEngine
    from serving.http import serve
    from serving.tiny import build_tiny_model

    server = serve(LocalEngine(build_tiny_model(tmp_path / "model"), max_total_tokens=4096, torch_threads=1), port=0)
    try:
        traj = run_episode(task, EngineClient(server.url, timeout_s=30), tokenizer, platform_sandbox_factory("bwrap"),
                           max_turns=1, max_new_tokens=4, adapter_version="step_000009")
    finally:
        server.shutdown()
    assert traj.stop_reason == "infra_error" and traj.reward is None
    assert "400" in traj.error and "'step_000009' is not loaded" in traj.error, traj.error


def test_the_trainers_episodes_are_bounded_by_the_models_own_context(tmp_path, tokenizer):
    """An episode that outgrows the model stops and is graded (``stop_reason="context"``) rather
    than reaching the engine's refusal, an infrastructure error the policy could provoke to leave a
    failing attempt unscored: the trainer's runner takes the bound from the model folder."""
    import json

    from training.config import TrainConfig
    from training.episodes import HarnessRunner

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    runner = HarnessRunner({}, "http://127.0.0.1:9", tokenizer, None, TrainConfig(base_model=str(tmp_path)),
                           episode_workers=1)
    try:
        assert runner.context == {"max_context_tokens": 512}
    finally:
        runner.close()


def test_harness_runner_grades_an_identical_patch_once(task, tokenizer):
    """A group whose samples commit the same patch: every rollout carries the real grade, and the
    grading sandbox opens once for the group (with ``reuse_grading`` off, once per sample)."""
    from evals.actions import demonstration
    from training.config import TrainConfig
    from training.episodes import HarnessRunner
    from training.loop import AdapterRef

    _, answer = demonstration(task)
    opened = {}
    for reuse in (True, False):
        factory, count = killing_factory(kill_first=0, after_s=0.0)
        cfg = TrainConfig(base_model="unused", max_turns=2, reuse_grading=reuse)
        runner = HarnessRunner({task.id: task}, "http://127.0.0.1:9", tokenizer, factory, cfg, episode_workers=1)
        runner.client = Scripted(tokenizer, answer)
        try:
            rollouts = list(runner.run_group(task.id, AdapterRef(0, None, None), "g0", size=3, seed=0))
        finally:
            runner.close()
        assert [r.reward for r in rollouts] == [1.0, 1.0, 1.0]
        opened[reuse] = count[0]
    # the grading ones and one answering the task's hidden inputs; no agent sandbox: the samples only
    # edit and commit, which the harness keeps on the host (evals.harness.HostEdits)
    assert opened == {True: 1 + 1, False: 3 + 1}
