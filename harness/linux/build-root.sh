#!/bin/bash
# Build (or reuse) the cached Debian trixie root that carries QEMU >= 10.1 (vfio-user-pci),
# the trixie kernel and the guest tools. Prints the root directory on stdout.
#   IOPATH_HARNESS_CACHE   cache directory (default /var/cache/iopath-harness)
#   IOPATH_HARNESS_MIRROR  Debian mirror (default http://deb.debian.org/debian)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

need_root build-root.sh
for t in debootstrap unshare chroot flock sha256sum; do
    command -v "$t" >/dev/null || die "missing host tool: $t"
done

BASE=$(root_base)
ROOT="$BASE/root"
H=$(root_hash)

if [[ -f "$BASE/.complete" && -x "$ROOT/usr/bin/qemu-system-x86_64" ]]; then
    log_cached "root cached: $ROOT"
    echo "$ROOT"
    exit 0
fi

take_lock "root-$H"
if [[ -f "$BASE/.complete" ]]; then   # built by a concurrent run while we waited
    log_cached "root cached: $ROOT"
    echo "$ROOT"
    exit 0
fi
[[ -e "$BASE" ]] && die "$BASE exists but is not marked complete; remove it by hand"

TMP="$HARNESS_CACHE/.tmp-root-$H-$$"
rm -rf "$TMP"
mkdir -p "$TMP"
cleanup() { local rc=$?; if [[ $rc -ne 0 ]]; then log "build failed (rc=$rc); removing $TMP"; rm -rf "$TMP"; fi; }
trap cleanup EXIT
T0=$SECONDS

PKGS_BPO=(qemu-system-x86)
PKGS=(linux-image-amd64 busybox-static fio nvme-cli e2fsprogs kmod pciutils xz-utils cpio
      zstd ca-certificates)

log "debootstrap trixie (minbase) into $TMP/root from $HARNESS_MIRROR"
# debootstrap mounts /proc and /sys inside the target: keep that in a private mount namespace.
unshare -m --propagation private -- \
    debootstrap --variant=minbase --components=main trixie "$TMP/root" "$HARNESS_MIRROR" \
    >"$TMP/debootstrap.log" 2>&1 || { tail -n 40 "$TMP/debootstrap.log" >&2; die "debootstrap failed (log above)"; }

R="$TMP/root"
cat >"$R/etc/apt/sources.list" <<SRC
deb $HARNESS_MIRROR trixie main
deb $HARNESS_MIRROR trixie-updates main
deb $HARNESS_MIRROR trixie-backports main
SRC
# No daemons may start in the chroot.
printf '#!/bin/sh\nexit 101\n' >"$R/usr/sbin/policy-rc.d"
chmod +x "$R/usr/sbin/policy-rc.d"
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$R/etc/apt/apt.conf.d/90harness"
# The kernel's postinst would build a /boot/initrd.img with initramfs-tools, which we never use
# (build-initramfs.sh makes our own) and which fails in a chroot: divert update-initramfs to a no-op.
in_root "$R" dpkg-divert --local --rename --add /usr/sbin/update-initramfs >/dev/null
printf '#!/bin/sh\necho "update-initramfs: disabled in the iopath harness root" >&2\nexit 0\n' \
    >"$R/usr/sbin/update-initramfs"
chmod +x "$R/usr/sbin/update-initramfs"
cp -L /etc/resolv.conf "$R/etc/resolv.conf" 2>/dev/null || true

log "apt-get update"
in_root "$R" apt-get update >"$TMP/apt.log" 2>&1 || { tail -n 40 "$TMP/apt.log" >&2; die "apt-get update failed"; }
log "apt-get install ${PKGS[*]}"
in_root "$R" apt-get install -y "${PKGS[@]}" >>"$TMP/apt.log" 2>&1 \
    || { tail -n 40 "$TMP/apt.log" >&2; die "apt-get install ${PKGS[*]} failed"; }
log "apt-get install -t trixie-backports ${PKGS_BPO[*]}"
in_root "$R" apt-get install -y -t trixie-backports "${PKGS_BPO[@]}" >>"$TMP/apt.log" 2>&1 \
    || { tail -n 40 "$TMP/apt.log" >&2; die "apt-get install -t trixie-backports ${PKGS_BPO[*]} failed"; }
in_root "$R" apt-get clean

log "checking QEMU"
QV=$(in_root "$R" qemu-system-x86_64 --version | head -n1) || die "qemu-system-x86_64 does not run in the root"
log "  $QV"
ver=$(sed -nE 's/.*version ([0-9]+)\.([0-9]+).*/\1 \2/p' <<<"$QV")
read -r maj min <<<"$ver"
[[ -n ${maj:-} ]] || die "cannot parse QEMU version from: $QV"
(( maj > 10 || (maj == 10 && min >= 1) )) || die "QEMU in the root is $maj.$min, need >= 10.1"
in_root "$R" qemu-system-x86_64 -machine none -device help 2>&1 | grep -q '"vfio-user-pci"' \
    || die "qemu-system-x86_64 in the root has no -device vfio-user-pci"
ls "$R"/boot/vmlinuz-* >/dev/null 2>&1 || die "no kernel in $R/boot"
for b in busybox fio nvme mkfs.ext4 e2fsck; do
    in_root "$R" sh -c "command -v $b" >/dev/null || die "$b missing in the root"
done

{
    echo "qemu: $QV"
    echo "kernel: $(basename "$(ls "$R"/boot/vmlinuz-* | sort -V | tail -n1)")"
    echo "built: $(date -u +%FT%TZ) in $((SECONDS - T0)) s"
    echo "hash: $H"
} >"$TMP/info"
touch "$TMP/.complete"
mkdir -p "$HARNESS_CACHE"
mv -T "$TMP" "$BASE"    # atomic: a half-built root is never at $BASE
trap - EXIT
log "root built in $((SECONDS - T0)) s: $ROOT"
echo "$ROOT"
