#!/bin/sh
# iopath harness: two NVMe controllers in one Linux guest, run INSIDE the guest instead of
# guest-check.sh (run-linux.sh --vfio-user A --vfio-user B --script harness/linux/guest-two-nvme.sh).
# Prints "@check NAME ok|fail detail..." lines, then "@done passed=N failed=M", and powers off.
# Checks: two-probe (two live controllers, each with a namespace block device), two-subsystems
# (distinct serial numbers, subsystem NQNs and namespace ids: Linux keeps them apart),
# no-rejected (no "Duplicate cntlid" or "rejecting" in dmesg), then a verified fio write and
# read-back on each namespace (fio-nvmeXnY-w, fio-nvmeXnY-r). Knobs: as guest-lib.sh.
. /lib.sh

ctrls() { for c in /sys/class/nvme/nvme*; do [ -e "$c" ] && echo "${c##*/}"; done; }
ns_of() { # CTRL -> its namespace block device, if any
    for n in /sys/class/nvme/"$1"/"$1"n* /sys/class/nvme/"$1"/nvme*c*n*; do
        [ -b "/dev/${n##*/}" ] && { echo "/dev/${n##*/}"; return; }
    done
}
ready() { # the number of live controllers with a namespace
    k=0
    for c in $(ctrls); do
        [ "$(cat /sys/class/nvme/$c/state 2>/dev/null)" = live ] && [ -n "$(ns_of "$c")" ] && k=$((k + 1))
    done
    echo $k
}

say "guest-two-nvme: kernel $(uname -r), probe_wait=${PROBE_WAIT}s fio=${FIO_MB}MiB deadline=${DEADLINE}s"
i=0
lim=$(cap "$PROBE_WAIT")
while [ "$(ready)" -lt 2 ] && [ $i -lt $((lim * 2)) ]; do usleep 500000; i=$((i + 1)); done
for c in $(ctrls); do
    say "$c: state=$(cat /sys/class/nvme/$c/state 2>/dev/null) serial='$(cat /sys/class/nvme/$c/serial 2>/dev/null)' cntlid=$(cat /sys/class/nvme/$c/cntlid 2>/dev/null) subsysnqn='$(cat /sys/class/nvme/$c/subsysnqn 2>/dev/null)' ns=$(ns_of "$c")"
done
new_dmesg 'nvme'
if [ "$(ready)" -ge 2 ]; then check two-probe ok "$(ready) live controllers with a namespace: $(ctrls | tr '\n' ' ')"
else check two-probe fail "$(ready) live controllers with a namespace after ${PROBE_WAIT}s: $(ctrls | tr '\n' ' ')"; fi

# Distinct identities: serials, subsystem NQNs, subsystems and namespace ids.
SERIALS= NQNS= NGUIDS= UUIDS=
for c in $(ctrls); do
    SERIALS="$SERIALS $(cat /sys/class/nvme/$c/serial 2>/dev/null | tr -d ' ')"
    NQNS="$NQNS $(cat /sys/class/nvme/$c/subsysnqn 2>/dev/null)"
    n=$(ns_of "$c")
    [ -n "$n" ] || continue
    NGUIDS="$NGUIDS $(cat /sys/block/${n#/dev/}/nguid 2>/dev/null)"
    UUIDS="$UUIDS $(cat /sys/block/${n#/dev/}/uuid 2>/dev/null)"
done
distinct() { [ "$(echo $1 | tr ' ' '\n' | grep -c .)" -ge 2 ] && [ -z "$(echo $1 | tr ' ' '\n' | grep . | sort | uniq -d)" ]; }
subsys=$(ls -d /sys/class/nvme-subsystem/nvme-subsys* 2>/dev/null | wc -l)
if distinct "$SERIALS" && distinct "$NQNS" && distinct "$NGUIDS" && distinct "$UUIDS" && [ "$subsys" -ge 2 ]; then
    check two-subsystems ok "$subsys subsystems; serials:$SERIALS nguids:$NGUIDS"
else check two-subsystems fail "$subsys subsystems; serials:$SERIALS nqns:$NQNS nguids:$NGUIDS uuids:$UUIDS"; fi

if dmesg | grep -iE 'duplicate cntlid|rejecting' >$W/dup; then
    check no-rejected fail "$(head -n 1 $W/dup)"
else check no-rejected ok "no controller rejected"; fi

# fio verify on each namespace: a write with crc32c headers, then the read-back.
for c in $(ctrls); do
    NS=$(ns_of "$c")
    [ -n "$NS" ] || { check "fio-$c" fail "no namespace"; continue; }
    t=${NS#/dev/}
    if fio_run "$t-w" randwrite "$FIO_MB"; then check "fio-$t-w" ok "${FIO_MB}MiB 4k qd16 verify=crc32c errs=0"
    else check "fio-$t-w" fail "rc=$rc errs=$errs"; fi
    if fio_run "$t-r" randread "$FIO_MB" --verify_header_seed=0; then check "fio-$t-r" ok "${FIO_MB}MiB read back, verified"
    else check "fio-$t-r" fail "rc=$rc errs=$errs"; fi
done
new_dmesg 'nvme|timeout|error'
finish
