#!/bin/bash
# Build (or reuse) the stock vfio-user peers from the source archives in shared/peers:
#   SPDK v25.09 (its libvfio-user submodule from the f922ada archive) against Debian 12's DPDK,
#   libvfio-user efd091b with its samples,
#   qpair-cycle, a small client of SPDK's NVMe driver (qpair-cycle.c, linked to the built SPDK).
# Prints the install directory on stdout; it holds bin/ (the tools, by name), spdk/ (the built
# SPDK tree: build/bin, build/examples, scripts/rpc.py, python/), libvfio-user/ (its build/samples)
# and info.
#   IOPATH_PEERS        the archives (default: <repo>/../shared/peers)
#   IOPATH_PEERS_CACHE  the cache (default /var/cache/iopath-peers)
#   IOPATH_PEERS_JOBS   make/ninja parallelism (default 2)
#
# One change to SPDK, and only one: DPDK's version gate in lib/env_dpdk/pci_dpdk.c accepts
# 22.11 only up to 22.11.4 and refuses, at run time, Debian 12's 22.11.11 (whose public headers
# SPDK copies are the same; checked below). No build flag, configure option or environment
# avoids that gate (every SPDK application runs it in spdk_env_init, and Debian 12 has no other
# DPDK), so the gate is widened to every 22.11.x. SPDK's NVMe driver, its transports and
# everything else are built as shipped.
# The archive has no isa-l submodule, which configure requires on x86_64 unless nasm is older
# than 2.14, when it builds without ISA-L by itself: configure runs with an empty isa-l/ marker
# (never executed) and, on its PATH, a nasm that says it is 2.13. No SPDK file changes for that.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../linux/common.sh"

SPDK_HARNESS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HARNESS_CACHE="${IOPATH_PEERS_CACHE:-/var/cache/iopath-peers}"
JOBS="${IOPATH_PEERS_JOBS:-2}"
log()  { printf '[peers] %s\n' "$*" >&2; }
die()  { printf '[peers] ERROR: %s\n' "$*" >&2; exit 1; }

need_root build.sh

if [[ -n ${IOPATH_PEERS:-} ]]; then
    PEERS=$IOPATH_PEERS
else
    top=$(git -C "$SPDK_HARNESS" rev-parse --show-toplevel 2>/dev/null) \
        || top=$(cd "$SPDK_HARNESS/../.." && pwd)
    PEERS="$top/../shared/peers"
fi
SPDK_TGZ="$PEERS/spdk-v25.09.tar.gz"
VFU_SPDK_TGZ="$PEERS/libvfio-user-f922ada.tar.gz"
VFU_TGZ="$PEERS/libvfio-user-efd091b.tar.gz"
for f in "$SPDK_TGZ" "$VFU_SPDK_TGZ" "$VFU_TGZ"; do
    [[ -f $f ]] || die "missing source archive $f (set IOPATH_PEERS to the directory holding it)"
done

# Debian 12 packages the builds need (from shared/peers/README.md) and the tools used here.
PKGS=(libdpdk-dev libaio-dev libcunit1-dev libiscsi-dev libkeyutils-dev libfuse3-dev
      python3-pyelftools python3-dev libnuma-dev uuid-dev libssl-dev libjson-c-dev libcmocka-dev
      pkgconf python3-jsonschema meson ninja-build gcc make patch)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    log "apt-get install ${missing[*]}"
    apt-get update -qq >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2 \
        || die "apt-get install ${missing[*]} failed"
fi
DPDK_VER=$(pkg-config --modversion libdpdk 2>/dev/null) || die "pkg-config finds no libdpdk (libdpdk-dev)"
[[ $DPDK_VER == 22.11.* ]] || die "DPDK is $DPDK_VER; this build widens SPDK's gate for 22.11.x only"

