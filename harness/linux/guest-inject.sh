#!/bin/sh
# iopath harness: Linux's nvme driver against injected errors, run INSIDE the guest instead of
# guest-check.sh (run-linux.sh --vfio-user SOCK --nvme-timeout 10 --script guest-inject.sh).
# The device is started with these rules (cli/tests/real_clients.rs, INJECT_RULES), 512 B LBAs:
#   LBA 2048 read: Unrecovered Read Error (2/81h) with DNR, always
#   LBA 3072 read: the same without DNR, once (the driver retries, the retry succeeds)
#   LBA 4096 read: never completed, once (the driver times out, aborts it, retries)
#   LBA 8192 write: no completion and controller fatal status, once (the driver resets)
# Checks: probe, eio (the read of LBA 2048 fails, a media error: ENODATA; the blocks beside it read),
# retried (LBA 3072 reads: the driver retried the error without DNR), aborted (LBA 4096 reads
# after the timeout), reset (LBA 8192 is written after the controller reset), then fio verify
# on a region away from those LBAs (I/O goes on). Knobs: as guest-lib.sh.
. /lib.sh

NS=
find_ns() {
    for n in /sys/class/nvme/nvme0/nvme0n* /sys/class/nvme/nvme0/nvme*c*n*; do
        [ -b "/dev/${n##*/}" ] && { NS=/dev/${n##*/}; return 0; }
    done
    return 1
}
live() { [ "$(cat /sys/class/nvme/nvme0/state 2>/dev/null)" = live ]; }
# rd LBA NAME / wr LBA NAME: one direct 512 B transfer at LBA; its exit code (bounded).
rd() { bounded $STEP $W/$2 dd if=$NS of=/dev/null bs=512 skip=$1 count=1 iflag=direct; }
wr() { bounded $STEP $W/$2 sh -c "head -c 512 /dev/urandom | dd of=$NS bs=512 seek=$1 count=1 oflag=direct"; }

say "guest-inject: kernel $(uname -r), probe_wait=${PROBE_WAIT}s deadline=${DEADLINE}s"
i=0
lim=$(cap "$PROBE_WAIT")
while ! { find_ns && live; } && [ $i -lt $((lim * 2)) ]; do usleep 500000; i=$((i + 1)); done
if find_ns && live; then check probe ok "nvme0 live, namespace $NS"
else check probe fail "no live nvme0 with a namespace after ${PROBE_WAIT}s"; finish; fi
new_dmesg 'nvme'

# The error with DNR reaches the reader, on that LBA only.
rd 2047 before; b=$?
rd 2048 eio; e=$?
rd 2049 after; a=$?
new_dmesg 'nvme|error|I/O' >$W/dm.eio
indent eio <$W/dm.eio
# Linux maps Unrecovered Read Error (a media error) to BLK_STS_MEDIUM, which a reader sees as
# ENODATA ("No data available"); other statuses reach it as EIO.
if [ $b -eq 0 ] && [ $a -eq 0 ] && [ $e -ne 0 ] && grep -qiE 'no data available|input/output error' $W/eio; then
    check eio ok "LBA 2048: $(tail -n 1 $W/eio); LBAs 2047 and 2049 read"
else check eio fail "rc 2047=$b 2048=$e 2049=$a: $(tr '\n' ' ' <$W/eio)"; fi

# Without DNR the driver retries, and the retry succeeds.
rd 3072 retried; r=$?
if [ $r -eq 0 ]; then check retried ok "LBA 3072 read (the first attempt failed without DNR)"
else check retried fail "rc=$r: $(tr '\n' ' ' <$W/retried)"; fi
new_dmesg 'nvme|error|I/O' | indent retried

# No completion: the driver's timeout, an Abort, the retry.
t0=$(uptime_s)
rd 4096 aborted; r=$?
t1=$(uptime_s)
new_dmesg 'nvme|timeout|abort|reset' >$W/dm.abort
indent aborted <$W/dm.abort
if [ $r -eq 0 ] && grep -qiE 'timeout' $W/dm.abort && live; then
    check aborted ok "LBA 4096 read after $((t1 - t0)) s: $(grep -iE -m1 'timeout' $W/dm.abort | sed 's/^\[dmesg\] //')"
else check aborted fail "rc=$r after $((t1 - t0)) s, state=$(cat /sys/class/nvme/nvme0/state)"; fi

# Controller fatal status: the driver resets the controller; the write is retried after it.
t0=$(uptime_s)
wr 8192 reset; r=$?
j=0
while ! live && [ $j -lt 60 ]; do usleep 500000; j=$((j + 1)); done
t1=$(uptime_s)
new_dmesg 'nvme|timeout|abort|reset|CSTS' >$W/dm.reset
indent reset <$W/dm.reset
if [ $r -eq 0 ] && grep -qiE 'reset|CSTS' $W/dm.reset && live; then
    check reset ok "LBA 8192 written after $((t1 - t0)) s: $(grep -iE -m1 'reset|CSTS' $W/dm.reset | sed 's/^\[dmesg\] //')"
else check reset fail "rc=$r after $((t1 - t0)) s, state=$(cat /sys/class/nvme/nvme0/state): $(tr '\n' ' ' <$W/reset)"; fi

# I/O goes on: a verified write and read-back from 16 MiB on (LBA 32768 up, no rule there).
if fio_run after-w randwrite "$FIO_MB" --offset=16M; then check fio-after-w ok "${FIO_MB}MiB at 16MiB verify=crc32c errs=0"
else check fio-after-w fail "rc=$rc errs=$errs"; fi
if fio_run after-r randread "$FIO_MB" --offset=16M --verify_header_seed=0; then check fio-after-r ok "${FIO_MB}MiB read back errs=0"
else check fio-after-r fail "rc=$rc errs=$errs"; fi
finish
