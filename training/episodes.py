"""The environment of an RL run: engine replicas, and groups of agent episodes on tasks.

:func:`make_environment` starts what the trainer needs around it. With ``environment = "harness"``
(the default): the RL tasks of the task source (``split = "train"``, without the base model's demonstrations), ``replicas`` engine
replica processes (``python -m serving.replica``: a vLLM server and the capture front on loopback,
each serving the base model and the published adapter versions; ``POSTTRAIN_ENGINE=local`` picks the
project's transformers engine), and a :class:`HarnessRunner` that runs each episode through the evals agent harness
(:func:`evals.harness.run_episode`: the model acts in a sandbox, its committed work is graded by the
task's tests). ``environment = "module:function"`` names another factory with the same signature
(tests use one).

One replica (:func:`serving.fleet.start_engine`) is called directly. With ``replicas > 1`` they
are a :class:`ReplicaFleet`: the project's router (:mod:`serving.router`, sessions sticky to a
replica, moved and retried when one dies) in the trainer process, the replica processes behind it
(:class:`serving.fleet.LocalFleet`), and a watcher that replaces a replica whose process exits; the
replacement loads the newest adapter from the run's volume before it takes traffic. Weight
publication pushes to the live replicas of the moment (``Environment.receivers`` is then a
function), and each group announces its adapter version to the router first (:class:`FleetRunner`),
so a replica that joined during a publication loads it too.

A trajectory becomes a :class:`~training.rollout.Rollout` from the exact token ids the engine returned:
the sequence is the last call's input plus its output (each call's context extends the previous one
by its output and the observation's tokens), the loss mask covers every call's output tokens, and the
logprobs are the engine's. An episode lost to a sandbox failure is retried, never scored as a failure;
one whose failure persists through its retries raises :class:`EpisodeInfraError`, and the producer
drops its group (:class:`training.loop.Producer`) instead of stopping the run. What the agent broke
itself (its repository, its sandbox) is a finished episode scored 0 (:mod:`evals.harness`).
"""

from __future__ import annotations

import importlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from serving.adapters import newest_adapter
from training.checkpoint import adapters_volume, logs_dir
from training.config import TrainConfig
from training.curriculum import Curriculum, TaskStream, open_task_stream
from training.grpo import IntegrityGate
from training.loop import AdapterRef, EpisodeInfraError, GroupRunner
from training.rollout import Rollout
import os
from evals.harness import HttpClient, episode_context
from evals.harness import run_episode
from evals.sandbox import platform_sandbox_factory
from evals.scaffolds import run_scaffold_episode
from evals.tasks import load_bundled, load_tasks, rl_tasks
from sandboxes.home import default_suite_dir
from serving.engines.vllm import lora_rank_slot
from training.capture_rollouts import CaptureMissing, fetch_session, rollout_from_capture
from training.remote_fleet import ROUTER_URL_VARIABLE, RemoteFleet

INFRA_RETRIES = 2
INFRA_RETRY_WAIT_S = 2.0


@dataclass
class Environment:
    runner: GroupRunner
    curriculum: Curriculum
    # replica URLs the publisher pushes to, or a function giving the live ones at each publication
    receivers: list[str] | Callable[[], list[str]] = field(default_factory=list)
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
        adapter_step=adapter.step, input_ids=ids, loss_mask=mask, serving_logprobs=logprobs, reward=reward,
        info={"stop_reason": traj.stop_reason, "turns": len(calls), "committed": traj.committed,
              "agent_s": traj.agent_s, "grade_s": traj.grade_s,
              "generation_s": round(sum(c.latency_s for c in calls), 4),  # of agent_s, the model calls'
              "grade_status": getattr(getattr(traj, "grade", None), "status", None),
              **committed_work(traj)},
    )


def canary_info(task: Any) -> dict[str, Any]:
    """``{"canary": True}`` for a canary of the task stream (an impossible variant: never trained on,
    its pass rate measures cheating; :func:`training.grpo.batch_from_groups`), else nothing."""
    return {"canary": True} if (getattr(task, "metadata", None) or {}).get("canary") else {}


MAX_STORED_PATCH_BYTES = 1 << 20  # a policy must not escape the audit by committing a large patch


