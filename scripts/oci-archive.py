"""Pack one root file system layer (an uncompressed tar) into an OCI image archive that
`ctr images import`, `podman load` and `skopeo copy oci-archive:` read.

    python3 scripts/oci-archive.py TAG LAYER.tar OUT.oci.tar CONFIG.json

CONFIG.json is the image config's ``config`` object (Env, User, WorkingDir, Cmd, Labels). The layer
is streamed (a workload image's is GBs): hashed in blocks and added to the archive from its file.
Used by scripts/build-image.sh (the workloads' image) and scripts/build-task-image.sh (the sandbox
image of task folders). Standard library only.
"""

import hashlib
import io
import json
import os
import sys
import tarfile


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def main(tag: str, layer_path: str, out: str, config_path: str) -> None:
    h = hashlib.sha256()
    with open(layer_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    layer_digest, layer_size = "sha256:" + h.hexdigest(), os.path.getsize(layer_path)
    with open(config_path) as f:
        image_config = json.load(f)
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": image_config,
                         "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
    }).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest(manifest), "size": len(manifest),
        "annotations": {"io.containerd.image.name": tag}}]}).encode()
    with tarfile.open(out, "w") as tar:
        for path, data in [("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", index),
                           (f"blobs/sha256/{digest(config)[7:]}", config),
                           (f"blobs/sha256/{digest(manifest)[7:]}", manifest)]:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        tar.add(layer_path, arcname=f"blobs/sha256/{layer_digest[7:]}")
    print(f"{tag}: layer {layer_size / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
