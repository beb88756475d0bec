#!/usr/bin/env bash
# Runs every test of the given test binaries (tests/NAME.rs) in a process of its own, for the
# binaries that put several UCX engines, so several UCX workers, in one process.
#
# libucs before UCX 1.17 can abort such a process: an event one worker missed is replayed after
# its handler was removed and its fd reused by another worker's handler (`async.c:643
# Assertion 'handler->async == async' failed` in `ucs_async_poll_missed`; fixed upstream in
# openucx/ucx#9942). Run together, a binary's tests churn many workers' fds at once; one test
# per process leaves only that test's own engines. A test that still dies of that abort (or
# of UCX 1.13's `ucp_put_handler` abort over emulated RMA, docs/pd.md "Only over a real RMA
# lane") runs again, at most three times, each said here; any other failure fails at once.
#
#   scripts/test_isolated.sh pd_loopback pd_many_engines
set -euo pipefail

cargo=${CARGO:-cargo}
failed=0
for bin in "$@"; do
    "$cargo" test -q --test "$bin" --no-run
    # The binary's tests less its ignored ones (those run only when asked for, as with cargo).
    mapfile -t ignored < <("$cargo" test -q --test "$bin" -- --list --ignored 2>/dev/null | sed -n 's/: test$//p')
    mapfile -t tests < <("$cargo" test -q --test "$bin" -- --list 2>/dev/null | sed -n 's/: test$//p' |
        grep -vxF -f <(printf '%s\n' "${ignored[@]}" ""))
    if [ "${#tests[@]}" -eq 0 ]; then
        echo "test_isolated: $bin lists no tests" >&2
        exit 1
    fi
    passed=0
    for t in "${tests[@]}"; do
        for attempt in 1 2 3; do
            if out=$("$cargo" test -q --test "$bin" -- --exact "$t" 2>&1); then
                if ! grep -q "test result: ok. 1 passed" <<<"$out"; then
                    echo "$bin: $t: its process did not run it:" >&2
                    echo "$out" >&2
                    exit 1
                fi
                passed=$((passed + 1))
                break
            fi
            if grep -q "ucs_async_poll_missed" <<<"$out" ||
                { grep -q "Fatal: unexpected error" <<<"$out" && grep -q "ucp_put_handler" <<<"$out"; }; then
                echo "$bin: $t: attempt $attempt: libucs/libucp aborted the process (UCX < 1.17, see this script's header): running it again" >&2
                if [ "$attempt" -eq 3 ]; then
                    echo "$bin: $t: aborted by UCX three times in a row" >&2
                    echo "$out" >&2
                    failed=1
                fi
                continue
            fi
            echo "$bin: $t failed:" >&2
            echo "$out" >&2
            exit 1
        done
    done
    echo "$bin: $passed of ${#tests[@]} tests passed, one process each"
    [ "$passed" -eq "${#tests[@]}" ] || failed=1
done
exit "$failed"
