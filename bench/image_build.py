"""The workload image's build (scripts/build-image.sh) of this checkout beside a baseline commit's,
in one call: the baseline's build, this checkout's first build (which makes the dependencies'
layer it keeps), and this checkout's build again (the dependencies' layer kept, as after a commit of
the project's code alone). Wall and CPU seconds of each, and the ratios to the baseline's.

    sudo .venv/bin/python bench/image_build.py [--baseline b8a50f8]

Root, as the build itself. Each build gets a work folder of its own under ``--work-root`` with a copy
of the Debian base the machine's own builds keep (``~/.cache/posttrain/image/base-*``), so
``debootstrap`` is in none of the figures (without one, each build makes its own and the figures
include it). Nothing is imported into a node (``POSTTRAIN_IMAGE_NO_IMPORT=1``): the import is the same
for both. The work folders (about 8 GB at the peak) are removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.worktrees import REPO, baseline_tree  # noqa: E402


def kept_base() -> Path | None:
    """The newest complete Debian base of the machine's own image builds, if any."""
    bases = [b for b in (Path.home() / ".cache" / "posttrain" / "image").glob("base-*") if (b / ".posttrain-base").is_file()]
    return max(bases, key=lambda b: b.stat().st_mtime) if bases else None


def build(tree: Path, work: Path, base: Path | None) -> tuple[float, float]:
    """(wall s, CPU s of the build's processes) of ``tree``'s scripts/build-image.sh into ``work``."""
    if base is not None and not (work / base.name).exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", str(base), str(work / base.name)], check=True)
    env = {**os.environ, "POSTTRAIN_IMAGE_WORK": str(work), "POSTTRAIN_IMAGE_NO_IMPORT": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    done = subprocess.run(["bash", str(tree / "scripts" / "build-image.sh")], env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"image_build: {tree}/scripts/build-image.sh failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="b8a50f8", help="the commit built beside this checkout (default b8a50f8)")
    parser.add_argument("--work-root", default=str(Path.home() / ".cache" / "posttrain"),
                        help="where the work folders are made (default ~/.cache/posttrain)")
    parser.add_argument("--keep", action="store_true", help="keep the work folders")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root, as scripts/build-image.sh does (debootstrap, chroot, mounts)")
    tree = baseline_tree(args.baseline, "image-build-base")
    if not (tree / ".venv").exists():  # the build makes the project's wheel with the checkout's venv
        (tree / ".venv").symlink_to(REPO / ".venv")
    base = kept_base()
    work = Path(tempfile.mkdtemp(prefix="image-bench-", dir=args.work_root))
    try:
        rows = [(f"baseline {args.baseline}", build(tree, work / "baseline", base)),
                ("this checkout, the dependencies' layer made", build(REPO, work / "current", base)),
                ("this checkout, the dependencies' layer kept", build(REPO, work / "current", base))]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"Debian base: {'copied from ' + str(base) if base else 'made by each build (debootstrap)'}")
    print("| build | wall s | CPU s | wall vs baseline | CPU vs baseline |")
    print("| --- | ---: | ---: | ---: | ---: |")
    (_, (base_wall, base_cpu)) = rows[0]
    for name, (wall, cpu) in rows:
        print(f"| {name} | {wall:.0f} | {cpu:.0f} | {wall / base_wall:.2f}x | {cpu / base_cpu:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
