"""The CPU a pxd start costs (user + system of ``python -I -S pxd.py --help``, which imports
everything the daemon imports and exits), against a bare interpreter start, and optionally against
another copy of pxd.py (an older version, to see what a change saved).

    .venv/bin/python bench/pxd_start.py [--runs 40] [--other OLD_PXD.py]

Every episode starts two sandboxes (its own and its grading's), each running pxd; the interpreter
is the harness's own (bound read-only into the sandbox), and the sandboxes start the daemon
compiled (``sandboxes.runtimes.compiled_pxd``). Runs of each kind are
interleaved, so load from elsewhere falls on all of them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PXD = ROOT / "sandboxes" / "pxd.py"
sys.path.insert(0, str(ROOT))

from sandboxes.runtimes import compiled_pxd  # noqa: E402


def cpu_ms(argv: list[str]) -> float:
    """User + system CPU of one run of ``argv``, in milliseconds."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return 1000 * (usage.ru_utime + usage.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter (default: this one, which the local sandboxes run pxd with; "
                             "the compiled form is measured only for it)")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--other", type=Path, default=None, help="another pxd.py to compare (e.g. git show REV:sandboxes/pxd.py)")
    args = parser.parse_args()
    kinds = {"bare interpreter (-c pass)": [args.python, "-I", "-S", "-c", "pass"],
             "pxd.py (this checkout, from source)": [args.python, "-I", "-S", str(PXD), "--help"]}
    if os.path.realpath(args.python) == os.path.realpath(sys.executable):
        kinds["pxd.pyc (this checkout, compiled: as sandboxes start it)"] = [
            args.python, "-I", "-S", str(compiled_pxd()), "--help"]
    if args.other:
        if not args.other.is_file():
            raise SystemExit(f"--other {args.other}: no such file")
        kinds[f"pxd.py ({args.other})"] = [args.python, "-I", "-S", str(args.other), "--help"]
    runs: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.runs):
        for name, argv in kinds.items():
            runs[name].append(cpu_ms(argv))
    base_name = f"pxd.py ({args.other})" if args.other else "bare interpreter (-c pass)"
    base = statistics.median(runs[base_name])
    print(f"{args.python}, {args.runs} runs each, median CPU (user + system) per start; ratio against {base_name}")
    print("| start | CPU ms | ratio |")
    print("| --- | --- | --- |")
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
