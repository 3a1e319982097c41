#!/bin/sh
# iopath harness: one NVMe controller with several namespaces, run INSIDE the guest instead of
# guest-check.sh (run-linux.sh --vfio-user SOCKET --script harness/linux/guest-ns.sh
# --append "harness.ns_count=4 harness.ns_lba=512,4096,512,4096").
# Prints "@check NAME ok|fail detail..." lines, then "@done passed=N failed=M", and powers off.
# Checks: ns-probe (the controller live with ns_count namespace block devices), nvme-list (nvme list
# shows each), list-ns (nvme list-ns, active and --all, gives NSIDs 1..ns_count), ns-ids (distinct
# NGUIDs and UUIDs), ns-lba (each namespace's logical block size as ns_lba says), a verified fio
# write and read-back on each namespace (fio-nvme0nY-w, fio-nvme0nY-r), then format (nvme format
# of namespace 1 to LBA format 1, 4096 bytes: the block device follows) and fio on it again
# (fio-formatted-w, fio-formatted-r), no-timeout. Knobs: as guest-lib.sh, and harness.ns_count=N,
# harness.ns_lba=A,B,... (each namespace's LBA size, in NSID order); harness.ns_timed=NSID and
# harness.ns_timed_us=US (that namespace has a timing model of US per read): check ns-timing, a QD1
# fio randread on each namespace, the timed one's minimum total latency at least US, every other's
# minimum more than US/2 below the timed one's.
. /lib.sh

