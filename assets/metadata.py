"""How assets show numbers, plots and tables in the Dagster UI: the helpers every asset family shares."""

import base64
import math
from pathlib import Path
from typing import Any

import dagster as dg

from viewer import links


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats rounded for display (0.415, not 0.41500000000000004); other values as they are."""
    return round(float(value), digits) if isinstance(value, float) else value


def png_markdown(path: Path, title: str) -> str:
    """A PNG inline in Markdown metadata (a data URI), so the UI shows it without a file server."""
    return f"![{title}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"


# columns of the per-task tables (deepswe_eval, eval_report): name -> Dagster column type
PER_TASK_COLUMNS = {"task_id": "string", "level": "int", "base": "string", "checkpoint": "string",
                    "base_pass@1": "float", "pass@1": "float", "change": "float", "flip": "string",
                    "flagged": "int", "flawed": "string", "viewer": "string"}


def _number(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else round(float(value), 4)


def per_task_table(rows: list[dict[str, Any]], checkpoint: str) -> dg.TableMetadataValue:
    """The per-task rows of :func:`viewer.data.task_table` as Dagster table metadata: passes out of
    graded attempts at the base model and at ``checkpoint``, pass@1 of each and the change, the flip
    (``gained``: solved now and never by the base model; ``lost``: the other way round), flagged
    attempts, the flawed lists naming the task and the task's page in the viewer. Flips first."""
    order = {"gained": 0, "lost": 1, "": 2}
    base = links.viewer_url()  # the configured viewer (viewer.links), read once for every row
    records = [dg.TableRecord(data={
        "task_id": r["task_id"], "level": int(r["level"]),
        "base": f"{r['base_passes']}/{r['base_attempts']}" if r["base_attempts"] is not None else "",
        "checkpoint": f"{r['passes']}/{r['attempts']}", "base_pass@1": _number(r["base_pass@1"]),
        "pass@1": _number(r["pass@1"]), "change": _number(r["change"]), "flip": r["flip"], "flagged": int(r["flagged"]),
        "flawed": ", ".join(r["flawed"]), "viewer": links.url(links.task_path(checkpoint, r["task_id"]), base),
    }) for r in sorted(rows, key=lambda r: (order[r["flip"]], r["task_id"]))]
    return dg.MetadataValue.table(records, dg.TableSchema(columns=[dg.TableColumn(n, t) for n, t in PER_TASK_COLUMNS.items()]))