# The key: the archives, this script, its C program, common.sh and the DPDK it links.
H=$( { sha256sum "$SPDK_TGZ" "$VFU_SPDK_TGZ" "$VFU_TGZ" | cut -d' ' -f1
       cat "$SPDK_HARNESS/build.sh" "$SPDK_HARNESS/qpair-cycle.c" "$HARNESS_DIR/common.sh"
       echo "dpdk $DPDK_VER"; } | sha256sum | cut -c1-16)
OUT="$HARNESS_CACHE/$H"

complete() { [[ -f "$OUT/.complete" && -x "$OUT/bin/nvmf_tgt" ]]; }
if complete; then
    log_cached "peers cached: $OUT"
    echo "$OUT"
    exit 0
fi
take_lock "peers-$H"
if complete; then   # built by a concurrent run while we waited
    log_cached "peers cached: $OUT"
    echo "$OUT"
    exit 0
fi
[[ -e $OUT ]] && die "$OUT exists but is not marked complete; remove it by hand"

TMP="$HARNESS_CACHE/.tmp-peers-$H-$$"
rm -rf "$TMP"
mkdir -p "$TMP"
cleanup() { local rc=$?; if [[ $rc -ne 0 ]]; then log "build failed (rc=$rc); logs in $TMP.failed"; rm -rf "$TMP.failed"; mv "$TMP" "$TMP.failed" 2>/dev/null || true; fi; }
trap cleanup EXIT
T0=$SECONDS
# run LOG CMD...: CMD with its output in $TMP/LOG; on failure the log's tail and a clear error.
run() {
    local logf="$TMP/$1.log"; shift
    "$@" >>"$logf" 2>&1 || { tail -n 40 "$logf" >&2; die "$* failed (log: $logf, kept under $TMP.failed)"; }
}

# --- SPDK v25.09 ---
log "unpacking SPDK v25.09 and its libvfio-user (f922ada)"
tar -xzf "$SPDK_TGZ" -C "$TMP"
mv "$TMP/spdk-25.09" "$TMP/spdk"
S="$TMP/spdk"
rmdir "$S/libvfio-user"
tar -xzf "$VFU_SPDK_TGZ" -C "$S"          # the submodule's place: spdk/libvfio-user

# The DPDK headers SPDK copies for 22.11 (lib/env_dpdk/22.11) must match the installed ones: the
# public three are compared (the driver headers are not installed by Debian); rte_bus_pci.h may
# only gain declarations.
inc=$(pkg-config --variable=includedir libdpdk)/dpdk
[[ -d $inc ]] || inc=$(pkg-config --cflags-only-I libdpdk | tr ' ' '\n' | sed -n 's/^-I//p' | head -n1)
for h in rte_bus.h rte_dev.h rte_bus_pci.h; do
    [[ -f "$inc/$h" ]] || die "DPDK header $inc/$h not found"
    d=$(diff "$S/lib/env_dpdk/22.11/$h" "$inc/$h" || true)
    if [[ $h == rte_bus_pci.h ]]; then
        d=$(grep -vE '^(> |>$|[0-9]+a[0-9]+(,[0-9]+)?$)' <<<"$d" || true)
    fi
    [[ -z $d ]] || die "DPDK $DPDK_VER's $h differs from SPDK's 22.11 copy: the gate must not be widened:
$d"
done
# The gate: 22.11.x for every x (see the header of this script).
gate="$S/lib/env_dpdk/pci_dpdk.c"
[[ $(grep -c '^		if (minor > 4) {$' "$gate") == 1 ]] || die "the 22.11 gate in $gate is not as expected"
sed -i 's/^		if (minor > 4) {$/		if (0 \&\& minor > 4) { \/* iopath harness: every 22.11.x *\//' "$gate"
log "pci_dpdk.c: the 22.11 gate accepts 22.11.x (DPDK $DPDK_VER)"

