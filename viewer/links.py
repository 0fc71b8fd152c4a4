"""Where the trajectory viewer is served, and the address of each of its pages.

Asset metadata links here (each ``rl_run`` step observation, each ``deepswe_eval`` partition, each
row of the per-task tables, TensorBoard through the viewer's ``/tensorboard``), so this module is
small and imports nothing heavy. The address a link takes is the one configured, never a fixed port:
``posttrain ui`` sets :data:`URL_ENV` for the processes it starts, and the viewer records where it
serves in the home (``HOME/viewer.json``, :data:`HOME_RECORD`) when it starts, so that a run or an
eval materialized later without ``posttrain ui`` (``posttrain demo``, ``posttrain eval``) links to the
viewer the researcher last served for that home. A link is written into the instance once: one
written before the viewer moved to another port keeps the old port.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

from sandboxes.home import default_home

DEFAULT_PORT = 3001
URL_ENV = "POSTTRAIN_VIEWER_URL"
HOME_RECORD = "viewer.json"  # {"url": <base URL the viewer serves this home on>}


def record_viewer_url(home: str | Path, url: str) -> Path:
    """Record in ``home`` that its viewer is served at ``url`` (in one rename)."""
    path = Path(home) / HOME_RECORD
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"url": url.rstrip("/")}) + "\n")
    tmp.replace(path)
    return path


def recorded_viewer_url(home: str | Path) -> str:
    """The URL ``home``'s viewer last recorded (:func:`record_viewer_url`), '' when none is."""
    try:
        url = json.loads((Path(home) / HOME_RECORD).read_text()).get("url", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else ""


def viewer_url() -> str:
    """The viewer's base URL: ``$POSTTRAIN_VIEWER_URL``, else the one the home's viewer recorded,
    else ``http://127.0.0.1:3001``."""
    return (os.environ.get(URL_ENV) or recorded_viewer_url(default_home())
            or f"http://127.0.0.1:{DEFAULT_PORT}").rstrip("/")


def _q(part: str | int) -> str:
    return quote(str(part), safe="")


def run_path(run: str) -> str:
    return f"/runs/{_q(run)}"


def step_path(run: str, step: int) -> str:
    return f"/runs/{_q(run)}/steps/{int(step)}"


def rollout_path(run: str, rollout_id: str) -> str:
    return f"/runs/{_q(run)}/rollouts/{_q(rollout_id)}"


def checkpoint_path(checkpoint: str) -> str:
    return f"/evals/{_q(checkpoint)}"


def task_path(checkpoint: str, task_id: str) -> str:
    return f"/evals/{_q(checkpoint)}/tasks/{_q(task_id)}"


def attempt_path(checkpoint: str, task_id: str, attempt: int) -> str:
    return f"/evals/{_q(checkpoint)}/tasks/{_q(task_id)}/attempts/{int(attempt)}"


def url(path: str, base: str | None = None) -> str:
    """``path`` (one of the ``*_path`` above) on the viewer at ``base`` (default :func:`viewer_url`)."""
    return (base or viewer_url()).rstrip("/") + path
