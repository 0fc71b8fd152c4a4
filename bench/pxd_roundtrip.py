"""pxd command round trip for ``true``, p50 and p99, against a plain subprocess on the host.

    .venv/bin/python bench/pxd_roundtrip.py                 # about a minute on 2 cores
    .venv/bin/python bench/pxd_roundtrip.py --calls 2000 --runtimes bwrap

Per runtime, one sandbox is started and ``sb.pxd.exec(["true"])`` is timed on the client (JSON
request over the pipe, pxd spawns ``true`` inside the sandbox, waits, answers). The baseline is
``subprocess.run(["true"])`` from the same host process. The calls alternate (one pxd, one host),
so both see the same load. Overhead = pxd p50 - host p50.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sandboxes  # noqa: E402


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--runtimes", default="bwrap,gvisor,unisolated")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        repo = work / "task"
        repo.mkdir()
        (repo / "README").write_text("bench\n")
        store, cache = sandboxes.ImageStore(work / "images"), sandboxes.LayerCache(work / "cache")
        print(f"{'runtime':<11} {'calls':>6} {'pxd p50 ms':>11} {'pxd p99 ms':>11} {'host p50 ms':>12} "
              f"{'host p99 ms':>12} {'overhead p50 ms':>16} {'pxd/host p50':>13}")
        for runtime in args.runtimes.split(","):
            calls = args.calls if runtime != "gvisor" else max(50, args.calls // 4)
            with sandboxes.start(repo, runtime=runtime, store=store, cache=cache,
                                 allow_unisolated=runtime == "unisolated") as sb:
                for _ in range(20):  # warm up both paths
                    sb.pxd.exec(["true"])
                    subprocess.run(["true"])
                pxd, host = [], []
                for _ in range(calls):
                    t = time.perf_counter()
                    r = sb.pxd.exec(["true"])
                    pxd.append(time.perf_counter() - t)
                    assert r.exit_code == 0
                    t = time.perf_counter()
                    subprocess.run(["true"])
                    host.append(time.perf_counter() - t)
            p50, h50 = statistics.median(pxd), statistics.median(host)
            print(f"{runtime:<11} {calls:>6} {p50 * 1e3:>11.3f} {pct(pxd, 99) * 1e3:>11.3f} {h50 * 1e3:>12.3f} "
                  f"{pct(host, 99) * 1e3:>12.3f} {(p50 - h50) * 1e3:>16.3f} {p50 / h50:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
