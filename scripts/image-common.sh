# What scripts/build-image.sh and scripts/build-task-image.sh share (sourced, not run): the checks
# and lock of a build's work folder, a Debian base kept between builds, and the import of the
# finished OCI archive into the kube-local node's containerd. The caller sets `what` (its name in
# messages) and `repo` (the checkout) before sourcing.

log() { echo "$what: [$SECONDS s] $*" >&2; }
die() { echo "$what: $*" >&2; exit 1; }

# prepare_work WORK VARIABLE: root, debootstrap installed, WORK made and locked for this build
prepare_work() {
    [[ $(id -u) -eq 0 ]] || die "needs root (debootstrap and chroot)"
    [[ $1 == /* && $1 != / ]] || die "$2 must be an absolute folder, got '$1'"
    local missing=() tool
    for tool in debootstrap zstd; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    if ((${#missing[@]})); then
        log "installing Debian's ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    mkdir -p "$1"
    exec {lock}>"$1/.lock"
    flock -n "$lock" || die "another build uses $1"
}

# require_free WORK GIB: fail at once, saying so, when WORK's file system has less than GIB GiB free
# (POSTTRAIN_IMAGE_MIN_FREE_GIB overrides GIB): a build that runs the disk full half way breaks
# whatever else writes there (a test plane's etcd, SQLite) with errors that name neither.
require_free() {
    local need=${POSTTRAIN_IMAGE_MIN_FREE_GIB:-$2} free
    free=$(df --output=avail -B1G "$1" | tail -1 | tr -d ' ')
    ((free >= need)) || die "needs about $need GiB free on the file system of $1 (the root file system, the archive and its import); $free GiB free (POSTTRAIN_IMAGE_MIN_FREE_GIB overrides)"
}

# debian_base WORK PACKAGES: prints the folder of `debootstrap --variant=minbase bookworm` with
# PACKAGES (comma-separated), made once and kept (keyed by the package list)
debian_base() {
    local base
    base=$1/base-$(printf '%s' "bookworm $2" | sha256sum | cut -c1-12)
    if [[ ! -f $base/.posttrain-base ]]; then
        log "debootstrap --variant=minbase bookworm ($2)"
        rm -rf "$base"
        debootstrap --variant=minbase --include="$2" bookworm "$base" http://deb.debian.org/debian >"$1/debootstrap.log" 2>&1 ||
            die "debootstrap failed; see $1/debootstrap.log"
        rm -rf "$base"/var/cache/apt/archives/*.deb "$base"/var/lib/apt/lists/*
        touch "$base/.posttrain-base"
    fi
    echo "$base"
}

# pack_image TAG ROOT ARCHIVE CONFIG [BASE]: ROOT's files as a zstd layer of an OCI archive, its only
# one, or the top one over the layers of the OCI archive BASE. The layer is streamed from tar through
# scripts/oci-archive.py into the archive: an image's GBs are never on disk twice (a test machine's
# disk is shared, and the build's peak is what fills it). Extended attributes of the trusted
# namespace (an overlay's own bookkeeping on its upper folder) are left out.
# A failed pack (tar's or the packer's) leaves the archive that was there, if any, as it was.
pack_image() {
    log "packing ${2}${5:+ over the layers of $5}"
    if ! tar --numeric-owner --xattrs --xattrs-exclude='trusted.*' -C "$2" -cf - . |
        python3 "$repo/scripts/oci-archive.py" ${5:+--base "$5"} "$1" - "$3.new" "$4"; then
        rm -f "$3.new" "$3.new.part"
        die "could not pack $2 into $3"
    fi
    mv -f "$3.new" "$3"
}

# import_into_node ARCHIVE: `ctr images import` into the containerd of the kube-local node of
# POSTTRAIN_KUBE_STATE (or POSTTRAIN_CONTAINERD_SOCK), then the archive goes; none there (or
# POSTTRAIN_IMAGE_NO_IMPORT=1): the archive stays for `ctr`, `podman load` or `skopeo copy oci-archive:`
import_into_node() {
    [[ ${POSTTRAIN_IMAGE_NO_IMPORT:-} == 1 ]] && return 0
    local sock=${POSTTRAIN_CONTAINERD_SOCK:-} checkout_id
    if [[ -z $sock ]]; then
        checkout_id=$(basename "$repo" | sed 's/[^A-Za-z0-9._-]/-/g')-$(printf '%s' "$repo" | sha256sum | cut -c1-10)
        sock=${POSTTRAIN_KUBE_STATE:-$HOME/.cache/posttrain/kube-local/$checkout_id}/node/containerd.sock
    fi
    if [[ -S $sock ]]; then
        log "importing into the containerd of $sock (namespace k8s.io)"
        ctr -a "$sock" -n k8s.io images import "$1" >/dev/null || die "ctr could not import the image"
        rm -f "$1"
    else
        log "no containerd at $sock: the archive is left at $1 for \`ctr images import\`, \`podman load\` or \`skopeo copy oci-archive:...\`"
    fi
}
