#!/bin/bash
# Build (or reuse) the guest kernel + initramfs from the cached trixie root (build-root.sh runs
# first if needed). Prints the output directory on stdout; it holds:
#   vmlinuz             the trixie kernel
#   initramfs.cpio.gz   busybox-static, fio, nvme-cli, e2fsprogs, NVMe + virtio-blk + virtio-rng + ext4 modules,
#                       /init, /lib.sh (= guest-lib.sh), /check.sh (= guest-check.sh),
#                       /check-vblk.sh (= guest-vblk.sh)
#   kver                the kernel version
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

need_root build-initramfs.sh
ROOT=$("$HARNESS_DIR/build-root.sh")
OUT=$(initramfs_dir)
H=$(initramfs_hash)

if [[ -f "$OUT/.complete" ]]; then
    log_cached "initramfs cached: $OUT"
    echo "$OUT"
    exit 0
fi
take_lock "initramfs-$H"
if [[ -f "$OUT/.complete" ]]; then
    log_cached "initramfs cached: $OUT"
    echo "$OUT"
    exit 0
fi
[[ -e "$OUT" ]] && die "$OUT exists but is not marked complete; remove it by hand"

T0=$SECONDS
TMP="$(dirname "$OUT")/.tmp-initramfs-$H-$$"
rm -rf "$TMP"
mkdir -p "$TMP"
cleanup() { local rc=$?; if [[ $rc -ne 0 ]]; then log "build failed (rc=$rc); removing $TMP"; rm -rf "$TMP"; fi; }
trap cleanup EXIT

KVER=$(ls "$ROOT/lib/modules" | sort -V | tail -n1)
[[ -n $KVER && -f "$ROOT/boot/vmlinuz-$KVER" ]] || die "no kernel/modules in $ROOT"
log "kernel $KVER"

S="$TMP/stage"
mkdir -p "$S"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,etc,proc,sys,dev,tmp,mnt,run,root}
ln -s usr/bin "$S/bin"; ln -s usr/sbin "$S/sbin"; ln -s usr/lib "$S/lib"; ln -s usr/lib64 "$S/lib64"
mknod -m 600 "$S/dev/console" c 5 1
mknod -m 666 "$S/dev/null" c 1 3

# --- binaries and their shared libraries (resolved by ldd inside the root) ---
BINS=(/usr/bin/busybox /usr/bin/fio /usr/sbin/nvme /usr/sbin/mke2fs /usr/sbin/e2fsck /usr/bin/lspci)
for b in "${BINS[@]}"; do
    [[ -x "$ROOT$b" ]] || die "missing $b in the root"
    cp -L "$ROOT$b" "$S$b"
done
ln -s mke2fs "$S/usr/sbin/mkfs.ext4"
ln -s e2fsck "$S/usr/sbin/fsck.ext4"
cp "$ROOT/etc/mke2fs.conf" "$S/etc/mke2fs.conf"
LIBS=$(in_root "$ROOT" /bin/sh -c 'for b in "$@"; do ldd "$b" || exit 1; done' ldd "${BINS[@]:1}" \
       | awk '/=> \//{print $3} /^[ \t]*\/[^ ]*ld-linux/{print $1}' | sort -u) \
    || die "ldd inside the root failed"
[[ -n $LIBS ]] || die "ldd found no libraries"
n=0
for l in $LIBS; do
    [[ -e "$ROOT$l" ]] || die "library $l (from ldd) not found in the root"
    mkdir -p "$(dirname "$S$l")"
    cp -L "$ROOT$l" "$S$l"
    n=$((n + 1))
done
log "copied ${#BINS[@]} binaries and $n libraries"
# busybox applets as symlinks, never shadowing a real binary copied above
"$S/usr/bin/busybox" --list-full | while read -r a; do
    [[ -e "$S/$a" || -L "$S/$a" ]] || ln -s /usr/bin/busybox "$S/$a"
done

