"""The set-up's installs with uv against pip, side by side in one run, each on a fresh clone with
cold caches (as on a fresh machine).

    .venv/bin/python bench/setup_install.py [--rounds 1] [--work /tmp/setup-bench]

Each round clones this checkout's HEAD twice and runs ``bash scripts/setup.sh`` in each clone, once
with ``POSTTRAIN_INSTALLER=pip`` (the baseline: pip throughout, as the set-up installed before) and
once with uv (the default), in turn, with pip's and uv's caches pointed at empty folders of their own.
From the set-up's own stage lines it takes the seconds from the first install to the byte-compile
(the project with its dependencies, then vLLM and its dependencies: what the installer decides) and
the whole set-up's seconds, and prints both for each installer with the ratio uv / pip. Last, the
packages each venv ended with (``pip freeze``), and any that differ. Needs the network the package
indexes are on; about 8 minutes a round on 2 cores, and 10 GB of disk while it runs (each clone's
venv is removed after it is measured).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = re.compile(r"^setup: \[(\d+) s\] (.*)$")


def one_setup(work: Path, installer: str, index: int) -> dict:
    """Clone HEAD into ``work``, run its set-up with ``installer`` and cold caches; its stage times,
    wall seconds and the installed packages."""
    clone = work / f"{installer}-{index}"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {**os.environ, "POSTTRAIN_INSTALLER": installer, "PIP_CACHE_DIR": str(clone / ".pip-cache"),
           "UV_CACHE_DIR": str(clone / ".uv-cache")}
    started = time.monotonic()
    done = subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{installer}: scripts/setup.sh failed (exit {done.returncode}): {done.stderr[-2000:]}")
    stages = [(int(m.group(1)), m.group(2)) for m in map(STAGE.match, done.stdout.splitlines()) if m]
    first_install = next(t for t, what in stages if what.startswith("installing"))
    compile_at = next(t for t, what in stages if what.startswith("byte-compiling"))
    freeze = subprocess.run([str(clone / ".venv/bin/python"), "-m", "pip", "freeze", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout
    packages = {line.split("==")[0].lower().replace("_", "-"): line.split("==")[-1]
                for line in freeze.splitlines() if "==" in line}
    shutil.rmtree(clone, ignore_errors=True)
    return {"install_s": compile_at - first_install, "setup_s": wall, "packages": packages}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="set-ups of each installer, alternating (default 1)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/setup-bench"), help="where the clones go")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"pip": [], "uv": []}
    for index in range(args.rounds):
        for installer in ("pip", "uv"):
            result = one_setup(args.work, installer, index)
            results[installer].append(result)
            print(f"round {index + 1} {installer}: installs {result['install_s']} s, set-up {result['setup_s']:.0f} s",
                  flush=True)
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("install_s", "setup_s")} for k, rs in results.items()}
    print(f"{'':28s}{'pip (baseline)':>16s}{'uv':>10s}{'uv/pip':>10s}")
    for field, label in (("install_s", "installs, s (median)"), ("setup_s", "whole set-up, s (median)")):
        print(f"{label:28s}{med['pip'][field]:16.0f}{med['uv'][field]:10.0f}{med['uv'][field] / med['pip'][field]:10.2f}")
    pip_pkgs, uv_pkgs = results["pip"][-1]["packages"], results["uv"][-1]["packages"]
    differ = sorted(n for n in pip_pkgs.keys() | uv_pkgs.keys() if pip_pkgs.get(n) != uv_pkgs.get(n))
    print(f"packages: {len(pip_pkgs)} with pip, {len(uv_pkgs)} with uv; differing: "
          + (", ".join(f"{n} {pip_pkgs.get(n, '-')} / {uv_pkgs.get(n, '-')}" for n in differ) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
