#!/bin/bash
# Boot the trixie kernel + harness initramfs under the root's QEMU (TCG) with one block device (NVMe
# or virtio-blk) and run guest-check.sh (or, with --check vblk, guest-vblk.sh) in the guest. Exit codes:
#   0  "@done ... failed=0"           2  wall-clock timeout (QEMU killed), no @done
#   1  "@done ... failed=N" (N > 0)   3  QEMU/guest ended without @done
#   4  usage or setup error (build, missing socket, ...)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
die() { printf '[run-linux] ERROR: %s\n' "$*" >&2; exit 4; }

usage() {
    cat >&2 <<USAGE
usage: run-linux.sh (--device qemu-nvme|qemu-virtio-blk | --vfio-user SOCKET | --vhost-user SOCKET) [options]
  --device qemu-nvme     control: QEMU's own -device nvme on a 64 MiB raw image
  --device qemu-virtio-blk  control: QEMU's own -device virtio-blk-pci on a 64 MiB raw image
                         (implies --check vblk)
  --vfio-user SOCKET     -device vfio-user-pci on SOCKET (absolute path; under /tmp, or its
                         directory is bound into the QEMU root); repeatable: one device each
  --vhost-user SOCKET    -device vhost-user-blk-pci on SOCKET (a vhost-user-blk backend; implies
                         --check vblk; needs the shared memfd RAM, so not with --no-share)
  --vhost-reconnect MS   the vhost-user chardev reconnects MS ms after its backend goes away
                         (reconnect-ms=MS: a backend killed and started again on SOCKET)
  --check nvme|vblk      the checks the guest runs: guest-check.sh (NVMe, the default) or
                         guest-vblk.sh (virtio-blk)
  --root-port            each vfio-user device behind a pcie-root-port of its own (q35's root
                         bus makes QEMU show an Express endpoint as Root Complex Integrated)
  --no-share             plain -m, no memfd/share=on backend (vfio-user DMA_READ/WRITE fallback)
  --hugetlb              the shared memfd in 2 MiB hugetlbfs pages (hugetlb=on): MB/2 free pages
                         in the host's pool (vm.nr_hugepages)
  --timeout SECS         wall clock for QEMU (default 300), then QEMU is killed (exit 2);
                         the guest gets harness.deadline=SECS-25 so it still prints @done
  --nvme-timeout SECS    nvme_core.admin_timeout and io_timeout in the guest (kernel default 60/30)
  --append "ARGS"        extra kernel command line (e.g. harness.skip=rebind loglevel=7)
  --script FILE          run FILE in the guest instead of the baked-in guest-check.sh
  --mem MB               guest RAM (default 512)   --smp N   vCPUs (default 1)
  --log FILE             console log (default RUNDIR/console.log)
  --run-dir DIR          working directory (default: new /tmp/iopath-linux.XXXXXX, kept)
  --qemu-arg ARG         one more QEMU argument (repeatable)
  --quiet                do not echo @check lines (still logged)
USAGE
    exit 4
}

MODE= CHECK=nvme SOCK= SOCKS=() ROOT_PORT=0 SHARE=1 HUGETLB=0 TIMEOUT=300 NVME_TO= APPEND= SCRIPT= MEM=512 SMP=1 LOG= RUN= QUIET=0 RECONNECT=
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device)
            case ${2:-} in
                qemu-nvme) ;;
                qemu-virtio-blk) CHECK=vblk ;;
                *) die "--device takes qemu-nvme or qemu-virtio-blk" ;;
            esac
            MODE=$2; shift 2 ;;
        --vfio-user) MODE=vfio-user; SOCK=${2:?}; SOCKS+=("$2"); shift 2 ;;
        --vhost-user) MODE=vhost-user; CHECK=vblk; SOCK=${2:?}; shift 2 ;;
        --vhost-reconnect) RECONNECT=${2:?}; shift 2 ;;
        --check) [[ ${2:-} == nvme || ${2:-} == vblk ]] || die "--check takes nvme or vblk"; CHECK=$2; shift 2 ;;
        --no-share) SHARE=0; shift ;;
        --root-port) ROOT_PORT=1; shift ;;
        --hugetlb) HUGETLB=1; shift ;;
        --timeout) TIMEOUT=${2:?}; shift 2 ;;
        --nvme-timeout) NVME_TO=${2:?}; shift 2 ;;
        --append) APPEND=${2?}; shift 2 ;;
        --script) SCRIPT=${2:?}; shift 2 ;;
        --mem) MEM=${2:?}; shift 2 ;;
        --smp) SMP=${2:?}; shift 2 ;;
        --log) LOG=${2:?}; shift 2 ;;
        --run-dir) RUN=${2:?}; shift 2 ;;
        --qemu-arg) EXTRA+=("${2?}"); shift 2 ;;
        --quiet) QUIET=1; shift ;;
        -h|--help) usage ;;
        *) echo "unknown argument: $1" >&2; usage ;;
    esac