# --- kernel modules: NVMe, virtio-blk and virtio-rng over PCI (MSI-X is built in) and ext4, with their dependencies ---
MODS=(nvme virtio_pci virtio_blk virtio_rng ext4 crc32c-intel crc32c_generic libcrc32c crc16 jbd2 mbcache)
: >"$TMP/modlist"
for m in "${MODS[@]}"; do
    in_root "$ROOT" modprobe -S "$KVER" --show-depends "$m" >"$TMP/dep.$m" 2>&1 \
        || { cat "$TMP/dep.$m" >&2; die "modprobe --show-depends $m failed"; }
    awk '$1=="insmod"{print $2}' "$TMP/dep.$m" >>"$TMP/modlist"
done
awk '!seen[$0]++' "$TMP/modlist" >"$TMP/modorder"
MD="$S/lib/modules/$KVER"
mkdir -p "$MD"
: >"$S/etc/modules.load"
while read -r p; do
    rel=${p#/lib/modules/$KVER/}
    dst="$MD/${rel%.xz}"; dst=${dst%.zst}; dst=${dst%.gz}
    mkdir -p "$(dirname "$dst")"
    case "$p" in
        *.ko.xz)  xz -dc "$ROOT$p" >"$dst" ;;
        *.ko.zst) in_root "$ROOT" zstd -dc "$p" >"$dst" ;;
        *.ko.gz)  gzip -dc "$ROOT$p" >"$dst" ;;
        *.ko)     cp "$ROOT$p" "$dst" ;;
        *) die "unexpected module path $p" ;;
    esac
    echo "/lib/modules/$KVER/${dst#$MD/}" >>"$S/etc/modules.load"
done <"$TMP/modorder"
for f in modules.order modules.builtin modules.builtin.modinfo; do
    [[ -f "$ROOT/lib/modules/$KVER/$f" ]] && cp "$ROOT/lib/modules/$KVER/$f" "$MD/"
done
HARNESS_BIND_MNT="$S" in_root "$ROOT" depmod -b /mnt "$KVER" || die "depmod failed"
log "modules ($(wc -l <"$S/etc/modules.load")): $(xargs -n1 basename <"$S/etc/modules.load" | tr '\n' ' ')"

# --- /init and the check script ---
cat >"$S/init" <<'INIT'
#!/bin/sh
# iopath harness /init (busybox sh)
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null || true
mkdir -p /dev/pts /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /dev/shm
exec </dev/console >/dev/console 2>&1
echo "@init kernel $(uname -r) cmdline: $(cat /proc/cmdline)"
# Module parameters given on the kernel command line as MOD.PARAM=VALUE (busybox insmod does not
# read /proc/cmdline itself).
while read -r p; do
    m=$(basename "$p" .ko | tr - _)
    args=""
    for t in $(cat /proc/cmdline); do
        case "$t" in "$m".*=*) args="$args ${t#"$m".}" ;; esac
    done
    # shellcheck disable=SC2086
    if ! out=$(insmod "$p" $args 2>&1); then
        case "$out" in *"File exists"*) ;; *) echo "@init insmod $p failed: $out" ;; esac
    fi
done </etc/modules.load
script=/check.sh
for t in $(cat /proc/cmdline); do
    case "$t" in harness.script=*) script=${t#harness.script=} ;; esac
done
echo "@init running $script"
sh "$script"
echo "@init $script exited rc=$?"
sync
poweroff -f
echo o >/proc/sysrq-trigger
sleep 5
INIT
chmod 755 "$S/init"
install -m 644 "$HARNESS_DIR/guest-lib.sh" "$S/lib.sh"
install -m 755 "$HARNESS_DIR/guest-check.sh" "$S/check.sh"
install -m 755 "$HARNESS_DIR/guest-vblk.sh" "$S/check-vblk.sh"

# --- pack ---
HARNESS_BIND_MNT="$S" in_root "$ROOT" /bin/sh -c 'cd /mnt && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner 0:0 --quiet' \
    | gzip -6 >"$TMP/initramfs.cpio.gz" || die "cpio/gzip failed"
cp "$ROOT/boot/vmlinuz-$KVER" "$TMP/vmlinuz"
echo "$KVER" >"$TMP/kver"
rm -rf "$S" "$TMP"/dep.* "$TMP/modlist"
touch "$TMP/.complete"
mv -T "$TMP" "$OUT"
trap - EXIT
log "initramfs built in $((SECONDS - T0)) s: $OUT ($(du -h "$OUT/initramfs.cpio.gz" | cut -f1))"
echo "$OUT"
