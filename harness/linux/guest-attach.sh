#!/bin/sh
# iopath harness: namespaces detached and attached at run time through the device's control
# socket, run INSIDE the guest instead of guest-check.sh (run-linux.sh --vfio-user SOCK --script
# guest-attach.sh). The device has two namespaces of 512 B LBAs; the host side
# (cli/tests/real_clients.rs) watches two injection rules' match counters as its cue, since the
# guest has no other channel to it:
#   a read of LBA 99991 on namespace 2: the host detaches namespace 2 (`iopath ctl C detach 2`);
#   a read of LBA 99992 on namespace 1: the host attaches it again.
# Checks: probe (NSIDs 1 and 2), detach (NSID 2's block device goes away: Linux rescanned after the
# Namespace Attribute Changed event), ns1-during (namespace 1 reads and writes on), attach (NSID 2
# comes back), kept (the block written before the detach reads back the same). Knobs: guest-lib.sh.
. /lib.sh

# dev NSID: namespace NSID's block device. Linux names them in the order its scan finds them,
# not by NSID (nvme0n1 may be NSID 2), and may name one differently when it comes back.
dev() {
    for n in /sys/class/nvme/nvme0/nvme0n* /sys/class/nvme/nvme0/nvme*c*n*; do
        [ -b "/dev/${n##*/}" ] && [ "$(cat "$n/nsid" 2>/dev/null)" = "$1" ] && { echo "/dev/${n##*/}"; return 0; }
    done
    return 1
}
ns() { dev "$1" >/dev/null; }
rd() { bounded 60 $W/$3 dd if="$(dev $1)" of=/dev/null bs=512 skip=$2 count=1 iflag=direct; }
# wait_for COND SECS: poll COND every 0.5 s for at most SECS; its last status.
wait_for() { j=0; while ! eval "$1" && [ $j -lt $(($2 * 2)) ]; do usleep 500000; j=$((j + 1)); done; eval "$1"; }

say "guest-attach: kernel $(uname -r), probe_wait=${PROBE_WAIT}s deadline=${DEADLINE}s"
if wait_for 'ns 1 && ns 2' "$(cap "$PROBE_WAIT")"; then check probe ok "NSID 1 on $(dev 1), NSID 2 on $(dev 2)"
else check probe fail "namespaces: $(ls /dev/nvme* 2>/dev/null | tr '\n' ' ')"; finish; fi
new_dmesg 'nvme' >/dev/null

# A block on namespace 2 to find again after it comes back.
head -c 512 /dev/urandom >$W/block
bounded 60 $W/put dd if=$W/block of="$(dev 2)" bs=512 seek=4096 count=1 oflag=direct; put=$?
sum_before=$(md5sum <$W/block | cut -d' ' -f1)

rd 2 99991 cue1; c1=$?
t0=$(uptime_s)
if [ $put -eq 0 ] && [ $c1 -eq 0 ] && wait_for '! ns 2' "$(cap 120)"; then
    new_dmesg 'nvme' >$W/dm.detach
    indent detach <$W/dm.detach
    check detach ok "NSID 2 gone $(($(uptime_s) - t0)) s after the cue; NSID 1 stays on $(dev 1)"
else check detach fail "put=$put cue=$c1; still there after $(($(uptime_s) - t0)) s: $(ls /dev/nvme0n* | tr '\n' ' ')"; fi

# Namespace 1 is not disturbed meanwhile.
NS=$(dev 1)
io_check ns1-during

rd 1 99992 cue2; c2=$?
t0=$(uptime_s)
if [ $c2 -eq 0 ] && wait_for 'ns 2' "$(cap 120)"; then
    new_dmesg 'nvme' >$W/dm.attach
    indent attach <$W/dm.attach
    check attach ok "NSID 2 back on $(dev 2) $(($(uptime_s) - t0)) s after the cue"
else check attach fail "cue=$c2; no NSID 2 after $(($(uptime_s) - t0)) s"; fi

bounded 60 $W/get dd if="$(dev 2)" of=$W/back bs=512 skip=4096 count=1 iflag=direct; get=$?
sum_after=$(md5sum <$W/back 2>/dev/null | cut -d' ' -f1)
if [ $get -eq 0 ] && [ "$sum_after" = "$sum_before" ]; then check kept ok "LBA 4096 of namespace 2: md5 $sum_after as written"
else check kept fail "rc=$get md5 $sum_after, written $sum_before"; fi
finish
