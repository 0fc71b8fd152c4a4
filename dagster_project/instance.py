"""The local Dagster instance that the CLI, the demo and the UI share.

``DAGSTER_HOME`` defaults to ``$POSTTRAIN_HOME/dagster``; its ``dagster.yaml`` is written on first
use with telemetry and the first-run pop-up turned off, so the UI opens straight onto the graph.
"""

from __future__ import annotations

import os
from pathlib import Path

from sandboxes.home import HOME_ENV, default_home

DAGSTER_YAML = """\
telemetry:
  enabled: false
nux:
  enabled: false
run_coordinator:
  module: dagster._core.run_coordinator
  class: QueuedRunCoordinator
  config:
    max_concurrent_runs: 1
"""


def ensure_dagster_home(home: str | None = None) -> Path:
    """Set ``POSTTRAIN_HOME`` and ``DAGSTER_HOME`` for this process and write ``dagster.yaml`` if missing."""
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
    return dagster_home
