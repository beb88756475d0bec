#!/usr/bin/env python3
"""`make bench-burst`: what a new operator does to a deployment on its first day. Bursts of
concurrent streaming /v1/completions (prompts sharing a long prefix, as agents' do) straight at
a dsv4-server and through dsv4-router to a prefill + decode pair, HiCache on. Every request must
end as a whole stream (200, ending with [DONE] and no error event) or as a 429 refusal; anything
else (a reset, a 502, a truncated stream, an error event, no answer within the client timeout)
is "other" and fails the bench. Then more bursts through the router, with every process's
resident memory read after each: it must not grow (RSS after the last burst <= RSS after the
second + 64 MiB). Then the operator's replay: the decode killed in the middle of a burst (every
request must still end properly: whole, 429, an error event then [DONE], or a JSON 502/503; never
a reset or a cut stream) and restarted on its port, and one more burst with nothing "other".
The processes start with the soft limit on open files most do (1024). Ends with

  burst: direct 200=... 429=... other=...; router 200=... 429=... other=...

Standard library only (asyncio and raw HTTP/1.1, so no client library's pooling or retries
hides what the servers do):

  python3 scripts/bench_burst.py --bin PREFIX/bin --model MODEL_DIR [--concurrency 500]
"""

import argparse
import asyncio
import collections
import json
import random
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def default_open_files_limit():
    """The soft limit on open files most processes start with (systemd's default, and most
    shells'): 1024, under a higher hard limit. A server must cope with it."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


class Proc:
    """A dsv4-server or dsv4-router started on a free port, with the usual default soft limit of
    1024 open files."""

    def __init__(self, name, argv, log):
        self.name, self.argv = name, argv
        self.log = open(log, "w+")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=default_open_files_limit)
        lines = []
        while True:
            line = self.proc.stdout.readline()
            lines.append(line)
            if "listening on http://" in line:
                break
            if not line:
                sys.exit(f"bench-burst: {name} did not start:\n{''.join(lines)}")
        self.url = line.strip().rsplit(" ", 1)[1]
        self.port = int(self.url.rsplit(":", 1)[1])
        self.log.write("".join(lines))
        # The rest of its output goes to the log (a pipe nobody reads would fill and block it).
        self.pump = asyncio.get_event_loop().run_in_executor(None, self._pump)

    def _pump(self):
        for line in self.proc.stdout:
            self.log.write(line)
        self.log.flush()

    def rss(self):
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def read_chunked(reader):
    """The body of a chunked response, or raises IncompleteReadError/ValueError if it breaks
    off before its last chunk."""
    body = b""
    while True:
        size = int((await reader.readline()).strip() or b"x", 16)
        if size == 0:
            await reader.readline()
            return body
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def one(port, body, timeout):
    """How one streamed request ended: "200", "429" or "other: why"."""
    try:
        return await asyncio.wait_for(exchange(port, body), timeout)
    except asyncio.TimeoutError:
        return f"other: no whole answer in {timeout:.0f} s"
    except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError) as e:
        return f"other: {type(e).__name__}"


async def exchange(port, body):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = json.dumps(body).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            data = await read_chunked(reader)
        else:
            data = await reader.readexactly(int(headers.get("content-length", "0")))
        if status == 429:
            return "429" if "retry-after" in headers else "other: 429 without Retry-After"
        if status != 200:
            return f"other: {status} {data[:120]!r}"
        events = [e for e in data.decode().split("\n\n") if e]
        if not events or events[-1] != "data: [DONE]":
            return "other: stream without [DONE]"
        for e in events[:-1]:
            event = json.loads(e[len("data: "):])
            if "error" in event:
                return f"other: error event {event['error'].get('message', '')[:100]}"
        return "200"
    finally:
        writer.close()


async def burst(port, n, prefix, rng, timeout):
    """`n` streaming completions at once, each the shared prefix + its own tokens."""
    bodies = [{"prompt": prefix + [rng.randrange(10, 4000) for _ in range(500)], "max_tokens": 32,
               "stream": True, "temperature": 0, "ignore_eos": True} for _ in range(n)]
    t = time.perf_counter()
    outcomes = await asyncio.gather(*(one(port, b, timeout) for b in bodies))
    return collections.Counter(outcomes), time.perf_counter() - t


def summary(counts):
    other = sum(v for k, v in counts.items() if k.startswith("other"))
    return f"200={counts['200']} 429={counts['429']} other={other}"


def server_params(model, role=None, threads=2):
    p = {"model_path": model, "threads": threads,
         "kv": {"page_size": 128, "device_memory_bytes": "64MiB", "max_running_requests": 32},
         "hicache": {"enabled": True, "ratio": 2.0}}
    if role:
        p.update(role=role, pd={"listen": "tcp://127.0.0.1:0"})
    return p


def kind(outcome):
    """An outcome without its details: "200", "429", "error event", "503", "other: ..."."""
    for prefix, name in (("other: error event", "error event then [DONE]"), ("other: 502", "502 JSON error"),
                         ("other: 503", "503 JSON error")):
        if outcome.startswith(prefix):
            return name
    return outcome


def ended_properly(outcome):
    """While a decode dies: a whole answer, a 429, a stream ended with an error event and
    [DONE], or a JSON 502/503 (the dead server's role named) are proper endings; a reset, a cut
    stream or no answer are not."""
    return outcome in ("200", "429") or outcome.startswith(("other: error event", "other: 502", "other: 503"))


async def replay(args, procs, prefix, rng, tmp):
    """The operator's replay: the decode killed in the middle of a burst through the router,
    restarted on its port, then one more burst. Returns what went wrong."""
    prefill, decode, router = procs
    task = asyncio.ensure_future(burst(router.port, args.concurrency, prefix, rng, args.timeout))
    await asyncio.sleep(args.kill_after)
    decode.proc.kill()
    decode.proc.wait()
    counts, took = await task
    bad = {k: v for k, v in counts.items() if not ended_properly(k)}
    kinds = collections.Counter()
    for k, v in counts.items():
        kinds[kind(k)] += v
    print(f"  replay: decode killed {args.kill_after:.0f} s into a burst: "
          + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + f" in {took:.1f} s", flush=True)
    failed = [f"replay: {sum(bad.values())} requests ended improperly while the decode died: {bad}"] if bad else []
    argv = list(decode.argv)
    argv[argv.index("--port") + 1] = str(decode.port)
    procs[1] = Proc("decode", argv, tmp / "decode-restarted.log")
    deadline = time.time() + 60
    while True:
        status = await asyncio.get_event_loop().run_in_executor(None, health, router.port)
        if status == 200:
            break
        if time.time() > deadline:
            return failed + ["replay: the router's /health did not turn 200 within 60 s of the restart"]
        await asyncio.sleep(0.5)
    counts, took = await burst(router.port, args.concurrency, prefix, rng, args.timeout)
    print(f"  replay: decode restarted on its port: {summary(counts)} in {took:.1f} s"
          + "".join(f"\n    {k}: {v}" for k, v in counts.items() if k.startswith("other")), flush=True)
    if any(k.startswith("other") for k in counts):
        failed.append("replay: the burst after the restart had requests that ended neither whole nor 429")
    return failed


def health(port):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


async def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="PREFIX/bin with dsv4-server and dsv4-router")
    ap.add_argument("--model", required=True, help="checkpoint directory (the tiny model)")
    ap.add_argument("--concurrency", type=int, default=500)
    ap.add_argument("--bursts", type=int, default=3, help="bursts per target for the counts")
    ap.add_argument("--gap", type=float, default=10.0, help="seconds between bursts")
    ap.add_argument("--rss-bursts", type=int, default=12)
    ap.add_argument("--rss-gap", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    ap.add_argument("--keep", help="directory for the processes' logs (default: a temporary one)")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="leave out the replay (the decode killed mid-burst and restarted)")
    ap.add_argument("--kill-after", type=float, default=3.0, help="seconds into the replay's burst")
    args = ap.parse_args()
    binary = Path(args.bin)
    rng = random.Random(7)
    prefix = [rng.randrange(10, 4000) for _ in range(2000)]
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="dsv4-bench-burst-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"bench-burst: {args.concurrency} concurrent streaming /v1/completions a burst (2,500-token prompts "
          f"sharing a 2,000-token prefix, max_tokens 32, {args.timeout:.0f} s client timeout), the tiny model, "
          f"HiCache on; logs in {tmp}", flush=True)
    failed = []

    def write(name, params):
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(params))
        return str(path)

    # Straight at one server.
    direct = Proc("direct", [str(binary / "dsv4-server"), "--params", write("direct", server_params(args.model)),
                             "--port", "0"], tmp / "direct.log")
    totals = {"direct": collections.Counter(), "router": collections.Counter()}
    try:
        for i in range(args.bursts):
            if i:
                await asyncio.sleep(args.gap)
            counts, took = await burst(direct.port, args.concurrency, prefix, rng, args.timeout)
            totals["direct"] += counts
            print(f"  direct burst {i + 1}: {summary(counts)} in {took:.1f} s; rss {direct.rss() / MiB:.0f} MiB"
                  + "".join(f"\n    {k}: {v}" for k, v in counts.items() if k.startswith("other")), flush=True)
    finally:
        direct.stop()

    # Through the router to a prefill + decode pair.
    token = tmp / "router.token"
    token.write_text(secrets.token_urlsafe(32) + "\n")
    procs = []
    try:
        for role in ("prefill", "decode"):
            procs.append(Proc(role, [str(binary / "dsv4-server"), "--params",
                                     write(role, server_params(args.model, role, threads=1)), "--port", "0",
                                     "--router-token-file", str(token)], tmp / f"{role}.log"))
        procs.append(Proc("router", [str(binary / "dsv4-router"), "--prefill", procs[0].url, "--decode",
                                     procs[1].url, "--port", "0", "--router-token-file", str(token)],
                          tmp / "router.log"))
        router = procs[2]
        rss = []
        for i in range(args.bursts + args.rss_bursts):
            if i:
                await asyncio.sleep(args.gap if i < args.bursts else args.rss_gap)
            counts, took = await burst(router.port, args.concurrency, prefix, rng, args.timeout)
            if i < args.bursts:
                totals["router"] += counts
            else:
                rss.append({p.name: p.rss() for p in procs})
            print(f"  router burst {i + 1}: {summary(counts)} in {took:.1f} s; rss "
                  + ", ".join(f"{p.name} {p.rss() / MiB:.0f} MiB" for p in procs)
                  + "".join(f"\n    {k}: {v}" for k, v in counts.items() if k.startswith("other")), flush=True)
            if i >= args.bursts and counts.get("200", 0) == 0:
                failed.append(f"router burst {i + 1} served nothing")
        if len(rss) >= 2:
            for p in procs:
                second, last = rss[1][p.name], rss[-1][p.name]
                verdict = "ok" if last <= second + 64 * MiB else "GREW"
                print(f"  rss {p.name}: after RSS burst 2 {second / MiB:.0f} MiB, after RSS burst {len(rss)} "
                      f"{last / MiB:.0f} MiB ({verdict})")
                if verdict != "ok":
                    failed.append(f"{p.name} RSS grew {(last - second) / MiB:.0f} MiB over {len(rss) - 2} bursts")
        if args.replay:
            failed += await replay(args, procs, prefix, rng, tmp)
    finally:
        for p in reversed(procs):
            p.stop()

    for name, counts in totals.items():
        if any(k.startswith("other") for k in counts):
            failed.append(f"{name}: {sum(v for k, v in counts.items() if k.startswith('other'))} requests ended "
                          "neither whole nor 429")
    print(f"burst: direct {summary(totals['direct'])}; router {summary(totals['router'])}")
    if failed:
        print("bench-burst: FAILED: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
