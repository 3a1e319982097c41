# shellcheck shell=bash
# Shared helpers for the iopath real-client harness (sourced, not run).
# Cache layout:
#   $IOPATH_HARNESS_CACHE/<root-hash>/root/                      the debootstrapped trixie root
#   $IOPATH_HARNESS_CACHE/<root-hash>/initramfs-<ir-hash>/{vmlinuz,initramfs.cpio.gz,kver}
# <root-hash> covers common.sh + build-root.sh; <ir-hash> also covers build-initramfs.sh and the
# guest scripts baked in (guest-lib.sh, guest-check.sh, guest-vblk.sh).

HARNESS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HARNESS_CACHE="${IOPATH_HARNESS_CACHE:-/var/cache/iopath-harness}"
HARNESS_MIRROR="${IOPATH_HARNESS_MIRROR:-http://deb.debian.org/debian}"

log()  { printf '[harness] %s\n' "$*" >&2; }
# "cached" notices are silenced with IOPATH_HARNESS_QUIET=1 (qemu.sh sets it for its own lookup)
log_cached() { [[ ${IOPATH_HARNESS_QUIET:-0} == 1 ]] || log "$@"; }
die()  { printf '[harness] ERROR: %s\n' "$*" >&2; exit 1; }

need_root() { [[ $(id -u) -eq 0 ]] || die "$1 must run as root (debootstrap/chroot/unshare)"; }

hash_files() { cat "$@" | sha256sum | cut -c1-16; }

root_hash() { hash_files "$HARNESS_DIR/common.sh" "$HARNESS_DIR/build-root.sh"; }
root_base() { printf '%s/%s\n' "$HARNESS_CACHE" "$(root_hash)"; }
root_dir()  { printf '%s/root\n' "$(root_base)"; }

initramfs_hash() {
    hash_files "$HARNESS_DIR/common.sh" "$HARNESS_DIR/build-root.sh" \
        "$HARNESS_DIR/build-initramfs.sh" "$HARNESS_DIR/guest-lib.sh" "$HARNESS_DIR/guest-check.sh" \
        "$HARNESS_DIR/guest-vblk.sh"
}
initramfs_dir() { printf '%s/initramfs-%s\n' "$(root_base)" "$(initramfs_hash)"; }

# take_lock NAME: serialise concurrent builders of the same artefact (fd 9, released on exit).
take_lock() {
    mkdir -p "$HARNESS_CACHE"
    exec 9>"$HARNESS_CACHE/.lock-$1"
    if ! flock -n 9; then
        log "waiting for another build holding $HARNESS_CACHE/.lock-$1 ..."
        flock 9
    fi
}

# in_root ROOT CMD...: run CMD chrooted in ROOT inside a private mount namespace with
# /proc, /sys and /dev bound (and the host /tmp on ROOT/tmp when HARNESS_BIND_TMP=1, and the
# host directory HARNESS_BIND_MNT on ROOT/mnt when set);
# the mounts vanish with the namespace.
in_root() {
    local root=$1; shift
    unshare -m --propagation private -- /bin/bash -euo pipefail -c '
        r=$1; shift
        mount -t proc proc "$r/proc"
        mount -t sysfs sysfs "$r/sys"
        mount --rbind /dev "$r/dev"
        mount --make-rslave "$r/dev"
        if [[ -n ${HARNESS_BIND_MNT:-} ]]; then
            mount --bind "$HARNESS_BIND_MNT" "$r/mnt"
        fi
        if [[ ${HARNESS_BIND_TMP:-0} == 1 ]]; then
            mkdir -p "$r/tmp"
            mount --rbind /tmp "$r/tmp"
        fi
        exec chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
            LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"
    ' in_root "$root" "$@"
}
