"""Sandbox start latency, layer cache hit vs cold, per runtime, side by side.

    .venv/bin/python bench/sandbox_start.py                 # about a minute on 2 cores
    .venv/bin/python bench/sandbox_start.py --repeats 21 --runtimes bwrap

"Start" is ``sandboxes.start(image)`` returning: the layers taken from the node cache (cold: the
cache is emptied first, so both layers are unpacked from their zstd blobs), the overlay and tmpfs
mounted, the cgroup made, the runtime started and ``pxd`` answering (its ready line read). A closed
sandbox is removed before the next start. Cold and hit starts alternate, so both see the same load.
Two images: a small task repository (the size of a bundled task) and a repository the size of
the ``pip`` source tree (about 1000 files, 13 MB), where unpacking on a miss costs more.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sandboxes  # noqa: E402


def make_repo(root: Path) -> Path:
    repo = root / "task"
    (repo / "src").mkdir(parents=True)
    for i in range(10):
        (repo / "src" / f"m{i}.py").write_text(f"def f(x):\n    return x + {i}\n" * 40)
    (repo / "test_m.py").write_text("def test_ok():\n    assert True\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *cmd], cwd=repo, check=True)
    return repo


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--runtimes", default="bwrap,gvisor")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        store = sandboxes.ImageStore(work / "images")
        cache = sandboxes.LayerCache(work / "cache")
        import pip

        big = work / "pip-sized"
        shutil.copytree(Path(pip.__file__).parent, big, ignore=shutil.ignore_patterns("__pycache__"))
        images = [sandboxes.build_image("small-task", make_repo(work), store),
                  sandboxes.build_image("pip-sized", big, store)]
        print(f"{'image':<11} {'zstd kB':>8} {'runtime':<11} {'cold p50 ms':>12} {'hit p50 ms':>11} {'hit p90 ms':>11} "
              f"{'cold/hit':>9}")
        for image, runtime in [(i, r) for i in images for r in args.runtimes.split(",")]:
            times = {"cold": [], "hit": []}
            sandboxes.start(image, runtime=runtime, store=store, cache=cache).close()  # warm the page cache
            for _ in range(args.repeats):
                for kind in ("cold", "hit"):
                    if kind == "cold":
                        cache.evict(1)
                    t = time.perf_counter()
                    sb = sandboxes.start(image, runtime=runtime, store=store, cache=cache)
                    times[kind].append(time.perf_counter() - t)
                    assert sb.cache_hit == (kind == "hit")
                    sb.close()
            cold, hit = statistics.median(times["cold"]), statistics.median(times["hit"])
            print(f"{image.name:<11} {image.size_bytes / 1e3:>8.0f} {runtime:<11} {cold * 1e3:>12.1f} {hit * 1e3:>11.1f} "
                  f"{pct(times['hit'], 90) * 1e3:>11.1f} {cold / hit:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
