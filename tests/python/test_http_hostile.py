"""Hostile HTTP clients, written here on raw sockets, against dsv4-server and dsv4-router: slow
request heads (slowloris), bodies and texts too large to work on, rids and integers out of
range, bytes that are not UTF-8, ambiguous framing (request smuggling), pipelining, and clients
that leave. Every attack must end with a 4xx or a closed connection within its bound while the
server keeps serving, and the process's threads, descriptors and resident memory must come back
to where they were."""

import asyncio
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from test_router import PD, Router, servers, value, wait_until
from test_server import CONTEXT, GREEDY, PROMPT, Server, post_raw

MiB = 1 << 20


def process_counts(pid):
    """(threads, open descriptors, resident bytes) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(status.split("Threads:")[1].split()[0])
    rss = int(status.split("VmRSS:")[1].split()[0]) * 1024
    return threads, len(os.listdir(f"/proc/{pid}/fd")), rss


def baseline(target):
    """The process's counts once it has served a request (a server starts its signal thread
    just after its "listening" line, a router keeps a kept-alive connection per server)."""
    assert target.call("/health")[0] in (200, 503)
    time.sleep(0.2)
    return process_counts(target.proc.pid)


def settles(pid, before, what, timeout=20):
    """Waits until the process holds no more threads and descriptors than `before` and its RSS
    is within 64 MiB of it."""
    deadline = time.time() + timeout
    while True:
        now = process_counts(pid)
        if now[0] <= before[0] and now[1] <= before[1] and now[2] <= before[2] + 64 * MiB:
            return now
        if time.time() > deadline:
            pytest.fail(f"{what}: threads/fds/RSS {now} did not come back to {before}")
        time.sleep(0.1)


def raw(port, data, read=True, timeout=10):
    """Sends `data` on a fresh connection; the whole answer (until the server closes) or what
    came within `timeout`. A server may answer (and stop reading) before all of `data` is sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = b""
        if not read:
            return got
        try:
            while chunk := s.recv(65536):
                got += chunk
        except socket.timeout:
            pass
        return got


def post(path, body, extra=b"", close=True):
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s%s\r\n"
            % (path.encode(), len(payload), extra, b"Connection: close\r\n" if close else b"") + payload)


def status_of(answer):
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def json_of(answer):
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


@pytest.fixture
def server(tmp_path):
    # A 3 s head deadline keeps the slowloris test short; the default is 10 s.
    s = Server(tmp_path, args=["--head-timeout-ms", "3000"])
    yield s
    s.stop()


@pytest.fixture
def pair_and_router(tmp_path):
    (p,) = servers(tmp_path, "prefill", 1)
    (d,) = servers(tmp_path, "decode", 1)
    r = Router([p], [d], "--head-timeout-ms", "3000")
    yield p, d, r
    for s in (r, d, p):
        s.stop()


