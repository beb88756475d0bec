#!/usr/bin/env bash
# `make fuzz`: runs each fuzz target with AFL++ (through cargo-afl, on stable Rust) for a bounded
# time, starting from the committed seed corpus in fuzz/corpus/<target>/, and fails when any
# target found a crash (a panic, an abort, or one of the targets' own checks).
#
#   FUZZ_SECONDS  seconds per target (default 300)
#   FUZZ_TARGETS  targets to run (default: params_json config_json safetensors_header pd_frames
#                 ucx_messages)
#
# Findings stay in fuzz/out/<target>/default/{crashes,hangs}/ (git-ignored); replay one with
#   fuzz/target/release/<target> < fuzz/out/<target>/default/crashes/<file>
set -euo pipefail
cd "$(dirname "$0")"

SECONDS_EACH=${FUZZ_SECONDS:-300}
TARGETS=${FUZZ_TARGETS:-"params_json config_json safetensors_header pd_frames ucx_messages"}
# Pinned with the `afl` crate in fuzz/Cargo.toml: the macro and the runtime pair up.
CARGO_AFL_VERSION=0.18.2

if ! cargo afl --version 2>/dev/null | grep -q "^cargo-afl $CARGO_AFL_VERSION "; then
    echo "== installing cargo-afl $CARGO_AFL_VERSION (builds AFL++ from its bundled source)"
    cargo install cargo-afl --version "$CARGO_AFL_VERSION" --locked
fi
# Builds the AFL++ runtime for this rustc if it is missing; says "already built" otherwise.
if ! out=$(cargo afl config --build 2>&1) && ! grep -q "already built" <<<"$out"; then
    echo "$out" >&2
    exit 1
fi

echo "== building the fuzz targets (instrumented, release with debug assertions)"
cargo afl build --release --locked --quiet

# No UI (not a terminal); no CPU pinning or frequency check (a shared 2-core machine); crashes
# are seen through the exit signal, so a core_pattern that pipes elsewhere does not matter.
export AFL_NO_UI=1 AFL_NO_AFFINITY=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
export AFL_NO_STARTUP_CALIBRATION=1

# The safetensors target writes each input to a file here (in memory where /dev/shm exists).
DSV4_FUZZ_SCRATCH=$(mktemp -d /dev/shm/dsv4-fuzz.XXXXXX 2>/dev/null || mktemp -d)
export DSV4_FUZZ_SCRATCH
trap 'rm -rf "$DSV4_FUZZ_SCRATCH"' EXIT

failed=0
mkdir -p out
for target in $TARGETS; do
    rm -rf "out/$target"
    echo "== $target: fuzzing for ${SECONDS_EACH}s from $(ls "corpus/$target" | wc -l) seeds"
    # -t: an input that takes over 2 s is a hang (validation is meant to be linear and capped).
    if ! cargo afl fuzz -i "corpus/$target" -o "out/$target" -V "$SECONDS_EACH" -t 2000 \
        "target/release/$target" >"out/$target.log" 2>&1; then
        echo "afl-fuzz failed; the end of out/$target.log:" >&2
        tail -n 30 "out/$target.log" >&2
        failed=1
        continue
    fi
    stats="out/$target/default/fuzzer_stats"
    stat() { sed -n "s/^$1 *: *//p" "$stats"; }
    crashes=$(find "out/$target/default/crashes" -type f ! -name README.txt | wc -l)
    hangs=$(find "out/$target/default/hangs" -type f | wc -l)
    echo "   $(stat execs_done) executions ($(stat execs_per_sec)/s), corpus $(stat corpus_count)," \
        "edges $(stat edges_found), crashes $crashes, hangs $hangs"
    if [ "$crashes" -gt 0 ]; then
        echo "   CRASHES in fuzz/out/$target/default/crashes/:" >&2
        ls "out/$target/default/crashes" | grep -v README.txt | head -n 10 >&2
        failed=1
    fi
    if [ "$hangs" -gt 0 ]; then
        # Reported, not failed: on a loaded machine a slow input is not always a slow path.
        echo "   hangs (inputs over 2 s) in fuzz/out/$target/default/hangs/: replay them"
    fi
done
exit $failed
