#!/usr/bin/env bash
# Coverage-guided fuzzing of iopath's hostile-input parsers and device models, on the STABLE
# toolchain (cargo-fuzz + libFuzzer; RUSTC_BOOTSTRAP=1 lets stable rustc take the -Z flags
# cargo-fuzz passes).
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 60 s, every target)
#
# Builds the fuzz crate (installing cargo-fuzz into $IOPATH_TOOLS if it is not there), then runs
# each target for SECONDS_PER_TARGET with libFuzzer, one after the other on one core. The grown
# corpus lives outside the repository in $IOPATH_FUZZ_CACHE/corpus/TARGET (the committed seeds in
# fuzz/corpus/TARGET are read too); crash inputs go to $IOPATH_FUZZ_CACHE/artifacts/TARGET and
# each target's full libFuzzer log to $IOPATH_FUZZ_CACHE/logs/TARGET.log. Prints one line per
# target, `fuzz TARGET: executions=N coverage=C crashes=K`, and for a crash the input, its path
# and the panic with its stack. Exits 1 if any target crashed (panic, sanitizer report, timeout,
# out-of-memory), 2 if the build failed.
#
# Environment: IOPATH_TOOLS (default /var/cache/iopath-tools), IOPATH_FUZZ_CACHE (default
# /var/cache/iopath-fuzz), IOPATH_FUZZ_SANITIZER (address or none; default address when the
# toolchain ships the ASan runtime, else none), IOPATH_FUZZ_ARGS (extra libFuzzer flags).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

CARGO_FUZZ_VERSION=0.13.2
tools=${IOPATH_TOOLS:-/var/cache/iopath-tools}
cache=${IOPATH_FUZZ_CACHE:-/var/cache/iopath-fuzz}
secs=${1:-60}
shift || true
if [ $# -gt 0 ]; then
  targets=("$@")
else
  targets=()
  for f in fuzz/fuzz_targets/*.rs; do targets+=("$(basename "$f" .rs)"); done
fi
for t in "${targets[@]}"; do
  [ -f "fuzz/fuzz_targets/$t.rs" ] || { echo "fuzz: no target $t (fuzz/fuzz_targets/$t.rs)" >&2; exit 2; }
done

# libfuzzer-sys compiles libFuzzer (C++) with the host's compiler.
if ! command -v c++ >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++
fi

# Stable rustc takes -Zsanitizer, -Cpasses=sancov-module... only with RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
triple=$(rustc -vV | sed -n 's/^host: //p')
cargo_fuzz=$tools/bin/cargo-fuzz
if ! "$cargo_fuzz" --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION into $tools"
  cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION" --root "$tools"
fi

san=${IOPATH_FUZZ_SANITIZER:-}
if [ -z "$san" ]; then
  if ls "$(rustc --print sysroot)/lib/rustlib/$triple/lib/"librustc-*_rt.asan.a >/dev/null 2>&1; then
    san=address
  else
    san=none
    echo "fuzz: this toolchain ships no ASan runtime: fuzzing without a sanitizer"
  fi
fi

mkdir -p "$cache/target" "$cache/logs"
echo "fuzz: $(rustc --version), $("$cargo_fuzz" --version), sanitizer $san, ${secs} s per target"
t0=$SECONDS
# -O: optimised; -a: debug assertions and overflow checks (an overflow is a bug here too).
if ! "$cargo_fuzz" build --fuzz-dir fuzz -O -a -s "$san" --target-dir "$cache/target" >"$cache/logs/build.log" 2>&1; then
  tail -n 40 "$cache/logs/build.log"
  echo "fuzz: build failed (log: $cache/logs/build.log)" >&2
  exit 2
fi
# nvme_queues without libFuzzer's comparison tracing: its input is the choices of a schedule,
# never a value compared as such, and the hooks cost three quarters of its time in the oracle's
# word-by-word sweeps of its 8 MiB of guest RAM (4x the executions without them). Its own target
# directory, as the flags differ.
no_cmp=(nvme_queues)
for t in "${no_cmp[@]}"; do
  [[ " ${targets[*]} " == *" $t "* ]] || continue
  if ! "$cargo_fuzz" build --fuzz-dir fuzz -O -a -s "$san" --no-trace-compares --target-dir "$cache/target-$t" "$t" \
    >"$cache/logs/build-$t.log" 2>&1; then
    tail -n 40 "$cache/logs/build-$t.log"
    echo "fuzz: build of $t failed (log: $cache/logs/build-$t.log)" >&2
    exit 2
  fi
done
echo "fuzz: built in $((SECONDS - t0)) s"
bin=$cache/target/$triple/release

failed=()
for t in "${targets[@]}"; do
  tbin=$bin
  [[ " ${no_cmp[*]} " == *" $t "* ]] && tbin=$cache/target-$t/$triple/release
  corpus=$cache/corpus/$t
  artifacts=$cache/artifacts/$t
  log=$cache/logs/$t.log
  mkdir -p "$corpus" "$artifacts"
  before=$(find "$artifacts" -type f | sort)
  # New inputs go to the first directory (the cache); the committed seeds are read only.
  # -timeout: an input that runs 10 s is a hang; -rss_limit_mb: 2 GiB is an out-of-memory.
  # nvme_queues: 30 s, so that the queue oracle's own patience (10 s for a completion) reports
  # a hang first, with its text (its inputs run 3.2 s at most otherwise).
  timeout=10
  [ "$t" = nvme_queues ] && timeout=30
  set +e
  # shellcheck disable=SC2086 # IOPATH_FUZZ_ARGS is split into flags on purpose
  "$tbin/$t" "$corpus" "fuzz/corpus/$t" -max_total_time="$secs" -print_final_stats=1 -timeout="$timeout" \
    -rss_limit_mb=2048 -artifact_prefix="$artifacts/" ${IOPATH_FUZZ_ARGS:-} >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
  new=$(comm -13 <(echo "$before") <(find "$artifacts" -type f | sort) | sed '/^$/d')
  crashes=$(echo -n "$new" | grep -c . || true)
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
    crashes=1 # died without an artifact (a crash of libFuzzer itself, a signal): the log says
  fi
  echo "fuzz $t: executions=${execs:-0} coverage=${cov:-0} crashes=$crashes"
  if [ "$crashes" -gt 0 ]; then
    failed+=("$t")
    echo "---- $t (exit $rc; full log: $log)"
    sed -n '/panicked at\|==ERROR\|ERROR: libFuzzer\|^SUMMARY/,$p' "$log" | grep -v '^stat::' | head -n 60
    for a in $new; do
      echo "crash input: $a ($(stat -c %s "$a") bytes)"
      head -c 512 "$a" | od -An -tx1 | head -n 32
      echo "reproduce: $tbin/$t $a"
    done
    echo "----"
  fi
  # Keep the corpus lean: merge it down when it has grown large.
  if [ "$(find "$corpus" -type f | wc -l)" -gt 4000 ]; then
    rm -rf "$corpus.merge" && mkdir -p "$corpus.merge"
    "$tbin/$t" -merge=1 "$corpus.merge" "$corpus" >"$cache/logs/$t.merge.log" 2>&1 &&
      rm -rf "$corpus" && mv "$corpus.merge" "$corpus"
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets, no crash ($((SECONDS - t0)) s)"
