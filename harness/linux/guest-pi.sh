#!/bin/sh
# iopath harness: namespaces with metadata and protection information, run INSIDE the guest
# instead of guest-check.sh (run-linux.sh --vfio-user SOCKET --script harness/linux/guest-pi.sh),
# against `iopath serve nvme` with four namespaces in NSID order:
#   1 lba=512;ms=8;pi=1         (separate metadata: Linux's block layer generates and verifies PI)
#   2 lba=512;ms=8;ext=on;pi=1  (extended LBAs: Linux asks the controller to insert/strip, PRACT)
#   3 lba=4096;ms=16;ext=on     (extended LBAs, no PI: Linux gives it no capacity, recorded)
#   4 lba=4096;ms=16;pi=1       (separate, PI in the last 8 of 16 bytes; formatted to PI first)
# Prints "@check NAME ok|fail detail..." lines, then "@done passed=N failed=M", and powers off.
# Checks: pi-probe (four namespace block devices), pi-id-ns (nvme id-ns: the formats, flbas and dps
# of namespaces 1 and 2), pi-integrity (namespace 1's integrity/format is T10-DIF-TYPE1-CRC),
# fio-pi1-w/-r and fio-pi2-w/-r (verified write and read-back), pi-ext-nopi (what Linux made of
# namespace 3: always ok, the detail says), pi-format (nvme format of namespace 4 to 4096+16 with PI
# in the first 8 bytes: id-ns flbas 0x6, dps 0x9), fio-pi4-w/-r on it, no-timeout.
. /lib.sh

ctrl() { for c in /sys/class/nvme/nvme*; do [ -e "$c" ] && { echo "${c##*/}"; return; }; done; }
nss() { # the controller's namespace block devices, by NSID
    c=$(ctrl)
    [ -n "$c" ] || return
    for n in /sys/class/nvme/"$c"/"$c"n* /sys/class/nvme/"$c"/nvme*c*n*; do
        [ -b "/dev/${n##*/}" ] && echo "${n##*/} $(cat "$n/nsid" 2>/dev/null)"
    done | sort -k2 -n | awk '{print $1}'
}
nth() { nss | sed -n "${1}p"; }
info() { # BLOCKDEV: its size, block size and integrity profile as sysfs has them
    echo "size=$(cat /sys/block/$1/size 2>/dev/null) lbs=$(cat /sys/block/$1/queue/logical_block_size 2>/dev/null)" \
        "integrity=$(cat /sys/block/$1/integrity/format 2>/dev/null || echo -)" \
        "tag_size=$(cat /sys/block/$1/integrity/tag_size 2>/dev/null || echo -)" \
        "protection_interval=$(cat /sys/block/$1/integrity/protection_interval_bytes 2>/dev/null || echo -)"
}

say "guest-pi: kernel $(uname -r), fio=${FIO_MB}MiB deadline=${DEADLINE}s"
i=0
lim=$(cap "$PROBE_WAIT")
while [ "$(nss | wc -l)" -lt 4 ] && [ $i -lt $((lim * 2)) ]; do usleep 500000; i=$((i + 1)); done
C=$(ctrl)
new_dmesg 'nvme|integrity|protection'
n=$(nss | wc -l)
if [ "$n" -eq 4 ]; then check pi-probe ok "$C with $n namespaces: $(nss | tr '\n' ' ')"
else check pi-probe fail "$n namespace block devices of 4 after ${PROBE_WAIT}s: $(nss | tr '\n' ' ')"; fi
for k in 1 2 3 4; do b=$(nth $k); [ -n "$b" ] && say "namespace $k ($b): $(info "$b")"; done

B1=$(nth 1); B2=$(nth 2)
ok=1
for k in 1 2; do
    b=$(nth $k)
    bounded 60 $W/idn$k nvme id-ns "/dev/$b"
    grep -E '^(nsze|flbas|mc|dpc|dps|nlbaf|lbaf)' $W/idn$k | indent "id-ns $k"
