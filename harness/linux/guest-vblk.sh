#!/bin/sh
# iopath harness: the virtio-blk checks, run INSIDE the Linux guest (busybox sh) as /check-vblk.sh
# (kernel command line harness.script=/check-vblk.sh; run-linux.sh --check vblk). Same output as
# /check.sh: "@check NAME ok|fail detail..." lines, then "@done passed=N failed=M", then power off.
# Knobs: those of /lib.sh (harness.skip takes fio ext4 rebind), and
#   harness.vblk_sectors=N     the capacity the disk must show, in 512-byte sectors
#   harness.vblk_queues=N      the request queues the driver must have set up; with N > 1 each
#                              queue's own MSI-X vector (virtioK-req.Q) must take interrupts during
#                              fio (check queue-irqs; harness.fio_jobs=N puts a job on each vCPU)
. /lib.sh

SECTORS=
QUEUES=
for t in $(cat /proc/cmdline); do
    case "$t" in
        harness.vblk_sectors=*) SECTORS=${t#*=} ;;
        harness.vblk_queues=*) QUEUES=${t#*=} ;;
    esac
done

NS=
BDF=
VDEV=
find_disk() { # sets NS (/dev/vda), VDEV (virtio0), BDF: the first disk the virtio_blk driver owns
    NS=; VDEV=; BDF=
    for b in /sys/block/vd*; do
        [ -e "$b/device/driver" ] || continue
        [ "$(basename "$(readlink -f "$b/device/driver")")" = virtio_blk ] || continue
        [ -b "/dev/${b##*/}" ] || continue
        NS=/dev/${b##*/}
        VDEV=$(basename "$(readlink -f "$b/device")")
        BDF=$(basename "$(dirname "$(readlink -f "$b/device")")")
        return 0
    done
    return 1
}
wait_disk() { # SECS
    i=0
    lim=$(cap "$1")
    while [ $i -lt $((lim * 2)) ]; do
        find_disk && return 0
        usleep 500000
        i=$((i + 1))
    done
    return 1
}
irq_lines() { [ -n "$VDEV" ] && grep -E "$VDEV-" /proc/interrupts; }
irq_sum() { awk '{for (i = 2; i <= NF; i++) { if ($i ~ /^[0-9]+$/) s += $i; else break }} END {print s + 0}'; }
irq_total() { irq_lines | irq_sum; }
queue_irqs() { # the interrupt count of each request queue's vector: "req.0=N req.1=M ..."
    k=0; out=
    while [ $k -lt "${QUEUES:-0}" ]; do
        out="$out req.$k=$(irq_lines | awk -v n="$VDEV-req.$k" '$NF == n' | irq_sum)"
        k=$((k + 1))
    done
    echo "${out# }"
}
feature() { # BIT: 1 if the driver negotiated virtio feature BIT (sysfs lists bits 0.. as 0/1)
    cut -c$(($1 + 1)) "/sys/bus/virtio/devices/$VDEV/features" 2>/dev/null
}

say "guest-vblk: kernel $(uname -r), probe_wait=${PROBE_WAIT}s step=${STEP}s fio=${FIO_MB}MiB deadline=${DEADLINE}s uptime=$(uptime_s)s"

# 1. probe ---------------------------------------------------------------------------------------
if wait_disk "$PROBE_WAIT"; then
    sz=$(($(cat /sys/block/${NS#/dev/}/size) / 2048))
    check probe ok "$NS on $VDEV at $BDF vid=$(cat /sys/bus/pci/devices/$BDF/vendor) did=$(cat /sys/bus/pci/devices/$BDF/device) size=${sz}MiB queues=$(ls -d /sys/block/${NS#/dev/}/mq/* 2>/dev/null | wc -l)"
    # VERSION_1 (32), EVENT_IDX (29), INDIRECT_DESC (28), FLUSH (9): what a modern device offers
    f="v1=$(feature 32) event_idx=$(feature 29) indirect=$(feature 28) flush=$(feature 9) discard=$(feature 13) write_zeroes=$(feature 14)"
    if [ "$(feature 32)" = 1 ] && [ "$(feature 9)" = 1 ]; then check features ok "$f"
    else check features fail "$f"; fi
    b=/sys/block/${NS#/dev/}
    if [ -n "$SECTORS" ]; then
        if [ "$(cat $b/size)" = "$SECTORS" ]; then check capacity ok "$SECTORS sectors"
        else check capacity fail "$(cat $b/size) sectors, want $SECTORS"; fi
    fi
    if [ -n "$QUEUES" ]; then
        n=$(ls -d $b/mq/[0-9]* 2>/dev/null | wc -l)
        if [ "$n" = "$QUEUES" ]; then check queues ok "$n hardware queues"
        else check queues fail "$n hardware queues, want $QUEUES"; fi
    fi
    # DISCARD and WRITE_ZEROES are offered, and the cache is write back (FLUSH)
    q=$b/queue
    l="lbs=$(cat $q/logical_block_size) max_segments=$(cat $q/max_segments) discard_max=$(cat $q/discard_max_bytes) write_zeroes_max=$(cat $q/write_zeroes_max_bytes) wc=$(cat $q/write_cache)"
    case "$l" in
        *discard_max=0*|*write_zeroes_max=0*|*"wc=write through"*) check queue-limits fail "$l" ;;
        *) check queue-limits ok "$l" ;;
    esac
else
    check probe fail "no virtio_blk disk after ${PROBE_WAIT}s"
    ls /sys/bus/pci/devices/*/class 2>/dev/null | while read -r f; do
        d=${f%/class}; echo "  pci| ${d##*/} class=$(cat $f) vendor=$(cat $d/vendor) device=$(cat $d/device) driver=$(basename "$(readlink $d/driver 2>/dev/null)" 2>/dev/null)"
    done
fi
new_dmesg 'virtio|msi|error'
if [ -n "$BDF" ] && command -v lspci >/dev/null; then lspci -nn -vv -s "$BDF" 2>&1 | grep -vE '^\s*$' | indent lspci; fi

# 2. interrupts ----------------------------------------------------------------------------------
irq_lines | indent irq
IRQ0=$(irq_total)
if irq_lines | grep -q MSI; then check irq-msix ok "$(irq_lines | wc -l) $VDEV vectors, MSI-X, total=$IRQ0"
else check irq-msix fail "no MSI-X $VDEV lines in /proc/interrupts (total=$IRQ0)"; fi

# 3. fio, ext4 -----------------------------------------------------------------------------------
QIRQ0=$(queue_irqs)
fio_checks
IRQ1=$(irq_total)
if [ "$IRQ1" -gt "$IRQ0" ]; then check irq-count-rise ok "before=$IRQ0 after=$IRQ1"
else check irq-count-rise fail "before=$IRQ0 after=$IRQ1"; fi
queue_irq_check() { # each queue's vector of its own took interrupts during fio (none shared)
    QIRQ1=$(queue_irqs)
    set -- $QIRQ0
    bad=
    for a in $QIRQ1; do
        b=${1#*=}; shift
        [ "${a#*=}" -gt "$b" ] || bad="$bad ${a%%=*}"
    done
    if [ -z "$bad" ]; then check queue-irqs ok "before: $QIRQ0; after: $QIRQ1"
    else check queue-irqs fail "no interrupt on$bad: before: $QIRQ0; after: $QIRQ1; vectors: $(irq_lines | awk '{print $NF}' | tr '\n' ' ')"; fi
}
if [ "${QUEUES:-1}" -gt 1 ]; then
    case "$SKIP" in *,fio,*) ;; *) queue_irq_check ;; esac
fi
ext4_check
new_dmesg 'virtio|error|EXT4|I/O'

# 4. unbind / bind: the device is reset and set up again ------------------------------------------
skipped rebind || {
    if [ -n "$BDF" ]; then
        bounded $STEP $W/unbind sh -c "echo $BDF >/sys/bus/pci/drivers/virtio-pci/unbind"; rc=$?
        i=0; while [ -e "$NS" ] && [ $i -lt 20 ]; do usleep 250000; i=$((i + 1)); done
        gone=no; [ -e /sys/bus/pci/devices/$BDF/driver ] || gone=yes
        bounded $STEP $W/bind sh -c "echo $BDF >/sys/bus/pci/drivers/virtio-pci/bind"; rc2=$?
        cat $W/unbind $W/bind | indent rebind
        if [ $rc -eq 0 ] && [ $rc2 -eq 0 ] && [ $gone = yes ] && wait_disk "$PROBE_WAIT"; then
            check rebind ok "unbind+bind $BDF, $NS on $VDEV again"
        else check rebind fail "unbind rc=$rc unbound=$gone bind rc=$rc2 disk='$NS'"; fi
    else check rebind fail "no BDF"; fi
    io_check io-after-rebind
    new_dmesg 'virtio|error|I/O'
}

# 5. errors --------------------------------------------------------------------------------------
dmesg | grep -iE 'virtio|vd[a-z]' | grep -iE 'I/O error|timeout|timed out|failed|broken' >$W/dm.err
if [ -s $W/dm.err ]; then
    check no-errors fail "$(wc -l <$W/dm.err) virtio error lines in dmesg"
    head -n 20 $W/dm.err | indent error
else check no-errors ok "no virtio I/O error or timeout in dmesg"; fi

finish
