"""scripts/oci-archive.py, the packer of the workload and task images (scripts/image-common.sh's
pack_image) and of the kube-local node's own images: the archive it writes is checked here against the
OCI image layout's own rules (every blob named by the sha256 of its bytes, the config's diff_id the
sha256 of the uncompressed layer, the manifest's layer digest and size those of the blob as stored),
and the zstd layer decompresses to exactly the tar that went in. That containerd imports and runs such
an archive is tests/kube/test_node.py's part: both images it runs pods from are packed by this script.
"""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "oci-archive.py"
pytestmark = pytest.mark.skipif(shutil.which("zstd") is None and os.environ.get("CI") != "true",
                                reason="Debian's zstd is not installed (scripts/setup.sh installs it)")


def layer_of(root: Path) -> bytes:
    return subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", "-", "."], check=True,
                          capture_output=True).stdout


def pack(tmp_path: Path, layer: bytes, *flags: str, tag: str = "posttrain.local/test:1") -> subprocess.CompletedProcess:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"Cmd": ["/bin/sh"], "User": "1000:1000"}))
    return subprocess.run([sys.executable, str(SCRIPT), *flags, tag, "-", str(tmp_path / "out.oci.tar"), str(config)],
                          input=layer, capture_output=True)


def image_common(call: str, **env: str) -> subprocess.CompletedProcess:
    """CALL, a function of scripts/image-common.sh, in bash with the file sourced as the build scripts do."""
    repo = SCRIPT.parents[1]
    return subprocess.run(["bash", "-c", f"what=build-image repo={repo}; source {repo}/scripts/image-common.sh; {call}"],
                          capture_output=True, text=True, env={**os.environ, **env})


