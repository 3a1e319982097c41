#!/bin/sh
# iopath harness: runs INSIDE the Linux guest (busybox sh) as /check.sh, started by /init.
# Prints "@check NAME ok|fail detail..." lines on the console, then "@done passed=N failed=M",
# then powers off. Kernel command line knobs (all optional):
#   harness.probe_wait=SECS   how long to wait for /dev/nvme0n1 (default 120)
#   harness.step=SECS         bound on each step (default 180)
#   harness.fio_mb=MB         fio region size (default 16)
#   harness.skip=a,b          checks to skip (nvme-list id-ctrl id-ns ns-descs fio ext4 reset rebind)
#   harness.deadline=SECS     guest uptime after which every remaining step fails at once, so
#                             that @done is still printed (run-linux.sh passes its timeout - 25)
PASS=0
FAIL=0
PROBE_WAIT=120
STEP=180
FIO_MB=16
SKIP=,
DEADLINE=0
for t in $(cat /proc/cmdline); do
    case "$t" in
        harness.probe_wait=*) PROBE_WAIT=${t#*=} ;;
        harness.step=*) STEP=${t#*=} ;;
        harness.fio_mb=*) FIO_MB=${t#*=} ;;
        harness.skip=*) SKIP=,${t#*=}, ;;
        harness.deadline=*) DEADLINE=${t#*=} ;;
    esac
done
W=/tmp/hc
mkdir -p $W

check() { # NAME ok|fail DETAIL...
    n=$1; s=$2; shift 2
    echo "@check $n $s $*"
    if [ "$s" = ok ]; then PASS=$((PASS + 1)); else FAIL=$((FAIL + 1)); fi
}
skipped() { case "$SKIP" in *,"$1",*) echo "@skip $1"; return 0 ;; esac; return 1; }
say() { echo "# $*"; }
indent() { sed "s/^/  $1| /"; }

DMESG_SEEN=0
new_dmesg() { # REGEX: print the matching kernel messages that appeared since the last call
    dmesg >$W/dm 2>/dev/null
    n=$(wc -l <$W/dm)
    if [ "$n" -gt "$DMESG_SEEN" ]; then
        tail -n +$((DMESG_SEEN + 1)) $W/dm | grep -iE "$1" | head -n 60 | sed 's/^/[dmesg] /'
    fi
    DMESG_SEEN=$n
}

uptime_s() { cut -d. -f1 /proc/uptime; }
cap() { # SECS -> SECS limited to what is left before the deadline (0 when it has passed)
    if [ "$DEADLINE" -gt 0 ]; then
        left=$((DEADLINE - $(uptime_s)))
        [ $left -lt 0 ] && left=0
        [ "$1" -gt $left ] && { echo $left; return; }
    fi
    echo "$1"
}

kill_tree() {
    for c in /proc/[0-9]*; do
        [ -r "$c/stat" ] || continue
        pp=$(awk '{print $4}' "$c/stat" 2>/dev/null)
        [ "$pp" = "$1" ] && kill_tree "${c#/proc/}"
    done
    kill -9 "$1" 2>/dev/null
}

# bounded SECS OUT CMD...: run CMD with output to OUT; its exit code, or 124 after SECS seconds
# (the command is then killed and left behind, even if stuck in the kernel).
bounded() {
    secs=$(cap "$1"); out=$2; shift 2
    rm -f "$out.rc"
    if [ "$secs" -le 0 ]; then
        echo "[bounded] deadline (uptime ${DEADLINE}s) reached, not run: $*" >"$out"
        return 125
    fi
    ( ("$@"); echo $? >"$out.rc" ) >"$out" 2>&1 </dev/null &
    bpid=$!
    ticks=0
    while [ ! -s "$out.rc" ]; do
        if [ $ticks -ge $((secs * 5)) ]; then
            kill_tree $bpid
            echo "[bounded] timed out after ${secs}s: $*" >>"$out"
            return 124
        fi
        usleep 200000
        ticks=$((ticks + 1))
    done
    wait $bpid 2>/dev/null
    return "$(cat "$out.rc")"
}

irq_lines() { grep -E 'nvme[0-9]+q[0-9]+' /proc/interrupts; }
irq_total() { # sum of all per-CPU counts on the nvme lines
    irq_lines | awk '{for (i = 2; i <= NF; i++) { if ($i ~ /^[0-9]+$/) s += $i; else break }} END {print s + 0}'
}