done
grep -qE '^flbas +: 0x2$' $W/idn1 && grep -qE '^dps +: 0x1$' $W/idn1 || ok=0
grep -qE '^flbas +: 0x12$' $W/idn2 && grep -qE '^dps +: 0x1$' $W/idn2 || ok=0
grep -qE '^lbaf +2 : ms:8 +lbads:9 .*in use' $W/idn1 || ok=0
if [ $ok = 1 ]; then check pi-id-ns ok "ns 1: flbas 0x2 (512+8 separate), ns 2: flbas 0x12 (extended), dps 0x1 (type 1)"
else check pi-id-ns fail "flbas/dps/lbaf not as configured"; fi

fmt=$(cat /sys/block/$B1/integrity/format 2>/dev/null)
if [ "$fmt" = T10-DIF-TYPE1-CRC ]; then check pi-integrity ok "$B1: integrity/format $fmt, $(info "$B1")"
else check pi-integrity fail "$B1: integrity/format '$fmt'"; fi

# fio verify on namespaces 1 and 2: Linux's block layer adds and checks PI on 1; on 2 the controller does (PRACT).
for k in 1 2; do
    NS=/dev/$(nth $k)
    if fio_run "pi$k-w" randwrite "$FIO_MB"; then check "fio-pi$k-w" ok "$NS: ${FIO_MB}MiB 4k qd16 verify=crc32c errs=0"
    else check "fio-pi$k-w" fail "rc=$rc errs=$errs"; fi
    if fio_run "pi$k-r" randread "$FIO_MB" --verify_header_seed=0; then check "fio-pi$k-r" ok "$NS: ${FIO_MB}MiB read back, verified"
    else check "fio-pi$k-r" fail "rc=$rc errs=$errs"; fi
done
new_dmesg 'nvme|integrity|protection|guard|ref tag|error'

# What Linux made of namespaces 3 (extended, no PI) and 4 (16 bytes, PI last): recorded, not judged.
B3=$(nth 3)
check pi-ext-nopi ok "namespace 3 ($B3, 4096+16 extended, no PI): $(info "$B3")"
B4=$(nth 4)
NS=/dev/$B4
say "namespace 4 ($B4, 4096+16 separate, PI last) as probed: $(info "$B4")"
# Linux 6.12's block layer writes the PI tuple at the start of each block's metadata whatever DPS
# says (a run with PI last got EILSEQ from fio and the device counted guard errors), so namespace 4
# is formatted to PI first (LBAF 6: 4096+16, PI type 1, PIL 1) before any write, and verified then.
bounded 120 $W/fmt4 nvme format "$NS" --lbaf=6 --pi=1 --pil=1 --ms=0 --force; frc=$?
indent format4 <$W/fmt4
usleep 500000
bounded 60 $W/idn4 nvme id-ns "$NS"; grep -E '^(flbas|dps)' $W/idn4 | indent "id-ns 4"
if [ $frc -eq 0 ] && grep -qE '^flbas +: 0x6$' $W/idn4 && grep -qE '^dps +: 0x9$' $W/idn4; then
    check pi-format ok "$B4 formatted to 4096+16, PI type 1 first: $(info "$B4")"
else check pi-format fail "rc=$frc: $(tail -n 1 $W/fmt4)"; fi
if fio_run pi4-w randwrite "$FIO_MB"; then check fio-pi4-w ok "$NS: ${FIO_MB}MiB verify=crc32c errs=0"
else check fio-pi4-w fail "rc=$rc errs=$errs"; fi
if fio_run pi4-r randread "$FIO_MB" --verify_header_seed=0; then check fio-pi4-r ok "$NS: read back, verified"
else check fio-pi4-r fail "rc=$rc errs=$errs"; fi

new_dmesg 'nvme|integrity|protection|guard|timeout|error'
no_timeout_check
finish
