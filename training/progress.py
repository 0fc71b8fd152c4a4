"""Progress of a training run: through Dagster Pipes when ``rl_run`` launched the process, plain
stdout lines otherwise."""

from __future__ import annotations

import json
from typing import Any


class Reporter:
    def __init__(self) -> None:
        self._pipes = None
        self._cm = None

    def __enter__(self) -> "Reporter":
        import os

        from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, open_dagster_pipes

        if os.environ.get(DAGSTER_PIPES_CONTEXT_ENV_VAR):
            self._cm = open_dagster_pipes()
            self._pipes = self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)

    def info(self, message: str) -> None:
        if self._pipes is not None:
            self._pipes.log.info(message)
        print(message, flush=True)

    def step(self, row: dict[str, Any], published: Any) -> None:
        line = (f"step {row['step']:4d} loss {row['loss']:+.4f} solve {row['solve_rate']:.3f} "
                f"groups {row['groups']} (zero-var {row['zero_variance_groups']}, stale {row['discarded_groups']}) "
                f"age {row['policy_age_mean']:.2f}/{row['policy_age_max']} wait {row['wait_s']:.1f}s "
                f"train {row['train_s']:.1f}s publish {published.http_s + published.volume_s:.2f}s")
        print(line, flush=True)
        if self._pipes is not None:
            self._pipes.report_custom_message({"step": row, "adapter_version": published.version})
            self._pipes.log.info(line)

    def done(self, state: Any) -> None:
        rows = state.metrics.steps
        summary = {
            "steps": state.step,
            "final_solve_rate": rows[-1]["solve_rate"] if rows else None,
            "rollouts": state.store.counts(),
        }
        print("done " + json.dumps(summary, default=str), flush=True)
        if self._pipes is not None:
            self._pipes.log.info("done " + json.dumps(summary, default=str))
