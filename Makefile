# dsv4 — quick start on a fresh machine (Rust, gcc, make, python3):
#   make demo    the built-in tiny DeepSeek V4 model serving an agentic workload on the CPU
#                backend (HiCache on, small device pool): latencies, cache tiers, Prometheus;
#                first the memory plans of a V4-Flash prefill node, HiCache by ratio and by size;
#                then the same workload on a prefill + decode pair over TCP loopback (TTFT,
#                transfer rate, rooms per side against the unified run)
#   make test    everything: the CUDA kernels through NVRTC, fmt, clippy, Rust tests, header
#                freshness, PD across two network namespaces (root), install + CMake/ctest,
#                the C tests under valgrind, pkg-config build, pytest
# Other targets: demo-pd (a prefill and a decode dsv4-server behind dsv4-router, on loopback),
# lib, header, install PREFIX=..., kernels-check, stress (a minute of concurrent load, then the
# books), fuzz (AFL++ on the params, config.json and safetensors-header parsers, the PD frame
# decoder and the UCX message parser), clean.
# Benchmarks: bench-forward, bench-radix, bench-hicache, bench-prefix, bench-overload, bench-pd,
# bench-transfer (PD room transfer vs raw TCP, PD vs unified TTFT under 10x overload), bench-ucx
# (PD over the ucx transport vs ucx_perftest and vs the tcp transport), bench-compare,
# bench-burst (bursts of 500 streaming completions at a server and through the router).

CARGO   ?= cargo
PREFIX  ?= /usr/local
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
MAJOR   := $(firstword $(subst ., ,$(VERSION)))
# cargo's output directory: CARGO_TARGET_DIR when set (a build directory per worktree), else target.
REL     := $(or $(CARGO_TARGET_DIR),target)/release
STAGE   := $(CURDIR)/build/prefix
VENV    := $(CURDIR)/.venv
CC      ?= cc

.PHONY: all deps venv lib header install demo demo-pd test kernels-check test-rust test-netns test-c test-valgrind test-pkgconfig test-python stress clean bench-forward bench-radix bench-hicache bench-prefix bench-overload bench-pd bench-transfer bench-ucx bench-compare bench-burst fuzz gpu-bundle

all: lib

deps:
	@./scripts/deps.sh

venv: deps
	@./scripts/venv.sh $(VENV)

lib: deps
	@CARGO=$(CARGO) ./scripts/build-lib.sh

# Regenerates include/dsv4.h from src/ffi (commit the result).
header:
	DSV4_UPDATE_HEADER=1 $(CARGO) build --lib

