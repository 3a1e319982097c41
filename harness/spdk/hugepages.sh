#!/bin/bash
# hugepages.sh [PAGES]: make DPDK's 2 MiB hugepages available to SPDK's tools (idempotent).
#   - mounts hugetlbfs at /dev/hugepages unless a hugetlbfs is mounted there already;
#   - grows vm.nr_hugepages until PAGES (default 64) pages are free; never shrinks it.
# Prints "hugepages: N free of M" on stderr. Needs root for what it changes.
set -euo pipefail
want=${1:-64}
[[ $want =~ ^[0-9]+$ ]] || { echo "hugepages.sh: PAGES must be a number, not '$want'" >&2; exit 2; }
die() { echo "hugepages.sh: ERROR: $*" >&2; exit 1; }

[[ $(awk '/^Hugepagesize:/ {print $2}' /proc/meminfo) == 2048 ]] \
    || die "the default hugepage size is not 2 MiB: $(grep Hugepagesize /proc/meminfo)"

if ! awk '$2 == "/dev/hugepages" && $3 == "hugetlbfs" {found=1} END {exit !found}' /proc/mounts; then
    mkdir -p /dev/hugepages
    mount -t hugetlbfs -o pagesize=2M nodev /dev/hugepages || die "cannot mount hugetlbfs at /dev/hugepages"
fi

free=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
if (( free < want )); then
    total=$(cat /proc/sys/vm/nr_hugepages)
    echo $((total + want - free)) >/proc/sys/vm/nr_hugepages || die "cannot grow vm.nr_hugepages"
    free=$(awk '/^HugePages_Free:/ {print $2}' /proc/meminfo)
    (( free >= want )) || die "need $want free 2 MiB pages, the pool has $free (memory too fragmented?)"
fi
echo "hugepages: $free free of $(cat /proc/sys/vm/nr_hugepages) (wanted $want), hugetlbfs at /dev/hugepages" >&2