NS_COUNT=4
NS_LBA=
NS_TIMED=
NS_TIMED_US=
for t in $(cat /proc/cmdline); do
    case "$t" in
        harness.ns_count=*) NS_COUNT=${t#*=} ;;
        harness.ns_lba=*) NS_LBA=${t#*=} ;;
        harness.ns_timed=*) NS_TIMED=${t#*=} ;;
        harness.ns_timed_us=*) NS_TIMED_US=${t#*=} ;;
    esac
done

ctrl() { for c in /sys/class/nvme/nvme*; do [ -e "$c" ] && { echo "${c##*/}"; return; }; done; }
nss() { # the controller's namespace block devices, by NSID
    c=$(ctrl)
    [ -n "$c" ] || return
    for n in /sys/class/nvme/"$c"/"$c"n* /sys/class/nvme/"$c"/nvme*c*n*; do
        [ -b "/dev/${n##*/}" ] && echo "${n##*/} $(cat "$n/nsid" 2>/dev/null)"
    done | sort -k2 -n | awk '{print $1}'
}

say "guest-ns: kernel $(uname -r), expecting $NS_COUNT namespaces (lba $NS_LBA), fio=${FIO_MB}MiB deadline=${DEADLINE}s"
i=0
lim=$(cap "$PROBE_WAIT")
while [ "$(nss | wc -l)" -lt "$NS_COUNT" ] && [ $i -lt $((lim * 2)) ]; do usleep 500000; i=$((i + 1)); done
C=$(ctrl)
say "$C: state=$(cat /sys/class/nvme/$C/state 2>/dev/null) namespaces: $(nss | tr '\n' ' ')"
new_dmesg 'nvme'
n=$(nss | wc -l)
if [ "$n" -eq "$NS_COUNT" ]; then check ns-probe ok "$C with $n namespaces: $(nss | tr '\n' ' ')"
else check ns-probe fail "$n namespace block devices of $NS_COUNT after ${PROBE_WAIT}s: $(nss | tr '\n' ' ')"; fi

bounded 60 $W/list nvme list; rc=$?
indent list <$W/list
listed=0
for b in $(nss); do grep -q "/dev/$b " $W/list && listed=$((listed + 1)); done
if [ $rc -eq 0 ] && [ $listed -eq "$NS_COUNT" ]; then check nvme-list ok "$listed namespaces listed"
else check nvme-list fail "rc=$rc, $listed of $NS_COUNT listed"; fi

want=$(seq 1 "$NS_COUNT" | tr '\n' ' ')
for all in "" --all; do
    bounded 60 $W/lns nvme list-ns /dev/${C:-nvme0} $all; rc=$?
    indent "list-ns $all" <$W/lns
    got=$(sed -nE 's/^\[ *[0-9]+\]: *(0x[0-9a-f]+|[0-9]+).*/\1/p' $W/lns | while read -r x; do printf '%s ' "$((x))"; done)
    if [ $rc -eq 0 ] && [ "$got" = "$want" ]; then check "list-ns${all}" ok "NSIDs $got"
    else check "list-ns${all}" fail "rc=$rc NSIDs '$got', want '$want': $(head -n 2 $W/lns | tr '\n' ' ')"; fi
done

IDS=
for b in $(nss); do IDS="$IDS $(cat /sys/block/$b/nguid 2>/dev/null) $(cat /sys/block/$b/uuid 2>/dev/null)"; done
k=$(echo $IDS | tr ' ' '\n' | grep -c .)
if [ "$k" -eq $((2 * NS_COUNT)) ] && [ -z "$(echo $IDS | tr ' ' '\n' | grep . | sort | uniq -d)" ]; then
    check ns-ids ok "$k distinct NGUIDs and UUIDs"
else check ns-ids fail "ids:$IDS"; fi

if [ -n "$NS_LBA" ]; then
    got=$(for b in $(nss); do cat /sys/block/$b/queue/logical_block_size; done | tr '\n' ',' | sed 's/,$//')
    if [ "$got" = "$NS_LBA" ]; then check ns-lba ok "logical block sizes $got"
    else check ns-lba fail "logical block sizes $got, want $NS_LBA"; fi
fi

# fio verify on each namespace: a write with crc32c headers, then the read-back.
for b in $(nss); do
    NS=/dev/$b
    if fio_run "$b-w" randwrite "$FIO_MB"; then check "fio-$b-w" ok "${FIO_MB}MiB 4k qd16 verify=crc32c errs=0"
    else check "fio-$b-w" fail "rc=$rc errs=$errs"; fi
    if fio_run "$b-r" randread "$FIO_MB" --verify_header_seed=0; then check "fio-$b-r" ok "${FIO_MB}MiB read back, verified"
    else check "fio-$b-r" fail "rc=$rc errs=$errs"; fi
done
new_dmesg 'nvme|timeout|error'

# The timing model of one namespace: fio's total latency (submission + completion: this guest's
# io_submit takes hundreds of us, and the device works meanwhile, so clat alone can be shorter than
# the device's time) at QD1, terse v3 field 38 (lat min, us), shows it there and only there: the
# timed namespace's minimum at least US, every other's minimum more than US/2 below it.
if [ -n "$NS_TIMED" ] && [ -n "$NS_TIMED_US" ]; then
    bad=; seen=; tmin=
    for b in $(nss); do
        k=$(cat /sys/block/$b/nsid 2>/dev/null || echo "?")
        bounded $STEP $W/lat.$b fio --name=lat-$b --filename=/dev/$b --rw=randread --bs=4k --ioengine=libaio \
            --direct=1 --iodepth=1 --size=16M --runtime=1 --time_based --output-format=terse --terse-version=3
        line=$(grep -E '^3;' $W/lat.$b | head -n 1)
        min=$(echo "$line" | cut -d';' -f38 | cut -d. -f1)
        mean=$(echo "$line" | cut -d';' -f40 | cut -d. -f1)
        seen="$seen $b(nsid $k): lat min ${min}us mean ${mean}us;"
        echo "$k $min" >>$W/lat.min
        [ "$k" = "$NS_TIMED" ] && tmin=$min
    done
    if [ -z "$tmin" ]; then bad="no figures for namespace $NS_TIMED;"
    elif [ "$tmin" -lt "$NS_TIMED_US" ]; then bad="namespace $NS_TIMED: min ${tmin}us < ${NS_TIMED_US}us;"
    else
        while read -r k min; do
            [ "$k" = "$NS_TIMED" ] && continue
            if [ -z "$min" ] || [ $((min + NS_TIMED_US / 2)) -gt "$tmin" ]; then
                bad="$bad namespace $k: min ${min}us not ${NS_TIMED_US}/2 us below ${tmin}us;"
            fi
        done <$W/lat.min
    fi
    if [ -z "$bad" ]; then check ns-timing ok "namespace $NS_TIMED at >= ${NS_TIMED_US}us, the others below:$seen"
    else check ns-timing fail "$bad all:$seen"; fi
fi

# Format NVM: namespace 1 to LBA format 1 (4096 bytes); the block device follows, fio verifies on it.
skipped format || {
    B=$(nss | head -n 1)
    NS=/dev/$B
    before=$(cat /sys/block/$B/queue/logical_block_size)
    bounded 120 $W/fmt nvme format "$NS" --lbaf=1 --force; rc=$?
    indent format <$W/fmt
    i=0
    while [ "$(cat /sys/block/$B/queue/logical_block_size 2>/dev/null)" != 4096 ] && [ $i -lt 40 ]; do usleep 250000; i=$((i + 1)); done
    after=$(cat /sys/block/$B/queue/logical_block_size 2>/dev/null)
    bounded 60 $W/idn nvme id-ns "$NS"; grep -E '^(nsze|flbas|lbaf)' $W/idn | indent id-ns
    if [ $rc -eq 0 ] && [ "$after" = 4096 ] && grep -qE '^flbas +: 0x1' $W/idn; then check format ok "$B: $before -> $after bytes, flbas 0x1"
    else check format fail "rc=$rc $B: $before -> $after bytes: $(tail -n 1 $W/fmt)"; fi
    if fio_run formatted-w randwrite "$FIO_MB"; then check fio-formatted-w ok "$B at 4096: ${FIO_MB}MiB verify=crc32c errs=0"
    else check fio-formatted-w fail "rc=$rc errs=$errs"; fi
    if fio_run formatted-r randread "$FIO_MB" --verify_header_seed=0; then check fio-formatted-r ok "$B at 4096: read back, verified"
    else check fio-formatted-r fail "rc=$rc errs=$errs"; fi
}
new_dmesg 'nvme|timeout|error'
no_timeout_check
finish
