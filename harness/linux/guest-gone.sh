#!/bin/sh
# iopath harness: a device process that dies under QEMU's vfio-user-pci (issue 37, item 4), run
# INSIDE the Linux guest (run-linux.sh --vfio-user A --vfio-user B --script guest-gone.sh). The
# controller with serial HARNESS-GONE is the one the host kills (kill -9 of its `iopath serve`);
# HARNESS-STAYS keeps running. QEMU's vfio-user-pci does not reconnect, so the clean failure is:
# I/O on the dead controller fails with an error (not a hang) within a bound, the driver gives the
# controller up, the other controller's data is intact and its I/O goes on, and the guest powers off.
# Prints "@gone-cue" when the host is to kill, then checks two-probe, gone-eio, gone-given-up,
# stays-fio, and "@done passed=N failed=M".
. /lib.sh

ctrls() { for c in /sys/class/nvme/nvme*; do [ -e "$c" ] && echo "${c##*/}"; done; }
by_serial() { for c in $(ctrls); do [ "$(tr -d ' ' </sys/class/nvme/$c/serial 2>/dev/null)" = "$1" ] && echo "$c"; done; }
ns_of() { # CTRL -> its namespace block device, if any
    for n in /sys/class/nvme/"$1"/"$1"n* /sys/class/nvme/"$1"/nvme*c*n*; do
        [ -b "/dev/${n##*/}" ] && { echo "/dev/${n##*/}"; return; }
    done
}
live() { [ "$(cat /sys/class/nvme/"$1"/state 2>/dev/null)" = live ] && [ -n "$(ns_of "$1")" ]; }

i=0
lim=$(cap "$PROBE_WAIT")
while [ $i -lt $((lim * 2)) ]; do
    G=$(by_serial HARNESS-GONE); S=$(by_serial HARNESS-STAYS)
    [ -n "$G" ] && [ -n "$S" ] && live "$G" && live "$S" && break
    usleep 500000; i=$((i + 1))
done
if [ -z "$G" ] || [ -z "$S" ] || ! live "$G" || ! live "$S"; then
    check two-probe fail "controllers: $(ctrls | tr '\n' ' ') gone=$G stays=$S"
    finish
fi
GNS=$(ns_of "$G"); SNS=$(ns_of "$S")
check two-probe ok "HARNESS-GONE $G $GNS, HARNESS-STAYS $S $SNS"

# Data on the surviving controller before the other one dies: read back after it.
NS=$SNS
fio_run stays-before randwrite "$FIO_MB" || check stays-before fail "rc=$rc errs=$errs"

# Reads on the doomed controller, one at a time, until one fails; the host kills its device
# process at the cue. Each read bypasses the page cache.
new_dmesg 'nvme' >/dev/null
echo "@gone-cue"
t0=$(uptime_s)
n=0
while [ $(($(uptime_s) - t0)) -lt "$(cap 120)" ]; do
    # each read bounded: one that never ends is the hang this check exists to catch
    bounded 90 $W/dd dd if="$GNS" of=/dev/null bs=4k count=1 skip=$((n % 1024)) iflag=direct
    last=$?
    [ $last = 0 ] || break
    n=$((n + 1))
done
t1=$(uptime_s)
case $last in
    0) check gone-eio fail "$n reads of $GNS still succeeding $((t1 - t0))s after the cue" ;;
    124|125) check gone-eio fail "read $n of $GNS hung: $(tail -n1 $W/dd)" ;;
    *) check gone-eio ok "read $n of $GNS failed $((t1 - t0))s after the cue: $(grep -m1 -iE 'error|dd:' $W/dd)" ;;
esac

# The driver gives the dead controller up (state dead/deleting, or gone from sysfs).
i=0
while [ $i -lt 120 ]; do
    st=$(cat /sys/class/nvme/"$G"/state 2>/dev/null || echo removed)
    case "$st" in dead|deleting|"deleting (no IO)"|removed) break ;; esac
    usleep 500000; i=$((i + 1))
done
if [ "$st" != live ] && [ "$st" != resetting ] && [ "$st" != connecting ]; then
    check gone-given-up ok "$G state '$st' $(( $(uptime_s) - t0 ))s after the cue"
else
    check gone-given-up fail "$G state '$st' $(( $(uptime_s) - t0 ))s after the cue"
fi
new_dmesg "$G|nvme" | head -n 12

# The surviving controller: what it held before is intact, and I/O goes on.
NS=$SNS
if fio_run stays-read randread "$FIO_MB" --verify_header_seed=0 &&
   fio_run stays-after randwrite "$FIO_MB"; then
    check stays-fio ok "$SNS: data written before the other's death read back verified, then ${FIO_MB}MiB randwrite+verify errs=0"
else
    check stays-fio fail "$SNS rc=$rc errs=$errs"
fi
finish
