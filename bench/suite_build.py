"""The bundled suite's build with the ``task_dataset`` asset's old worker count against the default,
side by side in one run.

Builds the default suite (``evals.bundled.build_suite``: 540 tasks written, each validated in real
sandboxes: the base fails its targets, the reference solution scores 1) twice into a scratch folder,
one build after the other: ``--before`` workers (2, the asset's setting before
``evals.bundled.default_build_workers``), then ``--after`` (that default: four per core). Each
worker writes its tasks' repositories too (before that change they were written one by one). Each
build has its own image store and layer cache (``POSTTRAIN_SANDBOX_DIR``), empty at its start, as
in a fresh home. Prints each build's wall seconds and the machine's busy CPU over it (``/proc/stat``:
what the cores did, the sandboxes' short processes included), and the ratio of the wall times. Run
it on a machine doing nothing else.

    .venv/bin/python bench/suite_build.py --out /tmp/suite-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from evals.bundled import build_suite, default_build_workers
from loop_profile import machine_busy_s  # bench/loop_profile.py (this folder is on sys.path)


def timed_build(out: Path, workers: int) -> dict:
    """One build into ``out/suite`` with images and unpacked layers of its own under ``out/sandboxes``
    (a fresh home's: the second build must not find the first one's layers unpacked)."""
    shutil.rmtree(out, ignore_errors=True)
    os.environ["POSTTRAIN_SANDBOX_DIR"] = str(out / "sandboxes")
    busy0, t0 = machine_busy_s(), time.monotonic()
    summary = build_suite(out / "suite", workers=workers)
    wall = time.monotonic() - t0
    busy = machine_busy_s() - busy0
    return {"workers": workers, "wall_s": wall, "busy_s": busy, "tasks": summary["n_tasks"],
            "fingerprint": summary["fingerprint"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a scratch folder; both suites are built under it")
    parser.add_argument("--before", type=int, default=2, help="validation workers of the first build (default %(default)s)")
    parser.add_argument("--after", type=int, default=default_build_workers(),
                        help="workers of the second build (default %(default)s: the default, four per core)")
    args = parser.parse_args()
    results = [timed_build(args.out / f"workers{w}", w) for w in (args.before, args.after)]
    cores = os.cpu_count() or 1
    for r in results:
        print(f"workers {r['workers']}: {r['tasks']} tasks in {r['wall_s']:.1f} s; the machine busy "
              f"{r['busy_s']:.1f} s = {r['busy_s'] / r['wall_s']:.2f} of {cores} cores; suite {r['fingerprint']}")
    before, after = results
    if before["fingerprint"] != after["fingerprint"]:
        raise SystemExit("the two builds made different suites")
    print(f"ratio: {after['wall_s']:.1f} s against {before['wall_s']:.1f} s = {after['wall_s'] / before['wall_s']:.2f}x "
          f"the wall time ({before['wall_s'] / after['wall_s']:.2f}x as fast)")
    print(json.dumps(results))
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
