"""Load benchmark: the rollout store under concurrent writer processes and a trainer reading.

    .venv/bin/python bench/load_store.py                        # 4 writers x 150 groups of 8, 2k-token rollouts
    .venv/bin/python bench/load_store.py --writers 8 --tokens 8192

Each writer is its own process (as producers on other hosts sharing the run volume would be, or
threads of one producer: SQLite serializes them the same way), announcing groups and storing each
rollout with ``put`` (one durable commit each, ``synchronous=FULL``). At the same time a trainer
process takes whole groups (``take_groups``, 4 at a time) as they complete. Printed: rollouts stored
per second, put latency p50/p99 (writer side), take latency p50/p99, and the checks: every rollout
stored once, every group taken exactly once, nothing left ready.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.store import RolloutStore  # noqa: E402

WRITER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from training.rollout import Rollout
from training.store import RolloutStore
db, w, groups, size, tokens = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
store = RolloutStore(db)
lat = []
for g in range(groups):
    gid = f"w{w}-g{g:05d}"
    store.add_group(gid, "task", 0, size)
    for i in range(size):
        r = Rollout(f"{gid}-{i}", gid, "task", 0, list(range(tokens)), [0] + [1] * (tokens - 1),
                    [0.0] + [-0.5] * (tokens - 1), float(i % 2))
        t0 = time.perf_counter()
        store.put(r)
        lat.append(time.perf_counter() - t0)
print(json.dumps(lat))
"""

READER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from training.store import RolloutStore
db, total_groups = sys.argv[2], int(sys.argv[3])
store = RolloutStore(db)
taken, lat, step = [], [], 0
deadline = time.monotonic() + 600
while len(taken) < total_groups and time.monotonic() < deadline:
    step += 1
    t0 = time.perf_counter()
    got = store.take_groups(4, step=step, min_adapter_step=0).groups
    if got:
        lat.append(time.perf_counter() - t0)
    taken += [g.group_id for g in got]
    if not got:
        time.sleep(0.01)
print(json.dumps({"taken": taken, "lat": lat}))
"""


def run(*, writers: int = 4, groups: int = 150, size: int = 8, tokens: int = 2048, workdir: Path | None = None) -> dict:
    db = Path(workdir or tempfile.mkdtemp(prefix="store-load-")) / "rollouts.sqlite"
    RolloutStore(db).close()
    started = time.perf_counter()
    reader = subprocess.Popen([sys.executable, "-c", READER, str(ROOT), str(db), str(writers * groups)],
                              stdout=subprocess.PIPE, text=True)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT), str(db), str(w), str(groups), str(size), str(tokens)],
                              stdout=subprocess.PIPE, text=True) for w in range(writers)]
    put_lat = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        put_lat += json.loads(out)
    write_s = time.perf_counter() - started
    out, _ = reader.communicate(timeout=600)
    read = json.loads(out)
    counts = RolloutStore(db).counts()
    put_lat.sort()
    take_lat = sorted(read["lat"])

    def q(values, p):
        return values[min(len(values) - 1, int(p * len(values)))] * 1e3 if values else float("nan")

    return {
        "writers": writers, "rollouts": writers * groups * size, "groups": writers * groups, "tokens": tokens,
        "stored": counts["consumed"] + counts["ready"] + counts["discarded"],
        "taken_groups": len(read["taken"]), "taken_twice": len(read["taken"]) - len(set(read["taken"])),
        "left_ready": counts["ready"], "write_s": write_s, "rollouts_per_s": writers * groups * size / write_s,
        "put_p50_ms": q(put_lat, 0.5), "put_p99_ms": q(put_lat, 0.99),
        "take_p50_ms": q(take_lat, 0.5), "take_p99_ms": q(take_lat, 0.99),
        "db_mib": db.stat().st_size / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--groups", type=int, default=150, help="groups per writer")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    r = run(writers=args.writers, groups=args.groups, size=args.size, tokens=args.tokens)
    print(f"{r['writers']} writer processes + 1 trainer process: {r['rollouts']} rollouts of {r['tokens']} tokens "
          f"in {r['groups']} groups of {args.size}")
    print(f"stored {r['stored']}/{r['rollouts']}, groups taken {r['taken_groups']}/{r['groups']} "
          f"(taken twice: {r['taken_twice']}), left ready {r['left_ready']}")
    print(f"{r['rollouts_per_s']:.0f} rollouts/s stored ({r['write_s']:.1f} s, store {r['db_mib']:.0f} MiB); "
          f"put p50 {r['put_p50_ms']:.1f} ms, p99 {r['put_p99_ms']:.1f} ms; "
          f"take_groups p50 {r['take_p50_ms']:.1f} ms, p99 {r['take_p99_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
