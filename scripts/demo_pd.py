#!/usr/bin/env python3
"""`make demo-pd`: a prefill dsv4-server, a decode dsv4-server and dsv4-router on loopback,
serving a model (the built-in tiny DeepSeek V4 by default) to a short agentic chat workload sent
through the router: a shared system prompt, several users, multi-turn, streamed. Prints TTFT and
end-to-end latency as the client saw them, the rooms and bytes each side moved (from the
servers' /metrics), the router's counts, then stops all three with SIGTERM.

Standard library only, so it runs on a fresh machine:

  python3 scripts/demo_pd.py --bin PREFIX/bin --model MODEL_DIR [--users 8 --turns 4]
"""

import argparse
import json
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

SYSTEM = (
    "You are a coding agent working in a large repository. Tools: read_file(path), "
    "search(query), run(command), edit(path, old, new). Read before you edit; run the tests "
    "after every change; keep each step small and say why you take it. "
) * 6
QUESTIONS = [
    "Where is the scheduler's admission check?",
    "Why does the decode engine claim rooms from the prefill?",
    "Summarise the last test failure.",
    "Which file holds the page allocator?",
    "What does the router do when a server refuses?",
    "How is the KV cache split between device and host?",
]


def start(argv, what):
    """A child process and the URL it printed on its "listening on" line (a server prints its
    memory plan first)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while True:
        line = proc.stdout.readline()
        lines.append(line)
        if "listening on http://" in line:
            return proc, line.strip().rsplit(" ", 1)[1]
        if not line:
            proc.kill()
            sys.exit(f"demo-pd: {what} did not start: {''.join(lines)}")


def metrics(url):
    """[(name, {label: value}, value)] from a /metrics exposition."""
    out = []
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                name, _, labels = key.partition("{")
                pairs = [kv.split("=", 1) for kv in labels.rstrip("}").split(",") if kv]
                out.append((name, {k: v.strip('"') for k, v in pairs}, float(value)))
    return out


def total(samples, name):
    """The sum of every sample of `name`."""
    return sum(v for n, _, v in samples if n == name)


def by(samples, name, label):
    """{label value: sample} of `name`."""
    return {labels[label]: v for n, labels, v in samples if n == name}


def chat_stream(router, messages, max_tokens):
    """(TTFT s, e2e s, answer text, completion tokens) of one streamed chat through the router."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True,
                       "temperature": 0.7, "seed": 1}).encode()
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    req = urllib.request.Request(router + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is None and ttft is None:
                ttft = time.perf_counter() - t0
            text += choice.get("delta", {}).get("content", "")
            usage = chunk.get("usage", usage)
    return ttft, time.perf_counter() - t0, text, usage.get("completion_tokens", 0)


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the directory holding dsv4-server and dsv4-router")
    ap.add_argument("--model", required=True, help="a checkpoint directory with a tokenizer")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    binary = Path(args.bin)

    kv = {"page_size": 128, "device_memory_bytes": "16MiB", "max_running_requests": 8}
    base = {"model_path": args.model, "threads": 1, "kv": kv, "pd": {"listen": "tcp://127.0.0.1:0"}}
    procs = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            # The servers honour the router's PD fields (room, prefill endpoint) only with the
            # token they share with it.
            token = Path(tmp) / "router.token"
            token.write_text(secrets.token_urlsafe(32) + "\n")
            urls = {}
            for role in ("prefill", "decode"):
                conf = Path(tmp) / f"{role}.json"
                conf.write_text(json.dumps({**base, "role": role,
                                            "metrics": {"labels": {"engine": f"demo-{role}"}}}))
                proc, urls[role] = start([str(binary / "dsv4-server"), "--params", str(conf),
                                          "--port", "0", "--router-token-file", str(token)],
                                         f"the {role} server")
                procs.append(proc)
            proc, router = start([str(binary / "dsv4-router"), "--prefill", urls["prefill"],
                                  "--decode", urls["decode"], "--port", "0",
                                  "--router-token-file", str(token)], "the router")
            procs.append(proc)
            print(f"prefill {urls['prefill']}   decode {urls['decode']}   router {router}"
                  f"   (up in {time.perf_counter() - t_start:.1f} s)")
            print(f"workload: {args.users} users x {args.turns} turns of chat through the router, "
                  f"streamed, a shared {len(SYSTEM)}-character system prompt, "
                  f"{args.max_tokens} new tokens per turn")

            results, errors, sample = [], [], {}
            lock = threading.Lock()

            def user(u):
                messages = [{"role": "system", "content": SYSTEM}]
                for turn in range(args.turns):
                    messages.append({"role": "user",
                                     "content": QUESTIONS[(u + turn) % len(QUESTIONS)]})
                    try:
                        ttft, e2e, text, n = chat_stream(router, messages, args.max_tokens)
                    except Exception as e:  # reported, not raised: the summary counts them
                        with lock:
                            errors.append(str(e))
                        return
                    messages.append({"role": "assistant", "content": text})
                    with lock:
                        results.append((ttft, e2e, n))
                        sample.setdefault("text", (messages[-2]["content"], text))

            t0 = time.perf_counter()
            threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            ttfts = [r[0] * 1e3 for r in results if r[0] is not None]
            e2es = [r[1] * 1e3 for r in results]
            tokens = sum(r[2] for r in results)
            print(f"requests {len(results)} ok, {len(errors)} failed; {tokens} tokens in "
                  f"{wall:.2f} s ({tokens / wall:.1f} tok/s)")
            print(f"TTFT p50 {quantile(ttfts, 0.5):.1f} ms  p99 {quantile(ttfts, 0.99):.1f} ms;  "
                  f"e2e p50 {quantile(e2es, 0.5):.1f} ms  p99 {quantile(e2es, 0.99):.1f} ms")
            for e in errors[:3]:
                print(f"  failed: {e}")

            p, d, r = metrics(urls["prefill"]), metrics(urls["decode"]), metrics(router)
            for side, m in (("prefill", p), ("decode", d)):
                rooms = total(m, "dsv4_kv_transfer_requests_total")
                nbytes = total(m, "dsv4_kv_transfer_bytes_total")
                secs = total(m, "dsv4_kv_transfer_seconds_total")
                fails = {k: int(v) for k, v in by(m, "dsv4_kv_transfer_failures_total", "reason").items() if v}
                # claim → done includes the prefill computing the room (the decode claims at once).
                print(f"{side:7} rooms transferred {int(rooms)}, {nbytes / 2**20:.2f} MiB, "
                      f"claim → done {1e3 * secs / rooms if rooms else 0:.1f} ms per room; "
                      f"failures {fails or 'none'}")
            prompt = total(p, "dsv4_prompt_tokens_total")
            cached = total(p, "dsv4_cached_tokens_total")
            print(f"prefill prefix cache: {int(cached)} of {int(prompt)} prompt tokens reused "
                  f"({100 * cached / prompt if prompt else 0:.0f} %)")
            outcomes = by(r, "dsv4_router_requests_total", "outcome")
            print("router  requests " + ", ".join(f"{k} {int(v)}" for k, v in outcomes.items()))
            if "text" in sample:
                q, a = sample["text"]
                print(f"a turn: user {q!r} → {a[:80]!r}")
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            codes = [proc.wait(timeout=60) for proc in reversed(procs)]
        print(f"SIGTERM: router, decode, prefill exited {codes}; "
              f"demo-pd took {time.perf_counter() - t_start:.1f} s")
        if errors or any(codes) or not results:
            sys.exit(1)


if __name__ == "__main__":
    main()
