"""Pack one root file system layer into an OCI image archive that `ctr images import`,
`podman load` and `skopeo copy oci-archive:` read.

    tar -C ROOT -cf - . | python3 scripts/oci-archive.py TAG - OUT.oci.tar CONFIG.json
    python3 scripts/oci-archive.py [--uncompressed] [--base BASE.oci.tar] TAG LAYER.tar OUT.oci.tar CONFIG.json

CONFIG.json is the image config's ``config`` object (Env, User, WorkingDir, Cmd, Labels). LAYER is an
uncompressed tar, a file or ``-`` for standard input.

A workload image's layer is GBs, and the disk of a test machine is not ours alone, so nothing is
written twice: the layer is read once, as a stream, compressed with zstd on the way (Debian's `zstd`,
all cores; `application/vnd.oci.image.layer.v1.tar+zstd`, which containerd reads since 1.5) and
written straight into the archive as its first member. A tar member's header names the blob by its
digest and gives its size, neither known until the stream ends, so a placeholder header is written
first and filled in afterwards (the archive is a seekable file). The uncompressed stream's digest is
the config's diff_id; the compressed blob's is the manifest's. The small members (config, manifest,
index, oci-layout) follow; readers take the members in any order.

``--base BASE.oci.tar`` (an archive this script wrote) puts BASE's layers under the new one: its
layer blobs are copied first, each checked against its digest on the way, and the image's layers and
diff_ids are BASE's followed by the new layer's. The workload image is built so (scripts/build-image.sh):
its dependencies' layer, GBs, is packed once and kept, and each build of the project packs only the
project's own files on top.

Used by scripts/image-common.sh (pack_image: the workloads' image and the sandbox image of task
folders) and scripts/kube-local.sh (the node's own small images, --uncompressed). Standard library
only, and Debian's zstd binary.
"""

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from typing import BinaryIO, Iterator

BLOCK = 1 << 20
ZSTD = ["zstd", "-q", "-3", "-T0", "-c"]
LAYER_TYPES = {True: "application/vnd.oci.image.layer.v1.tar+zstd", False: "application/vnd.oci.image.layer.v1.tar"}


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def uncompressed(source: BinaryIO, diff: "hashlib._Hash") -> Iterator[bytes]:
    for block in iter(lambda: source.read(BLOCK), b""):
        diff.update(block)
        yield block


