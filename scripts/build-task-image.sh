#!/usr/bin/env bash
# The sandbox image of tasks that are folders ([sandbox] image of a run on Kubernetes): the bundled
# suite's tasks and the task stream's are repository folders, not images; on the cluster each
# episode's sandbox pod runs this image and the trainer copies the task's repository into its
# empty /workspace before the episode starts (evals.sandbox.copy_workspace). Built here without a
# registry or a container builder (Containerfile.task-base is the same image for a registry):
#
#   sudo bash scripts/build-task-image.sh      # builds, and imports into the kube-local node
#
# What it is: Debian bookworm (`debootstrap --variant=minbase`) with python3 (no third-party
# packages), git, bash, coreutils and tar: what a local sandbox of such a task sees of the host's
# /usr (sandboxes.toolchain); pxd at /opt/pxd/pxd.py (from the committed tree); the sandbox user
# uid 1000 owning /workspace and /home/sandbox. Nothing of posttrain's (no grader code, no
# venv): the agent's sandbox holds only its task.
#
# Settings: POSTTRAIN_TASK_IMAGE (the tag, default posttrain.local/task-base:local),
# POSTTRAIN_TASK_IMAGE_WORK (work folder, default ~/.cache/posttrain/task-image; the Debian base is
# kept there), POSTTRAIN_KUBE_STATE / POSTTRAIN_CONTAINERD_SOCK (where it is imported, as
# scripts/build-image.sh), POSTTRAIN_IMAGE_NO_IMPORT=1 (only the archive). Needs root.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tag=${POSTTRAIN_TASK_IMAGE:-posttrain.local/task-base:local}
work=${POSTTRAIN_TASK_IMAGE_WORK:-$HOME/.cache/posttrain/task-image}
mirror=http://deb.debian.org/debian
packages=python3,git
uid=1000

log() { echo "build-task-image: [$SECONDS s] $*" >&2; }
die() { echo "build-task-image: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap)"
[[ $work == /* && $work != / ]] || die "POSTTRAIN_TASK_IMAGE_WORK must be an absolute folder, got '$work'"
command -v debootstrap >/dev/null || {
    log "installing Debian's debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}
mkdir -p "$work"
exec {lock}>"$work/.lock"
flock -n "$lock" || die "another build uses $work"

base=$work/base-$(printf '%s' "bookworm $packages" | sha256sum | cut -c1-12)
if [[ ! -f $base/.posttrain-base ]]; then
    log "debootstrap --variant=minbase bookworm ($packages)"
    rm -rf "$base"
    debootstrap --variant=minbase --include="$packages" bookworm "$base" "$mirror" >"$work/debootstrap.log" 2>&1 ||
        die "debootstrap failed; see $work/debootstrap.log"
    rm -rf "$base"/var/cache/apt/archives/*.deb "$base"/var/lib/apt/lists/* "$base"/usr/share/doc/* "$base"/usr/share/man/*
    touch "$base/.posttrain-base"
fi

root=$work/rootfs
rm -rf "$root"
cp -a "$base" "$root"
rm -f "$root/.posttrain-base"
commit=$(git -C "$repo" rev-parse --short=12 HEAD)
mkdir -p "$root/opt/pxd" "$root/workspace" "$root/home/sandbox"
git -C "$repo" show HEAD:sandboxes/pxd.py >"$root/opt/pxd/pxd.py"
grep -q "^sandbox:" "$root/etc/passwd" || echo "sandbox:x:$uid:$uid:sandbox:/home/sandbox:/bin/bash" >>"$root/etc/passwd"
grep -q "^sandbox:" "$root/etc/group" || echo "sandbox:x:$uid:" >>"$root/etc/group"
chown "$uid:$uid" "$root/workspace" "$root/home/sandbox"
chmod 1777 "$root/tmp"
: >"$root/etc/resolv.conf"
chroot "$root" /usr/bin/python3 -c "import ast; ast.parse(open('/opt/pxd/pxd.py').read())" || die "the image's python3 cannot read pxd"
chroot "$root" git --version >/dev/null || die "the image has no working git"

log "packing the root file system"
tar --numeric-owner --xattrs -C "$root" -cf "$work/layer.tar" .
cat >"$work/image-config.json" <<JSON
{"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "HOME=/home/sandbox"],
 "User": "$uid:$uid", "WorkingDir": "/workspace", "Cmd": ["/usr/bin/python3", "-I", "-S", "/opt/pxd/pxd.py", "--workspace", "/workspace", "--stdio"],
 "Labels": {"org.opencontainers.image.revision": "$commit"}}
JSON
python3 "$repo/scripts/oci-archive.py" "$tag" "$work/layer.tar" "$work/task-image.oci.tar" "$work/image-config.json"
size=$(du -sh --apparent-size "$root" | cut -f1)
rm -rf "$root" "$work/layer.tar"
log "image $tag: root file system $size, archive $(du -h --apparent-size "$work/task-image.oci.tar" | cut -f1)"

if [[ ${POSTTRAIN_IMAGE_NO_IMPORT:-} != 1 ]]; then
    sock=${POSTTRAIN_CONTAINERD_SOCK:-}
    if [[ -z $sock ]]; then
        checkout_id=$(basename "$repo" | sed 's/[^A-Za-z0-9._-]/-/g')-$(printf '%s' "$repo" | sha256sum | cut -c1-10)
        sock=${POSTTRAIN_KUBE_STATE:-$HOME/.cache/posttrain/kube-local/$checkout_id}/node/containerd.sock
    fi
    if [[ -S $sock ]]; then
        log "importing into the containerd of $sock (namespace k8s.io)"
        ctr -a "$sock" -n k8s.io images import "$work/task-image.oci.tar" >/dev/null || die "ctr could not import the image"
        rm -f "$work/task-image.oci.tar"
    else
        log "no containerd at $sock: the archive is left at $work/task-image.oci.tar"
    fi
fi
log "built $tag in $SECONDS s"
echo "$tag"
