"""dsv4-server (examples/server/dsv4_server.cpp, installed next to the library) over real HTTP:
the SGLang-native and OpenAI APIs against the same engine run in-process, SSE streams read off
a raw socket, the error mapping, an abort when a client disconnects, and a SIGTERM drain."""

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import dsv4

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flash-like" / "hf-f32-text"
PROMPT = [5, 17, 300, 2, 9, 44, 81, 120]
# The fixture's context (model_info's context_limit): the most tokens a request may ask for, and
# the length of a request that runs "as long as the context allows" (about a second here).
CONTEXT = 4096
GREEDY = {"temperature": 0, "ignore_eos": True}


def params(**extra):
    p = {"model_path": str(FIXTURE), "threads": 2,
         "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128}}
    p.update(extra)
    return p


def server_binary():
    """Next to the library under test: <prefix>/lib/libdsv4.so.N → <prefix>/bin/dsv4-server."""
    lib = os.environ.get("DSV4_LIBRARY")
    assert lib, "DSV4_LIBRARY is unset: run through `make test-python`, which installs the server"
    path = Path(lib).resolve().parent.parent / "bin" / "dsv4-server"
    assert path.is_file(), f"{path} is missing: `make install` builds it"
    return path


def token_file(directory):
    """A router token file (what --router-token-file takes) in `directory`, and its token."""
    token = "t0k3n-" + os.urandom(16).hex()
    path = directory / "router.token"
    path.write_text(token + "\n")
    return path, token


_SHARED_TOKEN = []


def shared_token():
    """(file, token): the router token every PD server of this test run is started with (unless a
    test passes its own options), so any router over them can use it."""
    if not _SHARED_TOKEN:
        _SHARED_TOKEN.append(token_file(Path(tempfile.mkdtemp(prefix="dsv4-token-"))))
    return _SHARED_TOKEN[0]


def start_lines(proc, what):
    """The lines a server or router prints up to and including its "listening on" line."""
    lines = []
    while True:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"{what} exited before listening:\n" + "".join(lines))
        lines.append(line)
        if "listening on http://" in line:
            return lines


class Server:
    """A dsv4-server on a free port; `args` are extra command-line options. In a PD role it takes
    PD fields from requests carrying `self.token` (its --router-token-file), unless
    `router_token` is false or `args` has --trust-pd-fields."""

    def __init__(self, tmp_path, args=(), router_token=True, **extra):
        conf = tmp_path / "params.json"
        conf.write_text(json.dumps(params(**extra)))
        args = list(args)
        self.token_file, self.token = None, None
        if router_token and extra.get("role") in ("prefill", "decode") and "--trust-pd-fields" not in args:
            self.token_file, self.token = shared_token()
            args += ["--router-token-file", str(self.token_file)]
        self.proc = subprocess.Popen([str(server_binary()), "--params", str(conf), "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.start_lines = start_lines(self.proc, "dsv4-server")
        self.port = int(self.start_lines[-1].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, path, body=None, raw=None, headers=None):
        """(status, headers, parsed JSON body) of one request."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.headers, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read().decode()

    def json(self, path, body=None, raw=None, headers=None):
        status, headers, text = self.call(path, body, raw, headers)
        return status, headers, json.loads(text)

    def routed(self, path, body):
        """A request as the router sends it: with this server's router token."""
        return self.json(path, body, headers={"X-DSV4-Router-Token": self.token})

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine():
    with dsv4.Engine(params()) as e:
        yield e


def post_raw(port, path, body, close=False):
    """A socket with a POST of `body` (JSON) written to it, for the caller to read or drop."""
    payload = json.dumps(body).encode()
    c = socket.create_connection(("127.0.0.1", port), timeout=60)
    c.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n%s\r\n" % (path.encode(), len(payload),
                                                   b"Connection: close\r\n" if close else b"")
              + payload)
    return c


def wait_for_metrics(server, lines, what):
    """Polls /metrics until every one of `lines` (whole sample lines) is there."""
    deadline = time.time() + 30
    while True:
        m = server.call("/metrics")[2]
        if all("\n" + line + "\n" in m for line in lines):
            return
        if time.time() > deadline:
            pytest.fail(f"{what}:\n{m}")
        time.sleep(0.05)


