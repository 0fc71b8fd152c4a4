"""The RL trainer: asynchronous GRPO on a LoRA adapter, one process per run or one per GPU.

    python -m training --config RUN_DIR/trainer-config.json --run-dir RUN_DIR
    python -m torch.distributed.run --standalone --nproc-per-node 8 -m training --config ... --run-dir RUN_DIR

``--config`` is a JSON file of :class:`training.config.TrainConfig` keys (or a resolved run plan with
a ``trainer`` table). The trainer first locks the run directory (``RUN_DIR/trainer.lock``: a second
trainer on it is refused, naming the first one's pid), then starts its environment (engine replicas with their adapter
receivers, the sandboxed agent harness: :mod:`training.episodes`), resumes from the newest complete
checkpoint in ``RUN_DIR/checkpoints/`` that loads (a damaged one is reported and skipped), and then loops: producers generate groups
and store each finished rollout; the trainer takes whole groups within the policy lag, takes a GRPO
step, checkpoints every ``checkpoint_every`` steps, and publishes the new adapter version. An episode
lost to the infrastructure drops its group (``logs/lost-episodes.jsonl``); the run stops only when
``max_consecutive_infra_failures`` are lost in a row, the store cannot be written, or the engine is gone. Launched by
the ``rl_run`` asset it reports through Dagster Pipes; run by hand it prints one line per step.

Started by torchrun (what the trainer Job and ``posttrain run`` do when ``[trainer] gpus`` > 1), rank 0
is the trainer above and the other processes only follow its backend: each builds, loads, steps on its
shard of every batch and saves as rank 0 says (:mod:`training.backends.parallel`), so every GPU trains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from training.backends import backend_default_device, build_replica
from training.backends.parallel import follow, start_ranks
from training.config import TrainConfig
from training.episodes import make_environment
from training.loop import Producer, RunLock, RunState
from training.progress import Reporter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="trainer config JSON (or a resolved plan)")
    parser.add_argument("--run-dir", required=True, help="the run's folder (checkpoints, store, adapters, metrics)")
    args = parser.parse_args(argv)
    cfg = TrainConfig.load(args.config)
    torch.set_num_threads(cfg.torch_threads)
    run_dir = Path(args.run_dir)
    # torchrun's processes: rank 0 runs the loop below, the others make its backend calls on their shards
    ranks = start_ranks(cfg.device or backend_default_device(cfg.backend), wait_for_groups_s=cfg.take_timeout_s)
    if not ranks.leads:
        return follow(ranks, build_replica)

    with Reporter(run_dir, of_steps=cfg.steps, scale_by_std=cfg.loss.scale_advantages_by_std) as report, ranks:
        lock = RunLock(run_dir)  # one trainer per run directory, held until this process exits
        env = make_environment(cfg, run_dir)  # engine replicas + adapter receivers + harness
        state = RunState(cfg, run_dir, env.curriculum, receivers=env.receivers, lock=lock, log=report.info)
        report.info(f"run {cfg.run_name}: step {state.step} of {cfg.steps}"
                    + (f" (resumed from checkpoint {state.resumed_from})" if state.resumed_from else "")
                    + (f", data parallel on {ranks.size} trainer processes" if ranks.size > 1 else ""))
        producer = Producer(state, env.runner)
        producer.start()  # no threads when producer_workers == 0: each step produces its own groups
        sync = cfg.producer_workers == 0
        try:
            for step in range(state.step + 1, cfg.steps + 1):
                taken = state.take(step, produce=(lambda r, n: producer.produce_step(step, r, n)) if sync else None,
                                   should_stop=lambda: _raise_first(producer.errors),
                                   producers_alive=producer.alive)  # generate + store
                row = state.train(step, taken)  # one GRPO step on whole groups
                if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                    state.checkpoint(step, {"loss": row["loss"], "solve_rate": row["solve_rate"]})
                published = state.publish(step)  # HTTP shards to every replica + volume copy
                report.step(row, published)
        finally:
            producer.stop()
            env.close()
        report.done(state)
    return 0


def _raise_first(errors: list[BaseException]) -> None:
    if errors:
        raise RuntimeError(f"a producer failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]


if __name__ == "__main__":
    sys.exit(main())
