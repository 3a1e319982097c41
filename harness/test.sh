#!/usr/bin/env bash
# The tests, with all their set-up, on a fresh machine (Debian 12, root, /dev/kvm): what
# `cargo test` needs installed, built and sized, then the whole suite, every test binary's
# result shown (a failing one does not stop the others). Arguments go to `cargo test`
# (e.g. `bash harness/test.sh -p iopath-devices`). Each cold step says how long it takes here
# (2 cores); warm, the set-up takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
say() { echo "[test] $* ($((SECONDS - t0)) s)"; }

if [ ! -c /dev/kvm ]; then
  echo "the tests need /dev/kvm: the end-to-end tests boot the guest on real KVM" >&2
  exit 1
fi
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
# qemu-storage-daemon: the independent vhost-user-blk backend the VMM's frontend is tested against
command -v qemu-storage-daemon >/dev/null || need+=(qemu-system-common)
# fio, and its own JSON reader (fio_jsonplus_clat2csv, a Python script in the fio package) that
# checks --output-format
command -v fio >/dev/null && command -v fio_jsonplus_clat2csv >/dev/null || need+=(fio)
command -v python3 >/dev/null || need+=(python3)
# rsvg-convert: the report test renders every plot to PNG with an independent SVG renderer
command -v rsvg-convert >/dev/null || need+=(librsvg2-bin)
command -v gcc >/dev/null || need+=(gcc)
command -v objcopy >/dev/null || need+=(binutils)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v unshare >/dev/null || need+=(util-linux)
command -v script >/dev/null || need+=(bsdutils)
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]} (about a minute cold)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

# Guest RAM in hugetlb pages: the Linux-guest tests take up to 144 pages of 2 MiB at once
# (vm.nr_hugepages), and SPDK's apps in their own test binary about 217 for an nvmf_tgt plus
# what bdevperf's pools take beside it, two tests at a time: with 300 free, bdevperf beside
# nvmf_tgt failed to allocate its iobuf pool (ENOMEM). The pool of a fresh machine is empty;
# hugepages.sh grows it to 600 free (1.2 GiB; never shrinks it) and mounts hugetlbfs at
# /dev/hugepages.
bash harness/spdk/hugepages.sh 600

# The real-client harness: a Debian trixie root with QEMU >= 10.1 (vfio-user-pci), the trixie
# kernel and an initramfs with fio, nvme-cli and e2fsprogs, cached under /var/cache by the
# scripts' hash (about 65 s cold). The Linux-guest tests fail loudly without it.
say "the Linux harness (about 65 s cold)"
bash harness/linux/build-root.sh >/dev/null
bash harness/linux/build-initramfs.sh >/dev/null
# The stock vfio-user peers: SPDK v25.09 (nvmf_tgt, spdk_nvme_perf/identify, bdevperf) and
# libvfio-user with its samples, built from ../shared/peers and cached under
# /var/cache/iopath-peers (7 to 10 min cold; harness/spdk/README.md).
say "the SPDK and libvfio-user peers (7 to 10 min cold)"
bash harness/spdk/build.sh >/dev/null
say "set-up done; the suite (about 25 min here, every binary in turn)"

export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
# Bounded: a hung test fails with its name on screen, not at some outer limit.
timeout --foreground 45m cargo test --workspace --no-fail-fast "$@"
say "all tests passed"
