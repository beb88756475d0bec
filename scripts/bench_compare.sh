#!/usr/bin/env bash
# Compares engine speed across commits on this machine: builds the release examples
# bench_forward, bench_prefix and bench_overload of every REV given, then runs them round-robin
# (REV1, REV2, … then again) ROUNDS times, so drift in the machine's load hits every commit
# alike, and prints the median of each number per commit with its ratio to the first REV.
#
#   scripts/bench_compare.sh e40b8d0 main          # ROUNDS=3 by default
#   ROUNDS=1 BENCHES="overload" scripts/bench_compare.sh HEAD~1 HEAD
#
# Run it on an otherwise idle machine; outputs stay in $OUT (default /tmp/dsv4-bench-compare).
set -euo pipefail

ROUNDS=${ROUNDS:-3}
BENCHES=${BENCHES:-"forward prefix overload"}
OUT=${OUT:-/tmp/dsv4-bench-compare}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# One build directory for every commit: each build's binaries are copied out before the next.
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}

[ $# -ge 1 ] || { echo "usage: $0 REV [REV ...]" >&2; exit 2; }
mkdir -p "$OUT"
revs=()
for rev in "$@"; do
    sha=$(git -C "$ROOT" rev-parse --short "$rev^{commit}")
    revs+=("$sha")
    tree="$OUT/tree-$sha"
    if [ ! -x "$OUT/bin-$sha/bench_overload" ]; then
        rm -rf "$tree"
        git -C "$ROOT" worktree add -q --detach "$tree" "$sha"
        (cd "$tree" && CARGO_TARGET_DIR="$TARGET" cargo build -q --release \
            --example bench_forward --example bench_prefix --example bench_overload)
        mkdir -p "$OUT/bin-$sha"
        cp "$TARGET"/release/examples/bench_{forward,prefix,overload} "$OUT/bin-$sha/"
    fi
done

for r in $(seq 1 "$ROUNDS"); do
    for sha in "${revs[@]}"; do
        # The examples find their fixtures from the tree they were built in.
        bin="$OUT/bin-$sha"
        for b in $BENCHES; do
            case $b in
                forward)
                    for m in fixture large; do
                        "$bin/bench_forward" --model $m --threads 2 --weights f32 --json \
                            > "$OUT/$sha-forward-$m-$r.txt"
                    done ;;
                prefix) "$bin/bench_prefix" > "$OUT/$sha-prefix-$r.txt" ;;
                overload) "$bin/bench_overload" > "$OUT/$sha-overload-$r.txt" ;;
            esac
        done
        echo "round $r: $sha done" >&2
    done
done

python3 - "$OUT" "$ROUNDS" "$BENCHES" "${revs[@]}" <<'EOF'
import json, re, statistics, sys
out, rounds, benches, revs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4:]
def numbers(sha, r):
    n = {}
    if "forward" in benches:
        for m in ("fixture", "large"):
            x = json.loads(open(f"{out}/{sha}-forward-{m}-{r}.txt").read().strip().splitlines()[-1])
            for k in ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s"):
                n[f"forward {m} {k}"] = x[k]
    if "prefix" in benches:
        for line in open(f"{out}/{sha}-prefix-{r}.txt"):
            for label in ("prefix cache off", "device only", "HiCache (ratio 6)"):
                if line.startswith(label):
                    f = line[len(label):].split()
                    n[f"prefix {label}: gen tok/s"] = float(f[1])
                    n[f"prefix {label}: TTFT p50 ms"] = float(f[3])
    if "overload" in benches:
        t = open(f"{out}/{sha}-overload-{r}.txt").read()
        n["overload admitted req/s"] = float(re.search(r"admitted \(([\d.]+) req/s\)", t).group(1))
        m = re.search(r"admitted TTFT p50 ([\d.]+) ms p99 ([\d.]+) ms", t)
        n["overload admitted TTFT p50 ms"], n["overload admitted TTFT p99 ms"] = map(float, m.groups())
        n["overload refusal p50 us"] = float(re.search(r"refusal latency p50 ([\d.]+) us", t).group(1))
    return n
med = {s: {} for s in revs}
for s in revs:
    runs = [numbers(s, r) for r in range(1, rounds + 1)]
    for k in runs[0]:
        med[s][k] = statistics.median(x[k] for x in runs)
print(f"medians of {rounds} interleaved rounds; ratio = commit / {revs[0]}")
print("| bench | " + " | ".join(f"{s} | ratio" for s in revs) + " |")
print("|---|" + "---|---|" * len(revs))
for k in med[revs[0]]:
    base = med[revs[0]][k]
    cells = " | ".join(f"{med[s][k]:.1f} | {med[s][k] / base:.3f}" for s in revs)
    print(f"| {k} | {cells} |")
EOF
