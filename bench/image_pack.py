"""The packing of an image's root file system into an OCI archive: this checkout's (tar streamed
through scripts/oci-archive.py, zstd) beside a baseline commit's (an uncompressed layer.tar written
first, then packed into the archive), on the same root, in one run.

    python bench/image_pack.py [--root DIR] [--baseline 18f84c2] [--work DIR]

What it prints for each: the bytes on disk when the pack ends (every file it wrote that exists at once:
the disk peak the pack adds to the root's own), the archive's size, wall seconds and the CPU of the
processes it ran. The root defaults to this checkout's .venv: torch, vLLM and Dagster, the bulk of the
workload image's root file system (scripts/build-image.sh). Needs Debian's zstd.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def config_file(work: Path) -> Path:
    path = work / "image-config.json"
    path.write_text('{"Cmd": ["python"], "User": "1000:1000"}')
    return path


def pack_baseline(root: Path, work: Path, script: Path) -> tuple[int, int]:
    layer, archive = work / "layer.tar", work / "baseline.oci.tar"
    subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-cf", str(layer), "."], check=True)
    subprocess.run([sys.executable, str(script), "bench:base", str(layer), str(archive), str(config_file(work))],
                   check=True, capture_output=True)
    on_disk = layer.stat().st_size + archive.stat().st_size  # both there until the build removes the layer
    size = archive.stat().st_size
    layer.unlink()
    archive.unlink()
    return on_disk, size


def pack_here(root: Path, work: Path) -> tuple[int, int]:
    archive = work / "this.oci.tar"
    tar = subprocess.Popen(["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-cf", "-", "."],
                           stdout=subprocess.PIPE)
    subprocess.run([sys.executable, str(REPO / "scripts" / "oci-archive.py"), "bench:this", "-", str(archive),
                    str(config_file(work))], stdin=tar.stdout, check=True, capture_output=True)
    tar.stdout.close()
    if tar.wait() != 0:
        sys.exit(f"tar of {root} failed")
    size = archive.stat().st_size
    archive.unlink()
    return size, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO / ".venv", help="the root file system to pack")
    parser.add_argument("--baseline", default="18f84c2", help="the commit whose scripts/oci-archive.py is the baseline")
    parser.add_argument("--work", type=Path, default=None, help="where the archives are written (default: a temporary folder)")
    args = parser.parse_args()
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a folder")
    with tempfile.TemporaryDirectory(dir=args.work, prefix="image-pack-") as tmp:
        work = Path(tmp)
        script = work / "baseline-oci-archive.py"
        script.write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{args.baseline}:scripts/oci-archive.py"],
                                          check=True, capture_output=True).stdout)
        root_bytes = int(subprocess.run(["du", "-sb", str(args.root)], check=True, capture_output=True,
                                        text=True).stdout.split()[0])
        print(f"root {args.root}: {root_bytes / 2**30:.2f} GiB; load average {os.getloadavg()[0]:.1f}", flush=True)
        rows = []
        for name, pack in [(f"baseline {args.baseline}", lambda: pack_baseline(args.root, work, script)),
                           ("this tree", lambda: pack_here(args.root, work))]:
            cpu0, t0 = children_cpu(), time.perf_counter()
            on_disk, size = pack()
            rows.append((name, on_disk, size, time.perf_counter() - t0, children_cpu() - cpu0))
        print("| pack | on disk at its end (GiB) | archive (GiB) | wall (s) | CPU (s) |")
        print("| --- | --- | --- | --- | --- |")
        for name, on_disk, size, wall, cpu in rows:
            print(f"| {name} | {on_disk / 2**30:.2f} | {size / 2**30:.2f} | {wall:.1f} | {cpu:.1f} |")
        (_, d0, s0, w0, c0), (_, d1, s1, w1, c1) = rows
        print(f"this tree / baseline: on disk {d1 / d0:.2f}x, archive {s1 / s0:.2f}x, wall {w1 / w0:.2f}x, "
              f"CPU {c1 / c0:.2f}x; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