def read_archive(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("flags", [(), ("--uncompressed",)], ids=["zstd", "uncompressed"])
def test_the_archive_is_a_valid_oci_layout_whose_layer_is_the_tar_that_went_in(tmp_path, flags):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("sandbox\n")
    (root / "data").write_bytes(os.urandom(3 << 20))  # more than one of the packer's blocks
    layer = layer_of(root)
    done = pack(tmp_path, layer, *flags)
    assert done.returncode == 0, done.stderr.decode()

    members = read_archive(tmp_path / "out.oci.tar")
    for name, data in members.items():
        if name.startswith("blobs/sha256/"):
            assert name.rsplit("/", 1)[1] == hashlib.sha256(data).hexdigest(), name
    assert json.loads(members["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(members["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "posttrain.local/test:1"
    manifest_bytes = members["blobs/sha256/" + entry["digest"][7:]]
    assert entry["size"] == len(manifest_bytes)
    manifest = json.loads(manifest_bytes)
    config = json.loads(members["blobs/sha256/" + manifest["config"]["digest"][7:]])
    assert config["config"] == {"Cmd": ["/bin/sh"], "User": "1000:1000"}
    (desc,) = manifest["layers"]
    blob = members["blobs/sha256/" + desc["digest"][7:]]
    assert desc["size"] == len(blob)
    if flags:
        assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar" and blob == layer
    else:
        assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+zstd"
        assert len(blob) < len(layer) and zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read() == layer
    assert config["rootfs"] == {"type": "layers", "diff_ids": [sha(layer)]}


def test_an_empty_layer_is_refused_and_leaves_no_archive(tmp_path):
    done = pack(tmp_path, b"")
    assert done.returncode != 0 and b"is empty" in done.stderr
    assert not list(tmp_path.glob("out.oci.tar*"))


def test_a_failed_pack_keeps_the_archive_there_and_leaves_no_part(tmp_path):
    """scripts/image-common.sh's pack_image: tar failing (here: no root) fails the build, and the
    archive of the last good build is kept, not replaced by a truncated one."""
    archive = tmp_path / "image.oci.tar"
    archive.write_bytes(b"the last good archive")
    (tmp_path / "config.json").write_text("{}")
    done = image_common(f"pack_image t:1 {tmp_path}/no-such-root {archive} {tmp_path}/config.json")
    assert done.returncode != 0 and f"could not pack {tmp_path}/no-such-root" in done.stderr, done.stderr
    assert archive.read_bytes() == b"the last good archive"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "image.oci.tar"]


def test_pack_image_replaces_the_archive_when_whole(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "f").write_text("x")
    archive = tmp_path / "image.oci.tar"
    archive.write_bytes(b"an older build")
    (tmp_path / "config.json").write_text("{}")
    done = image_common(f"pack_image t:1 {tmp_path}/root {archive} {tmp_path}/config.json")
    assert done.returncode == 0, done.stderr
    assert "index.json" in read_archive(archive)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "image.oci.tar", "root"]


def test_a_build_without_the_disk_it_needs_stops_before_it_starts_and_says_so(tmp_path):
    """scripts/image-common.sh's require_free, which scripts/build-image.sh calls before it writes anything."""
    done = image_common(f"require_free {tmp_path} 9", POSTTRAIN_IMAGE_MIN_FREE_GIB=str(1 << 40))
    assert done.returncode != 0
    assert f"needs about {1 << 40} GiB free on the file system of {tmp_path}" in done.stderr, done.stderr
    ok = image_common(f"require_free {tmp_path} 0")
    assert ok.returncode == 0, ok.stderr


def test_a_layer_packed_on_a_base_archive_keeps_the_base_layers_under_it(tmp_path):
    """``--base``: the workload image's kept dependencies' layer under the project's own (scripts/build-image.sh)."""
    base_root, top_root = tmp_path / "base-root", tmp_path / "top-root"
    (base_root / "opt").mkdir(parents=True)
    (base_root / "opt" / "deps").write_bytes(os.urandom(2 << 20))
    (top_root / "opt").mkdir(parents=True)
    (top_root / "opt" / "project").write_text("the project\n")
    base_layer, top_layer = layer_of(base_root), layer_of(top_root)
    done = pack(tmp_path, base_layer)
    assert done.returncode == 0, done.stderr.decode()
    base = tmp_path / "base.oci.tar"
    (tmp_path / "out.oci.tar").rename(base)
    done = pack(tmp_path, top_layer, "--base", str(base), tag="posttrain.local/test:2")
    assert done.returncode == 0, done.stderr.decode()

    members = read_archive(tmp_path / "out.oci.tar")
    for name, data in members.items():
        if name.startswith("blobs/sha256/"):
            assert name.rsplit("/", 1)[1] == hashlib.sha256(data).hexdigest(), name
    (entry,) = json.loads(members["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "posttrain.local/test:2"
    manifest = json.loads(members["blobs/sha256/" + entry["digest"][7:]])
    config = json.loads(members["blobs/sha256/" + manifest["config"]["digest"][7:]])
    assert config["rootfs"]["diff_ids"] == [sha(base_layer), sha(top_layer)]
    unpacked = [zstandard.ZstdDecompressor().stream_reader(io.BytesIO(members["blobs/sha256/" + d["digest"][7:]])).read()
                for d in manifest["layers"]]
    assert unpacked == [base_layer, top_layer]


def test_a_base_archive_whose_blob_does_not_match_its_digest_is_refused_and_leaves_no_archive(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "f").write_text("x")
    layer = layer_of(tmp_path / "root")
    assert pack(tmp_path, layer).returncode == 0
    members = read_archive(tmp_path / "out.oci.tar")
    (tmp_path / "out.oci.tar").unlink()
    base = tmp_path / "base.oci.tar"
    with tarfile.open(base, "w") as tar:
        for name, data in members.items():
            if name.startswith("blobs/") and data[:4] == b"\x28\xb5\x2f\xfd":  # the zstd layer: altered
                data = data[:-1] + bytes([data[-1] ^ 1])
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    done = pack(tmp_path, layer, "--base", str(base))
    assert done.returncode != 0 and f"--base {base}: blob sha256:".encode() in done.stderr, done.stderr
    assert not list(tmp_path.glob("out.oci.tar*"))
    done = pack(tmp_path, layer, "--base", str(tmp_path / "no-such.oci.tar"))
    assert done.returncode != 0 and b"is not an OCI archive of one image" in done.stderr, done.stderr
