"""Per-step training metrics, written as Parquet under ``<run>/metrics/``.

``steps.parquet``: one row per step (loss, rewards, policy age, waits, throughput, discards, and the
integrity gate's counts: ``integrity_gated`` attempts caught, ``integrity_<signal>`` per cheating signal).
``bins.parquet``: per step, samples and tokens used and discarded in bins of completion length and
of policy age, so one sees whether long or stale rollouts are the ones thrown away.
Both files are rewritten whole after each step under a temporary name and renamed (a run has at most
thousands of steps, so this stays small); on resume rows after the resumed step are dropped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from training.store import Group

LENGTH_BINS = (0, 32, 64, 128, 256, 512, 1024, 2048, 1 << 30)


def length_bin(tokens: int) -> str:
    for lo, hi in zip(LENGTH_BINS, LENGTH_BINS[1:]):
        if lo <= tokens < hi:
            return f"{lo}-{hi - 1}" if hi < (1 << 30) else f">={lo}"
    return f">={LENGTH_BINS[-2]}"


def bin_rows(step: int, used: Iterable[Group], discarded: Iterable[Group], trainer_step: int) -> list[dict[str, Any]]:
    """Rows of ``bins.parquet`` for one step."""
    acc: dict[tuple[str, str], dict[str, int]] = {}
    for status, groups in (("used", used), ("discarded", discarded)):
        for group in groups:
            for r in group.rollouts:
                for kind, label in (("length", length_bin(r.generated_tokens)),
                                    ("age", str(trainer_step - r.adapter_step))):
                    cell = acc.setdefault((kind, label), {"used_samples": 0, "used_tokens": 0,
                                                          "discarded_samples": 0, "discarded_tokens": 0})
                    cell[f"{status}_samples"] += 1
                    cell[f"{status}_tokens"] += r.generated_tokens
    return [{"step": step, "kind": k, "bin": b, **v} for (k, b), v in sorted(acc.items())]


class MetricsWriter:
    def __init__(self, directory: Path, resume_step: int = 0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.steps = self._read("steps.parquet", resume_step)
        self.bins = self._read("bins.parquet", resume_step)

    def _read(self, name: str, resume_step: int) -> list[dict[str, Any]]:
        path = self.directory / name
        if not path.is_file():
            return []
        frame = pd.read_parquet(path)
        return frame[frame["step"] <= resume_step].to_dict("records")

    def record(self, step_row: dict[str, Any], bins: list[dict[str, Any]]) -> None:
        self.steps.append(step_row)
        self.bins.extend(bins)
        self._write("steps.parquet", self.steps)
        self._write("bins.parquet", self.bins)

    def _write(self, name: str, rows: list[dict[str, Any]]) -> None:
        tmp = self.directory / f".tmp-{name}"
        pd.DataFrame(rows).to_parquet(tmp, index=False)
        os.replace(tmp, self.directory / name)