# configure requires isa-l/autogen.sh and builds ISA-L if nasm >= 2.14: give it the marker and
# a nasm that is too old, so it takes its own path without ISA-L (and IPSEC_MB).
mkdir -p "$TMP/fakebin"
printf '#!/bin/sh\necho "NASM version 2.13.00 (iopath harness: ISA-L is not built)"\n' >"$TMP/fakebin/nasm"
chmod +x "$TMP/fakebin/nasm"
: >"$S/isa-l/autogen.sh"
log "configure"
(cd "$S" && PATH="$TMP/fakebin:$PATH" run configure ./configure --with-dpdk --with-vfio-user --without-crypto \
    --disable-unit-tests --disable-tests --without-fio --without-usdt)
rm -f "$S/isa-l/autogen.sh"
grep -q '^CONFIG_ISAL?=n' "$S/mk/config.mk" || die "configure left ISA-L on"
grep -q '^CONFIG_VFIO_USER?=y' "$S/mk/config.mk" || die "configure left vfio-user off"
log "make -j$JOBS (about 10 min at -j2)"
run make make -C "$S" -j"$JOBS" CONFIG_IPSEC_MB=n
B="$S/build"
for t in bin/spdk_nvme_perf bin/spdk_nvme_identify bin/nvmf_tgt examples/bdevperf; do
    [[ -x "$B/$t" ]] || die "SPDK built no $t"
done

# --- qpair-cycle: SPDK's NVMe driver as a library. With Debian's DPDK, configure builds SPDK's
# libraries shared (packaged DPDK has no static libraries), and libvfio-user beside them. ---
log "qpair-cycle"
PC="$B/lib/pkgconfig"
VFU_LIB="$B/libvfio-user/usr/local/lib"
[[ -f "$PC/spdk_nvme.pc" && -d $VFU_LIB ]] || die "no $PC/spdk_nvme.pc or $VFU_LIB"
# shellcheck disable=SC2046
run qpair-cycle gcc -O2 -Wall -Werror -o "$TMP/qpair-cycle" "$SPDK_HARNESS/qpair-cycle.c" \
    $(PKG_CONFIG_PATH="$PC" pkg-config --cflags --libs spdk_nvme spdk_env_dpdk) \
    -L"$VFU_LIB" $(PKG_CONFIG_PATH="$PC" pkg-config --libs --static spdk_syslibs)

# --- libvfio-user efd091b and its samples ---
log "libvfio-user efd091b"
mkdir -p "$TMP/vfu"
tar -xzf "$VFU_TGZ" -C "$TMP/vfu"
mv "$TMP/vfu/libvfio-user" "$TMP/libvfio-user"
rmdir "$TMP/vfu"
V="$TMP/libvfio-user"
# The server sample of efd091b does not start: it gives BAR1 3 pages (0x3000), which the
# library's own check (a BAR's size is a power of two) refuses, "BAR region size 12288 must be
# a power of 2". Upstream fixed the samples after efd091b (nutanix/libvfio-user#871, #872) by
# making BAR1 4 pages: the same here, server.c's and client.c's BAR1 size 0x3000 -> 0x4000 and
# the client's migration iteration counts (1 KiB each) 12 -> 16 and 13 -> 17. Nothing else in
# libvfio-user changes (the library is SPDK's submodule's, built above, and this one as shipped).
sample_fix() {   # FILE OLD NEW: OLD must occur exactly once
    [[ $(grep -cF -- "$2" "$V/samples/$1") == 1 ]] || die "samples/$1 has no single '$2': not the efd091b sample"
    sed -i "s/$(sed 's/[][\\/.*^$]/\\&/g' <<<"$2")/$3/" "$V/samples/$1"
}
sample_fix server.c "const size_t bar1_size = 0x3000;" "const size_t bar1_size = 0x4000;"
sample_fix client.c "size_t bar1_size = 0x3000;" "size_t bar1_size = 0x4000;"
sample_fix client.c "assert(*nr_iters == 12);" "assert(*nr_iters == 16);"
sample_fix client.c "assert(*nr_iters == 13);" "assert(*nr_iters == 17);"
log "libvfio-user samples: BAR1 of server and client 0x4000 (upstream #872)"
(cd "$V" && run libvfio-user meson setup build -Dbuildtype=release)
run libvfio-user ninja -C "$V/build" -j"$JOBS"
for s in client server gpio-pci-idio-16 null lspci shadow_ioeventfd_server; do
    [[ -x "$V/build/samples/$s" ]] || die "libvfio-user built no samples/$s"
