#!/bin/sh
# iopath harness: runs INSIDE the Linux guest (busybox sh) as /check.sh (run-linux.sh --script) on
# a virtio-blk disk, /dev/vda: the stock virtio_blk driver, fio with verify, mkfs/mount/fsck.
# Prints "@check NAME ok|fail detail..." lines, then "@done passed=N failed=M"; /init powers off.
# Kernel command line knobs (optional):
#   harness.fio_mb=MB          fio region size (default 16)
#   harness.vblk_sectors=N     the capacity the disk must show, in 512-byte sectors
#   harness.vblk_queues=N      the request queues the driver must have set up
PASS=0
FAIL=0
FIO_MB=16
SECTORS=
QUEUES=
STEP=180
for t in $(cat /proc/cmdline); do
    case "$t" in
        harness.fio_mb=*) FIO_MB=${t#*=} ;;
        harness.vblk_sectors=*) SECTORS=${t#*=} ;;
        harness.vblk_queues=*) QUEUES=${t#*=} ;;
    esac
done
D=/dev/vda
W=/tmp/vb
mkdir -p $W
check() { # NAME ok|fail DETAIL...
    n=$1; s=$2; shift 2
    echo "@check $n $s $*"
    if [ "$s" = ok ]; then PASS=$((PASS + 1)); else FAIL=$((FAIL + 1)); fi
}
indent() { sed "s/^/  $1| /"; }
finish() { echo "@done passed=$PASS failed=$FAIL"; exit 0; }

# 1. probe: the driver binds and the disk shows its size --------------------------------------
i=0
while [ ! -b $D ] && [ $i -lt 120 ]; do usleep 500000; i=$((i + 1)); done
if [ ! -b $D ]; then
    check probe fail "no $D after 60 s"
    dmesg | grep -iE 'virtio|vd' | tail -n 20 | indent dmesg
    finish
fi
size=$(cat /sys/block/vda/size)
feat=$(cat /sys/block/vda/device/features 2>/dev/null)
check probe ok "$D size=$size sectors features=$feat"
if [ -n "$SECTORS" ]; then
    if [ "$size" = "$SECTORS" ]; then check capacity ok "$size sectors"
    else check capacity fail "$size sectors, want $SECTORS"; fi
fi
if [ -n "$QUEUES" ]; then
    n=$(ls -d /sys/block/vda/mq/[0-9]* 2>/dev/null | wc -l)
    if [ "$n" = "$QUEUES" ]; then check queues ok "$n hardware queues"
    else check queues fail "$n hardware queues, want $QUEUES"; fi
fi
q=/sys/block/vda/queue
say_q="lbs=$(cat $q/logical_block_size) max_segments=$(cat $q/max_segments) discard_max=$(cat $q/discard_max_bytes) write_zeroes_max=$(cat $q/write_zeroes_max_bytes) wc=$(cat $q/write_cache)"
# DISCARD and WRITE_ZEROES are offered, and the cache is write back (FLUSH).
case "$say_q" in
    *discard_max=0*|*write_zeroes_max=0*|*"wc=write through"*) check queue-limits fail "$say_q" ;;
    *) check queue-limits ok "$say_q" ;;
esac

# 2. fio: random writes verified, then read back and verified again ---------------------------
fio_run() { # NAME RW [extra fio args]
    fname=$1; rw=$2; shift 2
    timeout $STEP fio --name="$fname" --filename=$D --bs=4k --ioengine=libaio --direct=1 --iodepth=16 \
        --numjobs=1 --rw="$rw" --size="${FIO_MB}M" --verify=crc32c --verify_fatal=1 "$@" >$W/fio.$fname 2>&1
    rc=$?
    grep -E 'err=|IOPS=|verify|bad|fio: ' $W/fio.$fname | indent "$fname"
    errs=$(sed -nE 's/.*err= *([0-9]+).*/\1/p' $W/fio.$fname | head -n1)
    [ $rc -eq 0 ] && [ "$errs" = 0 ]
}
if fio_run randwrite randwrite; then check fio-randwrite ok "${FIO_MB}MiB 4k qd16 libaio direct verify=crc32c errs=0"
else check fio-randwrite fail "rc=$rc errs=$errs"; tail -n 15 $W/fio.randwrite | indent randwrite; fi
if fio_run randread randread --verify_header_seed=0; then check fio-randread ok "${FIO_MB}MiB read back, verify=crc32c errs=0"
else check fio-randread fail "rc=$rc errs=$errs"; tail -n 15 $W/fio.randread | indent randread; fi

# 3. ext4: mkfs (discards the disk), files written, remounted, compared, fsck clean -----------
ext4_test() {
    set -e
    mkfs.ext4 -F -q $D
    mkdir -p /mnt/t
    mount -t ext4 $D /mnt/t
    dd if=/dev/urandom of=$W/ref bs=64k count=64 2>/dev/null
    cp $W/ref /mnt/t/file
    mkdir -p /mnt/t/dir && echo hello >/mnt/t/dir/small
    sync
    umount /mnt/t
    echo 3 >/proc/sys/vm/drop_caches
    mount -t ext4 -o ro $D /mnt/t
    cmp $W/ref /mnt/t/file
    [ "$(cat /mnt/t/dir/small)" = hello ]
    umount /mnt/t
    e2fsck -n -f $D
}
(ext4_test) >$W/ext4 2>&1
rc=$?
indent ext4 <$W/ext4
if [ $rc -eq 0 ]; then check ext4 ok "mkfs+mount+4MiB write/remount/cmp+fsck -n clean"
else check ext4 fail "rc=$rc $(tail -n1 $W/ext4)"; grep -q ' /mnt/t ' /proc/mounts && umount -f /mnt/t; fi

# 4. no I/O error or timeout in the kernel log -------------------------------------------------
bad=$(dmesg | grep -iE 'virtio_blk.*(error|timeout)|I/O error|blk_update_request|EXT4-fs error' | head -n 5)
if [ -z "$bad" ]; then check no-io-error ok "dmesg clean"
else check no-io-error fail "$(echo "$bad" | head -n1)"; echo "$bad" | indent dmesg; fi
finish
