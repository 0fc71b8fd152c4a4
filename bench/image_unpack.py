"""Layer unpack time, zstd vs gzip, on the same layers, side by side.

    .venv/bin/python bench/image_unpack.py            # about a minute on 2 cores
    .venv/bin/python bench/image_unpack.py --repeats 9

Layers: a small task repository (the size of a bundled task), the ``pip`` package source (about
1000 files, 13 MB: a realistic repository checkout), and one large text-heavy layer (the Python
standard library's ``email``, ``json``, ``asyncio``, ``unittest`` and ``test`` folders). Each is
compressed once with zstd (level 3) and once with gzip (level 6) by ``sandboxes.images``; then, in
alternating order, repeats of:

- *decompress*: the blob streamed through the decompressor (the part the compression changes);
- *unpack to tmpfs*: ``sandboxes.images.unpack_layer`` (decompress + GNU tar extract) into /dev/shm;
- *unpack to disk*: the same into a folder on the cache's disk.

Prints medians and the gzip/zstd ratio for each. Disk writes on a shared machine are noisy; the
extraction cost is the same for both compressions, so it dilutes the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandboxes.images import ImageStore, decompressed_chunks, tar_directory, unpack_layer  # noqa: E402


def make_small_repo(root: Path) -> Path:
    repo = root / "small-task"
    (repo / "src").mkdir(parents=True)
    for i in range(12):
        (repo / "src" / f"mod_{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j} + {i}\n\n"
                                                          for j in range(60)))
    (repo / "tests").mkdir()
    (repo / "tests" / "test_mod.py").write_text("def test_ok():\n    assert True\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "base"], cwd=repo, check=True)
    return repo


def large_layer_source(root: Path) -> Path:
    stdlib = Path(os.__file__).parent
    dest = root / "stdlib-part"
    for name in ("email", "json", "asyncio", "unittest", "test"):
        if (stdlib / name).is_dir():
            shutil.copytree(stdlib / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    return dest


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import pip

    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        work, shm = Path(work), Path(shm)
        sources = {
            "small task repo": make_small_repo(work),
            "pip source": Path(pip.__file__).parent,
            "stdlib part": large_layer_source(work),
        }
        store = ImageStore(work / "store")
        print(f"{'layer':<16} {'files':>6} {'tar MB':>7} {'zstd MB':>8} {'gzip MB':>8}")
        layers = {}
        for name, src in sources.items():
            tar = tar_directory(src, "workspace")
            z, g = store.put_layer(tar, "zstd"), store.put_layer(tar, "gzip")
            files = sum(len(f) for _, _, f in os.walk(src))
            layers[name] = (z, g)
            print(f"{name:<16} {files:>6} {len(tar) / 1e6:>7.2f} {z.size_bytes / 1e6:>8.2f} {g.size_bytes / 1e6:>8.2f}")
        print()
        print(f"{'layer':<16} {'measure':<16} {'zstd ms':>8} {'gzip ms':>8} {'gzip/zstd':>10}")
        ratios = {}
        for name, (z, g) in layers.items():
            times = {(m, c): [] for m in ("decompress", "unpack tmpfs", "unpack disk") for c in ("zstd", "gzip")}
            for i in range(args.repeats):
                order = (z, g) if i % 2 == 0 else (g, z)
                for layer in order:
                    c, blob = layer.compression, store.blob_path(layer)
                    times[("decompress", c)].append(timed(lambda: sum(len(b) for b in decompressed_chunks(blob, c))))
                    out = shm / f"{c}-{i}"
                    times[("unpack tmpfs", c)].append(timed(lambda: unpack_layer(blob, c, out)))
                    shutil.rmtree(out)
                    out = work / f"{c}-{i}"
                    times[("unpack disk", c)].append(timed(lambda: unpack_layer(blob, c, out)))
                    shutil.rmtree(out)
            for m in ("decompress", "unpack tmpfs", "unpack disk"):
                zt, gt = statistics.median(times[(m, "zstd")]), statistics.median(times[(m, "gzip")])
                ratios[(name, m)] = gt / zt
                print(f"{name:<16} {m:<16} {zt * 1e3:>8.1f} {gt * 1e3:>8.1f} {gt / zt:>9.2f}x")
        print()
        for m in ("decompress", "unpack tmpfs", "unpack disk"):
            vals = [v for (n, mm), v in ratios.items() if mm == m]
            print(f"geometric mean gzip/zstd, {m}: {statistics.geometric_mean(vals):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
