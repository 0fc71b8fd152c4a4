"""The local Dagster instance that the CLI, the demo and the UI share.

``DAGSTER_HOME`` defaults to ``$POSTTRAIN_HOME/dagster``; its ``dagster.yaml`` is written on first
use (an existing one is left as it is) with telemetry and the first-run pop-up turned off, so the UI
opens straight onto the graph, and with the concurrency rules of an RL platform:

- Training and evaluation are limited separately, so checkpoint evals run while a run trains. Every
  run that trains carries the run tag ``posttrain/workload=train``, every eval run
  ``posttrain/workload=eval`` (the jobs and the sensor set them); the queue lets
  :data:`TRAIN_RUNS` training runs and :data:`EVAL_RUNS` eval runs go at once, and
  ``max_concurrent_runs`` (:data:`MAX_RUNS`) leaves room for both plus a report. The same limits
  hold for the ops themselves through pools (``rl_run`` is in pool ``train``, ``deepswe_eval`` in
  pool ``eval``), so materializing ``rl_run`` from the asset graph, where no job sets the tag,
  still never runs two trainers. Change a pool's limit with ``dagster instance concurrency set eval 4``.
- Run retries: the daemon re-executes a run that crashed (its process died) when its job says
  ``dagster/max_retries``; eval runs do (2), failures inside an op are left to its ``RetryPolicy``.
- Declarative automation: the daemon's automation sensors evaluate ``AutomationCondition``s, so
  ``eval_report`` refreshes after any ``deepswe_eval`` partition.
"""

from __future__ import annotations

import os
from pathlib import Path

from sandboxes.home import HOME_ENV, default_home

WORKLOAD_TAG = "posttrain/workload"
TRAIN_RUNS = 1
EVAL_RUNS = 2
MAX_RUNS = TRAIN_RUNS + EVAL_RUNS + 1  # one more for eval_report or an image build
TRAIN_POOL = "train"
EVAL_POOL = "eval"
POOL_LIMITS = {TRAIN_POOL: TRAIN_RUNS, EVAL_POOL: EVAL_RUNS}

DAGSTER_YAML = f"""\
telemetry:
  enabled: false
nux:
  enabled: false
run_coordinator:
  module: dagster._core.run_coordinator
  class: QueuedRunCoordinator
concurrency:
  runs:
    max_concurrent_runs: {MAX_RUNS}
    tag_concurrency_limits:
      - key: "{WORKLOAD_TAG}"
        value: "train"
        limit: {TRAIN_RUNS}
      - key: "{WORKLOAD_TAG}"
        value: "eval"
        limit: {EVAL_RUNS}
  pools:
    granularity: op
    default_limit: 1
run_retries:
  enabled: true
  max_retries: 0
  retry_on_asset_or_op_failure: false
auto_materialize:
  enabled: true
  use_sensors: true
"""


def ensure_dagster_home(home: str | None = None) -> Path:
    """Set ``POSTTRAIN_HOME`` and ``DAGSTER_HOME`` for this process, write ``dagster.yaml`` if missing
    and give the pools their limits (:data:`POOL_LIMITS`) where none is set yet."""
    root = Path(home).expanduser().resolve() if home else default_home()
    os.environ[HOME_ENV] = str(root)
    dagster_home = Path(os.environ.get("DAGSTER_HOME") or root / "dagster").resolve()
    dagster_home.mkdir(parents=True, exist_ok=True)
    config = dagster_home / "dagster.yaml"
    if not config.exists():
        tmp = config.with_suffix(".yaml.tmp")
        tmp.write_text(DAGSTER_YAML)
        tmp.replace(config)
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    set_pool_limits(dagster_home)
    return dagster_home


def set_pool_limits(dagster_home: Path) -> dict[str, int]:
    """The limit of each posttrain pool in the instance; one nobody set yet gets :data:`POOL_LIMITS`'s."""
    # heavy: dagster (about 750 modules); the other helpers here need only the folder
    import dagster as dg

    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        storage = instance.event_log_storage
        if not storage.supports_global_concurrency_limits:
            return {}
        limits = {limit.name: limit.limit for limit in storage.get_pool_limits() if not limit.from_default}
        for pool, limit in POOL_LIMITS.items():
            if pool not in limits:
                storage.set_concurrency_slots(pool, limit)
                limits[pool] = limit
    return {pool: limits[pool] for pool in POOL_LIMITS}
