"""Flawed-task lists: named files of tasks whose scores a reader may want to leave out.

A list is a file in a folder; its name (without extension) is the list's name. Formats:

- ``NAME.csv`` with a header ``id,reason,source``;
- ``NAME.jsonl``, one ``{"id": ..., "reason": ..., "source": ...}`` object per line;
- ``NAME.json``, a JSON array of such objects.

``reason`` says what is wrong with the task (an under-specified instruction, a flaky test...),
``source`` where that finding came from (a URL, a person, an audit). Every field is required, so a
list stays auditable. The report shows each score on all tasks and with each list's tasks dropped.

Published lists (DeepSWE v1.1's ``flawed/lists.json``: ``{"lists": [{"name", "source", "url",
"date", "task_ids", ...}]}``) are read as facts only: the ids, the list's name, source, URL and date
(:func:`load_published_lists`), never the sources' own wording of the reasons.
:func:`install_published_lists` writes them as list files into ``HOME/datasets/flawed/``, the folder
the report reads; :func:`ensure_flawed_lists` does so with the lists shipped in the package
(:data:`BUNDLED_LISTS`) in a new home. :func:`flawed_views` gives every score with and without each list and their union.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from sandboxes.files import NotARegularFile, check_regular_file, open_regular_text, read_regular_bytes, read_regular_text

FIELDS = ("id", "reason", "source")


class FlawedListError(ValueError):
    """A list file is malformed; the message names the file and the line or key."""


@dataclass(frozen=True)
class FlawedTask:
    id: str
    reason: str
    source: str


@dataclass(frozen=True)
class FlawedList:
    name: str
    path: str
    tasks: tuple[FlawedTask, ...]
    title: str = ""  # a published list's own name
    url: str = ""
    date: str = ""

    @property
    def ids(self) -> frozenset[str]:
        return frozenset(t.id for t in self.tasks)


def _entry(obj: object, where: str) -> FlawedTask:
    if not isinstance(obj, dict):
        raise FlawedListError(f"{where}: expected an object with keys {', '.join(FIELDS)}")
    for key in FIELDS:
        value = obj.get(key)
        if not isinstance(value, str) or not value.strip():
            raise FlawedListError(f"{where}: key {key!r} is missing or empty")
    return FlawedTask(obj["id"].strip(), obj["reason"].strip(), obj["source"].strip())


def load_flawed_list(path: str | Path) -> FlawedList:
    path = Path(path)
    try:
        check_regular_file(path)  # a FIFO or a device is refused at once, never waited on
    except NotARegularFile as exc:
        raise FlawedListError(f"{exc} (a flawed-task list)") from None
    entries: list[FlawedTask] = []
    if path.suffix == ".csv":
        with open_regular_text(path, newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or not set(FIELDS) <= set(reader.fieldnames):
                raise FlawedListError(f"{path}: header must name {', '.join(FIELDS)}; got {reader.fieldnames}")
            for lineno, row in enumerate(reader, 2):
                entries.append(_entry(row, f"{path}: line {lineno}"))
    elif path.suffix == ".jsonl":
        for lineno, line in enumerate(read_regular_text(path).splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise FlawedListError(f"{path}: line {lineno}: not valid JSON: {exc}") from exc
                entries.append(_entry(obj, f"{path}: line {lineno}"))
    elif path.suffix == ".json":
        try:
            data = json.loads(read_regular_text(path))
        except json.JSONDecodeError as exc:
            raise FlawedListError(f"{path}: not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise FlawedListError(f"{path}: expected a JSON array of entries")
        entries = [_entry(obj, f"{path}: entry {i}") for i, obj in enumerate(data)]
    else:
        raise FlawedListError(f"{path}: unknown list format (expected .csv, .jsonl or .json)")
    return FlawedList(path.stem, str(path), tuple(entries))


def load_flawed_lists(folder: str | Path) -> list[FlawedList]:
    """Every list file in ``folder`` (sorted by name); a missing folder means no lists."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = sorted(p for p in folder.iterdir() if p.suffix in (".csv", ".jsonl", ".json") and not p.name.startswith("."))
    lists = [load_flawed_list(p) for p in files]
    names = [fl.name for fl in lists]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise FlawedListError(f"{folder}: several files define list {dupes[0]!r}")
    return lists


# ---------------------------------------------------------------- published lists


def list_slug(title: str) -> str:
    """A file-safe short name of a published list (``Epoch AI benchmark review (...)`` -> ``epoch-ai-benchmark-review``)."""
    head = title.split("(", 1)[0]
    slug = re.sub(r"[^a-z0-9]+", "-", head.lower()).strip("-")
    return slug[:60].strip("-") or "list"


