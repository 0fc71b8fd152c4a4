"""How long the trajectory viewer takes to serve a checkpoint's page for the demo's eval size (450
held-out tasks, 2 attempts each, against the base model's eval of the same tasks), against reading
the two checkpoints' attempt rows with pandas alone, side by side in one run.

Writes two eval runs (``evals/deepswe/bench-step_000000`` and ``bench-step_000044``) of ``--tasks``
tasks x ``--attempts`` attempts through ``evals.attempts.write_rows``, each row with a transcript,
diff and test output of about the demo's size (``--text-kb``), three levels; serves the viewer
(uvicorn on loopback, in this process) over a home with the published flawed lists installed, and times ``GET /evals/bench-step_000044`` (the whole page:
pass@1 with bootstrap intervals overall and per level, the paired change, 450 task rows) over HTTP.
The baseline reads both Parquet files whole with pandas. Printed: the median of ``--repeats`` of
each, and their ratio.

    nice -n 5 .venv/bin/python bench/viewer_checkpoint_page.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402

from evals.attempts import ROW_COLUMNS, write_rows  # noqa: E402
from evals.flawed import ensure_flawed_lists  # noqa: E402
from viewer.app import serve_in_thread  # noqa: E402

BASE, FINAL = "bench-step_000000", "bench-step_000044"


def write_evals(home: Path, tasks: int, attempts: int, text_kb: int) -> list[Path]:
    rng = random.Random(0)
    words = [f"{w}{i}" for i, w in enumerate(["def", "return", "self", "value", "assert", "line", "test"] * 40)]

    def text(n_bytes: int) -> str:  # code-like text that compresses as a transcript does, not as one repeated line
        out, size = [], 0
        while size < n_bytes:
            line = " ".join(rng.choice(words) for _ in range(8)) + "\n"
            out.append(line)
            size += len(line)
        return "".join(out)

    paths = []
    for checkpoint, solve in ((BASE, 0.35), (FINAL, 0.40)):
        rows = []
        for t in range(tasks):
            level = 1 + t % 3
            for a in range(attempts):
                passed = rng.random() < solve / level
                row = {c: None for c in ROW_COLUMNS}
                row.update(checkpoint=checkpoint, adapter_version=None, task_id=f"bundled-l{level}-{t:03d}-bench",
                           source="bundled", difficulty=level, split="eval", attempt=a,
                           status="graded", reward=1.0 if passed else 0.0, f2p=float(passed), p2p=1.0,
                           partial=float(passed), target_score=float(passed), strict_target_score=float(passed),
                           f2p_total=1, f2p_passed=int(passed), p2p_total=3, p2p_passed=3, committed=True,
                           stop_reason="commit", turns=3, output_tokens=400, agent_s=20.0, grade_s=3.0,
                           infra_retries=0, detail="", session_id=f"{checkpoint}/{t}/{a}", signals="",
                           diff=text(2000), test_outcomes=json.dumps([{"test": "t", "kind": "target",
                                                                          "outcome": "passed" if passed else "failed"}]),
                           test_output=text(4000),
                           transcript=json.dumps([{"role": "task", "text": text(text_kb * 1024)}]))
                rows.append(row)
        paths.append(write_rows(rows, home / "evals" / "deepswe" / checkpoint / "run-1.parquet"))
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=450)
    parser.add_argument("--attempts", type=int, default=2)
    parser.add_argument("--text-kb", type=int, default=12, help="transcript size of an attempt (KiB)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        paths = write_evals(home, args.tasks, args.attempts, args.text_kb)
        ensure_flawed_lists(home)  # the published flawed lists, as every eval installs them in a home
        page_s, rows_s = [], []
        with serve_in_thread(home) as url:
            urllib.request.urlopen(f"{url}/evals/{FINAL}", timeout=120).read()  # warm: imports, caches
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                assert sum(len(pd.read_parquet(p)) for p in paths) == 2 * args.tasks * args.attempts
                rows_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with urllib.request.urlopen(f"{url}/evals/{FINAL}", timeout=120) as resp:
                    body = resp.read()
                page_s.append(time.perf_counter() - t0)
                assert resp.status == 200 and b'id="summary"' in body and body.count(b"<tr class=") == args.tasks
    page, rows = statistics.median(page_s), statistics.median(rows_s)
    print(f"checkpoint page of {args.tasks} tasks x {args.attempts} attempts against its base (95% intervals overall "
          f"and per level): {page * 1000:.0f} ms ({len(body) / 1e6:.2f} MB of HTML); both eval runs' rows read whole "
          f"with pandas: {rows * 1000:.0f} ms; ratio {page / rows:.2f}x (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