def sse_events(port, path, body):
    """The `data:` payloads of a streamed response, read off a raw socket (no HTTP library)."""
    with post_raw(port, path, body, close=True) as s:
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"text/event-stream" in head, head
    if b"transfer-encoding: chunked" not in head.lower():  # a whole body (Content-Length)
        return [e[len("data: "):] for e in rest.decode().split("\n\n") if e]
    # Chunked transfer encoding: size line, data, CRLF.
    text = b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        text += rest[:n]
        rest = rest[n + 2:]
    return [e[len("data: "):] for e in text.decode().split("\n\n") if e]


def test_health_and_metrics(server):
    status, _, body = server.json("/health")
    assert status == 200 and body == {"state": "ready", "reason": "ready: 0 requests in flight"}
    status, headers, text = server.call("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "\ndsv4_engine_state 1\n" in text


def test_generate_matches_the_engine(server, engine):
    want = engine.generate(PROMPT, max_new_tokens=6, **GREEDY)
    status, _, body = server.json("/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert status == 200, body
    assert body["output_ids"] == list(want)
    assert body["text"] == engine.detokenize(list(want))
    assert body["meta_info"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 6,
                                 "cached_tokens": 0, "finish_reason": {"type": "length"},
                                 "id": body["meta_info"]["id"]}
    assert body["meta_info"]["id"].startswith("cmpl-")
    # Text in: tokenized with the special tokens (BOS), like SGLang.
    text = "Hello, world!"
    ids = engine.tokenize(text, add_special=True)
    status, _, body = server.json("/generate", {"text": text, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert status == 200 and body["meta_info"]["prompt_tokens"] == len(ids)
    assert body["output_ids"] == list(engine.generate(ids, max_new_tokens=4, **GREEDY))


def test_generate_streams_server_sent_events(server, engine):
    want = list(engine.generate(PROMPT, max_new_tokens=5, **GREEDY))
    events = sse_events(server.port, "/generate", {"input_ids": PROMPT, "stream": True,
                                                   "sampling_params": {"max_new_tokens": 5, **GREEDY}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["output_ids"] for c in chunks[:-1]] == [want[:i + 1] for i in range(5)]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert chunks[-1]["text"] == engine.detokenize(want)


def test_openai_completions_and_chat(server, engine):
    want = list(engine.generate(PROMPT, max_new_tokens=4, **GREEDY))
    status, _, body = server.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **GREEDY})
    assert status == 200, body
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == engine.detokenize(want)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 4, "total_tokens": 12}

    messages = [{"role": "user", "content": "What is 6 x 7?"}]
    ids = engine.tokenize(engine.chat_apply(messages, add_generation_prompt=True), add_special=False)
    want = list(engine.generate(ids, max_new_tokens=3, **GREEDY))
    status, _, body = server.json("/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                                           **GREEDY})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": engine.detokenize(want)}
    events = sse_events(server.port, "/v1/chat/completions",
                        {"messages": messages, "max_tokens": 3, "stream": True, **GREEDY})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        engine.detokenize(want)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_errors_map_to_http_statuses(server):
    status, _, body = server.json("/generate", {"input_ids": [999999]})
    assert status == 400 and body["error"]["status"] == "DSV4_ERR_INVALID_ARGUMENT"
    assert body["error"]["message"] == "input_ids[0] = 999999 is not a token id in [0, 383]", body
    status, _, body = server.json("/generate", raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = server.json("/generate", {"sampling_params": {}})
    assert status == 400 and "input_ids" in body["error"]["message"]
    status, _, body = server.json("/generate", {"input_ids": PROMPT,
                                                "sampling_params": {"max_new_tokens": "many"}})
    assert status == 400 and "max_new_tokens" in body["error"]["message"]
    status, _, body = server.json("/v1/chat/completions", {"messages": "hi"})
    assert status == 400


def test_queue_full_is_429_with_retry_after(tmp_path):
    s = Server(tmp_path, kv={"device_memory_bytes": "32MiB", "max_running_requests": 1,
                             "page_size": 128},
               admission={"max_queued_requests": 1})
    try:
        # As long as the context allows (~4000 tokens, about a second on this fixture), not
        # streamed: a stream nobody reads is aborted once the server's write times out.
        long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": CONTEXT, **GREEDY}}
        # One running, then one queued (sent together, the second would find the first still
        # queued and be refused itself), then a third is refused at once. On a loaded machine
        # the first may end before the third arrives (then the third is rightly accepted):
        # a few attempts.
        for attempt in range(5):
            socks = [post_raw(s.port, "/generate", long)]
            wait_for_metrics(s, ["dsv4_num_running_reqs 1"], "the first request is not running")
            socks.append(post_raw(s.port, "/generate", long))
            wait_for_metrics(s, ["dsv4_num_queue_reqs 1", "dsv4_num_running_reqs 1"],
                             "the second request is not queued behind the first")
            status, headers, body = s.json("/generate", {"input_ids": PROMPT,
                                                         "sampling_params": {"max_new_tokens": 1}})
            for c in socks:
                c.close()
            if status != 200:
                break
            wait_for_metrics(s, ["dsv4_num_queue_reqs 0", "dsv4_num_running_reqs 0"],
                             "the attempt's requests did not end")
        assert status == 429 and headers["Retry-After"] == "1", body
        assert body["error"]["status"] == "DSV4_ERR_QUEUE_FULL"
    finally:
        s.stop()


def test_a_client_that_disconnects_aborts_its_request(server):
    long = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": CONTEXT, **GREEDY}}
    with post_raw(server.port, "/generate", long) as c:
        got = b""
        while got.count(b"data:") < 3:
            got += c.recv(4096)
    wait_for_metrics(server, ["dsv4_num_aborted_requests_total 1", "dsv4_num_running_reqs 0"],
                     "the request of a client that disconnected was not aborted")


def test_sigterm_drains_then_exits_0(server):
    result = {}

    def long():
        result["body"] = server.json("/generate", {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 2000, **GREEDY}})

    t = threading.Thread(target=long)
    t.start()
    deadline = time.time() + 30
    while "\ndsv4_num_running_reqs 1\n" not in server.call("/metrics")[2]:
        assert time.time() < deadline
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    # Draining: unhealthy and refusing, while the request in flight runs to its end.
    while True:
        status, _, body = server.json("/health")
        if status == 503:
            break
        time.sleep(0.01)
    assert body["state"] == "draining", body
    status, _, body = server.json("/generate", {"input_ids": PROMPT})
    if status != 503:  # the drain may have ended (and the listener closed) in between
        pytest.fail(f"a request during the drain got {status}: {body}")
    assert body["error"]["status"] == "DSV4_ERR_SHUTDOWN"
    t.join(timeout=60)
    status, _, body = result["body"]
    assert status == 200 and body["meta_info"]["completion_tokens"] == 2000, body
    assert server.proc.wait(timeout=30) == 0
    out = server.proc.stdout.read()
    assert "SIGTERM: draining" in out and "stopped" in out, out


def test_a_prefill_and_a_decode_server_give_the_unified_engines_tokens(tmp_path, engine):
    """PD through two servers, as a router drives them: the same /generate body to both, with
    the room, and the prefill's endpoint (from its /server_info) on the decode's."""
    pd = {"listen": "tcp://127.0.0.1:0"}
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    prefill = Server(tmp_path / "p", role="prefill", pd=pd)
    decode = Server(tmp_path / "d", role="decode", pd=pd)
    try:
        status, _, info = prefill.json("/server_info")
        assert status == 200 and info["role"] == "prefill", info
        assert info["pd_endpoint"] == f"tcp://{info['bootstrap_host']}:{info['bootstrap_port']}"
        assert decode.json("/server_info")[2]["role"] == "decode"
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, **GREEDY},
                "bootstrap_room": 7}
        result = {}
        t = threading.Thread(target=lambda: result.update(p=prefill.routed("/generate", body)))
        t.start()
        status, _, got = decode.routed("/generate", {**body, "bootstrap_host": info["bootstrap_host"],
                                                     "bootstrap_port": info["bootstrap_port"]})
        t.join(timeout=60)
        assert status == 200, got
        assert got["output_ids"] == list(engine.generate(PROMPT, max_new_tokens=6, **GREEDY))
        status, _, sent = result["p"]
        assert status == 200 and sent["output_ids"] == [], sent
        assert sent["meta_info"]["finish_reason"] == {"type": "transferred"}
        # A decode request without its prefill's endpoint is the library's refusal, as a 400.
        status, _, err = decode.routed("/generate", {**body, "bootstrap_room": 8})
        assert status == 400 and "pd_peer" in err["error"]["message"], err
    finally:
        prefill.stop()
        decode.stop()