async def slowloris(port, n, interval, stop):
    """`n` connections each sending one byte of a request head every `interval` seconds until
    the server closes it or `stop` is set: how each ended (status, or "closed")."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for byte in head:
            if stop.is_set():
                break
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(4096), interval)
                writer.close()
                return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                return "closed"
        writer.close()
        return "gave up"

    return await asyncio.gather(*(one() for _ in range(n)))


def attack_with_slowloris(target, legit):
    """300 slowloris connections against `target` (a Server or Router); while they hold, /health
    answers within a second and `legit()` succeeds; each is cut at the head deadline (408 or a
    close); afterwards threads, fds and RSS come back."""
    pid = target.proc.pid
    legit()  # connections a legitimate request leaves open (a router's pool) count as before
    before = baseline(target)
    stop = threading.Event()
    result = {}
    t = threading.Thread(target=lambda: result.update(
        ends=asyncio.run(slowloris(target.port, 300, 1.0, stop))))
    t0 = time.time()
    t.start()
    time.sleep(1.5)  # all connected, each a byte or two into its head
    assert process_counts(pid)[0] > before[0] + 100, "the slowloris connections did not arrive"
    for _ in range(3):
        t1 = time.time()
        status, _, body = target.json("/health")
        assert time.time() - t1 < 1.0, "a /health took a second or more under slowloris"
    legit()
    t.join(timeout=30)
    stop.set()
    took = time.time() - t0
    ends = result["ends"]
    assert set(ends) <= {"408", "closed"} and len(ends) == 300, {e: ends.count(e) for e in set(ends)}
    assert ends.count("408") >= 250, ends
    assert took < 3.0 + 4.0, f"the head deadline (3 s) cut them only after {took:.1f} s"
    settles(pid, before, "after the slowloris attack")


def test_slowloris_is_cut_at_the_head_deadline_and_the_server_keeps_serving(server):
    def legit():
        status, _, body = server.json("/generate", {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 3, **GREEDY}})
        assert status == 200 and len(body["output_ids"]) == 3, body

    attack_with_slowloris(server, legit)


def test_slowloris_against_the_router(pair_and_router):
    p, d, r = pair_and_router

    def legit():
        status, _, body = r.json("/generate", {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 3, **GREEDY}})
        assert status == 200 and len(body["output_ids"]) == 3, body

    attack_with_slowloris(r, legit)


def test_bodies_and_texts_too_large_are_refused_before_any_work(server):
    """A 20 MB text, 100 MB of input_ids (announced, never sent) and a chunked body past the
    limit: 413 at once from the HTTP layer; a text, ids or a chat within the body limit but
    beyond what the context could hold: 413 before tokenizing or rendering."""
    pid = server.proc.pid
    before = baseline(server)
    t = time.time()
    answer = raw(server.port, post("/generate", {"text": "x" * (20 * MiB)}))
    assert status_of(answer) == 413 and "--max-body-bytes" in json_of(answer)["error"]["message"], answer[:300]
    # Announced, not sent: refused from Content-Length alone.
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 104857600\r\n\r\n{\"input_ids\": [")
    answer = raw(server.port, head)
    assert status_of(answer) == 413, answer[:300]
    # Chunked: refused when the chunks pass the limit.
    chunk = b"x" * (256 << 10)
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8))
    answer = raw(server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert status_of(answer) == 413, answer[:300]
    assert time.time() - t < 3, "refusing large bodies took seconds"
    # Within the body limit (1 MiB for this 4096-token context), beyond the context.
    status, _, err = server.json("/generate", {"text": "ab " * 20000})
    assert status == 413 and "--max-text-bytes" in err["error"]["message"], err
    status, _, err = server.json("/generate", {"input_ids": [5] * CONTEXT})
    assert status == 413 and "the context holds 4096 tokens" in err["error"]["message"], err
    status, _, err = server.json("/v1/chat/completions", {"messages": [{"role": "system", "content": "x" * 20}] * 5000})
    assert status == 413 and "--max-messages" in err["error"]["message"], err
    # SGLang's chat of 20k system messages, 4.7 MB: past the body limit, refused before parsing.
    answer = raw(server.port, post("/v1/chat/completions", {"messages": [{"role": "system", "content": "s" * 200}] * 20000}))
    assert status_of(answer) == 413, answer[:300]
    settles(pid, before, "after the large bodies")


def test_a_chat_of_many_system_messages_renders_in_linear_time(tmp_path):
    """Rendering a chat is linear in its messages (the fixture's template accumulates system
    prompts; rendered natively). 4000 system messages render and answer quickly."""
    s = Server(tmp_path, args=["--max-body-bytes", str(8 * MiB), "--max-text-bytes", str(4 * MiB)])
    try:
        messages = [{"role": "system", "content": "s" * 200}] * 4000 + [{"role": "user", "content": "hi"}]
        t = time.time()
        status, _, body = s.json("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        # 800 KB of system prompt tokenizes to more than the 4096-token context: the engine's
        # refusal, after rendering and tokenizing, in well under a second each.
        assert status in (200, 413), body
        assert time.time() - t < 5
    finally:
        s.stop()


def test_rids_integers_and_utf8_are_checked(server, pair_and_router):
    p, d, r = pair_and_router
    for target, limit in ((server, 256), (r, 240)):
        status, _, err = target.json("/abort_request", {"rid": "x" * (10 * MiB)})
        assert status in (400, 413), err
        status, _, err = target.json("/abort_request", {"rid": "x" * (limit + 1)})
        assert status == 400 and f"{limit} bytes" in err["error"]["message"], err
        # Invalid UTF-8: a 400 with a JSON body naming the byte, never a 500.
        answer = raw(target.port, post("/generate", b'{"text": "caf\xe9 ok"}'))
        assert status_of(answer) == 400, answer
        assert json_of(answer)["error"]["message"].startswith("the body is not valid UTF-8: byte 13"), answer
    cases = [({"max_new_tokens": -1}, "max_new_tokens = -1 is outside [1, 4096]"),
             ({"max_new_tokens": 4294967296}, "max_new_tokens = 4294967296 is outside [1, 4096]"),
             ({"max_new_tokens": 5000}, "max_new_tokens = 5000 is outside [1, 4096]"),
             ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer in [1, 4096], got 2.5"),
             ({"top_k": 10 ** 12}, "top_k = 1000000000000 is outside [-1, 384]"),
             ({"seed": -3}, "seed must be an integer in [0, 18446744073709551615], got -3"),
             ({"temperature": 1000}, "temperature must be a number in [0, 100], got 1000"),
             ({"stop_token_ids": [2 ** 40]}, "stop_token_ids[0] = 1099511627776 is not a token id in [0, 383]")]
    for sampling, want in cases:
        status, _, err = server.json("/generate", {"input_ids": PROMPT, "sampling_params": sampling})
        assert status == 400 and err["error"]["message"].startswith(want), (sampling, err)
    status, _, err = server.json("/v1/completions", {"prompt": PROMPT, "max_tokens": -5})
    assert status == 400 and "max_tokens = -5 is outside [1, 4096]" in err["error"]["message"], err
    status, _, err = server.json("/generate", {"input_ids": [1, -2]})
    assert status == 400 and "input_ids[1] = -2 is not a token id" in err["error"]["message"], err


def test_the_router_refuses_large_bodies_and_ambiguous_framing_at_once(pair_and_router):
    p, d, r = pair_and_router
    before = baseline(r)
    answer = raw(r.port, post("/generate", {"text": "x" * (20 * MiB)}))
    assert status_of(answer) == 413 and "--max-body-bytes" in json_of(answer)["error"]["message"], answer[:300]
    # SGLang's chat of 20k system messages, 4.7 MB: within the router's 16 MiB, refused by the
    # server's smaller body limit, passed on.
    chat = {"messages": [{"role": "system", "content": "s" * 200}] * 20000}
    status, _, err = r.json("/v1/chat/completions", chat)
    assert status == 413, err
    n = b"%d" % len(b'{"input_ids": [5, 17]}')
    for extra in (b"Content-Length: " + n + b"\r\nContent-Length: 5\r\n",
                  b"Content-Length: " + n + b"\r\nTransfer-Encoding: chunked\r\n",
                  b"Content-Length: " + n + b"\r\nRange: bytes=0-3\r\n"):
        answer = raw(r.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n" + b'{"input_ids": [5, 17]}')
        assert status_of(answer) == 400, (extra, answer)
    assert p.json("/health")[0] == 200 and value(p, "dsv4_num_requests_total") in (None, 0)
    settles(r.proc.pid, before, "the router after large bodies and bad framing")


def test_ambiguous_framing_is_refused_and_pipelining_is_answered_in_order(server):
    def framed(extra, body=b'{"input_ids": [5, 17]}'):
        return raw(server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n" + body)

    n = b"%d" % len(b'{"input_ids": [5, 17]}')
    for extra, why in ((b"Content-Length: " + n + b"\r\nContent-Length: 5\r\n", None),
                       (b"Content-Length: " + n + b"\r\nContent-Length: " + n + b"\r\n", "more than one Content-Length"),
                       (b"Content-Length: " + n + b"\r\nTransfer-Encoding: chunked\r\n", None),
                       (b"Transfer-Encoding: gzip\r\nContent-Length: " + n + b"\r\n", None),
                       (b"Content-Length: " + n + b"\r\nRange: bytes=0-3\r\n", "a Range header on POST")):
        answer = framed(extra)
        assert status_of(answer) == 400, (extra, answer)
        if why:
            assert why in json_of(answer)["error"]["message"], answer
        assert b"Connection: close" in answer.split(b"\r\n\r\n")[0]
    # Three requests in one write: three answers, in order, then the close the last asked for.
    one = post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, **GREEDY}}, close=False)
    answer = raw(server.port, one + post("/abort_request", {"rid": "nothing"}, close=False) +
                 b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    parts = answer.split(b"HTTP/1.1 ")[1:]
    assert [p[:3] for p in parts] == [b"200", b"200", b"200"], answer
    assert b"output_ids" in parts[0] and b'"aborted":false' in parts[1] and b'"state":"ready"' in parts[2], answer


def test_the_router_drops_a_departed_clients_calls(pair_and_router):
    """A non-streaming request through the router whose client leaves: the router drops both
    calls within a second or so (the decode server aborts the request), and its threads and fds
    come back (before: a thread and two fds held until --timeout, an hour)."""
    p, d, r = pair_and_router
    status, _, _ = r.json("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert status == 200
    before = baseline(r)
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": CONTEXT - len(PROMPT) - 8, **GREEDY}}
    c = post_raw(r.port, "/generate", long)
    wait_until("the request is not running", lambda: value(d, "dsv4_num_running_reqs") == 1)
    c.close()
    t = time.time()
    wait_until("the decode kept generating for a client that left", lambda: value(
        d, "dsv4_num_finished_requests_total", finish_reason="aborted") == 1, timeout=10)
    assert time.time() - t < 3
    wait_until("the router still counts calls in flight", lambda: value(r, "dsv4_router_calls_in_flight") == 0)
    assert value(r, "dsv4_router_requests_total", outcome="client_gone") == 1
    settles(r.proc.pid, before, "the router after its client left")
