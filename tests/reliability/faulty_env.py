"""A trainer environment with fault hooks, for the reliability tests (loaded by the trainer process
through ``environment = "tests.reliability.faulty_env:make"``).

It is the real test environment of the trainer tests (``tests.training.envs``: a tiny local engine on
loopback) plus two hooks set by environment variables, so that a SIGKILL from the test lands exactly
inside the phase it targets:

- ``POSTTRAIN_FAULT_HANG_IN_CHECKPOINT=N``: while writing checkpoint ``N``, after the adapter and the
  optimizer are written and before ``metadata.json``, print ``FAULT in-checkpoint N`` and wait;
- ``POSTTRAIN_FAULT_HANG_IN_STEP=N``: after step ``N`` took its groups from the store and before the
  GRPO update, print ``FAULT in-step N`` and wait.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from training.config import TrainConfig
from training.episodes import Environment


def _hang(marker: str) -> None:
    print(marker, flush=True)
    sys.stderr.flush()
    time.sleep(600)


def make(cfg: TrainConfig, run_dir: Path) -> Environment:
    import training.loop as loop
    from tests.training.envs import make as make_real

    in_ckpt = int(os.environ.get("POSTTRAIN_FAULT_HANG_IN_CHECKPOINT", "-1"))
    in_step = int(os.environ.get("POSTTRAIN_FAULT_HANG_IN_STEP", "-1"))
    real_write = loop.write_checkpoint

    def write_checkpoint(run_dir, step, fill, metadata):
        def slow_fill(tmp: Path) -> None:
            fill(tmp)
            if step == in_ckpt:
                _hang(f"FAULT in-checkpoint {step}")

        return real_write(run_dir, step, slow_fill, metadata)

    loop.write_checkpoint = write_checkpoint
    real_train = loop.RunState.train

    def train(self, step, taken):
        if step == in_step:
            _hang(f"FAULT in-step {step}")
        return real_train(self, step, taken)

    loop.RunState.train = train
    return make_real(cfg, run_dir)