def committed_work(traj: Any) -> dict[str, Any]:
    """The committed patch a rollout was graded on, kept in its ``info`` so that ``posttrain audit``
    can grade it again (a patch over :data:`MAX_STORED_PATCH_BYTES` is left out and said so)."""
    patch = getattr(traj, "patch", "") or ""
    if len(patch.encode()) > MAX_STORED_PATCH_BYTES:
        return {"patch": None, "patch_bytes": len(patch.encode())}
    return {"patch": patch}


def episode_reward(traj: Any, reward: str = "reward") -> float:
    """The score named ``reward`` (:data:`training.config.REWARDS`) of a graded episode; 0.0 when its
    work could not be scored (nothing committed that applies)."""
    scores = traj.grade.scores if traj.grade is not None else None
    return float(getattr(scores, reward)) if scores is not None else 0.0


def episode_signals(traj: Any) -> tuple[str, ...]:
    """The cheating signals of an episode's grading (:mod:`evals.signals`, sorted); none when ungraded."""
    grade = getattr(traj, "grade", None)
    return tuple(sorted(set(getattr(grade, "signals", None) or ()))) if grade is not None else ()


def gated_reward(traj: Any, reward: str, gate: IntegrityGate) -> tuple[float, dict[str, Any]]:
    """The reward a graded episode trains with, and what its rollout's ``info`` keeps of the grading.

    The reward is the score named ``reward`` (:func:`episode_reward`) unless a gating cheating signal
    flagged the attempt: then ``gate`` decides (:class:`training.grpo.IntegrityGate`: 0 under ``zero``
    and ``drop``). ``info`` gets ``score`` (the score itself) and ``signals`` (every signal, gating
    or not): the rollout store keeps them and the trainer applies the gate again from them before the
    advantages (:func:`training.grpo.batch_from_groups`), which is where ``drop`` leaves the group."""
    score = episode_reward(traj, reward)
    signals = episode_signals(traj)
    return gate.reward(score, signals), {"score": score, "signals": list(signals)}