def test_abort_request_by_rid(server):
    """SGLang's POST /abort_request: a request in flight by its "rid", an abort that arrives
    before its request (a router's race), and a rid used twice."""
    result = {}
    body = {"input_ids": PROMPT, "rid": "r1", "sampling_params": {"max_new_tokens": CONTEXT, **GREEDY}}
    t = threading.Thread(target=lambda: result.update(r1=server.json("/generate", body)))
    t.start()
    wait_for_metrics(server, ["dsv4_num_running_reqs 1"], "the request is not running")
    status, _, again = server.json("/generate", body)
    assert status == 400 and "rid r1 is already in flight" in again["error"]["message"], again
    assert server.json("/abort_request", {"rid": "r1"})[2] == {"aborted": True}
    t.join(timeout=60)
    status, _, got = result["r1"]
    assert status == 200 and got["meta_info"]["finish_reason"] == {"type": "aborted"}, got
    # Ended: aborting it again finds nothing, and is not taken for an early abort (a router's
    # late abort must not kill the rid's next use).
    assert server.json("/abort_request", {"rid": "r1"})[2] == {"aborted": False}
    short = {"max_new_tokens": 2, **GREEDY}
    status, _, got = server.json("/generate", {**body, "sampling_params": short})
    assert status == 200 and got["meta_info"]["finish_reason"] == {"type": "length"}, got
    # An abort before its request: the request is answered as aborted without running.
    assert server.json("/abort_request", {"rid": "r2"})[2] == {"aborted": False}
    status, _, got = server.json("/generate", {**body, "rid": "r2"})
    assert status == 200 and got["output_ids"] == [], got
    assert got["meta_info"]["finish_reason"] == {"type": "aborted"}
    assert got["meta_info"]["prompt_tokens"] == len(PROMPT)
    # Streamed too: one final chunk, then [DONE].
    assert server.json("/abort_request", {"rid": "r3"})[2] == {"aborted": False}
    events = sse_events(server.port, "/v1/completions", {"prompt": PROMPT, "rid": "r3",
                                                          "stream": True, "max_tokens": 5,
                                                          "stream_options": {"include_usage": True}})
    assert len(events) == 3 and events[2] == "[DONE]", events
    last, usage = json.loads(events[0]), json.loads(events[1])
    assert last["choices"][0]["finish_reason"] == "abort" and "usage" not in last, last
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 0, usage
    # ... once: the rid's next request runs.
    status, _, got = server.json("/generate", {**body, "rid": "r2", "sampling_params": short})
    assert status == 200 and got["meta_info"]["finish_reason"] == {"type": "length"}, got
    status, _, err = server.json("/generate", {**body, "rid": "x" * 257})
    assert status == 400 and "256 bytes" in err["error"]["message"]
    status, _, err = server.json("/abort_request", {})
    assert status == 400 and "rid" in err["error"]["message"]


