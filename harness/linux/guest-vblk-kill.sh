#!/bin/sh
# iopath harness: fio write+verify rounds on the virtio-blk disk, run INSIDE the Linux guest
# (busybox sh) as /check.sh (run-linux.sh --script), while the host kills the vhost-user backend
# (kill -9) and starts it again on the same socket (QEMU's chardev reconnects). Prints
# "@fio-start" when the first round begins (the host's cue to start killing), then one
# "@check fio-round-N" per round, "@check no-errors", and "@done passed=N failed=M".
# Knobs: those of /lib.sh (harness.fio_mb: each round's region), and
#   harness.kill_secs=N   rounds start until N seconds after the first (default 40)
#   harness.fio_fsync=N   fio's fsync=N: a FLUSH after every N writes (default 8; 0: none), which
#                         the backend serves with fdatasync: requests that stay in flight a while
. /lib.sh

SECS=40
FSYNC=8
for t in $(cat /proc/cmdline); do
    case "$t" in
        harness.kill_secs=*) SECS=${t#*=} ;;
        harness.fio_fsync=*) FSYNC=${t#*=} ;;
    esac
done

NS=
i=0
while [ -z "$NS" ] && [ $i -lt $((PROBE_WAIT * 2)) ]; do
    for b in /sys/block/vd*; do [ -b "/dev/${b##*/}" ] && NS=/dev/${b##*/}; done
    [ -n "$NS" ] || usleep 500000
    i=$((i + 1))
done
if [ -z "$NS" ]; then
    check probe fail "no virtio disk after ${PROBE_WAIT}s"
    finish
fi
check probe ok "$NS size=$(($(cat /sys/block/${NS#/dev/}/size) / 2048))MiB"

echo "@fio-start"
t0=$(uptime_s)
round=0
while [ $(($(uptime_s) - t0)) -lt "$SECS" ]; do
    round=$((round + 1))
    # each round writes its region (random order, crc32c in every block), then reads it all back
    if fio_run round$round randwrite "$FIO_MB" --fsync="$FSYNC"; then
        check fio-round-$round ok "${FIO_MB}MiB randwrite+verify fsync=$FSYNC errs=0 at $(($(uptime_s) - t0))s"
    else
        check fio-round-$round fail "rc=$rc errs=$errs at $(($(uptime_s) - t0))s"
    fi
done

dmesg | grep -iE 'I/O error|blk_update_request|timed out|virtio.*(broken|failed)' >$W/dm.err
if [ -s $W/dm.err ]; then
    check no-errors fail "$(wc -l <$W/dm.err) I/O error lines in dmesg"
    head -n 20 $W/dm.err | indent error
else
    check no-errors ok "no I/O error in dmesg after $round rounds"
fi
finish