CTRL=
NS=
BDF=
find_ctrl() { # sets CTRL (nvme0), NS (/dev/nvme0n1), BDF
    CTRL=; NS=
    for c in /sys/class/nvme/nvme*; do
        [ -e "$c" ] || continue
        CTRL=${c##*/}
        BDF=$(basename "$(readlink -f "$c/device")")
        for n in /sys/class/nvme/"$CTRL"/"$CTRL"n* /sys/class/nvme/"$CTRL"/nvme*c*n*; do
            [ -e "$n" ] || continue
            [ -b "/dev/${n##*/}" ] && { NS=/dev/${n##*/}; break; }
        done
        break
    done
}
wait_ready() { # SECS [ctrl]: wait for a live controller with a namespace block device (or
    # with "ctrl", only for a live controller)
    i=0
    lim=$(cap "$1")
    while [ $i -lt $((lim * 2)) ]; do
        find_ctrl
        if { [ -n "$NS" ] || [ "${2:-}" = ctrl ]; } && [ "$(cat /sys/class/nvme/$CTRL/state 2>/dev/null)" = live ]; then return 0; fi
        usleep 500000
        i=$((i + 1))
    done
    return 1
}

FIO_COMMON="--filename=NS --bs=4k --ioengine=libaio --direct=1 --iodepth=16 --numjobs=1 --group_reporting"
fio_run() { # NAME RW SIZE_MB [extra fio args]
    fname=$1; rw=$2; mb=$3; shift 3
    # shellcheck disable=SC2086
    bounded $STEP $W/fio.$fname fio --name=$fname $(echo $FIO_COMMON | sed "s#NS#$NS#") \
        --rw=$rw --size=${mb}M --verify=crc32c --verify_fatal=1 "$@"
    rc=$?
    grep -E 'err=|IOPS=|verify|bad|fio: |\[bounded\]' $W/fio.$fname | indent "$fname"
    errs=$(sed -nE 's/.*err= *([0-9]+).*/\1/p' $W/fio.$fname | head -n1)
    [ -n "$errs" ] || errs=unknown
    if [ $rc -eq 0 ] && [ "$errs" = 0 ]; then return 0; fi
    tail -n 15 $W/fio.$fname | indent "$fname"
    return 1
}
io_check() { # NAME: a small verified write + read-back through the block layer
    if [ -z "$NS" ]; then check "$1" fail "no namespace block device"; return; fi
    if fio_run "$1" randwrite 4; then check "$1" ok "fio randwrite+verify 4MiB on $NS errs=0$(grep -m1 'write: IOPS=' $W/fio.$1 | tr -s ' ' | cut -d'(' -f1)"
    else check "$1" fail "fio rc=$rc errs=$errs"; fi
}

say "guest-check: kernel $(uname -r), probe_wait=${PROBE_WAIT}s step=${STEP}s fio=${FIO_MB}MiB deadline=${DEADLINE}s uptime=$(uptime_s)s"

# 1. probe ---------------------------------------------------------------------------------------
if wait_ready "$PROBE_WAIT"; then
    check probe ok "$CTRL at $BDF ns=$NS state=$(cat /sys/class/nvme/$CTRL/state) model='$(cat /sys/class/nvme/$CTRL/model | sed 's/ *$//')' vid=$(cat /sys/bus/pci/devices/$BDF/vendor) did=$(cat /sys/bus/pci/devices/$BDF/device) queues=$(ls -d /sys/block/${NS#/dev/}/mq/* 2>/dev/null | wc -l)"
else
    find_ctrl
    check probe fail "no live controller with a namespace after ${PROBE_WAIT}s: ctrl='$CTRL' state='$(cat /sys/class/nvme/$CTRL/state 2>/dev/null)' ns='$NS'"
    ls /sys/bus/pci/devices/*/class 2>/dev/null | while read -r f; do
        d=${f%/class}; echo "  pci| ${d##*/} class=$(cat $f) vendor=$(cat $d/vendor) device=$(cat $d/device) driver=$(basename "$(readlink $d/driver 2>/dev/null)" 2>/dev/null)"
    done
fi
new_dmesg 'nvme|msi|timeout|error'
if [ -n "$BDF" ] && command -v lspci >/dev/null; then lspci -nn -vvv -s "$BDF" 2>&1 | grep -vE '^\s*$' | indent lspci; fi

# 2. interrupts ----------------------------------------------------------------------------------
say "/proc/interrupts (nvme) before I/O:"
irq_lines | indent irq
IRQ0=$(irq_total)
if irq_lines | grep -q MSI; then check irq-msix ok "$(irq_lines | wc -l) nvme vectors, MSI/MSI-X, total=$IRQ0"
else check irq-msix fail "no MSI/MSI-X nvme lines in /proc/interrupts (total=$IRQ0)"; fi

# 3. nvme-cli ------------------------------------------------------------------------------------
skipped nvme-list || {
    bounded 60 $W/list nvme list; rc=$?
    indent list <$W/list
    if [ $rc -eq 0 ] && [ -n "$NS" ] && grep -q "$NS" $W/list; then check nvme-list ok "$NS listed"
    else check nvme-list fail "rc=$rc, $(grep -c '^/dev/' $W/list) device lines, namespace block device '${NS:-none}'"; fi
}
skipped id-ctrl || {
    bounded 60 $W/idc nvme id-ctrl /dev/${CTRL:-nvme0}; rc=$?
    head -n 30 $W/idc | indent id-ctrl
    if [ $rc -eq 0 ] && grep -q '^vid' $W/idc; then check id-ctrl ok "$(grep -E '^(vid|mn|ver|mdts|nn) ' $W/idc | tr -s ' ' | tr '\n' ';')"
    else check id-ctrl fail "rc=$rc $(tail -n1 $W/idc)"; fi
}
skipped id-ns || {
    if [ -n "$NS" ]; then bounded 60 $W/idn nvme id-ns "$NS"; else bounded 60 $W/idn nvme id-ns /dev/${CTRL:-nvme0} --namespace-id=1; fi; rc=$?
    grep -E '^(nsze|ncap|nuse|nsfeat|nlbaf|flbas|nguid|eui64|lbaf)' $W/idn | indent id-ns
    if [ $rc -eq 0 ] && grep -q '^nsze' $W/idn; then check id-ns ok "$(grep -E '^(nsze|flbas) ' $W/idn | tr -s ' ' | tr '\n' ';')"
    else check id-ns fail "rc=$rc ns=${NS:-/dev/${CTRL:-nvme0} nsid=1} $(grep -v '^\s*$' $W/idn | head -n1)"; fi
}
skipped ns-descs || {
    if [ -n "$NS" ]; then bounded 60 $W/nsd nvme ns-descs "$NS"; else bounded 60 $W/nsd nvme ns-descs /dev/${CTRL:-nvme0} --namespace-id=1; fi; rc=$?
    indent ns-descs <$W/nsd
    if [ $rc -eq 0 ] && ! grep -qi 'error\|invalid' $W/nsd; then check ns-descs ok "$(grep -iE 'uuid|nguid|eui64|csi' $W/nsd | tr -s ' ' | tr '\n' ';')"
    else check ns-descs fail "rc=$rc ns=${NS:-/dev/${CTRL:-nvme0} nsid=1} $(grep -v '^\s*$' $W/nsd | head -n1)"; fi
}
new_dmesg 'nvme|timeout|error'

# 4. fio -----------------------------------------------------------------------------------------
skipped fio || {
    if [ -z "$NS" ]; then check fio-randwrite fail "no namespace"; check fio-randread fail "no namespace"
    else
        if fio_run randwrite randwrite "$FIO_MB"; then check fio-randwrite ok "${FIO_MB}MiB 4k qd16 libaio direct verify=crc32c errs=0$(grep -m1 'write: IOPS=' $W/fio.randwrite | tr -s ' ' | cut -d'(' -f1)"
        else check fio-randwrite fail "rc=$rc errs=$errs"; fi
        # the data written above carries crc32c verify headers; read it back in random order
        if fio_run randread randread "$FIO_MB" --verify_header_seed=0; then check fio-randread ok "${FIO_MB}MiB 4k qd16 libaio direct verify=crc32c errs=0$(grep -m1 'read: IOPS=' $W/fio.randread | tr -s ' ' | cut -d'(' -f1)"
        else check fio-randread fail "rc=$rc errs=$errs"; fi
    fi
}
say "/proc/interrupts (nvme) after I/O:"
irq_lines | indent irq
IRQ1=$(irq_total)
if [ "$IRQ1" -gt "$IRQ0" ]; then check irq-count-rise ok "before=$IRQ0 after=$IRQ1"
else check irq-count-rise fail "before=$IRQ0 after=$IRQ1"; fi
new_dmesg 'nvme|timeout|error|blk|I/O'

# 5. ext4 ----------------------------------------------------------------------------------------
ext4_test() {
    set -e
    mkfs.ext4 -F -q "$NS"
    mkdir -p /mnt/t
    mount -t ext4 "$NS" /mnt/t
    dd if=/dev/urandom of=$W/ref bs=64k count=64 2>/dev/null
    cp $W/ref /mnt/t/file
    mkdir -p /mnt/t/dir && echo hello >/mnt/t/dir/small
    sync
    umount /mnt/t
    echo 3 >/proc/sys/vm/drop_caches
    mount -t ext4 -o ro "$NS" /mnt/t
    a=$(md5sum <$W/ref); b=$(md5sum </mnt/t/file)
    echo "md5 ref=$a disk=$b"
    cmp $W/ref /mnt/t/file
    [ "$(cat /mnt/t/dir/small)" = hello ]
    umount /mnt/t
    e2fsck -n -f "$NS"
}
skipped ext4 || {
    if [ -z "$NS" ]; then check ext4 fail "no namespace"
    else
        bounded $STEP $W/ext4 ext4_test; rc=$?
        indent ext4 <$W/ext4
        if [ $rc -eq 0 ]; then check ext4 ok "mkfs+mount+4MiB write/remount/cmp+fsck -n clean"
        else check ext4 fail "rc=$rc $(tail -n1 $W/ext4)"; grep -q ' /mnt/t ' /proc/mounts && umount -f /mnt/t; fi
    fi
}
new_dmesg 'nvme|timeout|error|EXT4'

# 6. controller reset ----------------------------------------------------------------------------
skipped reset || {
    bounded $STEP $W/reset nvme reset /dev/${CTRL:-nvme0}; rc=$?
    indent reset <$W/reset
    # the controller must come back live; the namespace too if there was one before
    had_ns=$NS; want=ctrl; [ -n "$had_ns" ] && want=ns
    if [ $rc -eq 0 ] && wait_ready "$PROBE_WAIT" $want && { [ -z "$had_ns" ] || [ -n "$NS" ]; }; then
        check reset ok "nvme reset, $CTRL live again, ns='$NS'"
    else check reset fail "rc=$rc state=$(cat /sys/class/nvme/${CTRL:-nvme0}/state 2>/dev/null) ns='$NS' (before: '$had_ns')"; fi
    io_check io-after-reset
    new_dmesg 'nvme|timeout|error'
}

# 7. unbind / bind -------------------------------------------------------------------------------
skipped rebind || {
    if [ -n "$BDF" ]; then
        had_ns=$NS; want=ctrl; [ -n "$had_ns" ] && want=ns
        bounded $STEP $W/unbind sh -c "echo $BDF >/sys/bus/pci/drivers/nvme/unbind"; rc=$?
        i=0; while [ -e /sys/class/nvme/${CTRL:-nvme0} ] && [ $i -lt 20 ]; do usleep 250000; i=$((i + 1)); done
        gone=no; [ -e /sys/bus/pci/devices/$BDF/driver ] || gone=yes
        bounded $STEP $W/bind sh -c "echo $BDF >/sys/bus/pci/drivers/nvme/bind"; rc2=$?
        cat $W/unbind $W/bind | indent rebind
        if [ $rc -eq 0 ] && [ $rc2 -eq 0 ] && [ $gone = yes ] && wait_ready "$PROBE_WAIT" $want && { [ -z "$had_ns" ] || [ -n "$NS" ]; }; then
            check rebind ok "unbind+bind $BDF, $CTRL live, ns='$NS'"
        else check rebind fail "unbind rc=$rc unbound=$gone bind rc=$rc2 ctrl='$CTRL' state=$(cat /sys/class/nvme/${CTRL:-nvme0}/state 2>/dev/null) ns='$NS' (before: '$had_ns')"; fi
    else check rebind fail "no BDF"; fi
    io_check io-after-rebind
    new_dmesg 'nvme|timeout|error'
}

# 8. timeouts ------------------------------------------------------------------------------------
# nvme driver messages only: not the kernel command line, which may carry nvme_core.*_timeout=
dmesg | grep -i nvme | grep -viE 'command line' | grep -iE 'timeout|timed out' >$W/dm.to
if [ -s $W/dm.to ]; then
    check no-timeout fail "$(wc -l <$W/dm.to) nvme timeout lines in dmesg"
    head -n 20 $W/dm.to | indent timeout
else check no-timeout ok "no nvme timeout in dmesg"; fi
say "final /proc/interrupts (nvme):"
irq_lines | indent irq

echo "@done passed=$PASS failed=$FAIL"
sync
poweroff -f