def test_pd_fields_are_honoured_only_from_the_router(tmp_path, engine):
    """A body's PD routing fields steer a decode's connection and name a room: without
    --router-token-file or --trust-pd-fields a server refuses them (400 naming the field),
    with a token only from requests carrying it, and --trust-pd-fields takes them from anyone."""
    pd = {"listen": "tcp://127.0.0.1:0"}
    for d in ("plain", "p", "d", "t"):
        (tmp_path / d).mkdir()
    prefill = Server(tmp_path / "p", role="prefill", pd=pd)
    decode = Server(tmp_path / "d", role="decode", pd=pd)
    trusting = Server(tmp_path / "t", args=["--trust-pd-fields"], role="decode", pd=pd)
    refusing = Server(tmp_path / "plain", router_token=False, role="decode", pd=pd)
    try:
        info = prefill.json("/server_info")[2]
        assert (info["pd_fields"], "router_token" not in info) == ("router_token", True), info
        assert prefill.json("/server_info", headers={"X-DSV4-Router-Token": prefill.token})[2][
            "router_token"] == "accepted"
        assert prefill.json("/server_info", headers={"X-DSV4-Router-Token": "nope" * 5})[2][
            "router_token"] == "rejected"
        assert trusting.json("/server_info")[2]["pd_fields"] == "trusted"
        assert refusing.json("/server_info")[2]["pd_fields"] == "refused"
        forged = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        for name, field in (("bootstrap_room", 9), ("pd_room", 9), ("pd_peer", "tcp://127.0.0.1:1"),
                            ("bootstrap_host", "127.0.0.1"), ("bootstrap_port", 1)):
            for path in ("/generate", "/v1/completions"):
                status, _, err = decode.json(path, {**forged, name: field})
                assert status == 400 and err["error"]["message"].startswith(
                    f"{name} is a PD routing field: this server takes PD fields only from its router"), err
                status, _, err = refusing.json(path, {**forged, name: field})
                assert status == 400 and "--router-token-file" in err["error"]["message"], err
            status, _, err = decode.json("/generate", {**forged, name: field},
                                         headers={"X-DSV4-Router-Token": decode.token + "x"})
            assert status == 400 and "is not this server's --router-token-file token" in \
                err["error"]["message"], err
        assert value(decode, "dsv4_num_requests_total") in (None, 0)
        # With the token, or from anyone with --trust-pd-fields: the room is served.
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **GREEDY}}
        for room, d in ((11, decode), (12, trusting)):
            t = threading.Thread(target=prefill.routed, args=("/generate", {**body, "bootstrap_room": room}))
            t.start()
            peer = {"bootstrap_room": room, "bootstrap_host": info["bootstrap_host"],
                    "bootstrap_port": info["bootstrap_port"]}
            status, _, got = (d.routed if d is decode else d.json)("/generate", {**body, **peer})
            t.join(timeout=60)
            assert status == 200 and got["output_ids"] == list(engine.generate(PROMPT, max_new_tokens=4,
                                                                                **GREEDY)), got
    finally:
        for s in (prefill, decode, trusting, refusing):
            s.stop()


