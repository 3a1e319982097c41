#!/bin/bash
# Boot iopath's own guest image under the root's QEMU (>= 10.1) + KVM with one vfio-user-pci
# device served by `iopath serve ... --transport vfio-user --socket SOCKET`.
#   run-image.sh GUEST_ELF SOCKET [APPEND] [TIMEOUT_SECS]
#     GUEST_ELF  from `iopath image --out /tmp/guest.elf` (absolute path, under /tmp or bound)
#     SOCKET     the server's UNIX socket (absolute path)
#     APPEND     guest command line (default "batches=2 only=mmio-no,portio-no")
#     TIMEOUT    wall clock in seconds (default 120), then QEMU is killed
# Env: IOPATH_RUN_IMAGE_MEM (MB, default 64), IOPATH_RUN_IMAGE_SHARE=0 (plain -m, no memfd),
#      IOPATH_RUN_IMAGE_HUGETLB=1 (the memfd in 2 MiB hugetlbfs pages: MEM/2 free in the host's pool),
#      IOPATH_RUN_IMAGE_LOG (console log path; default /tmp/iopath-image.XXXXXX/console.log).
# The guest's serial output is echoed and logged. Exit: 0 when the guest printed "@done rc=0" and
# wrote 0 to isa-debug-exit (QEMU status 1), 1 otherwise, 124 on timeout, 4 on usage/setup errors.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
die() { printf '[run-image] ERROR: %s\n' "$*" >&2; exit 4; }

[[ $# -ge 2 ]] || { sed -n '2,14p' "$0" >&2; exit 4; }
IMG=$1 SOCK=$2 APPEND=${3:-batches=2 only=mmio-no,portio-no} TIMEOUT=${4:-120}
MEM=${IOPATH_RUN_IMAGE_MEM:-64}
need_root run-image.sh
[[ $IMG == /* && -f $IMG ]] || die "guest image must be an existing absolute path: $IMG"
[[ $SOCK == /* && -S $SOCK ]] || die "no vfio-user socket at $SOCK (absolute path; is iopath serve running?)"
[[ -c /dev/kvm ]] || die "no /dev/kvm"
"$HARNESS_DIR/build-root.sh" >/dev/null

BIND=()
[[ $IMG == /tmp/* ]] || BIND+=("$(dirname "$IMG")")
[[ $SOCK == /tmp/* ]] || BIND+=("$(dirname "$SOCK")")
if [[ -n ${IOPATH_RUN_IMAGE_LOG:-} ]]; then LOG=$IOPATH_RUN_IMAGE_LOG; else LOG="$(mktemp -d /tmp/iopath-image.XXXXXX)/console.log"; fi

Q=(-accel kvm -cpu host,-arch-capabilities -display none -serial stdio -monitor none -no-reboot
   -nodefaults -device isa-debug-exit,iobase=0xf4,iosize=1)
if [[ ${IOPATH_RUN_IMAGE_HUGETLB:-0} == 1 ]]; then
    Q+=(-m "${MEM}M" -object "memory-backend-memfd,id=mem,size=${MEM}M,share=on,hugetlb=on,hugetlbsize=2M"
        -machine pc,memory-backend=mem)
elif [[ ${IOPATH_RUN_IMAGE_SHARE:-1} == 1 ]]; then
    Q+=(-m "${MEM}M" -object "memory-backend-memfd,id=mem,size=${MEM}M,share=on" -machine pc,memory-backend=mem)
else
    Q+=(-m "${MEM}M" -machine pc)
fi
Q+=(-device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$SOCK\"}}"
    -kernel "$IMG" -append "$APPEND")
echo "[run-image] $IMG on $SOCK, append '$APPEND', timeout ${TIMEOUT}s, log $LOG" >&2
set +e
IOPATH_HARNESS_BIND=$(IFS=:; echo "${BIND[*]:-}") timeout --kill-after=10 "$TIMEOUT" \
    "$HARNESS_DIR/qemu.sh" "${Q[@]}" </dev/null 2>"$LOG.stderr" | sed -u 's/\r$//' | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
if [[ -s $LOG.stderr ]]; then echo "[run-image] QEMU stderr:" >&2; sed 's/^/  qemu| /' "$LOG.stderr" >&2; fi
# isa-debug-exit: QEMU exits with (value << 1) | 1; the guest writes 0 after "@done rc=0".
# QEMU's own errors also exit 1, hence the check of the console for "@done rc=0".
if [[ $rc == 124 || $rc == 137 ]]; then
    echo "[run-image] TIMEOUT after ${TIMEOUT}s; QEMU killed" >&2; exit 124
fi
if [[ $rc == 1 ]] && grep -q '^@done rc=0' "$LOG"; then
    echo "[run-image] PASS: guest @done rc=0 (QEMU exit status 1 = isa-debug-exit value 0)" >&2; exit 0
fi
echo "[run-image] FAIL: QEMU exit status $rc; $(grep '^@done' "$LOG" || echo 'no @done line')" >&2
exit 1