def zstd_compressed(source: BinaryIO, diff: "hashlib._Hash") -> Iterator[bytes]:
    """The layer through `zstd`: one thread feeds it (hashing the uncompressed bytes), this one reads."""
    if shutil.which("zstd") is None:
        sys.exit("oci-archive: Debian's zstd is not installed (apt-get install zstd), or pass --uncompressed")
    proc = subprocess.Popen(ZSTD, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    failure: list[BaseException] = []

    def feed() -> None:
        try:
            for block in uncompressed(source, diff):
                proc.stdin.write(block)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the reading thread
            failure.append(exc)
        finally:
            proc.stdin.close()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    yield from iter(lambda: proc.stdout.read(BLOCK), b"")
    feeder.join()
    if proc.wait() != 0:
        sys.exit(f"oci-archive: zstd exited with {proc.returncode}")
    if failure:
        raise failure[0]


def blob_member(out: BinaryIO, blocks: Iterator[bytes]) -> tuple[str, int]:
    """Streams BLOCKS into OUT as one tar member named blobs/sha256/<digest>; returns (digest, size)."""
    start = out.tell()
    out.write(bytes(tarfile.BLOCKSIZE))  # the header, once the name and size are known
    h, size = hashlib.sha256(), 0
    for block in blocks:
        out.write(block)
        h.update(block)
        size += len(block)
    out.write(bytes(-size % tarfile.BLOCKSIZE))
    end = out.tell()
    info = tarfile.TarInfo(f"blobs/sha256/{h.hexdigest()}")
    info.size, info.mode, info.mtime = size, 0o644, int(time.time())
    header = info.tobuf(tarfile.GNU_FORMAT)  # one block for a name this short, any size (GNU base-256)
    assert len(header) == tarfile.BLOCKSIZE, len(header)
    out.seek(start)
    out.write(header)
    out.seek(end)
    return "sha256:" + h.hexdigest(), size


def copy_base_layers(path: str, out: BinaryIO) -> tuple[list[dict], list[str]]:
    """BASE's layer blobs streamed into OUT; returns their manifest descriptors and config diff_ids.
    Exits naming the archive and what is wrong when it is not a one-image OCI archive whose layer
    blobs match their digests."""
    try:
        with tarfile.open(path) as tar:
            members = {m.name: m for m in tar.getmembers()}

            def read(name: str) -> bytes:
                if name not in members:
                    sys.exit(f"oci-archive: --base {path}: no member {name}")
                return tar.extractfile(members[name]).read()

            (entry,) = json.loads(read("index.json"))["manifests"]
            manifest = json.loads(read(f"blobs/sha256/{entry['digest'].split(':', 1)[1]}"))
            config = json.loads(read(f"blobs/sha256/{manifest['config']['digest'].split(':', 1)[1]}"))
            layers, diff_ids = manifest["layers"], config["rootfs"]["diff_ids"]
            if len(layers) != len(diff_ids):
                sys.exit(f"oci-archive: --base {path}: {len(layers)} layers but {len(diff_ids)} diff_ids")
            for layer in layers:
                name = f"blobs/sha256/{layer['digest'].split(':', 1)[1]}"
                if name not in members:
                    sys.exit(f"oci-archive: --base {path}: no member {name}")
                source = tar.extractfile(members[name])
                copied, size = blob_member(out, iter(lambda: source.read(BLOCK), b""))
                if (copied, size) != (layer["digest"], layer["size"]):
                    sys.exit(f"oci-archive: --base {path}: blob {layer['digest']} holds {copied}, {size} bytes")
            return layers, diff_ids
    except (OSError, tarfile.TarError, ValueError, KeyError, TypeError) as exc:
        sys.exit(f"oci-archive: --base {path} is not an OCI archive of one image: {type(exc).__name__}: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tag")
    parser.add_argument("layer", help="the layer, an uncompressed tar: a file, or - for standard input")
    parser.add_argument("out")
    parser.add_argument("config", help="a JSON file: the image config's `config` object")
    parser.add_argument("--uncompressed", action="store_true", help="store the layer as it comes (small layers)")
    parser.add_argument("--base", metavar="BASE.oci.tar", help="an OCI archive whose layers go under this one")
    args = parser.parse_args()
    with open(args.config) as f:
        image_config = json.load(f)
    source = sys.stdin.buffer if args.layer == "-" else open(args.layer, "rb")
    part = args.out + ".part"  # renamed when whole: a failed pack leaves no archive that looks finished
    try:
        write_archive(args, image_config, source, part)
    except BaseException:
        if os.path.exists(part):
            os.unlink(part)
        raise
    os.replace(part, args.out)


def write_archive(args: argparse.Namespace, image_config: dict, source: BinaryIO, part: str) -> None:
    compress = not args.uncompressed
    diff = hashlib.sha256()
    with source, open(part, "wb") as out:
        base_layers, base_diff_ids = copy_base_layers(args.base, out) if args.base else ([], [])
        blocks = (zstd_compressed if compress else uncompressed)(source, diff)
        layer_digest, layer_size = blob_member(out, blocks)
        if diff.hexdigest() == hashlib.sha256().hexdigest():
            sys.exit(f"oci-archive: the layer {args.layer} is empty")
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": image_config,
                             "rootfs": {"type": "layers",
                                        "diff_ids": [*base_diff_ids, "sha256:" + diff.hexdigest()]}}).encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(config),
                       "size": len(config)},
            "layers": [*base_layers, {"mediaType": LAYER_TYPES[compress], "digest": layer_digest, "size": layer_size}],
        }).encode()
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest(manifest),
            "size": len(manifest), "annotations": {"io.containerd.image.name": args.tag}}]}).encode()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:  # appends after the blob
            for path, data in [("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", index),
                               (f"blobs/sha256/{digest(config)[7:]}", config),
                               (f"blobs/sha256/{digest(manifest)[7:]}", manifest)]:
                info = tarfile.TarInfo(path)
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(data))
    print(f"{args.tag}: layer {layer_size / 2**20:.1f} MiB{' (zstd)' if compress else ''}", file=sys.stderr)


if __name__ == "__main__":
    main()
