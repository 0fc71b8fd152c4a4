"""Partition backfills launched through the Dagster instance, as the UI launches them.

The ``launchPartitionBackfill`` GraphQL mutation runs against the project's workspace and the
instance under ``DAGSTER_HOME``: the backfill is stored in the instance and the daemon (started by
``posttrain ui`` or ``dagster-daemon run``) launches and finishes its runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import dagster as dg
from dagster._core.storage.tags import BACKFILL_ID_TAG

LAUNCH_BACKFILL = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on PartitionSetNotFoundError { message }
    ... on InvalidStepError { invalidStepKey }
    ... on InvalidOutputError { stepKey invalidOutputName }
    ... on UnauthorizedError { message }
  }
}
"""


def select_partitions(
    available: Sequence[str], partitions: Sequence[str] | None, start: str | None, end: str | None, asset: str
) -> list[str]:
    """The partition keys named by ``--partitions`` or by the inclusive range ``--from``/``--to``."""
    ordered = sorted(available)
    if partitions:
        unknown = [key for key in partitions if key not in set(ordered)]
        if unknown:
            raise ValueError(f"asset {asset!r} has no partition {', '.join(unknown)}; known: {', '.join(ordered) or 'none'}")
        return list(partitions)
    if start is None or end is None:
        raise ValueError("give --partitions A,B or both --from A and --to B")
    for bound in (start, end):
        if bound not in ordered:
            raise ValueError(f"asset {asset!r} has no partition {bound!r}; known: {', '.join(ordered) or 'none'}")
    selected = ordered[ordered.index(start) : ordered.index(end) + 1]
    if not selected:
        raise ValueError(f"--from {start} comes after --to {end}")
    return selected


def launch_backfill(workspace_file: Path, asset: str, partition_keys: Sequence[str],
                    run_config: dict | None = None) -> str:
    """Create a backfill of ``asset`` over ``partition_keys`` in the current instance, each run with
    ``run_config`` (none: the assets' defaults); return its id."""
    # heavy: Dagster's workspace loading and its GraphQL client (dagster_graphql, starlette); only a backfill needs them
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget
    from dagster_graphql.cli import execute_query

    params = {
        "partitionNames": list(partition_keys),
        "assetSelection": [{"path": [asset]}],
        "fromFailure": False,
    }
    if run_config:
        params["runConfigData"] = run_config
    with dg.DagsterInstance.get() as instance:
        with WorkspaceProcessContext(instance, WorkspaceFileTarget(paths=[str(workspace_file)])) as context:
            result = execute_query(context, LAUNCH_BACKFILL, {"params": params})
    if result.get("errors"):
        raise RuntimeError(f"launchPartitionBackfill failed: {result['errors'][0].get('message')}")
    payload = result["data"]["launchPartitionBackfill"]
    if payload["__typename"] != "LaunchBackfillSuccess":
        raise RuntimeError(f"launchPartitionBackfill returned {payload['__typename']}: {payload.get('message', payload)}")
    return payload["backfillId"]


def wait_for_backfill(backfill_id: str, timeout_s: float, poll_s: float = 2.0) -> dict[str, int]:
    """Poll until every run of the backfill has finished; return run counts by status."""
    deadline = time.monotonic() + timeout_s
    last = None
    with dg.DagsterInstance.get() as instance:
        while True:
            backfill = instance.get_backfill(backfill_id)
            runs = instance.get_runs(filters=dg.RunsFilter(tags={BACKFILL_ID_TAG: backfill_id}))
            counts: dict[str, int] = {}
            for run in runs:
                counts[run.status.value] = counts.get(run.status.value, 0) + 1
            state = (backfill.status.value if backfill else "MISSING", tuple(sorted(counts.items())))
            if state != last:
                print(f"backfill {backfill_id}: {state[0]}, runs {dict(counts) or 'none yet'}", flush=True)
                last = state
            finished = all(run.is_finished for run in runs)
            if backfill and backfill.status.value != "REQUESTED" and finished:
                return counts
            if time.monotonic() > deadline:
                raise TimeoutError(f"backfill {backfill_id} not finished after {timeout_s:.0f}s: is the daemon running?")
            time.sleep(poll_s)