done
[[ -n $MODE ]] || usage
need_root run-linux.sh

IR=$("$HARNESS_DIR/build-initramfs.sh") || die "build-initramfs.sh failed"
if [[ -z $RUN ]]; then RUN=$(mktemp -d /tmp/iopath-linux.XXXXXX); else mkdir -p "$RUN"; fi
RUN=$(cd "$RUN" && pwd)
LOG=${LOG:-$RUN/console.log}
[[ $LOG == /* ]] || LOG="$PWD/$LOG"
BIND=()
[[ $RUN == /tmp/* ]] || BIND+=("$RUN")
[[ $(dirname "$LOG") == /tmp/* || $(dirname "$LOG") == "$RUN" ]] || BIND+=("$(dirname "$LOG")")

# kernel + initramfs into the run dir (a hard link when possible), so the chrooted QEMU sees them
ln -f "$IR/vmlinuz" "$RUN/vmlinuz" 2>/dev/null || cp "$IR/vmlinuz" "$RUN/vmlinuz"
ln -f "$IR/initramfs.cpio.gz" "$RUN/initramfs.cpio.gz" 2>/dev/null || cp "$IR/initramfs.cpio.gz" "$RUN/initramfs.cpio.gz"
INITRD="$RUN/initramfs.cpio.gz"
if [[ -n $SCRIPT ]]; then
    # append a second cpio archive carrying /check.sh; the kernel unpacks it over the first
    [[ -f $SCRIPT ]] || die "no such script: $SCRIPT"
    ov="$RUN/overlay"; rm -rf "$ov"; mkdir -p "$ov"; install -m 755 "$SCRIPT" "$ov/check.sh"
    HARNESS_BIND_MNT="$ov" in_root "$("$HARNESS_DIR/build-root.sh")" /bin/sh -c 'cd /mnt && echo ./check.sh | cpio -o -H newc --owner 0:0 --quiet' \
        | gzip >"$RUN/overlay.cpio.gz"
    cat "$RUN/initramfs.cpio.gz" "$RUN/overlay.cpio.gz" >"$RUN/initramfs-run.cpio.gz"
    INITRD="$RUN/initramfs-run.cpio.gz"
fi

CMDLINE="console=ttyS0 loglevel=4 panic=1"
# the guest fails every step still pending 25 s before the wall clock, so @done is still printed
(( TIMEOUT > 45 )) && CMDLINE+=" harness.deadline=$((TIMEOUT - 25))"
[[ -n $NVME_TO ]] && CMDLINE+=" nvme_core.admin_timeout=$NVME_TO nvme_core.io_timeout=$NVME_TO"
[[ $CHECK == vblk && -z $SCRIPT ]] && CMDLINE+=" harness.script=/check-vblk.sh"
[[ -n $APPEND ]] && CMDLINE+=" $APPEND"

Q=(-accel tcg -cpu max -smp "$SMP" -nodefaults -no-reboot -display none -nic none
   -serial "file:$LOG" -monitor none
   -kernel "$RUN/vmlinuz" -initrd "$INITRD" -append "$CMDLINE")
if [[ $HUGETLB == 1 ]]; then
    [[ $SHARE == 1 ]] || die "--hugetlb is the shared memfd: not with --no-share"
    Q+=(-m "${MEM}M" -object "memory-backend-memfd,id=mem,size=${MEM}M,share=on,hugetlb=on,hugetlbsize=2M"
        -machine q35,memory-backend=mem)
elif [[ $SHARE == 1 ]]; then
    Q+=(-m "${MEM}M" -object "memory-backend-memfd,id=mem,size=${MEM}M,share=on" -machine q35,memory-backend=mem)
else
    Q+=(-m "${MEM}M" -machine q35)
fi
case "$MODE" in
    qemu-nvme)
        truncate -s 64M "$RUN/disk.img"
        Q+=(-drive "file=$RUN/disk.img,if=none,id=d0,format=raw,cache=unsafe" -device nvme,drive=d0,serial=harness0)
        ;;
    qemu-virtio-blk)
        truncate -s 64M "$RUN/disk.img"
        Q+=(-drive "file=$RUN/disk.img,if=none,id=d0,format=raw,cache=unsafe" -device virtio-blk-pci,drive=d0)
        ;;
    vfio-user|vhost-user)
        [[ $MODE == vfio-user ]] || SOCKS=("$SOCK")
        n=0
        for SOCK in "${SOCKS[@]}"; do
            [[ $SOCK == /* ]] || SOCK="$PWD/$SOCK"
            [[ -S $SOCK ]] || die "no $MODE socket at $SOCK (is the server running?)"
            [[ $SOCK == /tmp/* ]] || BIND+=("$(dirname "$SOCK")")
            if [[ $MODE == vfio-user ]]; then
                BUS=
                if [[ $ROOT_PORT == 1 ]]; then
                    Q+=(-device "pcie-root-port,id=rp$n,chassis=$((n + 1)),slot=$((n + 1))")
                    BUS=",\"bus\":\"rp$n\""
                fi
                Q+=(-device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$SOCK\"}$BUS}")
                n=$((n + 1))
            else
                [[ $SHARE == 1 ]] || die "--vhost-user needs the shared memfd RAM (drop --no-share)"
                Q+=(-chardev "socket,id=vu0,path=$SOCK${RECONNECT:+,reconnect-ms=$RECONNECT}"
                    -device vhost-user-blk-pci,chardev=vu0)
            fi
        done
        SOCK=$(IFS=' '; echo "${SOCKS[*]}")
        ;;
esac
Q+=("${EXTRA[@]}")

: >"$LOG"
printf '%q ' "$HARNESS_DIR/qemu.sh" "${Q[@]}" >"$RUN/qemu.cmdline"; echo >>"$RUN/qemu.cmdline"
echo "[run-linux] $MODE${SOCK:+ $SOCK} share=$SHARE timeout=${TIMEOUT}s run-dir=$RUN" >&2
echo "[run-linux] console log: $LOG   QEMU stderr: $RUN/qemu.stderr" >&2
T0=$SECONDS
BINDS=$(IFS=:; echo "${BIND[*]:-}")
IOPATH_HARNESS_BIND="$BINDS" timeout --kill-after=10 "$TIMEOUT" "$HARNESS_DIR/qemu.sh" "${Q[@]}" \
    </dev/null >"$RUN/qemu.stdout" 2>"$RUN/qemu.stderr" &
QPID=$!
trap 'kill $QPID 2>/dev/null || true' EXIT INT TERM
if [[ $QUIET == 0 ]]; then
    tail -n +1 -F --pid=$QPID "$LOG" 2>/dev/null | sed -u 's/\r$//' | grep --line-buffered -E '^@(check|done|init|skip|fio)' &
    TPID=$!
fi
# After @done, give the guest GRACE seconds to power off (a wedged controller can stall the
# kernel's shutdown path), then stop QEMU; the verdict comes from @done either way.
GRACE=20
done_at=
while kill -0 $QPID 2>/dev/null; do
    if [[ -z $done_at ]] && grep -q '^@done ' "$LOG" 2>/dev/null; then done_at=$SECONDS; fi
    if [[ -n $done_at ]] && (( SECONDS - done_at > GRACE )); then
        echo "[run-linux] guest printed @done but did not power off within ${GRACE}s; stopping QEMU" >&2
        kill $QPID 2>/dev/null || true
        break
    fi
    sleep 1
done
set +e
wait $QPID
QRC=$?
set -e
[[ $QUIET == 0 ]] && { wait $TPID 2>/dev/null || true; }
trap - EXIT INT TERM
ELAPSED=$((SECONDS - T0))
echo "$QRC" >"$RUN/qemu.rc"

if [[ -s $RUN/qemu.stderr ]]; then
    echo "[run-linux] QEMU stderr:" >&2
    sed 's/^/  qemu| /' "$RUN/qemu.stderr" | tail -n 20 >&2
fi
DONE=$(sed 's/\r$//' "$LOG" | grep -E '^@done ' | tail -n1 || true)
FAILS=$(sed 's/\r$//' "$LOG" | grep -E '^@check [^ ]+ fail' | awk '{print $2}' | tr '\n' ' ' || true)
if [[ -z $DONE && ( $QRC == 124 || $QRC == 137 ) ]]; then
    echo "[run-linux] TIMEOUT after ${ELAPSED}s (limit ${TIMEOUT}s); QEMU killed. ${DONE:-no @done}. failed checks so far: ${FAILS:-none}" >&2
    echo "[run-linux] last console lines:" >&2; tail -n 15 "$LOG" | sed 's/^/  console| /' >&2
    exit 2
fi
if [[ -z $DONE ]]; then
    echo "[run-linux] QEMU exited (rc=$QRC) after ${ELAPSED}s without @done; failed checks so far: ${FAILS:-none}" >&2
    echo "[run-linux] last console lines:" >&2; tail -n 25 "$LOG" | sed 's/^/  console| /' >&2
    exit 3
fi
failed=$(sed -nE 's/.*failed=([0-9]+).*/\1/p' <<<"$DONE")
if [[ $failed == 0 ]]; then
    echo "[run-linux] PASS: $DONE in ${ELAPSED}s" >&2
    exit 0
fi
echo "[run-linux] FAIL: $DONE in ${ELAPSED}s; failed: $FAILS" >&2
exit 1