def test_sglangs_router_body_goes_to_both_halves_of_a_pair(tmp_path, engine):
    """SGLang's router in PD mode sends one body, with bootstrap_host, bootstrap_port and
    bootstrap_room, to the prefill and the decode (both run with --trust-pd-fields): the prefill
    ignores the host and port (they name it), the decode connects to them, and the decode's
    tokens are a unified engine's. A decode given a host without a port (null or missing), or a
    port of 0, refuses at once with 400 naming the field, instead of waiting out its timeout."""
    pd = {"listen": "tcp://127.0.0.1:0"}
    for d in ("p", "d"):
        (tmp_path / d).mkdir()
    prefill = Server(tmp_path / "p", args=["--trust-pd-fields"], role="prefill", pd=pd)
    decode = Server(tmp_path / "d", args=["--trust-pd-fields"], role="decode", pd=pd)
    try:
        info = prefill.json("/server_info")[2]
        want = list(engine.generate(PROMPT, max_new_tokens=4, **GREEDY))
        for room, path in ((21, "/generate"), (22, "/v1/completions")):
            body = {"bootstrap_room": room, "bootstrap_host": info["bootstrap_host"],
                    "bootstrap_port": info["bootstrap_port"]}
            if path == "/generate":
                body.update({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **GREEDY}})
            else:
                body.update({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            got = {}
            t = threading.Thread(target=lambda: got.update(p=prefill.json(path, body)))
            t.start()
            status, _, d = decode.json(path, body)
            t.join(timeout=60)
            assert got["p"][0] == 200, got
            assert status == 200, d
            if path == "/generate":
                assert d["output_ids"] == want, d
            else:
                assert d["usage"]["completion_tokens"] == 4, d
        bad = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "bootstrap_room": 30,
               "bootstrap_host": info["bootstrap_host"]}
        for extra, says in (({}, "bootstrap_host without bootstrap_port"),
                            ({"bootstrap_port": None}, "bootstrap_host without bootstrap_port"),
                            ({"bootstrap_port": 0}, "bootstrap_port = 0 is outside [1, 65535]")):
            started = time.time()
            status, _, err = decode.json("/generate", {**bad, **extra})
            assert status == 400 and says in err["error"]["message"], err
            assert time.time() - started < 5
        status, _, err = decode.json("/generate", {**bad, "bootstrap_host": None, "bootstrap_port": 7})
        assert status == 400 and "bootstrap_port without bootstrap_host" in err["error"]["message"], err
    finally:
        for s in (prefill, decode):
            s.stop()


def value(server, name, **labels):
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(server.call("/metrics")[2]):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_a_room_whose_peer_is_gone_is_503_and_ends_a_stream_in_shape(tmp_path):
    """A decode whose prefill does not answer: the room fails (its peer is dead), which is
    retryable on another pair: 503, not 500. Streamed, the stream ends with the endpoint's own
    error event (SGLang: finish_reason abort with the message), then [DONE]."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, never listening: connections are refused
        d = Server(tmp_path, role="decode", pd={"listen": "tcp://127.0.0.1:0"})
        try:
            body = {"input_ids": PROMPT, "bootstrap_room": 5, "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": closed, "sampling_params": {"max_new_tokens": 3}}
            status, headers, err = d.routed("/generate", body)
            assert status == 503 and err["error"]["status"] == "DSV4_ERR_KV_TRANSFER", err
            req = urllib.request.Request(d.url + "/generate", data=json.dumps(
                {**body, "bootstrap_room": 6, "stream": True}).encode(),
                headers={"X-DSV4-Router-Token": d.token})
            with urllib.request.urlopen(req, timeout=60) as r:
                events = [e[len("data: "):] for e in r.read().decode().split("\n\n") if e]
            assert events[-1] == "[DONE]" and len(events) == 2, events
            last = json.loads(events[0])
            assert last["output_ids"] == [] and last["meta_info"]["finish_reason"]["type"] == "abort", last
            assert last["meta_info"]["finish_reason"]["status_code"] == 503
            assert last["meta_info"]["finish_reason"]["message"], last
        finally:
            d.stop()


def test_health_answers_at_once_while_every_request_slot_is_busy(tmp_path):
    """/health must not wait behind generations: with every admitted request holding its
    connection (2 running, 40 queued) and 40 refused clients keeping their connections open,
    it answers within a second (a fixed pool sized running + queued + 16 would hold it until a
    kept-alive connection timed out)."""
    s = Server(tmp_path, kv={"device_memory_bytes": "32MiB", "max_running_requests": 2, "page_size": 128},
               admission={"max_queued_requests": 40})
    socks = []
    try:
        long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": CONTEXT, **GREEDY}}
        # Two running (each to the context's end, about a second here), then forty queued
        # behind them (sent together with the first two, some would be refused instead).
        socks = [post_raw(s.port, "/generate", long) for _ in range(2)]
        wait_for_metrics(s, ["dsv4_num_running_reqs 2"], "the first two are not running")
        socks += [post_raw(s.port, "/generate", long) for _ in range(40)]
        # Forty more, refused (429) and kept open by their clients (HTTP/1.1 keep-alive);
        # any the queue still took hold their connections too.
        socks += [post_raw(s.port, "/generate", long) for _ in range(40)]
        for path in ("/health", "/metrics", "/health"):
            t = time.time()
            status, _, body = s.call(path)
            took = time.time() - t
            assert status == 200 and took < 1.0, (path, took, body)
    finally:
        for c in socks:
            c.close()
        s.stop()


def test_models_help_plan_and_a_model_path_beside_the_params(tmp_path):
    """GET /v1/models; --help; the memory plan printed at start; a relative model_path found
    next to the params file from another working directory; bad options refused."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "model").symlink_to(FIXTURE)
    conf = tmp_path / "conf" / "params.json"
    conf.write_text(json.dumps({**params(), "model_path": "model",
                                "hicache": {"enabled": True, "ratio": 2.0}}))
    proc = subprocess.Popen([str(server_binary()), "--params", str(conf), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")
    try:
        lines = start_lines(proc, "dsv4-server")
        plan = "".join(line for line in lines if line.startswith("dsv4-server: plan: "))
        for want in ("DeepSeek V4 memory plan", "c4_kv", "snapshots", "hicache  ratio 2", "effective ratio: 2.00",
                     "numa     node"):
            assert want in plan, plan
        port = int(lines[-1].rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            models = json.loads(r.read())
        assert models["object"] == "list" and len(models["data"]) == 1, models
        assert models["data"][0]["object"] == "model" and models["data"][0]["id"], models
    finally:
        proc.kill()
        proc.wait()
    out = subprocess.run([str(server_binary()), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--router-token-file" in out.stdout and "--trust-pd-fields" in out.stdout
    out = subprocess.run([str(server_binary()), "--params", str(conf), "--trust-pd-fields",
                          "--router-token-file", "x"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "exclude each other" in out.stderr, out.stderr
    short = tmp_path / "short.token"
    short.write_text("abc\n")
    out = subprocess.run([str(server_binary()), "--params", str(conf), "--router-token-file", str(short)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "under the 16 required" in out.stderr, out.stderr


def test_a_burst_of_connections_is_accepted_not_reset(server):
    """600 clients connecting at once (each GET /health, then close): every one answered 200.
    The listen backlog takes the burst (a backlog of 5 dropped or reset about a fifth of 500
    simultaneous connections)."""
    import asyncio

    async def one():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            line = await reader.readline()
            await reader.read()
            writer.close()
            return line.split(b" ")[1].decode() if line else "closed"
        except OSError as e:
            return type(e).__name__

    async def burst():
        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(600))), 60)

    t = time.time()
    outcomes = asyncio.run(burst())
    took = time.time() - t
    assert outcomes.count("200") == 600, {o: outcomes.count(o) for o in set(outcomes)}
    # No client waited for a dropped SYN's retransmission (1 s, then 3 s).
    assert took < 5, took


def test_the_open_files_limit_is_raised_to_the_hard_limit(tmp_path):
    """Started with the usual soft limit of 1024 open files (under a higher hard one), the
    server raises it: a burst needs a descriptor per connection."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit on open files is {hard}: nothing to raise it to")

    def low():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    conf = tmp_path / "params.json"
    conf.write_text(json.dumps(params()))
    proc = subprocess.Popen([str(server_binary()), "--params", str(conf), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=low)
    try:
        start_lines(proc, "dsv4-server")
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        want = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        assert line.split()[3] == want, line
    finally:
        proc.kill()
        proc.wait()


def test_sglang_and_openai_model_discovery(tmp_path):
    """--served-model-name is the model's id in /v1/models and in every response; SGLang's
    /model_info and /get_model_info name the checkpoint directory (weights and tokenizer) and
    say the model generates; /get_server_info is /server_info under SGLang's name."""
    s = Server(tmp_path, args=["--served-model-name", "deepseek-v4-tiny"])
    try:
        status, _, models = s.json("/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["deepseek-v4-tiny"], models
        info = s.json("/server_info")[2]
        model_path = info["params"]["model_path"]
        assert Path(model_path).is_dir(), model_path
        for path in ("/model_info", "/get_model_info"):
            status, _, got = s.json(path)
            assert status == 200 and got == {"model_path": model_path, "tokenizer_path": model_path,
                                             "is_generation": True,
                                             "served_model_name": "deepseek-v4-tiny"}, got
        status, _, sglang = s.json("/get_server_info")
        assert status == 200 and sglang["role"] == info["role"] and sglang["params"] == info["params"]
        status, _, out = s.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and out["model"] == "deepseek-v4-tiny", out
    finally:
        s.stop()


def test_openai_shapes_the_sdk_reads(server, engine):
    """Chat content as a list of text parts renders as the joined string; a part of another kind
    is 400 naming it. Ids carry OpenAI's prefixes (chatcmpl-, cmpl-), every stream chunk the
    same `created`; an error object has OpenAI's `type` and `param`; SGLang's meta_info has the
    request's `id`."""
    messages = [{"role": "user", "content": "What is 6 x 7?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                          {"type": "text", "text": "6 x 7?"}]}]
    joined = [{"role": "user", "content": "What is\n6 x 7?"}]
    body = {"max_tokens": 3, **GREEDY}
    status, _, a = server.json("/v1/chat/completions", {"messages": parts, **body})
    status_b, _, b = server.json("/v1/chat/completions", {"messages": joined, **body})
    assert status == status_b == 200, (a, b)
    assert a["choices"] == b["choices"] and a["usage"] == b["usage"], (a, b)
    assert a["id"].startswith("chatcmpl-") and isinstance(a["created"], int), a
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    status, _, err = server.json("/v1/chat/completions", {"messages": image, **body})
    assert status == 400 and 'a content part of type "image_url" is not supported' in \
        err["error"]["message"], err
    assert err["error"]["type"] == "invalid_request_error" and "param" in err["error"], err
    status, _, c = server.json("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and c["id"].startswith("cmpl-"), c
    events = sse_events(server.port, "/v1/chat/completions", {"messages": messages, "stream": True, **body})
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["created"] for c in chunks}) == 1 and len({c["id"] for c in chunks}) == 1, chunks
    assert chunks[0]["id"].startswith("chatcmpl-")
    # The stream opens with the assistant's role; no piece is empty; no usage unless asked.
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, chunks[0]
    assert all(c["choices"][0]["delta"].get("content") for c in chunks[1:-1]), chunks
    assert all("usage" not in c for c in chunks), chunks
    status, _, whole = server.json("/v1/chat/completions", {"messages": messages, **body})
    events = sse_events(server.port, "/v1/chat/completions",
                        {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                         **body})
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"] == whole["usage"], (usage, whole)
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    status, _, err = server.json("/v1/completions", {"prompt": PROMPT, "stream": True, "stream_options": 1})
    assert status == 400 and "stream_options" in err["error"]["message"], err
    status, _, g = server.json("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and g["meta_info"]["id"], g


def test_fields_that_would_change_the_output_are_refused_by_name_and_inert_ones_accepted(server):
    """A field this server does not do (n > 1, logprobs, penalties, tools, a JSON response
    format, echo, suffix) is 400 naming it, never an answer to another question; at the value
    that asks for nothing it is accepted, as are fields that change nothing (user, metadata)."""
    base = {"prompt": PROMPT, "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = [("n", 2), ("best_of", 3), ("echo", True), ("suffix", "x"), ("logprobs", 2),
               ("top_logprobs", 3), ("frequency_penalty", 0.5), ("presence_penalty", -1),
               ("tools", [{"type": "function", "function": {"name": "f"}}]),
               ("response_format", {"type": "json_object"})]
    for name, v in refused:
        for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
            status, _, err = server.json(path, {**body, name: v})
            assert status == 400 and err["error"]["message"].startswith(f"{name} = "), (path, name, err)
            assert "is not supported" in err["error"]["message"], err
    for name, v in (("n", 2), ("return_logprob", True), ("frequency_penalty", 1)):
        status, _, err = server.json("/generate", {"input_ids": PROMPT,
                                                   "sampling_params": {"max_new_tokens": 2, name: v}})
        assert status == 400 and err["error"]["message"].startswith(f"{name} = "), err
    status, _, err = server.json("/generate", {"input_ids": PROMPT, "return_logprob": True})
    assert status == 400 and err["error"]["message"].startswith("return_logprob = "), err
    asks_nothing = {"n": 1, "echo": False, "frequency_penalty": 0, "presence_penalty": 0,
                    "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False}
    inert = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
             "parallel_tool_calls": False}
    for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
        status, _, out = server.json(path, {**body, **asks_nothing, **inert})
        assert status == 200, (path, out)
