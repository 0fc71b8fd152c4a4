"""How long the trajectory viewer takes to serve the page of a step with 1,000 rollouts, against
reading the same rows from the rollout store alone, side by side in one run.

Writes a run of ``--groups`` x ``--group-size`` rollouts (``--tokens`` tokens each, a quarter of them
generated, an ``info`` like the trainer's) through ``training.store.RolloutStore`` and has step 1
take them all; serves the viewer (uvicorn on loopback, in this process) and times ``GET
/runs/bench/steps/1`` (the whole page: groups, rollouts, advantages, five histograms) over HTTP.
The baseline reads the rows the page lists (no token arrays) from SQLite and parses each ``info``.
Printed: the median of ``--repeats`` of each, and their ratio.

    .venv/bin/python bench/viewer_step_page.py          # ~20 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.checkpoint import run_path, store_path  # noqa: E402
from training.rollout import Rollout  # noqa: E402
from training.store import RolloutStore  # noqa: E402
from viewer.app import serve_in_thread  # noqa: E402


def write_run(home: Path, groups: int, group_size: int, tokens: int) -> Path:
    rng = random.Random(0)
    run = run_path(home, "bench")
    store = RolloutStore(store_path(run))
    generated = tokens // 4
    for g in range(groups):
        group_id = f"g{g:04d}"
        store.add_group(group_id, f"task-{g % 135:03d}", 0, group_size)
        for i in range(group_size):
            mask = [0] * (tokens - generated) + [1] * generated
            reward = float(rng.random() < 0.3)
            store.put(Rollout(f"{group_id}-{i}", group_id, f"task-{g % 135:03d}", 0,
                              [rng.randrange(50_000) for _ in range(tokens)], mask,
                              [-rng.random() if m else 0.0 for m in mask], reward,
                              {"stop_reason": "commit", "turns": rng.randint(1, 5), "committed": True,
                               "agent_s": 20.0, "grade_s": 3.0, "generation_s": 12.0, "grade_status": "graded"}))
    take = store.take_groups(groups, step=1, min_adapter_step=0)
    assert len(take.groups) == groups
    store.close()
    return run


def read_rows(run: Path) -> int:
    conn = sqlite3.connect(f"file:{store_path(run)}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT rollout_id, group_id, task_id, adapter_version, reward, total_tokens, "
                            "generated_tokens, status, status_step, info FROM rollouts WHERE status_step=1 "
                            "ORDER BY created_s").fetchall()
    finally:
        conn.close()
    return sum(1 for r in rows if json.loads(r[9]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=125)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        run = write_run(home, args.groups, args.group_size, args.tokens)
        rollouts = args.groups * args.group_size
        page_s, rows_s = [], []
        with serve_in_thread(home) as url:
            urllib.request.urlopen(f"{url}/runs/bench/steps/1", timeout=60).read()  # warm: imports, caches
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                assert read_rows(run) == rollouts
                rows_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with urllib.request.urlopen(f"{url}/runs/bench/steps/1", timeout=60) as resp:
                    body = resp.read()
                page_s.append(time.perf_counter() - t0)
                assert resp.status == 200 and f"{rollouts} rollout(s)".encode() in body
    page, rows = statistics.median(page_s), statistics.median(rows_s)
    print(f"step page with {rollouts} rollouts ({args.tokens} tokens each): {page * 1000:.0f} ms "
          f"({len(body) / 1e6:.2f} MB of HTML); the same rows from SQLite alone: {rows * 1000:.0f} ms; "
          f"ratio {page / rows:.1f}x (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
