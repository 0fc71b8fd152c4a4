"""A trainer environment on a fleet of engine replicas behind the router, for the replica fault test
(loaded by the trainer process through ``environment = "tests.reliability.fleet_env:make"``).

The fleet is the trainer's own (:func:`training.episodes.fleet_environment`: ``replicas`` processes of
``python -m serving.local_engine`` behind ``serving.router``, a replica that dies is replaced); only the
episodes differ from the harness: instead of an agent in a sandbox, each episode is a multi-turn
session of ``max_turns`` calls whose context grows by the model's output and a fixed "observation"
every turn, as an agent's does. A group's episodes run at once. The reward is the share of sampled
tokens in the lower half of the vocabulary (a LoRA step can raise it). Each rollout's ``info`` keeps
the replica and the adapter version that answered each of its calls, so the test can see sessions
move and replacements take traffic.
"""

from __future__ import annotations

import json
from pathlib import Path
import time
from types import SimpleNamespace

from training.config import TrainConfig
from training.curriculum import Curriculum
from training.episodes import Environment, PooledGroupRunner, fleet_environment, rollout_from_trajectory
from training.loop import AdapterRef
from training.rollout import Rollout

PROMPTS = {"count-a": [1, 2, 3, 4, 5, 6], "count-b": [5, 6, 7, 8, 9], "count-c": [9, 8, 7, 6, 5, 4, 3]}
OBSERVATION = [11, 12, 13]


class SessionRunner(PooledGroupRunner):
    def __init__(self, url: str, cfg: TrainConfig, vocab_size: int) -> None:
        from serving.client import EngineClient

        super().__init__(cfg.group_size, thread_name_prefix="session")
        self.client = EngineClient(url, timeout_s=300)
        self.cfg = cfg
        self.vocab_size = vocab_size

    def episode(self, task_id: str, adapter: AdapterRef, group_id: str, index: int, seed: int) -> Rollout:
        rid = f"{group_id}/{index}"
        context = list(PROMPTS[task_id])
        calls, replicas, versions = [], [], []
        for turn in range(self.cfg.max_turns):
            started = time.monotonic()
            out = self.client.generate(
                context, {"max_new_tokens": self.cfg.max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                          "sampling_seed": seed + 1000 * index + turn},
                return_logprob=True, lora_path=adapter.name, rid=rid)
            meta = out["meta_info"]
            calls.append(SimpleNamespace(input_ids=list(context), output_ids=list(out["output_ids"]),
                                         output_logprobs=[float(e[0]) for e in meta["output_token_logprobs"]],
                                         latency_s=time.monotonic() - started))
            replicas.append(meta.get("replica"))
            versions.append(meta.get("weight_version"))
            context = context + list(out["output_ids"]) + OBSERVATION
        generated = [t for c in calls for t in c.output_ids]
        reward = sum(1 for t in generated if t < self.vocab_size // 2) / len(generated)
        traj = SimpleNamespace(calls=calls, session_id=rid, task_id=task_id, stop_reason="max_turns", committed=False,
                               agent_s=0.0, grade_s=0.0)
        rollout = rollout_from_trajectory(traj, group_id, adapter, reward)
        return Rollout(**{**rollout.__dict__, "info": {**rollout.info, "replicas": replicas, "weight_versions": versions}})


def make(cfg: TrainConfig, run_dir: Path) -> Environment:
    vocab_size = json.loads((Path(cfg.base_model) / "config.json").read_text())["vocab_size"]
    curriculum = Curriculum.from_pass_rates({t: 0.5 for t in PROMPTS}, seed=cfg.seed)
    return fleet_environment(cfg, run_dir, lambda url: SessionRunner(url, cfg, vocab_size), curriculum)
