#!/bin/sh
# iopath harness: runs INSIDE the Linux guest (busybox sh) as /check.sh, started by /init.
# Prints "@check NAME ok|fail detail..." lines on the console, then "@done passed=N failed=M",
# then powers off. Kernel command line knobs (all optional):
#   harness.probe_wait=SECS   how long to wait for /dev/nvme0n1 (default 120)
#   harness.step=SECS         bound on each step (default 180)
#   harness.fio_mb=MB         fio region size (default 16)
#   harness.skip=a,b          checks to skip (pci-caps nvme-list id-ctrl id-ns ns-descs fio ext4 reset rebind)
#   harness.deadline=SECS     guest uptime after which every remaining step fails at once, so
#                             that @done is still printed (run-linux.sh passes its timeout - 25)
. /lib.sh

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

# 1b. PCI Express and Power Management capabilities, as NVMe over PCIe has them ---------------------
skipped pci-caps || {
    lspci -vv -s "${BDF:-none}" >$W/lspci 2>&1
    exp=$(grep -o 'Express (v[0-9]) [A-Za-z ]*' $W/lspci | head -n 1)
    pm=$(grep -o 'Power Management version [0-9]*' $W/lspci | head -n 1)
    if [ -n "$exp" ] && [ -n "$pm" ]; then check pci-caps ok "$exp; $pm; driver=$(basename "$(readlink /sys/bus/pci/devices/$BDF/driver 2>/dev/null)")"
    else check pci-caps fail "express='$exp' pm='$pm' at ${BDF:-no BDF}"; fi
}

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
fio_checks
say "/proc/interrupts (nvme) after I/O:"
irq_lines | indent irq
IRQ1=$(irq_total)
if [ "$IRQ1" -gt "$IRQ0" ]; then check irq-count-rise ok "before=$IRQ0 after=$IRQ1"
else check irq-count-rise fail "before=$IRQ0 after=$IRQ1"; fi
new_dmesg 'nvme|timeout|error|blk|I/O'

# 5. ext4 ----------------------------------------------------------------------------------------
ext4_check
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
no_timeout_check
say "final /proc/interrupts (nvme):"
irq_lines | indent irq

finish