def load_published_lists(path: str | Path) -> list[FlawedList]:
    """The lists of a published ``lists.json`` (see the module docstring): ids with the list's name,
    source, URL and date. Each entry's ``reason`` says which list names it, ``source`` is the URL.
    A malformed file or list raises :class:`FlawedListError` naming the file and list."""
    path = Path(path)
    try:
        data = json.loads(read_regular_bytes(path).decode("utf-8"))  # a FIFO is refused, never waited on
    except OSError as exc:
        raise FlawedListError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FlawedListError(f"{path}: not UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("lists"), list):
        raise FlawedListError(f"{path}: expected an object with a list 'lists'")
    out: list[FlawedList] = []
    for i, entry in enumerate(data["lists"]):
        where = f"{path}: lists[{i}]"
        if not isinstance(entry, dict):
            raise FlawedListError(f"{where}: expected an object")
        for key in ("name", "url"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise FlawedListError(f"{where}: key {key!r} is missing or empty")
        ids = entry.get("task_ids")
        if not isinstance(ids, list) or not all(isinstance(t, str) and t.strip() for t in ids):
            raise FlawedListError(f"{where}: key 'task_ids' must be a list of task ids")
        title, url, date = entry["name"].strip(), entry["url"].strip(), str(entry.get("date", "")).strip()
        name = list_slug(title)
        if any(fl.name == name for fl in out):
            name = f"{name}-{i}"
        tasks = tuple(FlawedTask(t.strip(), f"named by the published list '{title}'" + (f" ({date})" if date else ""), url)
                      for t in dict.fromkeys(ids))
        out.append(FlawedList(name, str(path), tasks, title, url, date))
    return out


def install_published_lists(path: str | Path, home: str | Path) -> list[Path]:
    """Write the published lists of ``path`` as list files ``HOME/datasets/flawed/<name>.jsonl``
    (``id``, ``reason``, ``source``), where :func:`load_flawed_lists` and the report read them."""
    folder = Path(home) / "datasets" / "flawed"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for fl in load_published_lists(path):
        target = folder / f"{fl.name}.jsonl"
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps({"id": t.id, "reason": t.reason, "source": t.source}) + "\n"
                               for t in fl.tasks))
        tmp.replace(target)
        written.append(target)
    return written


# DeepSWE v1.1's published lists (facts only: titles, URLs, dates, task ids), shipped with the package
BUNDLED_LISTS = Path(__file__).with_name("deepswe_flawed_lists.json")


def ensure_flawed_lists(home: str | Path) -> Path:
    """``HOME/datasets/flawed``, with :data:`BUNDLED_LISTS` installed there when the folder does not
    exist yet (a new home); a folder that exists, even empty, is left as its owner made it."""
    folder = Path(home) / "datasets" / "flawed"
    if not folder.exists():
        install_published_lists(BUNDLED_LISTS, home)
    return folder


def union_list(lists: Sequence[FlawedList], name: str = "union") -> FlawedList:
    """One list of every task any of ``lists`` names (first entry of each id kept)."""
    seen: dict[str, FlawedTask] = {}
    for fl in lists:
        for t in fl.tasks:
            seen.setdefault(t.id, t)
    return FlawedList(name, "", tuple(seen.values()), f"union of {len(lists)} lists")


def flawed_views(rows: Sequence[Mapping[str, Any]] | Any, lists: Sequence[FlawedList], *,
                 k: int = 1) -> list[dict[str, Any]]:
    """Every score of attempt ``rows`` (:data:`evals.attempts.ROW_COLUMNS`; a list of dicts or a
    DataFrame) on all tasks, without each list's tasks, and without their union: one dict per view
    with ``view``, ``excluded`` (tasks of the rows the list drops), ``tasks``, ``attempts`` (graded),
    ``infra_errors``, ``pass@1``, ``pass@k`` (when ``k > 1``), ``target_score``,
    ``strict_target_score`` and ``partial`` (means over tasks of the per-task means). Attempts with
    ``status == "infra_error"`` are never scored."""
    # heavy: numpy (evals.metrics); only the flawed views need pass@k
    from evals.metrics import pass_at_k

    records = rows.to_dict("records") if hasattr(rows, "to_dict") else [dict(r) for r in rows]
    views = [("all", frozenset())] + [(f"without {fl.name}", fl.ids) for fl in lists]
    if len(lists) > 1:
        views.append(("without the union of all lists", union_list(lists).ids))
    present = {r["task_id"] for r in records}
    out = []
    for view, dropped in views:
        kept = [r for r in records if r["task_id"] not in dropped]
        graded = [r for r in kept if r.get("status") != "infra_error"]
        per_task: dict[str, list[Mapping[str, Any]]] = {}
        for r in graded:
            per_task.setdefault(r["task_id"], []).append(r)
        row: dict[str, Any] = {"view": view, "excluded": len(present & dropped), "tasks": len(per_task),
                               "attempts": len(graded), "infra_errors": len(kept) - len(graded)}

        def mean_over_tasks(fn) -> float:
            values = [v for v in (fn(group) for group in per_task.values()) if not math.isnan(v)]
            return sum(values) / len(values) if values else math.nan  # pass@k over tasks with k attempts

        row["pass@1"] = mean_over_tasks(lambda g: pass_at_k(len(g), sum(r["reward"] >= 1.0 for r in g), 1))
        if k > 1:
            row[f"pass@{k}"] = mean_over_tasks(
                lambda g: pass_at_k(len(g), sum(r["reward"] >= 1.0 for r in g), k) if len(g) >= k else math.nan)
        for metric in ("target_score", "strict_target_score", "partial"):
            row[metric] = mean_over_tasks(lambda g, m=metric: sum(float(r[m]) for r in g) / len(g))
        out.append(row)
    return out


def views_markdown(views: Sequence[Mapping[str, Any]]) -> str:
    """:func:`flawed_views` as a Markdown table."""
    if not views:
        return ""
    columns = list(views[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for v in views:
        cells = [f"{v[c]:.3f}" if isinstance(v[c], float) else str(v[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
