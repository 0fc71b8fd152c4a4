"""A small real environment for trainer tests: the local engine (in-process, behind the serving HTTP
layer on loopback) samples completions of fixed prompts; the reward is the share of sampled tokens in
the lower half of the vocabulary, which a LoRA step can raise. Episodes run one at a time with a seed
per episode, so a run is reproducible token for token (what the resume test needs)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from training.config import TrainConfig
from training.curriculum import Curriculum
from training.episodes import Environment
from training.loop import AdapterRef
from training.rollout import Rollout

PROMPTS = {"count-a": [1, 2, 3, 4], "count-b": [5, 6, 7], "count-c": [9, 8, 7, 6, 5], "count-d": [3, 3, 3]}


class EngineRunner:
    def __init__(self, url: str, cfg: TrainConfig, vocab_size: int) -> None:
        from serving.client import EngineClient

        self.client = EngineClient(url)
        self.cfg = cfg
        self.vocab_size = vocab_size

    def run_group(self, task_id: str, adapter: AdapterRef, group_id: str, size: int, seed: int) -> Iterator[Rollout]:
        prompt = PROMPTS[task_id]
        for i in range(size):
            out = self.client.generate(
                prompt, {"max_new_tokens": self.cfg.max_new_tokens, "temperature": 1.0, "sampling_seed": seed + i,
                         "ignore_eos": True},
                return_logprob=True, lora_path=adapter.name, rid=f"{group_id}/{i}",
            )
            ids = list(out["output_ids"])
            lps = [float(e[0]) for e in out["meta_info"]["output_token_logprobs"]]
            reward = sum(1 for t in ids if t < self.vocab_size // 2) / len(ids)
            yield Rollout(f"{group_id}-{i}", group_id, task_id, adapter.step, prompt + ids,
                          [0] * len(prompt) + [1] * len(ids), [0.0] * len(prompt) + lps, reward)


def make(cfg: TrainConfig, run_dir: Path) -> Environment:
    from serving.local_engine import LocalEngine
    from serving.http import serve

    engine = LocalEngine(cfg.base_model, torch_threads=1)
    server = serve(engine)
    curriculum = Curriculum.from_pass_rates({t: 0.5 for t in PROMPTS}, seed=cfg.seed)
    return Environment(EngineRunner(server.url, cfg, engine.vocab_size), curriculum, [server.url], server.shutdown)