class PooledGroupRunner:
    """A :class:`~training.loop.GroupRunner` whose group is ``size`` calls of ``episode`` on a thread
    pool, yielded as each finishes; subclasses define ``episode``."""

    def __init__(self, workers: int, thread_name_prefix: str = "episode") -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix)

    def episode(self, task_id: str, adapter: AdapterRef, group_id: str, index: int, seed: int) -> Rollout:
        raise NotImplementedError

    def run_group(self, task_id: str, adapter: AdapterRef, group_id: str, size: int, seed: int) -> Iterator[Rollout]:
        """Each episode's rollout as it finishes. An episode that raises :class:`EpisodeInfraError`
        does not cut the others short: every episode finishes first, then the first such error is
        raised (the group is incomplete; the producer drops it)."""
        futures = [self.pool.submit(self.episode, task_id, adapter, group_id, i, seed) for i in range(size)]
        lost: list[EpisodeInfraError] = []
        for fut in as_completed(futures):
            try:
                rollout = fut.result()
            except EpisodeInfraError as exc:
                lost.append(exc)
                continue
            yield rollout
        if lost:
            lost[0].lost = lost
            raise lost[0]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class HarnessRunner(PooledGroupRunner):
    """Groups of episodes through the evals harness against an engine URL."""

    def __init__(self, tasks: dict[str, Any], engine_url: str, tokenizer: Any, sandbox_factory: Any,
                 cfg: TrainConfig, episode_workers: int = 4) -> None:
        self.tasks = tasks
        self.engine_url = engine_url
        self.client = HttpClient(engine_url)
        self.tokenizer = tokenizer
        self.sandbox_factory = sandbox_factory
        self.cfg = cfg
        self.context = episode_context(cfg.base_model)  # an episode that outgrows the model stops
        super().__init__(episode_workers)
        # An identical committed patch of the same task is graded once (the tests are deterministic).
        self.grade_cache: dict | None = {} if cfg.reuse_grading else None
        self.gate = IntegrityGate.from_config(cfg)  # a flagged attempt's reward (training.grpo)

    def episode(self, task_id: str, adapter: AdapterRef, group_id: str, index: int, seed: int) -> Rollout:
        task = self.tasks[task_id]
        if self.cfg.scaffold != "builtin":
            return self._scaffold_episode(task, adapter, group_id, index)
        for retry in range(INFRA_RETRIES + 1):
            if retry:
                time.sleep(INFRA_RETRY_WAIT_S * retry)  # give a restarting router or a dead sandbox's node time
            traj = run_episode(
                task, self.client, self.tokenizer, self.sandbox_factory, adapter_version=adapter.name,
                session_id=f"{group_id}/{index}", action_format="compact", max_turns=self.cfg.max_turns,
                max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                seed=seed + 7919 * index + 104729 * retry, grade_cache=self.grade_cache, **self.context,
            )
            if not traj.infra_error:
                reward, graded = gated_reward(traj, self.cfg.reward, self.gate)
                rollout = rollout_from_trajectory(traj, group_id, adapter, reward)
                return replace(rollout, info={**rollout.info, **graded, **canary_info(task)})
        raise EpisodeInfraError(task_id, group_id, index, INFRA_RETRIES + 1, traj.error)

    def _scaffold_episode(self, task: Any, adapter: AdapterRef, group_id: str, index: int) -> Rollout:
        """An episode of a third-party scaffold (``cfg.scaffold``, :mod:`evals.scaffolds`) over the chat
        API: its rollout is what the replicas captured for the session, never the scaffold's own
        copy (:func:`training.capture_rollouts.rollout_from_capture`; a drifted turn is context only)."""
        for retry in range(INFRA_RETRIES + 1):
            if retry:
                time.sleep(INFRA_RETRY_WAIT_S * retry)
            session_id = f"{group_id}/{index}" + (f"/retry{retry}" if retry else "")
            traj = run_scaffold_episode(
                self.cfg.scaffold, task, model_url=self.engine_url, sandbox_factory=self.sandbox_factory,
                adapter_version=adapter.name, session_id=session_id, max_turns=self.cfg.max_turns,
                max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature, grade_cache=self.grade_cache)
            if traj.infra_error:
                continue
            reward, graded = gated_reward(traj, self.cfg.reward, self.gate)
            try:
                return rollout_from_capture(
                    fetch_session(self.engine_url, session_id), rollout_id=f"{group_id}-{index}", group_id=group_id,
                    task_id=task.id, adapter_step=adapter.step, reward=reward,
                    info={"stop_reason": traj.stop_reason, "committed": traj.committed, "scaffold": self.cfg.scaffold,
                          "agent_s": traj.agent_s, "grade_s": traj.grade_s,
                          "grade_status": traj.grade.status if traj.grade else None, **committed_work(traj),
                          **graded, **canary_info(task)})
            except CaptureMissing as exc:  # the replica holding the session is gone: the serving side's fault
                traj.error = str(exc)
        raise EpisodeInfraError(task.id, group_id, index, INFRA_RETRIES + 1, traj.error)


