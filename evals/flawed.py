"""Flawed-task lists: named files of tasks whose scores a reader may want to leave out.

A list is a file in a folder; its name (without extension) is the list's name. Formats:

- ``NAME.csv`` with a header ``id,reason,source``;
- ``NAME.jsonl``, one ``{"id": ..., "reason": ..., "source": ...}`` object per line;
- ``NAME.json``, a JSON array of such objects.

``reason`` says what is wrong with the task (an under-specified instruction, a flaky test...),
``source`` where that finding came from (a URL, a person, an audit). Every field is required, so a
list stays auditable. The report shows each score on all tasks and with each list's tasks dropped.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

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
    entries: list[FlawedTask] = []
    if path.suffix == ".csv":
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or not set(FIELDS) <= set(reader.fieldnames):
                raise FlawedListError(f"{path}: header must name {', '.join(FIELDS)}; got {reader.fieldnames}")
            for lineno, row in enumerate(reader, 2):
                entries.append(_entry(row, f"{path}: line {lineno}"))
    elif path.suffix == ".jsonl":
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise FlawedListError(f"{path}: line {lineno}: not valid JSON: {exc}") from exc
                entries.append(_entry(obj, f"{path}: line {lineno}"))
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
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
