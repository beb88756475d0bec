#!/usr/bin/env bash
# Builds what the GPU machine runs into gpu-bundle/ (git-ignored, well under 30 MiB): the
# stripped libdsv4.so, the GPU check binaries, bench_forward, and the shared libraries they
# need that the GPU image lacks (hwloc, udev). The GPU machine has no Rust toolchain and no
# network: everything scripts/gpu-check.sh runs comes from here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bundle
cargo=${CARGO:-cargo}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"

# Release builds: the library, the examples the check runs, and the gpu_ops test binary
# (its path comes from cargo's JSON messages).
$cargo build --release --lib --example bench_forward --example kernels_check
tests=$($cargo test --release --test gpu_ops --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_ops":
        print(m["executable"])')
target=${CARGO_TARGET_DIR:-target}
cp "$target/release/libdsv4.so" "$out/lib/"
cp "$tests" "$out/bin/gpu_ops"
cp "$target/release/examples/bench_forward" "$target/release/examples/kernels_check" "$out/bin/"
strip --strip-unneeded "$out/lib/libdsv4.so" "$out/bin/"*

# System libraries the binaries link that are not part of glibc or the driver.
for f in "$out/lib/libdsv4.so" "$out/bin/"*; do
    ldd "$f" | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so*|libm.so*|libgcc_s.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
        *) cp -L "$lib" "$out/lib/" ;;
    esac
done
git rev-parse HEAD > "$out/COMMIT"
du -sh "$out"
ls -la "$out/bin" "$out/lib"
size=$(du -sm "$out" | cut -f1)
if [ "$size" -ge 30 ]; then
    echo "gpu-bundle: $size MiB, over the 30 MiB budget" >&2
    exit 1
fi
