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
# /usr (sandboxes.toolchain); pxd at /opt/pxd/pxd.py with standalone.py beside it (from the committed
# tree); the sandbox user uid 1000 owning /workspace and /home/sandbox; the skeleton's /etc/gitconfig
# of sandboxes.images.
# Nothing of posttrain's (no grader code, no venv): the agent's sandbox holds only its task.
#
# Settings: POSTTRAIN_TASK_IMAGE (the tag, default posttrain.local/task-base:local),
# POSTTRAIN_TASK_IMAGE_WORK (work folder, default ~/.cache/posttrain/task-image; the Debian base is
# kept there), POSTTRAIN_KUBE_STATE / POSTTRAIN_CONTAINERD_SOCK (where it is imported, as
# scripts/build-image.sh), POSTTRAIN_IMAGE_NO_IMPORT=1 (only the archive). Needs root.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
tag=${POSTTRAIN_TASK_IMAGE:-posttrain.local/task-base:local}
work=${POSTTRAIN_TASK_IMAGE_WORK:-$HOME/.cache/posttrain/task-image}
packages=python3,git
uid=1000

what=build-task-image
# shellcheck source=scripts/image-common.sh
source "$repo/scripts/image-common.sh"
prepare_work "$work" POSTTRAIN_TASK_IMAGE_WORK
base=$(debian_base "$work" "$packages")
rm -rf "$base"/usr/share/doc/* "$base"/usr/share/man/*

root=$work/rootfs
rm -rf "$root"
cp -a "$base" "$root"
rm -f "$root/.posttrain-base"
commit=$(git -C "$repo" rev-parse --short=12 HEAD)
mkdir -p "$root/opt/pxd" "$root/workspace" "$root/home/sandbox"
git -C "$repo" show HEAD:sandboxes/pxd.py >"$root/opt/pxd/pxd.py"
# pxd run as a file takes its stand-ins from standalone.py beside it (sandboxes.programs)
git -C "$repo" show HEAD:sandboxes/standalone.py >"$root/opt/pxd/standalone.py"
# the skeleton's git and name settings every local sandbox has (sandboxes.images.BASE_FILES): the git
# identity commits are made with, safe.directory (the workspace is a volume whose mount point is not
# the sandbox user's), main as the default branch; without them every commit in a pod failed
"$repo/.venv/bin/python" - "$root" <<'PY' || die "could not write the skeleton's files (needs the project's .venv)"
import sys
from pathlib import Path
from sandboxes.images import BASE_FILES
for name in ("etc/gitconfig", "etc/hosts", "etc/hostname", "etc/nsswitch.conf"):
    Path(sys.argv[1], name).write_text(BASE_FILES[name])
PY
grep -q "^sandbox:" "$root/etc/passwd" || echo "sandbox:x:$uid:$uid:sandbox:/home/sandbox:/bin/bash" >>"$root/etc/passwd"
grep -q "^sandbox:" "$root/etc/group" || echo "sandbox:x:$uid:" >>"$root/etc/group"
chown "$uid:$uid" "$root/workspace" "$root/home/sandbox"
chmod 1777 "$root/tmp"
: >"$root/etc/resolv.conf"
chroot "$root" /usr/bin/python3 -I -S /opt/pxd/pxd.py --help >/dev/null || die "the image's python3 cannot start pxd"
chroot "$root" git --version >/dev/null || die "the image has no working git"

cat >"$work/image-config.json" <<JSON
{"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "HOME=/home/sandbox"],
 "User": "$uid:$uid", "WorkingDir": "/workspace", "Cmd": ["/usr/bin/python3", "-I", "-S", "/opt/pxd/pxd.py", "--workspace", "/workspace", "--stdio"],
 "Labels": {"org.opencontainers.image.revision": "$commit"}}
JSON
pack_image "$tag" "$root" "$work/task-image.oci.tar" "$work/image-config.json"
size=$(du -sh --apparent-size "$root" | cut -f1)
rm -rf "$root" "$work/layer.tar"
log "image $tag: root file system $size, archive $(du -h --apparent-size "$work/task-image.oci.tar" | cut -f1)"

import_into_node "$work/task-image.oci.tar"
log "built $tag in $SECONDS s"
echo "$tag"