def engine_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of each local replica that the config (or the run plan's local engine args) sets
    (:func:`serving.fleet.start_engine` and :class:`serving.fleet.LocalFleet` take them;
    ``max_total_tokens`` and ``torch_threads`` concern the local engine, ``max_running_requests`` both)."""
    kwargs: dict[str, Any] = {"torch_threads": 1, "max_lora_rank": lora_rank_slot(cfg.lora_rank)}
    if cfg.scaffold != "builtin":  # a chat scaffold's tool calls are parsed by the engine
        kwargs["tool_call_parser"] = "hermes"
    if cfg.engine_max_total_tokens:
        kwargs["max_total_tokens"] = cfg.engine_max_total_tokens
    if cfg.engine_max_running_requests:
        kwargs["max_running_requests"] = cfg.engine_max_running_requests
    return kwargs


def load_curriculum(cfg: TrainConfig, task_ids: list[str], run_dir: Path | None = None) -> Curriculum | TaskStream:
    """The curriculum from ``cfg.curriculum`` (the ``difficulty_curriculum`` asset's file), else every
    training task at an unknown pass rate (0.5). With ``cfg.task_stream``, or a file with
    ``task_stream`` settings, it is the run's task stream instead (:class:`training.curriculum.TaskStream`,
    under ``run_dir``; the file's settings, else its ``settings``, else the stream's defaults)."""
    def stream(settings: Any, source: str) -> TaskStream:
        if run_dir is None:
            raise ValueError(f"{source}: key 'task_stream' needs the run directory")
        return open_task_stream(settings, run_dir, cfg.tasks or default_suite_dir(), seed=cfg.seed,
                                sandbox_runtime=cfg.sandbox_runtime, source=source)

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
        if "task_stream" in data or cfg.task_stream:  # RL tasks generated and validated as the run goes
            return stream(data.get("task_stream", data.get("settings", {})), f"curriculum {path}")
        return Curriculum.from_pass_rates(rates, seed=cfg.seed, **data.get("settings", {}))
    if cfg.task_stream:
        return stream({}, "trainer config")
    return Curriculum.from_pass_rates({t: 0.5 for t in task_ids}, seed=cfg.seed)


def training_tasks(source: str) -> dict[str, Any]:
    """The RL tasks of ``source`` (:func:`evals.tasks.rl_tasks`: its ``train`` split without the
    demonstrations the embedded base model learned from): a built bundled suite folder is read as it
    is (the ``task_dataset`` asset built it); anything else goes through the evals loaders."""
    path = Path(source) if source else default_suite_dir()
    if (path / "suite.json").is_file():
        task_set = load_bundled(path)
    elif not path.exists():
        raise FileNotFoundError(f"trainer config key 'tasks': {path} does not exist (materialize task_dataset first)")
    else:
        task_set = load_tasks(path)
    tasks = {t.id: t for t in rl_tasks(task_set.tasks)}
    if not tasks:
        raise ValueError(f"task source {source or 'bundled suite'}: no task with split 'train' to train on "
                         "(demonstration tasks are left to the base model)")
    return tasks


class ReplicaFleet:
    """``cfg.replicas`` local engine processes behind the router, in the trainer process; a replica
    whose process exits is replaced (see the module docstring). ``url`` is the router's."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, watch_interval_s: float = 0.5, log=print) -> None:
        # heavy: the local fleet's HTTP servers (uvicorn); a run on a remote fleet never starts them
        from serving.fleet import LocalFleet
        from serving.router.core import Router
        from serving.router.server import serve_router

        self.volume = adapters_volume(run_dir)
        self.volume.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.router = Router("kv_headroom", adapters_volume=str(self.volume))
        self.server = serve_router(self.router)
        self.url = self.server.url
        self.fleet = LocalFleet(cfg.base_model, self.router, mode="process", engine_kwargs=engine_kwargs(cfg),
                                log_dir=logs_dir(run_dir))
        self._announced: set[str] = set()
        self._announce_lock = threading.Lock()
        self._stop = threading.Event()
        try:
            self.fleet.scale_up(cfg.replicas)
        except BaseException:
            self.close()
            raise
        self.log(f"engine replicas behind the router {self.url}: "
                 + ", ".join(f"{url} (pid {proc.pid})" for url, proc in self.fleet.members.items()))
        self._watcher = threading.Thread(target=self._watch, args=(watch_interval_s,), name="replica-watch", daemon=True)
        self._watcher.start()

    def receivers(self) -> list[str]:
        return self.fleet.live_urls()

    def announce(self, adapter: AdapterRef) -> None:
        """Tell the router that ``adapter`` is published (the replicas that got it by HTTP keep it; any
        other live replica loads it from the volume), once per version."""
        if adapter.name is None or adapter.path is None:
            return
        with self._announce_lock:
            if adapter.name not in self._announced:
                self.router.publish_adapter(adapter.name, str(adapter.path))
                self._announced.add(adapter.name)

    def end_session(self, rid: str) -> None:
        self.router.end_session(rid)

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            # What a replacement must serve: every version published before it started to join (one
            # published during its join reaches it too, but the log compares against this one).
            newest = newest_adapter(self.volume)
            try:
                replaced = self.fleet.replace_exited()
            except Exception as exc:  # a replacement that fails to start is tried again on the next look
                self.log(f"replica replacement failed, retrying: {exc!r}")
                continue
            for r in replaced:
                replica = self.router.replicas.get(r.url)
                serving = sorted(replica.adapters) if replica is not None else []
                pid = self.fleet.members[r.url].pid if r.url in self.fleet.members else None
                self.log(f"replica {r.dead_url} exited ({r.returncode}); replacement {r.url} (pid {pid}) joined "
                         f"serving {serving} (newest published before it joined: {newest[0] if newest else None})")

    def close(self) -> None:
        self._stop.set()
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.join(timeout=120)  # a replacement still starting joins first, then stops with the rest
        m = self.router.metrics()
        self.log(f"router: calls retried {m['router_retried_calls_total']:.0f}, "
                 f"sessions moved {m['router_moved_sessions_total']:.0f}")
        self.fleet.shutdown()
        self.server.shutdown()


class FleetRunner:
    """A group runner in front of a :class:`ReplicaFleet`: announces each group's adapter version to
    the router first, and ends the group's router sessions (``{group_id}/{index}``) once it is done."""

    def __init__(self, runner: GroupRunner, fleet: ReplicaFleet) -> None:
        self.runner = runner
        self.fleet = fleet

    def run_group(self, task_id: str, adapter: AdapterRef, group_id: str, size: int, seed: int) -> Iterator[Rollout]:
        self.fleet.announce(adapter)
        try:
            yield from self.runner.run_group(task_id, adapter, group_id, size, seed)
        finally:
            for i in range(size):
                self.fleet.end_session(f"{group_id}/{i}")

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()


def fleet_environment(cfg: TrainConfig, run_dir: Path, make_runner: Callable[[str], GroupRunner],
                      curriculum: Curriculum, fleet: Any = None) -> Environment:
    """An environment on replicas behind a router; ``make_runner(router_url)`` builds the group
    runner (the harness, or a test's). ``fleet``: a cluster's (:class:`training.remote_fleet.RemoteFleet`),
    else ``cfg.replicas`` local replicas (:class:`ReplicaFleet`)."""
    fleet = fleet if fleet is not None else ReplicaFleet(cfg, run_dir)
    try:
        runner = FleetRunner(make_runner(fleet.url), fleet)
    except BaseException:
        fleet.close()
        raise

    def close() -> None:
        runner.close()
        fleet.close()

    return Environment(runner=runner, curriculum=curriculum, receivers=fleet.receivers, close=close)


def harness_environment(cfg: TrainConfig, run_dir: Path) -> Environment:
    """Where an episode reaches its engine and its sandbox, locally or on a cluster: the harness
    runner gets one engine URL and one sandbox factory. The engine URL is the router of the cluster's
    fleet (``POSTTRAIN_ROUTER_URL``, set in the trainer Job: :mod:`training.remote_fleet`), else the
    router of ``cfg.replicas`` local replicas, else one local replica. The sandbox factory is
    ``cfg.sandbox_runtime``'s (:func:`evals.sandbox.platform_sandbox_factory`: bwrap or gVisor here,
    ``k8s``: the run's sandbox pool at ``POSTTRAIN_SANDBOX_POOL_URL``)."""
    # heavy: transformers (and torch through it)
    from transformers import AutoTokenizer


    tasks = training_tasks(cfg.tasks)
    curriculum = load_curriculum(cfg, sorted(tasks), run_dir)
    if isinstance(curriculum, TaskStream):  # its tasks are written under the run as they are served
        tasks = curriculum.tasks
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)

    def make_runner(url: str) -> HarnessRunner:
        return HarnessRunner(tasks, url, tokenizer, platform_sandbox_factory(cfg.sandbox_runtime), cfg,
                             episode_workers=cfg.episode_workers)


    if os.environ.get(ROUTER_URL_VARIABLE):  # a cluster run: engines and router are workloads of their own
        return fleet_environment(cfg, run_dir, make_runner, curriculum, fleet=RemoteFleet(os.environ[ROUTER_URL_VARIABLE]))
    if cfg.replicas > 1:
        return fleet_environment(cfg, run_dir, make_runner, curriculum)
    # heavy: the local fleet's HTTP servers (uvicorn); only a scaffold run without a router starts a replica here
    from serving.fleet import start_engine, stop_replica

    proc, url = start_engine(cfg.base_model, logs_dir(run_dir) / "engine-0.log", **engine_kwargs(cfg))
    runner = make_runner(url)

    def close() -> None:
        runner.close()
        stop_replica(proc)

    return Environment(runner=runner, curriculum=curriculum, receivers=[url], close=close)


def make_environment(cfg: TrainConfig, run_dir: Path) -> Environment:
    if cfg.environment == "harness":
        return harness_environment(cfg, Path(run_dir))
    module_name, _, func = cfg.environment.partition(":")
    if not func:
        raise ValueError(f"trainer config key 'environment': {cfg.environment!r} is neither 'harness' nor 'module:function'")
    return getattr(importlib.import_module(module_name), func)(cfg, Path(run_dir))
