#!/bin/bash
# Run the harness root's qemu-system-x86_64 (QEMU >= 10.1, with vfio-user-pci) from the host.
#   qemu.sh --version        print the QEMU version of the root and exit
#   qemu.sh --root           print the root directory and exit
#   qemu.sh QEMU-ARGS...     exec qemu-system-x86_64 QEMU-ARGS... chrooted in the root
# QEMU runs in a private mount namespace (nothing stays mounted on the host) with the host's
# /dev, /proc, /sys and /tmp bound at the same paths, so sockets, images and logs under /tmp are
# reachable by the same absolute path. More host directories can be bound at identical paths
# with IOPATH_HARNESS_BIND=/dir1:/dir2 (their mount points are created in the root). Paths given
# to QEMU must be absolute. The root is built first if it is not cached (build-root.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

need_root qemu.sh
ROOT=$(IOPATH_HARNESS_QUIET=1 "$HARNESS_DIR/build-root.sh")
case "${1:-}" in
    --root) echo "$ROOT"; exit 0 ;;
    --version) exec env HARNESS_BIND_TMP=0 bash -c "source '$HARNESS_DIR/common.sh'; in_root '$ROOT' qemu-system-x86_64 --version" ;;
esac

exec unshare -m --propagation private -- /bin/bash -euo pipefail -c '
    r=$1; shift
    mount -t proc proc "$r/proc"
    mount -t sysfs sysfs "$r/sys"
    mount --rbind /dev "$r/dev"
    mount --make-rslave "$r/dev"
    mount --rbind /tmp "$r/tmp"
    IFS=: read -r -a extra <<<"${IOPATH_HARNESS_BIND:-}"
    for d in "${extra[@]}"; do
        [[ -n $d ]] || continue
        [[ $d == /* && -d $d ]] || { echo "[harness] IOPATH_HARNESS_BIND: $d is not an absolute directory" >&2; exit 1; }
        mkdir -p "$r$d"
        mount --bind "$d" "$r$d"
    done
    exec chroot "$r" /usr/bin/env -i PATH=/usr/bin:/usr/sbin HOME=/root LANG=C.UTF-8 \
        qemu-system-x86_64 "$@"
' qemu.sh "$ROOT" "$@"
