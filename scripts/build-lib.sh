#!/bin/sh
# Builds libdsv4.so and libdsv4.a (release) and records the native libraries the static
# archive needs, as rustc reports them, for the CMake package and dsv4.pc.
#
# Every release build goes through this one command line, so cargo's fingerprint stays stable
# and nothing is rebuilt twice. rustc prints the list only when it compiles the crate; the last
# list is kept in <target dir>/release/native-static-libs.txt (CARGO_TARGET_DIR or target).
set -eu
cargo=${CARGO:-cargo}
out=${CARGO_TARGET_DIR:-target}/release
major=$(sed -n 's/^version = "\([0-9]*\)\..*/\1/p' Cargo.toml | head -n1)

build() {
    $cargo rustc --release --lib -- --print native-static-libs 2>&1 | tee "$1" \
        | grep -v "^note: " || true
    grep -q "^error" "$1" && exit 1
    return 0
}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
build "$log"
if ! grep -q "native-static-libs:" "$log" && [ ! -s "$out/native-static-libs.txt" ]; then
    touch src/lib.rs
    build "$log"
fi
if grep -q "native-static-libs:" "$log"; then
    sed -n 's/^note: native-static-libs: //p' "$log" > "$out/native-static-libs.txt"
fi
# The soname is libdsv4.so.<major>: give uninstalled builds the same name.
ln -sf libdsv4.so "$out/libdsv4.so.$major"
