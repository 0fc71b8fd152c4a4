"""What isolation costs the grader: seconds to grade one committed patch in a bubblewrap sandbox
versus the same grading with ``pxd`` as a plain host process (the ``unisolated`` debug runtime).

Builds a small bundled suite (validated for real), commits each task's reference solution, and
grades every patch with both runtimes, interleaved so machine load hits both alike. Prints the
median seconds per grading of each and their ratio.

    .venv/bin/python bench/evals_grading.py [--per-level 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from evals.actions import apply_edits
from evals.bundled import build_suite
from evals.grading import committed_patch, grade_patch
from evals.sandbox import platform_sandbox_factory
from evals.tasks import load_bundled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-level", type=int, default=2, help="tasks per difficulty level (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="gradings of each patch per runtime (default: 3)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-evals-") as tmp:
        os.environ.setdefault("POSTTRAIN_SANDBOX_DIR", str(Path(tmp) / "sandboxes"))
        started = time.perf_counter()
        build_suite(Path(tmp) / "suite", per_level=args.per_level, workers=2)
        build_s = time.perf_counter() - started
        tasks = list(load_bundled(Path(tmp) / "suite").tasks)
        bwrap = platform_sandbox_factory("bwrap")
        plain = platform_sandbox_factory("unisolated", allow_unisolated=True)
        patches = {}
        for task in tasks:
            module = task.metadata["module_file"]
            edits = [(line, text) for _, line, text in task.metadata["reference_edits"]]
            with bwrap(task) as box:
                box.write_file(module, apply_edits(box.read_file(module).decode(), edits).encode())
                box.exec("git add -A && git commit -qm fix")
                patches[task.id] = committed_patch(box, task.base_commit)
        times: dict[str, list[float]] = {"bwrap": [], "unisolated": []}
        for _ in range(args.rounds):
            for task in tasks:
                for name, factory in (("bwrap", bwrap), ("unisolated", plain)):
                    t0 = time.perf_counter()
                    result = grade_patch(task, patches[task.id], factory)
                    times[name].append(time.perf_counter() - t0)
                    if result.scores is None or result.scores.reward != 1.0:
                        raise SystemExit(f"{task.id}: the reference patch did not pass under {name}: {result}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"suite of {len(tasks)} tasks built and validated in {build_s:.1f} s")
    print(f"grading one patch, median of {len(times['bwrap'])}: bwrap {med['bwrap']:.3f} s, "
          f"unisolated {med['unisolated']:.3f} s, ratio bwrap/unisolated {med['bwrap'] / med['unisolated']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
