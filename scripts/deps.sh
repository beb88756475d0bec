#!/bin/sh
# Installs what `make` needs on a fresh Debian/Ubuntu machine that has only Rust, gcc, make and
# python3: the C libraries hwlocality links (hwloc, udev), cmake and pkg-config for the
# packaging tests, g++ for the C++ example, valgrind for `make test-valgrind` and promtool
# (package prometheus) for the metrics tests, Boost (Beast) and nlohmann-json for dsv4-server,
# iproute2 (`ip netns`) for `make test-netns`, UCX (libucx0, loaded at run time; ucx-utils for
# ucx_perftest) for the ucx transport's tests. Does nothing when everything is present.
set -eu

missing=""
command -v cmake >/dev/null 2>&1 || missing="$missing cmake"
command -v pkg-config >/dev/null 2>&1 || missing="$missing pkg-config"
command -v g++ >/dev/null 2>&1 || missing="$missing g++"
command -v valgrind >/dev/null 2>&1 || missing="$missing valgrind"
# promtool (Prometheus's linter and a real Prometheus) for the metrics tests.
command -v promtool >/dev/null 2>&1 || missing="$missing prometheus"
pkg-config --exists hwloc 2>/dev/null || missing="$missing libhwloc-dev"
pkg-config --exists libudev 2>/dev/null || missing="$missing libudev-dev"
# dsv4-server's and dsv4-router's HTTP parser (Boost.Beast, header-only) and JSON library.
[ -f /usr/include/boost/beast/http.hpp ] || missing="$missing libboost-dev"
[ -f /usr/include/nlohmann/json.hpp ] || missing="$missing nlohmann-json3-dev"
# Network namespaces and veth pairs for the two-host tests.
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
# UCX for pd.transport = "ucx": the library the tests load, and ucx_perftest.
ldconfig -p 2>/dev/null | grep -q 'libucp\.so\.0 ' || [ -e /usr/lib/x86_64-linux-gnu/libucp.so.0 ] \
    || missing="$missing libucx0"
command -v ucx_perftest >/dev/null 2>&1 || missing="$missing ucx-utils"

if [ -n "$missing" ]; then
    echo "deps: installing$missing"
    if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    # shellcheck disable=SC2086
    $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
