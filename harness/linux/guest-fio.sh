#!/bin/sh
# iopath harness: a timed fio comparison, run INSIDE the Linux guest instead of guest-check.sh
# (run-linux.sh --script harness/linux/guest-fio.sh). For each job it prints
#   @fio job=NAME iops=N lat_avg_us=X lat_p99_us=Y
# from fio's own terse output, then "@done passed=N failed=M" and powers off via /init.
# Knobs: harness.fio_time=SECS per job (default 5), harness.probe_wait=SECS (default 120).
T=5
WAIT=120
for t in $(cat /proc/cmdline); do
    case "$t" in
        harness.fio_time=*) T=${t#*=} ;;
        harness.probe_wait=*) WAIT=${t#*=} ;;
    esac
done
PASS=0
FAIL=0
i=0
while [ ! -b /dev/nvme0n1 ] && [ $i -lt $((WAIT * 2)) ]; do usleep 500000; i=$((i + 1)); done
if [ ! -b /dev/nvme0n1 ]; then
    echo "@fio error=no-namespace"
    echo "@done passed=0 failed=1"
    exit 0
fi
job() { # NAME RW BS IODEPTH
    # terse v3: field 8 read IOPS, 16 read clat mean (us); 49 write IOPS, 57 write clat mean;
    # clat percentiles are fields 18-37 (read) and 59-78 (write) as "P%=us"; p99 is the 13th.
    out=$(timeout $((T + 60)) fio --name=$1 --filename=/dev/nvme0n1 --rw=$2 --bs=$3 --iodepth=$4 \
        --ioengine=libaio --direct=1 --time_based --runtime=$T --size=32M --numjobs=1 \
        --output-format=terse --terse-version=3 2>&1 | grep '^3;')
    if [ -z "$out" ]; then
        echo "@fio job=$1 error=no-output"
        FAIL=$((FAIL + 1))
        return
    fi
    case "$2" in
        *read) iops=$(echo "$out" | cut -d';' -f8); lat=$(echo "$out" | cut -d';' -f16); p99=$(echo "$out" | cut -d';' -f30) ;;
        *) iops=$(echo "$out" | cut -d';' -f49); lat=$(echo "$out" | cut -d';' -f57); p99=$(echo "$out" | cut -d';' -f71) ;;
    esac
    echo "@fio job=$1 iops=$iops lat_avg_us=$lat lat_p99_us=${p99#*=}"
    PASS=$((PASS + 1))
}
job randread-4k-qd1 randread 4k 1
job randread-4k-qd16 randread 4k 16
job randwrite-4k-qd16 randwrite 4k 16
job read-128k-qd8 read 128k 8
echo "@done passed=$PASS failed=$FAIL"
