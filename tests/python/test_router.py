"""dsv4-router (examples/router/dsv4_router.cpp) in front of real dsv4-server processes in the
prefill and decode roles, over loopback: round robin over two of each, tokens equal to a unified
engine's (whole and streamed), a refusal on one side reaching the client as its status while the
other side's half is aborted, a client that disconnects, the router's /health and /metrics, and
`make demo-pd`'s script."""

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_metrics import promtool_check
from test_server import (CONTEXT, FIXTURE, GREEDY, PROMPT, Server, engine, post_raw,  # noqa: F401
                         server_binary, shared_token, sse_events, token_file)

PD = {"listen": "tcp://127.0.0.1:0"}


def router_binary():
    return server_binary().parent / "dsv4-router"


class Router:
    """A dsv4-router over `prefills` and `decodes`, with their router token (unless `extra`
    passes one)."""

    def __init__(self, prefills, decodes, *extra):
        token = [] if "--router-token-file" in extra else ["--router-token-file", str(shared_token()[0])]
        argv = [str(router_binary()), "--prefill", *[s.url for s in prefills],
                "--decode", *[s.url for s in decodes], "--port", "0", *token, *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        line = self.proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + self.proc.stdout.read()
        self.port = int(line.rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        # The same client calls as a server's.
        self.call = Server.call.__get__(self)
        self.json = Server.json.__get__(self)

    def stop(self):
        """Stops the router; what it printed since it started listening (its log)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        return self.proc.stdout.read()


def samples(text):
    """{(name, sorted label items): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(server, name, **labels):
    return samples(server.call("/metrics")[2]).get((name, tuple(sorted(labels.items()))))


def holds_nothing(server):
    """No request queued or running, no PD room waiting or in flight, no page held for one."""
    return all(value(server, name) == 0 for name in (
        "dsv4_num_queue_reqs", "dsv4_num_running_reqs", "dsv4_pd_pages_held",
        "dsv4_num_prefill_bootstrap_queue_reqs", "dsv4_num_prefill_inflight_queue_reqs",
        "dsv4_num_decode_prealloc_queue_reqs", "dsv4_num_decode_transfer_queue_reqs"))


def read_events(sock, n):
    """Reads a streamed response off `sock` until `n` events have come."""
    got = b""
    while got.count(b"data:") < n:
        chunk = sock.recv(4096)
        if not chunk:
            pytest.fail(f"the stream closed early: {got!r}")
        got += chunk


def wait_until(what, cond, timeout=30):
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            pytest.fail(what)
        time.sleep(0.05)


def servers(tmp_path, role, n, **extra):
    out = []
    for i in range(n):
        d = tmp_path / f"{role}{i}"
        d.mkdir()
        out.append(Server(d, role=role, pd=PD, **extra))
    return out


@pytest.fixture
def pair(tmp_path):
    """One prefill server, one decode server and a router over them."""
    (p,), (d,) = servers(tmp_path, "prefill", 1), servers(tmp_path, "decode", 1)
    r = Router([p], [d])
    yield p, d, r
    for s in (r, d, p):
        s.stop()


def test_two_of_each_take_turns_and_give_the_unified_tokens(tmp_path, engine):
    prefills, decodes = servers(tmp_path, "prefill", 2), servers(tmp_path, "decode", 2)
    # One poll, at start (all idle): between polls only the router's own open calls change a
    # server's load, so these sequential requests see equal loads.
    r = Router(prefills, decodes, "--poll-ms", "60000")
    try:
        prompts = [PROMPT, PROMPT[::-1], [7, 7, 7, 200, 31], PROMPT + [3, 4]]
        for prompt in prompts:
            status, _, body = r.json("/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 5, **GREEDY}})
            assert status == 200, body
            assert body["output_ids"] == list(engine.generate(prompt, max_new_tokens=5, **GREEDY))
            assert body["meta_info"]["finish_reason"] == {"type": "length"}
            # Its calls' threads end just after the answer: until then their servers look busier.
            wait_until("calls still open", lambda: value(r, "dsv4_router_calls_in_flight") == 0)
        # Idle servers of equal load take turns: two requests each; each room moved once,
        # counted on both sides.
        for role, group in (("prefill", prefills), ("decode", decodes)):
            for s in group:
                assert value(r, "dsv4_router_server_requests_total", role=role, url=s.url) == 2
                assert value(s, "dsv4_kv_transfer_requests_total") == 2
        for s in prefills:
            assert value(s, "dsv4_num_finished_requests_total", finish_reason="transferred") == 2
        assert value(r, "dsv4_router_requests_total", outcome="ok") == 4
        # Streamed through the router: the decode's server-sent events, token by token.
        want = list(engine.generate(PROMPT, max_new_tokens=4, **GREEDY))
        events = sse_events(r.port, "/generate", {"input_ids": PROMPT, "stream": True,
                                                  "sampling_params": {"max_new_tokens": 4, **GREEDY}})
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["output_ids"] for c in chunks[:-1]] == [want[:i + 1] for i in range(4)]
        # The OpenAI endpoints go through the same way.
        status, _, body = r.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **GREEDY})
        assert status == 200 and body["choices"][0]["text"] == engine.detokenize(want), body
        status, text = r.call("/health")[0], r.call("/health")[2]
        health = json.loads(text)
        assert status == 200 and len(health["prefill"]) == 2 and len(health["decode"]) == 2
        assert all(s["state"] == "ready" for s in health["prefill"] + health["decode"]), health
        promtool_check(r.call("/metrics")[2])
    finally:
        for s in [r] + decodes + prefills:
            s.stop()


def test_a_refusal_by_the_prefill_reaches_the_client_and_aborts_the_decode(tmp_path, engine):
    (p,) = servers(tmp_path, "prefill", 1, admission={"max_queued_tokens": 4})
    (d,) = servers(tmp_path, "decode", 1)
    r = Router([p], [d])
    try:
        t0 = time.time()
        status, headers, body = r.json("/generate", {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 5, **GREEDY}})
        # The prefill's own 429, at once, not the decode's timeout 30 s later.
        assert status == 429 and headers["Retry-After"] == "1", body
        assert body["error"]["status"] == "DSV4_ERR_QUEUE_FULL"
        assert "max_queued_tokens" in body["error"]["message"]
        assert time.time() - t0 < 10
        # The decode's half was aborted (before or after it was submitted) and holds nothing.
        # If the abort came first, the decode answered it without running the request (no
        # finished request there); either way the decode holds nothing.
        wait_until("the decode's half still holds its room", lambda: holds_nothing(d))
        assert value(r, "dsv4_router_requests_total", outcome="refused_by_prefill") == 1
        # A request both refuse: one side's 400 reaches the client.
        status, _, body = r.json("/generate", {"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 3, "temperature": -1}})
        assert status == 400 and body["error"]["status"] == "DSV4_ERR_INVALID_ARGUMENT", body
        status, _, body = r.json("/generate", raw=b"[1, 2]")
        assert status == 400 and "JSON object" in body["error"]["message"]
    finally:
        for s in (r, d, p):
            s.stop()


def test_the_decode_refusing_aborts_the_prefills_half(tmp_path):
    (p,) = servers(tmp_path, "prefill", 1)
    (d,) = servers(tmp_path, "decode", 1, admission={"max_queued_tokens": 4})
    r = Router([p], [d])
    try:
        status, _, body = r.json("/generate", {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 5, **GREEDY}})
        assert status == 429 and body["error"]["status"] == "DSV4_ERR_QUEUE_FULL", body
        # Without the abort the prefill would hold the room's pages for pd.bootstrap_timeout_ms.
        # (An abort that beats the request there answers it without running it.)
        wait_until("the prefill still holds the room", lambda: holds_nothing(p))
        assert value(r, "dsv4_router_requests_total", outcome="refused_by_decode") == 1
    finally:
        for s in (r, d, p):
            s.stop()


def test_a_client_that_disconnects_aborts_the_decode(pair):
    p, d, r = pair
    long = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": CONTEXT, **GREEDY}}
    with post_raw(r.port, "/generate", long) as c:
        read_events(c, 3)
    wait_until("the decode kept generating for a client that left", lambda: value(
        d, "dsv4_num_finished_requests_total", finish_reason="aborted") == 1
        and value(d, "dsv4_num_running_reqs") == 0)
    assert value(p, "dsv4_num_finished_requests_total", finish_reason="transferred") == 1
    wait_until("the router still counts calls in flight",
               lambda: value(r, "dsv4_router_calls_in_flight") == 0)


def test_sigterm_lets_a_stream_in_flight_finish(pair, engine):
    """SIGTERM while a stream is open: new requests get 503, the stream ends whole with
    [DONE], then the router exits 0."""
    p, d, r = pair
    n = 400
    result = {}
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": n, **GREEDY}}
    t = threading.Thread(target=lambda: result.update(events=sse_events(r.port, "/generate", body)))
    t.start()
    wait_until("the stream did not start", lambda: value(d, "dsv4_num_running_reqs") == 1)
    r.proc.send_signal(signal.SIGTERM)
    wait_until("the router did not start draining", lambda: "draining" in (r.proc.stdout.readline() or "draining"))
    status, _, err = r.json("/generate", {"input_ids": PROMPT})
    assert status == 503 and "shutting down" in err["error"]["message"], err
    t.join(timeout=120)
    events = result["events"]
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["meta_info"]["completion_tokens"] == n
    assert r.proc.wait(timeout=60) == 0


def test_health_follows_the_servers_and_sigterm_exits_0(pair):
    p, d, r = pair
    assert r.call("/health")[0] == 200
    d.stop()
    status, _, body = r.json("/health")
    assert status == 503 and body["decode"][0]["state"] == "unreachable", body
    # A request whose decode server is gone: 502 naming its role (the router's log names the
    # server; a client learns no internal endpoint), and the prefill's half aborted.
    status, _, body = r.json("/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 2, **GREEDY}})
    assert status == 502 and "the decode server did not answer" in body["error"]["message"], body
    assert "127.0.0.1" not in json.dumps(body), body
    wait_until("the prefill's half still holds its room", lambda: holds_nothing(p))
    r.proc.send_signal(15)
    assert r.proc.wait(timeout=30) == 0
    log = r.proc.stdout.read()
    assert "SIGTERM: draining" in log and f"decode server {d.url} did not answer" in log, log


def test_a_busy_decode_server_is_passed_over(tmp_path, engine):
    """Least loaded first: while one decode server holds a long stream (its load: the router's
    open call, then its running request at the next poll), new requests go to the other."""
    (p,) = servers(tmp_path, "prefill", 1)
    decodes = servers(tmp_path, "decode", 2)
    r = Router([p], decodes, "--poll-ms", "100")
    try:
        long = {"input_ids": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": CONTEXT, **GREEDY}}
        with post_raw(r.port, "/generate", long) as c:
            read_events(c, 2)
            wait_until("no decode server shows the stream running", lambda: sum(
                value(d, "dsv4_num_running_reqs") for d in decodes) == 1)
            busy = [d for d in decodes if value(d, "dsv4_num_running_reqs") == 1]
            (idle,) = [d for d in decodes if d is not busy[0]]
            # Its running request seen by a poll (load: that + the router's open call).
            wait_until("the poll did not see the busy server's request", lambda: value(
                r, "dsv4_router_server_load", role="decode", url=busy[0].url) >= 2)
            before = value(r, "dsv4_router_server_requests_total", role="decode", url=busy[0].url)
            for i in range(6):
                status, _, body = r.json("/generate", {"input_ids": PROMPT[i:], "sampling_params": {
                    "max_new_tokens": 3, **GREEDY}})
                assert status == 200, body
                assert body["output_ids"] == list(engine.generate(PROMPT[i:], max_new_tokens=3,
                                                                  **GREEDY))
                # Only the long stream's call left open (the others' threads end just after).
                wait_until("calls still open", lambda: value(r, "dsv4_router_calls_in_flight") == 1)
            assert value(r, "dsv4_router_server_requests_total", role="decode",
                         url=busy[0].url) == before
            assert value(r, "dsv4_router_server_requests_total", role="decode", url=idle.url) == 6
            assert value(r, "dsv4_router_server_load", role="decode", url=busy[0].url) >= 1
    finally:
        for s in [r] + decodes + [p]:
            s.stop()


def test_a_429_is_tried_on_another_server_and_a_dead_one_leaves_the_rotation(tmp_path, engine):
    """Two prefill servers, one refusing every prompt (429): each request still gets the
    unified tokens, tried again on the other. Two decode servers, one killed mid-workload: the
    request that finds it gone is tried on the other, /health takes it out of rotation, and a
    server stopped (SIGSTOP) and resumed leaves the rotation and comes back."""
    refusing = servers(tmp_path, "prefill", 1, admission={"max_queued_tokens": 4})
    (tmp_path / "ok").mkdir()
    prefills = refusing + [Server(tmp_path / "ok", role="prefill", pd=PD)]
    decodes = servers(tmp_path, "decode", 2)
    r = Router(prefills, decodes, "--poll-ms", "100", "--retries", "2")
    try:
        def generate(i):
            prompt = PROMPT[i % 4:] + [i + 2]
            status, _, body = r.json("/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 3, **GREEDY}})
            assert status == 200, body
            assert body["output_ids"] == list(engine.generate(prompt, max_new_tokens=3, **GREEDY))

        for i in range(4):
            generate(i)
        assert value(r, "dsv4_router_retries_total") >= 1
        assert value(refusing[0], "dsv4_num_rejected_requests_total", reason="queue_full") >= 1
        # A decode server killed: requests keep succeeding, and it leaves the rotation.
        dead = decodes[0]
        dead.proc.kill()
        dead.proc.wait(timeout=30)
        for i in range(4, 10):
            generate(i)
        wait_until("the dead server is still in rotation", lambda: value(
            r, "dsv4_router_server_up", role="decode", url=dead.url) == 0)
        status, _, health = r.json("/health")
        assert status == 503 and any(s["state"] == "unreachable" for s in health["decode"])
        # Stopped, it leaves the rotation; resumed, it comes back and takes requests again.
        live = decodes[1]
        live.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until("a stopped server is still in rotation", lambda: value(
                r, "dsv4_router_server_up", role="decode", url=live.url) == 0)
        finally:
            live.proc.send_signal(signal.SIGCONT)
        wait_until("a resumed server did not come back", lambda: value(
            r, "dsv4_router_server_up", role="decode", url=live.url) == 1)
        for i in range(10, 12):
            generate(i)
    finally:
        for s in [r] + decodes + prefills:
            s.stop()


def test_the_router_refuses_a_server_of_the_wrong_role(pair):
    p, d, _ = pair
    proc = subprocess.run([str(router_binary()), "--prefill", d.url, "--decode", d.url,
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"{d.url} is a decode server, but was given as --prefill" in proc.stderr, proc.stderr
    proc = subprocess.run([str(router_binary()), "--prefill", p.url], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--decode" in proc.stderr


def test_the_demo_pd_script_runs_on_a_checkpoint():
    """`make demo-pd`'s script, on the fixture (the demo uses the tiny model)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "demo_pd.py"
    proc = subprocess.run([sys.executable, str(script), "--bin", str(server_binary().parent),
                           "--model", str(FIXTURE), "--users", "2", "--turns", "2",
                           "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "requests 4 ok, 0 failed" in proc.stdout, proc.stdout
    assert "prefill rooms transferred 4" in proc.stdout and "decode  rooms transferred 4" in \
        proc.stdout, proc.stdout
    assert "exited [0, 0, 0]" in proc.stdout


def read_stream(sock, data=b""):
    """(events, ended): the data payloads of a streamed answer read off `sock` to its close
    (after `data`, what was read of it before), and whether the chunked body ended with its last
    chunk (not cut off)."""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    text, ended = b"", False
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            ended = True
            break
        text += rest[:n]
        rest = rest[n + 2:]
    return [e[len("data: "):] for e in text.decode().split("\n\n") if e], ended


def test_a_killed_decode_ends_streams_properly_and_a_restarted_one_serves_again(tmp_path, engine):
    """The operator's replay: a PD pair with HiCache behind the router, streams open, the decode
    killed. Every stream ends with an error event in its endpoint's shape and [DONE] (no
    truncated body); requests while it is down get 502/503, never 500; the decode restarted on
    its port is back in rotation and serves the unified engine's tokens."""
    (p,) = servers(tmp_path, "prefill", 1, hicache={"enabled": True, "ratio": 2.0})
    (d,) = servers(tmp_path, "decode", 1)
    r = Router([p], [d], "--poll-ms", "100")
    try:
        long_sglang = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": CONTEXT, **GREEDY}}
        long_openai = {"prompt": PROMPT, "stream": True, "max_tokens": CONTEXT, **GREEDY}
        socks = [(post_raw(r.port, "/generate", long_sglang, close=True), "sglang"),
                 (post_raw(r.port, "/v1/completions", long_openai, close=True), "openai")]
        started = []
        for s, _ in socks:
            got = b""
            while got.count(b"data:") < 2:
                got += s.recv(4096)
            started.append(got)
        d.proc.kill()
        d.proc.wait(timeout=30)
        for (s, shape), got in zip(socks, started):
            events, ended = read_stream(s, got)
            s.close()
            assert ended and events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            if shape == "sglang":
                assert last["meta_info"]["finish_reason"]["type"] == "abort", last
                assert "mid-stream" in last["meta_info"]["finish_reason"]["message"]
            else:
                assert last["error"]["code"] == 502 and "mid-stream" in last["error"]["message"], last
        assert value(r, "dsv4_router_broken_streams_total") == 2
        for _ in range(3):
            status, _, body = r.json("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            assert status in (502, 503), (status, body)
        wait_until("the dead decode is still in rotation",
                   lambda: value(r, "dsv4_router_server_up", role="decode", url=d.url) == 0)
        # Restarted on its port: back in rotation at the next poll, and serving.
        (tmp_path / "again").mkdir()
        again = Server(tmp_path / "again", args=["--port", str(d.port)], role="decode", pd=PD)
        try:
            wait_until("the restarted decode did not come back",
                       lambda: value(r, "dsv4_router_server_up", role="decode", url=d.url) == 1)
            status, _, body = r.json("/generate", {"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 5, **GREEDY}})
            assert status == 200 and body["output_ids"] == list(engine.generate(PROMPT, max_new_tokens=5, **GREEDY))
        finally:
            again.stop()
    finally:
        for s in (r, d, p):
            s.stop()


def test_a_burst_through_the_router_gets_200_or_429(tmp_path):
    """150 streaming completions at once through the router to a pair that admits few: each
    ends whole (200, [DONE]) or as a 429 with Retry-After, never a reset, a 502 or a cut."""
    import asyncio
    import importlib.util
    import random
    spec = importlib.util.spec_from_file_location(
        "bench_burst", Path(__file__).resolve().parents[2] / "scripts" / "bench_burst.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = {"kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128},
             "admission": {"max_queued_requests": 8}}
    (p,) = servers(tmp_path, "prefill", 1, **small)
    (d,) = servers(tmp_path, "decode", 1, **small)
    r = Router([p], [d])
    try:
        rng = random.Random(3)
        prefix = [rng.randrange(2, 300) for _ in range(200)]

        async def go():
            bodies = [{"prompt": prefix + [rng.randrange(2, 300) for _ in range(20)], "max_tokens": 8,
                       "stream": True, "temperature": 0, "ignore_eos": True} for _ in range(150)]
            return await asyncio.gather(*(bench.one(r.port, b, 120) for b in bodies))

        outcomes = asyncio.run(go())
        assert set(outcomes) <= {"200", "429"}, [o for o in outcomes if o not in ("200", "429")]
        # Each side admits 12 (4 running, 8 queued) of the 150, not always the same ones.
        assert outcomes.count("200") >= 1 and outcomes.count("429") >= 100, outcomes
    finally:
        for s in (r, d, p):
            s.stop()


def test_the_router_answers_model_discovery_as_its_servers_do(tmp_path):
    """/v1/models names the decode servers' --served-model-name; SGLang's /model_info and
    /get_model_info are a decode server's own answer; /get_server_info is /server_info."""
    (p,) = servers(tmp_path, "prefill", 1)
    d_dir = tmp_path / "decode0"
    d_dir.mkdir()
    d = Server(d_dir, args=["--served-model-name", "tiny-v4"], role="decode", pd=PD)
    r = Router([p], [d])
    try:
        status, _, models = r.json("/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny-v4"], models
        for path in ("/model_info", "/get_model_info"):
            status, _, got = r.json(path)
            assert status == 200 and got == d.json(path)[2] and got["served_model_name"] == "tiny-v4", got
        status, _, info = r.json("/get_server_info")
        assert status == 200 and info == r.json("/server_info")[2] and info["role"] == "router", info
    finally:
        for s in (r, d, p):
            s.stop()