install: lib
	install -d $(PREFIX)/lib $(PREFIX)/include $(PREFIX)/bin $(PREFIX)/share/dsv4
	install -m 755 $(REL)/libdsv4.so $(PREFIX)/lib/libdsv4.so.$(VERSION)
	# Debug info in a file of its own next to the library (gdb and valgrind follow the
	# .gnu_debuglink), so the library a host loads is ~10 MB instead of ~60.
	cd $(PREFIX)/lib && objcopy --only-keep-debug libdsv4.so.$(VERSION) libdsv4.so.$(VERSION).debug && \
	    strip --strip-debug libdsv4.so.$(VERSION) && \
	    objcopy --add-gnu-debuglink=libdsv4.so.$(VERSION).debug libdsv4.so.$(VERSION)
	ln -sf libdsv4.so.$(VERSION) $(PREFIX)/lib/libdsv4.so.$(MAJOR)
	ln -sf libdsv4.so.$(MAJOR) $(PREFIX)/lib/libdsv4.so
	install -m 644 $(REL)/libdsv4.a $(PREFIX)/lib/libdsv4.a
	strip --strip-debug $(PREFIX)/lib/libdsv4.a
	install -m 644 include/dsv4.h bindings/cpp/dsv4.hpp $(PREFIX)/include/
	cmake -DPREFIX=$(PREFIX) -DDSV4_VERSION=$(VERSION) \
	      -DNATIVE_LIBS="$$(cat $(REL)/native-static-libs.txt)" -P cmake/write-package.cmake
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I$(PREFIX)/include examples/c/plan.c \
	      -L$(PREFIX)/lib -ldsv4 '-Wl,-rpath,$$ORIGIN/../lib' -o $(PREFIX)/bin/dsv4-plan
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I$(PREFIX)/include examples/c/serve.c \
	      -L$(PREFIX)/lib -ldsv4 '-Wl,-rpath,$$ORIGIN/../lib' -o $(PREFIX)/bin/dsv4-serve-demo
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -I$(PREFIX)/include examples/server/dsv4_server.cpp \
	      -L$(PREFIX)/lib -ldsv4 -lpthread '-Wl,-rpath,$$ORIGIN/../lib' -o $(PREFIX)/bin/dsv4-server
	$(CXX) -std=c++17 -O2 -Wall -Wextra -Werror -DDSV4_ROUTER_VERSION='"$(VERSION)"' examples/router/dsv4_router.cpp \
	      -lpthread -o $(PREFIX)/bin/dsv4-router
	cp -r configs $(PREFIX)/share/dsv4/
	# Example params whose model_path is relative to the params file: they work from the prefix.
	install -d $(PREFIX)/share/dsv4/examples/params
	install -m 644 examples/params/*.json $(PREFIX)/share/dsv4/examples/params/

demo: lib
	@$(MAKE) --no-print-directory install PREFIX=$(STAGE) >/dev/null
	@echo "== DeepSeek V4-Flash on a PD prefill node (4 GiB device KV): HiCache by ratio vs by size =="
	@# Exit 3 (a plan that does not fit this machine's NUMA node) is part of the demo: the 150 GB
	@# host tier fits a serving node, not a small build machine. Refusals (1) and usage (2) fail.
	@$(STAGE)/bin/dsv4-plan examples/params/flash-prefill-ratio.json examples/params/flash-prefill-size.json || [ $$? -eq 3 ]
	@echo
	@echo "== Serving the built-in tiny DeepSeek V4 on the CPU backend: an agentic workload =="
	@$(CARGO) build --quiet --release --example demo
	@$(REL)/examples/demo

# A prefill dsv4-server, a decode dsv4-server and dsv4-router on loopback serving the tiny model
# to a short chat workload through the router (scripts/demo_pd.py): TTFT, rooms, router counts.
demo-pd: lib
	@$(MAKE) --no-print-directory install PREFIX=$(STAGE) >/dev/null
	@$(CARGO) build --quiet --release --example tiny_model
	@echo "== PD over HTTP: a prefill and a decode dsv4-server behind dsv4-router, the tiny model =="
	@python3 scripts/demo_pd.py --bin $(STAGE)/bin --model "$$($(REL)/examples/tiny_model)"

test: deps kernels-check test-rust test-netns test-c test-valgrind test-pkgconfig test-python
	@echo "make test: all passed"

# Compiles every CUDA kernel in kernels/ with NVRTC for sm_90 and sm_100, as the CUDA backend
# does at run time (no GPU or CUDA toolkit needed): one line per file and architecture, then
# `kernels: N compiled for sm_90, sm_100`. Installs the CUDA 13 NVRTC wheel into .venv first.
NVRTC_WHEEL := nvidia-cuda-nvrtc==13.0.*
NVRTC_GLOB  := $(VENV)/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13
kernels-check: venv
	@lib=$$(ls $(NVRTC_GLOB) 2>/dev/null | head -n1); \
	if [ -z "$$lib" ]; then \
	    $(VENV)/bin/python -m pip install -q --disable-pip-version-check "$(NVRTC_WHEEL)" || exit 1; \
	    lib=$$(ls $(NVRTC_GLOB) | head -n1); \
	fi; \
	DSV4_NVRTC_PATH="$$lib" $(CARGO) run --quiet --example kernels_check -- sm_90 sm_100

# The examples are built first (as a plain `cargo test` does; `--examples` would build them as
# test harnesses instead): tests/pd_processes.rs runs target/debug/examples/pd_node.
# Test binaries whose tests put several UCX engines in one process run one test per process
# (scripts/test_isolated.sh: libucs < 1.17 can abort a process with several UCX workers).
ISOLATED_TESTS := pd_loopback pd_many_engines
OTHER_TESTS    := $(filter-out $(ISOLATED_TESTS),$(basename $(notdir $(wildcard tests/*.rs))))

# The library's tests include the header freshness test (include/dsv4.h vs src/ffi).
test-rust: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) build --examples
	$(CARGO) test --lib --bins $(addprefix --test ,$(OTHER_TESTS))
	$(CARGO) test --doc
	CARGO="$(CARGO)" ./scripts/test_isolated.sh $(ISOLATED_TESTS)

# A prefill and a decode process on two "hosts": network namespaces joined by a veth pair
# (tests/pd_netns.rs). Needs root to make the namespaces and fails, never skips, without it;
# a plain `cargo test` lists these tests as ignored.
test-netns: deps
	$(CARGO) build --example pd_node
	$(CARGO) test --test pd_netns -- --ignored

test-c: lib
	rm -rf $(STAGE) build/ctest
	$(MAKE) --no-print-directory install PREFIX=$(STAGE)
	cmake -S tests/c -B build/ctest -DCMAKE_PREFIX_PATH=$(STAGE) -DCMAKE_BUILD_TYPE=Debug
	cmake --build build/ctest -j2
	ctest --test-dir build/ctest --output-on-failure --no-tests=error

# The C tests again under valgrind memcheck, in a build directory of their own (tests/c with
# DSV4_VALGRIND=ON says which run and why): any memcheck error or definite leak fails. About
# 3 minutes on 2 cores; the tests run one at a time, as their waits are wall-clock bounded.
test-valgrind: test-c
	rm -rf build/valgrind
	cmake -S tests/c -B build/valgrind -DCMAKE_PREFIX_PATH=$(STAGE) -DCMAKE_BUILD_TYPE=Debug \
	      -DDSV4_VALGRIND=ON
	cmake --build build/valgrind -j2
	ctest --test-dir build/valgrind --output-on-failure --no-tests=error

# Builds the C example through pkg-config alone and runs it.
test-pkgconfig: test-c
	mkdir -p build/pkgconfig
	$(CC) -std=c11 -Wall -Wextra -Werror examples/c/plan.c \
	      $$(PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig pkg-config --cflags --libs dsv4) \
	      -Wl,-rpath,$$(PKG_CONFIG_PATH=$(STAGE)/lib/pkgconfig pkg-config --variable=libdir dsv4) \
	      -o build/pkgconfig/dsv4-plan
	build/pkgconfig/dsv4-plan examples/params/flash-prefill-size.json | grep -q "hicache: size 150,000,000,000 B"
	@echo "pkg-config build: ok"

test-python: venv test-c
	DSV4_LIBRARY=$(STAGE)/lib/libdsv4.so.$(MAJOR) $(VENV)/bin/python -m pytest -q tests/python

# A minute of concurrent submit / poll / abort / score / cache_stats / flush on one engine while
# others are created, loaded and shut down under load; then the books of every engine, the pools,
# and the process's threads and open fds after the last destroy (tests/engine_books.rs). Not in
# `make test`. DSV4_STRESS_SECONDS=N runs it for N seconds.
DSV4_STRESS_SECONDS ?= 60
stress: deps
	DSV4_STRESS_SECONDS=$(DSV4_STRESS_SECONDS) $(CARGO) test --test engine_books -- --ignored --nocapture

# Forward-pass speed against transformers on the same weights. torch + transformers 5.23.0 go
# into .venv-bench first (scripts/bench_venv.sh; a few GB, once); where pip cannot install them,
# or with BENCH_PYTHON=python3, dsv4's numbers alone (the script says why).
BENCH_VENV   := $(CURDIR)/.venv-bench
BENCH_PYTHON ?=
bench-forward: deps
	$(CARGO) build --release --example bench_forward
	@py="$(BENCH_PYTHON)"; \
	if [ -z "$$py" ]; then \
	    if ./scripts/bench_venv.sh $(BENCH_VENV); then py=$(BENCH_VENV)/bin/python; \
	    else echo "bench-forward: could not install torch/transformers; dsv4 alone"; py=python3; fi; \
	fi; \
	$$py scripts/bench_forward.py

# What a new operator does on day one (scripts/bench_burst.py): bursts of 500 concurrent
# streaming /v1/completions (2,500-token prompts sharing a 2,000-token prefix) straight at a
# dsv4-server and through dsv4-router to a prefill + decode pair, the tiny model with HiCache on.
# Every request must end whole (200) or as a 429; then 12 more bursts through the router with
# every process's RSS read after each (the last <= the second + 64 MiB). Ends with
# `burst: direct 200=... 429=... other=...; router 200=... 429=... other=...`. About 6 minutes.
bench-burst: lib
	@$(MAKE) --no-print-directory install PREFIX=$(STAGE) >/dev/null
	@$(CARGO) build --quiet --release --example tiny_model
	@python3 scripts/bench_burst.py --bin $(STAGE)/bin --model "$$($(REL)/examples/tiny_model)"

# Prefix-cache match/insert vs memcmp on a 1.2M-token tree, page alloc/free rate.
bench-radix: deps
	$(CARGO) run --release --example bench_radix

# HiCache backup / load-back GB/s vs memcpy of the same bytes; host allocation + pre-touch rate.
bench-hicache: deps
	$(CARGO) run --release --example bench_hicache

# The demo's agentic workload with the prefix cache off, device-only and with HiCache.
bench-prefix: deps
	$(CARGO) run --release --example bench_prefix

# 10x offered load for 30 s against max_queued_requests: admitted TTFT vs unloaded, rejection
# latency, queue length and RSS over time.
bench-overload: deps
	$(CARGO) run --release --example bench_overload

# What the GPU machine runs (it has no Rust): gpu-bundle/ with the stripped library, the GPU
# check binaries and the shared libraries its image lacks. Then, there:
# bash scripts/gpu-check.sh gpu-bundle
gpu-bundle: deps
	bash scripts/gpu_bundle.sh

# Prefill + decode over loopback against a unified engine on the same requests; the state bytes
# moved against raw TCP.
bench-pd: deps
	$(CARGO) run --release --example bench_pd

# PD room transfer throughput (claim -> done, rooms one at a time) against raw TCP loopback
# moving the same bytes in the same 256 KiB chunks, then TTFT under 10x overload on a prefill +
# decode pair against a unified engine with the same admission bound. About 40 s; last line
# `ratios transfer_vs_tcp=... ttft_p99_pd_vs_unified=...`.
bench-transfer: deps
	$(CARGO) run --release --example bench_transfer

# PD room transfer over the ucx transport against ucx_perftest (same UCX_TLS, same bytes in
# 256 KiB puts and active messages: ucp_put_bw, ucp_am_bw), against the tcp transport, and
# with a pd.auth_key_file against without; last line `ratios ucx_rma_vs_put_perftest=…
# ucx_am_vs_am_perftest=… ucx_vs_tcp_transport=… ucx_rma_auth_vs_plain=… ucx_am_auth_vs_plain=…`.
bench-ucx: deps
	$(CARGO) run --release --example bench_ucx

# Speed across commits on this machine: builds each commit in REVS and runs bench_forward,
# bench_prefix and bench_overload round-robin ROUNDS times (3), printing medians and ratios to the
# first commit, e.g. `make bench-compare REVS="e40b8d0 main"`. Run it on an idle machine.
REVS ?= HEAD
bench-compare: deps
	scripts/bench_compare.sh $(REVS)

# Fuzzes the params JSON, config.json and safetensors header parsers, the PD frame decoder and
# the UCX message parser with AFL++ (cargo-afl, on stable Rust; installed on first use) for
# FUZZ_SECONDS each, from fuzz/corpus/. Not part of `make test`. Fails when a target crashes; findings stay in fuzz/out/.
FUZZ_SECONDS ?= 300
fuzz: deps
	FUZZ_SECONDS=$(FUZZ_SECONDS) ./fuzz/run.sh

clean:
	$(CARGO) clean
	rm -rf build
