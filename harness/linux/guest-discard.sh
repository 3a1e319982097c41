#!/bin/sh
# iopath harness: a discard from Linux, run INSIDE the guest instead of guest-check.sh
# (run-linux.sh --vfio-user SOCK --script harness/linux/guest-discard.sh). The disk (an NVMe
# namespace or a virtio-blk disk) is an image the host filled with 0x5a ('Z') bytes; the host
# checks the image's holes after the run. Checks: discard-probe (the disk is there),
# discard-limits (the block layer offers discard: discard_max_bytes > 0; NVMe: DLFEAT from
# nvme id-ns), discard-before (4 KiB around the range read as 'Z'), discard (blkdiscard of
# 4 MiB at 4 MiB), discard-after (O_DIRECT: the range reads as zeros, the 4 KiB on each side
# still as 'Z'). Prints "@check NAME ok|fail detail...", then "@done passed=N failed=M", and
# powers off. Knobs: as guest-lib.sh.
. /lib.sh

MIB=1048576
disk() { # the first NVMe namespace or virtio-blk disk, as /dev/NAME
    for b in /sys/block/nvme*n* /sys/block/vd*; do
        [ -e "$b" ] && { echo "/dev/${b##*/}"; return; }
    done
}

say "guest-discard: kernel $(uname -r), probe_wait=${PROBE_WAIT}s deadline=${DEADLINE}s"
i=0
lim=$(cap "$PROBE_WAIT")
while [ -z "$(disk)" ] && [ $i -lt $((lim * 2)) ]; do usleep 500000; i=$((i + 1)); done
DEV=$(disk)
if [ -n "$DEV" ] && [ -b "$DEV" ]; then check discard-probe ok "$DEV, $(cat /sys/block/${DEV#/dev/}/size) sectors"
else
    check discard-probe fail "no NVMe namespace or virtio-blk disk after ${PROBE_WAIT}s"
    finish
fi
Q=/sys/block/${DEV#/dev/}/queue
limits="discard_max_bytes=$(cat $Q/discard_max_bytes) discard_granularity=$(cat $Q/discard_granularity) write_zeroes_max_bytes=$(cat $Q/write_zeroes_max_bytes)"
case "$DEV" in /dev/nvme*) limits="$limits $(nvme id-ns "$DEV" 2>&1 | grep -E '^dlfeat' | tr -s ' ')" ;; esac
if [ "$(cat $Q/discard_max_bytes)" -gt 0 ]; then check discard-limits ok "$limits"
else check discard-limits fail "$limits"; fi

# References: 4 KiB of 'Z' and 4 MiB of zeros.
dd if=/dev/zero bs=4096 count=1 2>/dev/null | tr '\000' 'Z' >$W/z4k
dd if=/dev/zero of=$W/zero bs=$MIB count=4 2>/dev/null
# read OFFSET_BYTES LEN_BYTES OUT: O_DIRECT, so the page cache cannot answer for the disk
read_direct() { dd if="$DEV" of="$3" bs=4096 skip=$(($1 / 4096)) count=$(($2 / 4096)) iflag=direct 2>/dev/null; }

read_direct $((4 * MIB - 4096)) 4096 $W/b1 && read_direct $((8 * MIB)) 4096 $W/b2
if cmp -s $W/b1 $W/z4k && cmp -s $W/b2 $W/z4k; then check discard-before ok "the 4 KiB on each side of the range read as the host wrote them"
else check discard-before fail "$(od -An -tx1 $W/b1 | head -n 1)"; fi

bounded $STEP $W/discard blkdiscard -o $((4 * MIB)) -l $((4 * MIB)) "$DEV"
rc=$?
if [ $rc -eq 0 ]; then check discard ok "blkdiscard -o $((4 * MIB)) -l $((4 * MIB)) $DEV"
else check discard fail "rc=$rc $(tail -n 1 $W/discard)"; fi

read_direct $((4 * MIB)) $((4 * MIB)) $W/range
read_direct $((4 * MIB - 4096)) 4096 $W/b1 && read_direct $((8 * MIB)) 4096 $W/b2
if cmp -s $W/range $W/zero && cmp -s $W/b1 $W/z4k && cmp -s $W/b2 $W/z4k; then
    check discard-after ok "4 MiB read as zeros, the 4 KiB on each side unchanged"
else check discard-after fail "range: $(cmp $W/range $W/zero 2>&1 | head -n 1); sides: $(cmp $W/b1 $W/z4k 2>&1) $(cmp $W/b2 $W/z4k 2>&1)"; fi
new_dmesg 'nvme|virtio|blk|error|timeout'
finish