done

# --- bin/: the tools by name. SPDK's are wrappers that find its shared libraries (the binaries'
# RUNPATH names only the system's) relative to themselves, so the tree can be renamed. ---
mkdir -p "$TMP/bin" "$TMP/libexec"
mv "$TMP/qpair-cycle" "$TMP/libexec/qpair-cycle"
spdk_tool() {   # NAME PATH-RELATIVE-TO-THE-INSTALL-DIR
    cat >"$TMP/bin/$1" <<WRAP
#!/bin/sh
# SPDK v25.09's $1, with its shared libraries (built by harness/spdk/build.sh)
d=\$(dirname "\$(readlink -f "\$0")")/..
LD_LIBRARY_PATH="\$d/spdk/build/lib:\$d/spdk/build/libvfio-user/usr/local/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$d/$2" "\$@"
WRAP
    chmod +x "$TMP/bin/$1"
}
for t in spdk_nvme_perf spdk_nvme_identify nvmf_tgt spdk_tgt; do spdk_tool "$t" "spdk/build/bin/$t"; done
spdk_tool bdevperf spdk/build/examples/bdevperf
spdk_tool qpair-cycle libexec/qpair-cycle
for s in client server gpio-pci-idio-16 null lspci shadow_ioeventfd_server; do
    ln -s "../libvfio-user/build/samples/$s" "$TMP/bin/vfu-$s"
done
cat >"$TMP/bin/rpc.py" <<'RPC'
#!/bin/sh
# SPDK's scripts/rpc.py (it finds its python/ beside it)
exec python3 "$(dirname "$(readlink -f "$0")")/../spdk/scripts/rpc.py" "$@"
RPC
chmod +x "$TMP/bin/rpc.py"
"$TMP/bin/rpc.py" --help >/dev/null 2>"$TMP/rpc.log" || { cat "$TMP/rpc.log" >&2; die "rpc.py does not run with $(python3 --version)"; }
grep -qa 'VFIOUSER' "$B/lib/libspdk_nvmf.so" || die "SPDK's nvmf library has no VFIOUSER transport"
for t in spdk/build/bin/nvmf_tgt spdk/build/examples/bdevperf libexec/qpair-cycle libvfio-user/build/samples/client; do
    miss=$(LD_LIBRARY_PATH="$B/lib:$VFU_LIB" ldd "$TMP/$t" | grep 'not found' || true)
    [[ -z $miss ]] || die "$t misses shared libraries: $miss"
done
# Object files are not needed to run anything: drop them (the libraries stay, for qpair-cycle).
find "$S" "$V" -name '*.o' -delete
rm -rf "$TMP/fakebin"

{
    echo "spdk: v25.09 ($(sha256sum "$SPDK_TGZ" | cut -c1-16)), libvfio-user f922ada as its submodule"
    echo "libvfio-user: efd091b ($(sha256sum "$VFU_TGZ" | cut -c1-16))"
    echo "dpdk: $DPDK_VER (Debian); SPDK's 22.11 gate widened to 22.11.x"
    echo "built: $(date -u +%FT%TZ) in $((SECONDS - T0)) s at -j$JOBS"
    echo "hash: $H"
} >"$TMP/info"
touch "$TMP/.complete"
mv -T "$TMP" "$OUT"    # atomic: a half-built tree is never at $OUT
trap - EXIT
log "peers built in $((SECONDS - T0)) s: $OUT"
echo "$OUT"
