"""Attacks on the trainer process itself, each once a real failure: a second trainer on the run
directory (both resumed, rewound the store under each other and then waited forever), a damaged newest
checkpoint (resume stopped with an error naming no file), a full disk under the rollout store (an error
naming no path), episodes lost to the infrastructure (the first one stopped the run), a wait for
groups that never come (forever, silently). The trainers are real processes on a tiny random model
(``tests.training.envs``); the environments below wrap that one with the fault under test."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.reliability.conftest import rollout, small_disk  # noqa: F401 (a fixture)
from training.checkpoint import CheckpointLoadError, complete_steps
from training.config import TrainConfig
from training.curriculum import Curriculum
from training.loop import AdapterRef, EpisodeInfraError, Producer, RunDirInUse, RunState, TakeTimeout
from training.rollout import Rollout
from training.store import RolloutStore, StoreWriteError

REPO = Path(__file__).resolve().parents[2]
ENV = "tests.training.test_hostile_trainer"


# -- environments the trainer process loads (``environment = "tests.training.test_hostile_trainer:..."``)

def pausing_env(cfg: TrainConfig, run_dir: Path):
    """The tiny-engine environment; before producing step ``$HOSTILE_PAUSE_AT`` it prints
    ``PAUSED <step>`` and waits until the file ``$HOSTILE_RESUME_FILE`` exists."""
    from tests.training.envs import make
    import training.loop as loop

    pause_at, resume = int(os.environ["HOSTILE_PAUSE_AT"]), Path(os.environ["HOSTILE_RESUME_FILE"])
    real = loop.Producer.produce_step

    def produce_step(self, step, round=0, count=None):
        if step == pause_at and round == 0:
            print(f"PAUSED {step}", flush=True)
            while not resume.exists():
                time.sleep(0.05)
        return real(self, step, round, count)

    loop.Producer.produce_step = produce_step
    return make(cfg, run_dir)


class LosingRunner:
    """The tiny-engine runner, except that the episodes named in ``$HOSTILE_LOSE`` (``group/index``
    comma-separated, or ``all``) fail in the infrastructure, as a dead sandbox does after its retries."""

    def __init__(self, real, lose: str) -> None:
        self.real, self.lose = real, lose

    def run_group(self, task_id: str, adapter: AdapterRef, group_id: str, size: int, seed: int) -> Iterator[Rollout]:
        lost = []
        for i, r in enumerate(self.real.run_group(task_id, adapter, group_id, size, seed)):
            if self.lose == "all" or f"{group_id}/{i}" in self.lose.split(","):
                lost.append(EpisodeInfraError(task_id, group_id, i, 3, "sandbox pt-x: the daemon is gone"))
                continue
            yield r
        if lost:
            lost[0].lost = lost
            raise lost[0]


def losing_env(cfg: TrainConfig, run_dir: Path):
    from tests.training.envs import make

    env = make(cfg, run_dir)
    env.runner = LosingRunner(env.runner, os.environ["HOSTILE_LOSE"])
    return env


# -- helpers

def _config(tmp_path: Path, model: Path, name: str = "trainer.json", **overrides) -> Path:
    cfg = {
        "run_name": "hostile", "base_model": str(model), "steps": 3, "groups_per_step": 2, "group_size": 2,
        "max_policy_lag": 0, "producer_workers": 0, "checkpoint_every": 1, "lora_rank": 4, "learning_rate": 0.05,
        "max_new_tokens": 4, "seed": 3, "environment": "tests.training.envs:make", **overrides,
    }
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    env.pop("DAGSTER_PIPES_CONTEXT", None)
    return env


def _trainer(config: Path, run_dir: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run_dir)],
                          cwd=REPO, env=_env(**extra), capture_output=True, text=True, timeout=600)


def _consumed_steps(run_dir: Path) -> dict[str, set[int]]:
    conn = sqlite3.connect(run_dir / "store" / "rollouts.sqlite")
    try:
        out: dict[str, set[int]] = {}
        for gid, step in conn.execute("SELECT group_id, status_step FROM rollouts WHERE status='consumed'"):
            out.setdefault(gid, set()).add(step)
        return out
    finally:
        conn.close()


# -- one trainer per run directory

def test_second_trainer_on_a_run_directory_is_refused_and_the_first_is_unaffected(tmp_path: Path, tiny_model_dir: Path):
    config = _config(tmp_path, tiny_model_dir, environment=f"{ENV}:pausing_env")
    run, resume = tmp_path / "run", tmp_path / "resume-now"
    first = subprocess.Popen([sys.executable, "-m", "training", "--config", str(config), "--run-dir", str(run)],
                             cwd=REPO, env=_env(HOSTILE_PAUSE_AT="2", HOSTILE_RESUME_FILE=str(resume)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    try:
        assert first.stdout is not None
        for line in first.stdout:  # step 1 is trained and checkpointed; the first trainer waits in step 2
            out.append(line)
            if line.startswith("PAUSED 2"):
                break
        assert complete_steps(run) == [0, 1], "".join(out)
        second = _trainer(config, run, HOSTILE_PAUSE_AT="-1", HOSTILE_RESUME_FILE=str(resume))
        assert second.returncode != 0
        assert f"pid {first.pid}" in second.stderr and str(run) in second.stderr, second.stderr
        assert "RunDirInUse" in second.stderr and "run directory" in second.stderr
        assert "step 0 of" not in second.stdout and "resumed" not in second.stdout  # refused before resuming
        resume.write_text("go")
        rest = first.stdout.read()
        assert first.wait(timeout=600) == 0, "".join(out) + rest
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert complete_steps(run) == [0, 1, 2, 3]
    steps = _consumed_steps(run)
    assert all(len(s) == 1 for s in steps.values()), "a group was taken by two steps"
    assert sorted(st for s in steps.values() for st in s) == [1, 1, 2, 2, 3, 3]
    assert (run / "trainer.lock").read_text().strip() == str(first.pid)


def test_run_state_takes_the_lock_and_take_times_out_saying_what_it_waited_for(tmp_path: Path, tiny_model_dir: Path):
    """In one process: a second RunState on the same folder is refused; ``take`` with nothing
    produced raises after its timeout, naming the step, the groups wanted and ready, and the producers."""
    cfg = TrainConfig.from_mapping(json.loads(_config(tmp_path, tiny_model_dir).read_text()))
    curriculum = Curriculum.from_pass_rates({"count-a": 0.5}, seed=0)
    state = RunState(cfg, tmp_path / "run", curriculum)
    try:
        with pytest.raises(RunDirInUse, match=f"pid {os.getpid()}"):
            RunState(cfg, tmp_path / "run", curriculum)
        state.store.add_group("g-half", "count-a", 0, 2)
        state.store.put(rollout("g-half", 0))  # one of two episodes: not a whole group
        with pytest.raises(TakeTimeout) as err:
            state.take(1, timeout_s=0.3, producers_alive=lambda: 0)
        message = str(err.value)
        assert "step 1" in message and "2 whole groups" in message and "0 taken" in message
        assert "0 more complete" in message and "producers alive: 0" in message and "take_timeout_s" in message
    finally:
        state.lock.release()
    RunState(cfg, tmp_path / "run", curriculum).lock.release()  # released: the next trainer may open it


def test_a_group_in_flight_keeps_its_adapter_version_from_being_unloaded(tmp_path: Path, tiny_model_dir: Path):
    """While a group's episodes run, its version is in the set the publisher will not unload (vLLM
    unloads an adapter even while an episode waits between turns); afterwards it is not."""
    cfg = TrainConfig.from_mapping(json.loads(_config(tmp_path, tiny_model_dir).read_text()))
    state = RunState(cfg, tmp_path / "run", Curriculum.from_pass_rates({"count-a": 0.5}, seed=0))
    seen: list[set[str]] = []

    class Runner:
        def run_group(self, task_id, adapter, group_id, size, seed):
            for i in range(size):
                seen.append(state.publisher._in_use())
                yield rollout(group_id, i, adapter_step=adapter.step)
            if group_id == "g-lost":
                raise EpisodeInfraError(task_id, group_id, 1, 1, "sandbox gone")

    try:
        producer = Producer(state, Runner())
        assert producer.produce("count-a", "g-ok", AdapterRef(3, "step_000003", None))
        assert not producer.produce("count-a", "g-lost", AdapterRef(4, "step_000004", None))
        assert producer.produce("count-a", "g-base", AdapterRef(0, None, None))
        assert seen == [{"step_000003"}] * 2 + [{"step_000004"}] * 2 + [set()] * 2
        assert state.versions_in_flight() == set()
    finally:
        state.lock.release()


# -- resume falls back past damaged checkpoints

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir: Path) -> tuple[Path, Path]:
    """A real 3-step run with a checkpoint at every step (0, 1, 2, 3)."""
    tmp = tmp_path_factory.mktemp("finished")
    config = _config(tmp, tiny_model_dir)
    run = tmp / "run"
    done = _trainer(config, run)
    assert done.returncode == 0, done.stdout + done.stderr
    assert complete_steps(run) == [0, 1, 2, 3]
    return config, run


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x80\x05garbage, not a pickle or a zip archive")


DAMAGE = {
    "adapter/adapter_model.safetensors": _cut,
    "optimizer.pt": _garbage,
    "rng.pt": _garbage,
    "curriculum.json": _garbage,
    "store.sqlite": _garbage,
    "metadata.json": _garbage,
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, finished_run, name: str):
    config, finished = finished_run
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    DAMAGE[name](run / "checkpoints" / "step_000003" / name)
    cfg = TrainConfig.load(config)
    warnings: list[str] = []
    state = RunState(cfg, run, Curriculum.from_pass_rates({"count-a": 0.5}, seed=0), log=warnings.append)
    try:
        assert state.resumed_from == 2 and state.step == 2
        assert any(f"step_000003/{name} does not load" in w for w in warnings), warnings
        assert state.curriculum.to_json() == Curriculum.load(run / "checkpoints" / "step_000002" / "curriculum.json").to_json()
    finally:
        state.lock.release()


def test_no_checkpoint_loads_lists_each_failure(tmp_path: Path, finished_run):
    config, finished = finished_run
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for step, name in ((1, "rng.pt"), (2, "optimizer.pt"), (3, "adapter/adapter_model.safetensors"), (0, "metadata.json")):
        DAMAGE[name](run / "checkpoints" / f"step_{step:06d}" / name)
    with pytest.raises(CheckpointLoadError) as err:
        RunState(TrainConfig.load(config), run, Curriculum.from_pass_rates({"count-a": 0.5}, seed=0), log=lambda m: None)
    message = str(err.value)
    assert f"no checkpoint of {run} loads" in message
    for name in ("step_000003/adapter/adapter_model.safetensors", "step_000002/optimizer.pt", "step_000001/rng.pt",
                 "step_000000/metadata.json"):
        assert name in message, message


def test_trainer_resumes_past_a_cut_adapter_and_finishes(tmp_path: Path, finished_run):
    """The trainer process itself: the newest adapter cut to 10 bytes; it says which file and why,
    resumes from the checkpoint before, redoes the last step and rewrites the damaged checkpoint."""
    config, finished = finished_run
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _cut(run / "checkpoints" / "step_000003" / "adapter" / "adapter_model.safetensors")
    done = _trainer(config, run)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step_000003/adapter/adapter_model.safetensors does not load" in done.stdout
    assert "resumed from checkpoint 2" in done.stdout
    assert complete_steps(run) == [0, 1, 2, 3]
    assert (run / "checkpoints" / "step_000003" / "adapter" / "adapter_model.safetensors").stat().st_size > 10


# -- the disk under the store is full

def test_store_on_a_full_disk_names_its_path(small_disk):
    disk = small_disk(320)
    store = RolloutStore(disk / "store" / "rollouts.sqlite")
    store.add_group("g", "task", 0, 10_000)
    with pytest.raises(StoreWriteError) as err:
        for i in range(10_000):
            store.put(rollout("g", i, tokens=512))
    message = str(err.value)
    assert str(disk / "store" / "rollouts.sqlite") in message and "the disk is full" in message
    assert store.counts()["ready"] > 0  # what was committed before is still there


# -- episodes lost to the infrastructure

def test_lost_episode_drops_its_group_and_the_run_finishes(tmp_path: Path, tiny_model_dir: Path):
    config = _config(tmp_path, tiny_model_dir, environment=f"{ENV}:losing_env")
    run = tmp_path / "run"
    done = _trainer(config, run, HOSTILE_LOSE="s000002-g01/1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert complete_steps(run) == [0, 1, 2, 3]
    lines = [json.loads(line) for line in (run / "logs" / "lost-episodes.jsonl").read_text().splitlines()]
    assert [(x["group_id"], x["episode"]) for x in lines] == [("s000002-g01", 1)]
    assert "the daemon is gone" in lines[0]["error"] and lines[0]["task_id"]
    steps = _consumed_steps(run)
    assert "s000002-g01" not in steps and steps["s000002-g01-r1"] == {2}  # dropped, replaced
    assert sorted(st for s in steps.values() for st in s) == [1, 1, 2, 2, 3, 3]
    assert RolloutStore(run / "store" / "rollouts.sqlite").dropped_group_ids() == {"s000002-g01"}


def test_lost_episode_on_a_producer_thread_drops_its_group_and_the_run_finishes(tmp_path: Path, tiny_model_dir: Path):
    """The same with producers on worker threads (``producer_workers = 2``): the thread lives on and
    produces another group in place of the dropped one."""
    config = _config(tmp_path, tiny_model_dir, environment=f"{ENV}:losing_env", producer_workers=2, max_policy_lag=1)
    run = tmp_path / "run"
    done = _trainer(config, run, HOSTILE_LOSE="n0000002/0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert complete_steps(run) == [0, 1, 2, 3]
    lines = [json.loads(line) for line in (run / "logs" / "lost-episodes.jsonl").read_text().splitlines()]
    assert [(x["group_id"], x["episode"]) for x in lines] == [("n0000002", 0)]
    steps = _consumed_steps(run)
    assert "n0000002" not in steps and sorted(st for s in steps.values() for st in s) == [1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("workers", [0, 2])
def test_episodes_lost_in_a_row_open_the_circuit_and_stop_the_run(tmp_path: Path, tiny_model_dir: Path, workers: int):
    config = _config(tmp_path, tiny_model_dir, environment=f"{ENV}:losing_env", max_consecutive_infra_failures=3,
                     producer_workers=workers)
    run = tmp_path / "run"
    done = _trainer(config, run, HOSTILE_LOSE="all")
    assert done.returncode != 0
    assert "InfraCircuitOpen" in done.stderr and "max_consecutive_infra_failures" in done.stderr, done.stderr
    assert "the daemon is gone" in done.stderr and "lost-episodes.jsonl" in done.stderr
    assert complete_steps(run) == [0]


def test_trainer_config_that_is_not_utf8_json_names_the_file(tmp_path: Path):
    path = tmp_path / "trainer.json"
    path.write_bytes(b'{"run_name": "caf\xe9"}')
    with pytest.raises(ValueError, match=f"trainer config {path}: not UTF-8 text .*expected a JSON object"):
        TrainConfig.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"trainer config {path}: a JSON list; expected a JSON object"):
        TrainConfig.load(path)
