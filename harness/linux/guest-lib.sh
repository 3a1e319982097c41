# shellcheck shell=sh
# iopath harness: helpers shared by the check scripts that run INSIDE the Linux guest (busybox sh),
# sourced as /lib.sh. A script sets NS (the block device under test) before fio_run or ext4_test.
# Kernel command line knobs read here (all optional):
#   harness.probe_wait=SECS   how long to wait for the device (default 120)
#   harness.step=SECS         bound on each step (default 180)
#   harness.fio_mb=MB         fio region size (default 16), per job
#   harness.fio_jobs=N        fio jobs (default 1); with N > 1 each job on a vCPU of its own
#                             (cpus_allowed 0..N-1, split) and a region of its own (offset_increment)
#   harness.skip=a,b          checks to skip (each script lists its own)
#   harness.deadline=SECS     guest uptime after which every remaining step fails at once, so
#                             that @done is still printed (run-linux.sh passes its timeout - 25)
PASS=0
FAIL=0
PROBE_WAIT=120
STEP=180
FIO_MB=16
FIO_JOBS=1
SKIP=,
DEADLINE=0
for t in $(cat /proc/cmdline); do
    case "$t" in
        harness.probe_wait=*) PROBE_WAIT=${t#*=} ;;
        harness.step=*) STEP=${t#*=} ;;
        harness.fio_mb=*) FIO_MB=${t#*=} ;;
        harness.fio_jobs=*) FIO_JOBS=${t#*=} ;;
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

FIO_COMMON="--filename=NS --bs=4k --ioengine=libaio --direct=1 --iodepth=16 --group_reporting"
fio_jobs() { # SIZE_MB: the fio options of FIO_JOBS jobs, each on its vCPU and its own SIZE_MB region
    if [ "$FIO_JOBS" -gt 1 ]; then
        echo "--numjobs=$FIO_JOBS --offset_increment=${1}M --cpus_allowed=0-$((FIO_JOBS - 1)) --cpus_allowed_policy=split"
    else echo "--numjobs=1"; fi
}
fio_run() { # NAME RW SIZE_MB [extra fio args]
    fname=$1; rw=$2; mb=$3; shift 3
    # shellcheck disable=SC2086
    bounded $STEP $W/fio.$fname fio --name=$fname $(echo $FIO_COMMON | sed "s#NS#$NS#") $(fio_jobs $mb) \
        --rw=$rw --size=${mb}M --verify=crc32c --verify_fatal=1 "$@"
    rc=$?
    grep -E 'err=|IOPS=|verify|bad|fio: |\[bounded\]' $W/fio.$fname | indent "$fname"
    errs=$(sed -nE 's/.*err= *([0-9]+).*/\1/p' $W/fio.$fname | head -n1)
    [ -n "$errs" ] || errs=unknown
    if [ $rc -eq 0 ] && [ "$errs" = 0 ]; then return 0; fi
    tail -n 15 $W/fio.$fname | indent "$fname"
    return 1
}

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

ext4_check() { # mkfs, write, remount, compare, fsck (skip: ext4)
    skipped ext4 || {
        if [ -z "$NS" ]; then check ext4 fail "no namespace"
        else
            bounded $STEP $W/ext4 ext4_test; rc=$?
            indent ext4 <$W/ext4
            if [ $rc -eq 0 ]; then check ext4 ok "mkfs+mount+4MiB write/remount/cmp+fsck -n clean"
            else check ext4 fail "rc=$rc $(tail -n1 $W/ext4)"; grep -q ' /mnt/t ' /proc/mounts && umount -f /mnt/t; fi
        fi
    }
}

io_check() { # NAME: a small verified write + read-back through the block layer
    if [ -z "$NS" ]; then check "$1" fail "no namespace block device"; return; fi
    if fio_run "$1" randwrite 4; then check "$1" ok "fio randwrite+verify 4MiB on $NS errs=0$(grep -m1 'write: IOPS=' $W/fio.$1 | tr -s ' ' | cut -d'(' -f1)"
    else check "$1" fail "fio rc=$rc errs=$errs"; fi
}

fio_checks() { # fio-randwrite, then fio-randread of what it wrote, both verified (skip: fio)
    skipped fio || {
        if [ -z "$NS" ]; then check fio-randwrite fail "no namespace"; check fio-randread fail "no namespace"
        else
            if fio_run randwrite randwrite "$FIO_MB"; then check fio-randwrite ok "${FIO_MB}MiB x$FIO_JOBS 4k qd16 libaio direct verify=crc32c errs=0$(grep -m1 'write: IOPS=' $W/fio.randwrite | tr -s ' ' | cut -d'(' -f1)"
            else check fio-randwrite fail "rc=$rc errs=$errs"; fi
            # the data written above carries crc32c verify headers; read it back in random order
            if fio_run randread randread "$FIO_MB" --verify_header_seed=0; then check fio-randread ok "${FIO_MB}MiB x$FIO_JOBS 4k qd16 libaio direct verify=crc32c errs=0$(grep -m1 'read: IOPS=' $W/fio.randread | tr -s ' ' | cut -d'(' -f1)"
            else check fio-randread fail "rc=$rc errs=$errs"; fi
        fi
    }
}

no_timeout_check() { # no-timeout: no nvme timeout line in dmesg since boot
    dmesg | grep -i nvme | grep -viE 'command line' | grep -iE 'timeout|timed out' >$W/dm.to
    if [ -s $W/dm.to ]; then
        check no-timeout fail "$(wc -l <$W/dm.to) nvme timeout lines in dmesg"
        head -n 20 $W/dm.to | indent timeout
    else check no-timeout ok "no nvme timeout in dmesg"; fi
}

finish() { # the verdict line, then power off (by /init if this returns)
    echo "@done passed=$PASS failed=$FAIL"
    sync
    poweroff -f
}
