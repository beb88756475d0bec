"""dsv4-router's client-facing surface and what it sends its servers, checked against fake
servers written here (Python's http.server) that record every call: the router token on every
call, rooms from a CSPRNG (not a counter), a client's PD fields refused and never forwarded, the
client's rid on both halves and POST /abort_request reaching both, a stream whose decode breaks
off ending with an error event in the endpoint's shape and [DONE], errors that name no internal
endpoint or room, retries counted only when one goes out, a server kept in rotation until
--health-misses polls fail, /server_info, /v1/models and /metrics (build info, memory)."""

import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_metrics import promtool_check
from test_router import Router, read_stream, router_binary, wait_until
from test_server import post_raw, token_file

MODEL = {"name": "fake-model", "has_tokenizer": True}


class Fake:
    """A fake dsv4-server of `role` that records every call. `behaviour(path, body)` answers a
    generation: ("json", status, body), ("stream", [events]) or ("break", [events]) (the
    connection drops after those events, without the stream's end)."""

    def __init__(self, role, token, behaviour=None):
        self.role, self.token = role, token
        self.calls = []  # (method, path, headers, body)
        self.health = 200
        self.behaviour = behaviour or self.default
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status, body, content_type="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append(("GET", self.path, dict(self.headers), None))
                if self.path == "/server_info":
                    info = {"role": fake.role, "pd_fields": "router_token", "model": MODEL,
                            "bootstrap_host": "10.9.8.7", "bootstrap_port": 7777}
                    if "X-DSV4-Router-Token" in self.headers:
                        info["router_token"] = ("accepted" if self.headers["X-DSV4-Router-Token"] == fake.token
                                                else "rejected")
                    self.reply(200, info)
                elif self.path == "/health":
                    self.reply(fake.health, {"state": "ready" if fake.health == 200 else "failed"})
                else:
                    self.reply(200, "", "text/plain")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append(("POST", self.path, dict(self.headers), body))
                if self.path == "/abort_request":
                    self.reply(200, {"aborted": True})
                    return
                answer = fake.behaviour(fake, self.path, body)
                if answer[0] == "json":
                    self.reply(answer[1], answer[2])
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in answer[1]:
                    data = ("data: " + json.dumps(event) + "\n\n").encode()
                    # An event split over two chunks: the router forwards whole events only.
                    for part in (data[:7], data[7:]):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                    time.sleep(0.02)
                if answer[0] == "break":
                    half = b"data: {\"output_ids\": [1, 2"  # half an event, then the server dies
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(half), half))
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                done = b"data: [DONE]\n\n"
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # the router closing a connection mid-answer is part of the tests

        self.http = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @staticmethod
    def default(fake, path, body):
        if fake.role == "prefill":
            return ("json", 200, {"output_ids": [], "meta_info": {"finish_reason": {"type": "transferred"}}})
        if body.get("stream"):
            return ("stream", [{"output_ids": [1], "text": "a"}, {"output_ids": [1, 2], "text": "ab"}])
        return ("json", 200, {"output_ids": [1, 2], "text": "ab", "meta_info": {"finish_reason": {"type": "length"}}})

    def generations(self):
        return [c for c in self.calls if c[0] == "POST" and c[1] != "/abort_request"]

    def aborts(self):
        return [c[3]["rid"] for c in self.calls if c[1] == "/abort_request"]

    def stop(self):
        self.http.shutdown()


@pytest.fixture
def fakes(tmp_path):
    path, token = token_file(tmp_path)
    made = []

    def make(prefill=None, decode=None, *extra, n_prefill=1):
        ps = [Fake("prefill", token, prefill) for _ in range(n_prefill)]
        d = Fake("decode", token, decode)
        r = Router(ps, [d], "--router-token-file", str(path), *extra)
        made.extend(ps + [d])
        made.append(r)
        return ps[0] if n_prefill == 1 else ps, d, r

    yield make
    for m in made:
        m.stop()


def raw_events(port, path, body):
    """The data payloads of a streamed answer read off a raw socket, and whether the chunked
    body ended properly (its last chunk came)."""
    with post_raw(port, path, body, close=True) as s:
        return read_stream(s)


def test_every_call_carries_the_token_and_rooms_are_unpredictable(fakes):
    p, d, r = fakes()
    for i in range(40):
        status, _, body = r.json("/generate", {"input_ids": [1, 2, 3], "rid": f"c{i}"})
        assert status == 200 and body["output_ids"] == [1, 2], body
    token = p.token
    for fake in (p, d):
        assert fake.calls and all(c[2].get("X-DSV4-Router-Token") == token for c in fake.calls), fake.calls[:3]
    rooms = [c[3]["bootstrap_room"] for c in p.generations()]
    assert [c[3]["bootstrap_room"] for c in d.generations()] == rooms
    # Forty rooms from a CSPRNG: distinct, non-zero, below 2^63, and not a counter (no two
    # consecutive; their high bits vary).
    assert len(set(rooms)) == 40 and all(0 < x < 2 ** 63 for x in rooms)
    assert all(abs(a - b) > 1000 for a, b in zip(rooms, rooms[1:]))
    assert len({x >> 56 for x in rooms}) > 10
    # The client's rid names both halves; the decode is told the prefill's PD endpoint.
    assert [c[3]["rid"] for c in p.generations()] == [f"c{i}" for i in range(40)]
    assert all((c[3]["bootstrap_host"], c[3]["bootstrap_port"]) == ("10.9.8.7", 7777) for c in d.generations())
    assert all("bootstrap_host" not in c[3] for c in p.generations())


def test_a_clients_pd_fields_are_refused_and_never_forwarded(fakes):
    p, d, r = fakes()
    for name, value in (("pd_peer", "tcp://evil:1"), ("bootstrap_host", "evil"), ("bootstrap_port", 1),
                        ("bootstrap_room", 5), ("pd_room", 5)):
        status, _, body = r.json("/v1/completions", {"prompt": [1, 2], name: value})
        assert status == 400 and body["error"]["message"].startswith(f"{name} is a PD routing field"), body
    assert p.generations() == [] and d.generations() == []
    # null is no field (SGLang's clients send them as null).
    status, _, body = r.json("/generate", {"input_ids": [1], "bootstrap_room": None})
    assert status == 200, body
    assert value_of(r, "dsv4_router_requests_total", outcome="bad_request") == 5


def test_abort_request_through_the_router_reaches_both_halves(fakes):
    gate = threading.Event()

    def slow_decode(fake, path, body):
        gate.wait(30)
        return ("json", 200, {"output_ids": [], "meta_info": {"finish_reason": {"type": "aborted"}}})

    p, d, r = fakes(None, slow_decode)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=r.json("/generate", {"input_ids": [1], "rid": "mine"})))
    t.start()
    wait_until("the decode's half did not arrive", lambda: d.generations())
    status, _, body = r.json("/abort_request", {"rid": "mine"})
    assert status == 200 and body == {"aborted": True}, body
    assert d.aborts() == ["mine"] and p.aborts() == ["mine"]
    gate.set()
    t.join(timeout=30)
    assert result["r"][0] == 200 and result["r"][2]["meta_info"]["finish_reason"] == {"type": "aborted"}
    # Unknown (or ended) rids: nothing to abort, nothing sent.
    assert r.json("/abort_request", {"rid": "mine"})[2] == {"aborted": False}
    assert r.json("/abort_request", {"rid": "never"})[2] == {"aborted": False}
    assert len(d.aborts()) == 1
    status, _, body = r.json("/abort_request", {"rid": "x" * 241})
    assert status == 400 and "240 bytes" in body["error"]["message"]
    status, _, body = r.json("/generate", {"input_ids": [1], "rid": "x" * 241})
    assert status == 400 and "240 bytes" in body["error"]["message"]


def test_a_stream_whose_decode_breaks_off_ends_with_an_error_event(fakes):
    def breaking(fake, path, body):
        if path == "/generate":
            return ("break", [{"output_ids": [7], "text": "x", "meta_info": {"finish_reason": None}},
                              {"output_ids": [7, 8], "text": "xy", "meta_info": {"finish_reason": None}}])
        return ("break", [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}])

    p, d, r = fakes(None, breaking, "--retries", "0")
    events, ended = raw_events(r.port, "/generate", {"input_ids": [1], "stream": True})
    # SGLang's native shape: the output so far, finish_reason abort with a message; then [DONE]
    # and the chunked body's proper end.
    assert ended and events[-1] == "[DONE]", events
    assert [json.loads(e)["output_ids"] for e in events[:2]] == [[7], [7, 8]]
    last = json.loads(events[2])
    assert last["output_ids"] == [7, 8] and last["text"] == "xy", last
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert "stopped answering mid-stream" in last["meta_info"]["finish_reason"]["message"]
    assert len(events) == 4, events  # the half event the decode sent last is not forwarded
    # OpenAI's shape: an error object, then [DONE].
    events, ended = raw_events(r.port, "/v1/completions", {"prompt": [1], "stream": True})
    assert ended and events[-1] == "[DONE]" and len(events) == 3, events
    err = json.loads(events[1])["error"]
    assert err["code"] == 502 and "mid-stream" in err["message"] and "127.0.0.1" not in err["message"], err
    assert value_of(r, "dsv4_router_broken_streams_total") == 2
    # Non-streaming: a 502 with a JSON error (retries 0: nowhere else to go).
    status, _, body = r.json("/generate", {"input_ids": [1]})
    assert status == 502 and "decode server did not answer" in body["error"]["message"], body


def test_errors_reaching_clients_name_no_room_or_endpoint(fakes):
    def failing(fake, path, body):
        room = body["bootstrap_room"]
        return ("json", 503, {"error": {"status": "DSV4_ERR_KV_TRANSFER", "code": 503, "message":
                f"room {room} on the prefill tcp://10.9.8.7:7777: the peer tcp://10.1.2.3:5555 stopped "
                f"answering (claim from 10.1.2.3:41234, [::1]:99)"}})

    p, d, r = fakes(None, failing, "--retries", "0")
    status, headers, body = r.json("/generate", {"input_ids": [1]})
    assert status == 503 and headers["Retry-After"] == "1", body
    message = body["error"]["message"]
    room = d.generations()[0][3]["bootstrap_room"]
    assert str(room) not in message and "10.9.8.7" not in message and "10.1.2.3" not in message
    assert "::1" not in message and "7777" not in message, message
    assert message.startswith("room <room> on the prefill <internal endpoint>: the peer"), message
    log = r.stop()
    assert str(room) in log and "10.1.2.3" in log, log


def test_retries_count_only_tries_that_went_out(fakes):
    def refusing(fake, path, body):
        return ("json", 429, {"error": {"status": "DSV4_ERR_QUEUE_FULL", "code": 429, "message": "queue full"}})

    # One prefill, refusing: there is no other to try, so nothing is retried.
    p, d, r = fakes(refusing, None, "--retries", "2")
    status, headers, _ = r.json("/generate", {"input_ids": [1]})
    assert status == 429 and headers["Retry-After"] == "1"
    assert value_of(r, "dsv4_router_retries_total") == 0
    # Two prefills, both refusing: one retry went out, then the last 429 is the answer.
    ps, d, r = fakes(refusing, None, "--retries", "2", n_prefill=2)
    status, _, _ = r.json("/generate", {"input_ids": [1]})
    assert status == 429
    assert value_of(r, "dsv4_router_retries_total") == 1
    assert sum(len(f.generations()) for f in ps) == 2
    # Each refused half's decode half was aborted, by the rid of its try (just after the
    # answer: the prefill's call thread sends it).
    wait_until("a decode half was not aborted", lambda: len(d.aborts()) == 2)
    assert sorted(d.aborts()) == sorted(c[3]["rid"] for c in d.generations())
    assert len(set(d.aborts())) == 2


def test_a_server_stays_in_rotation_until_health_misses_polls_fail(fakes):
    p, d, r = fakes(None, None, "--poll-ms", "50", "--health-misses", "4")
    d.calls.clear()
    d.health = 500
    wait_until("the server did not leave the rotation",
               lambda: value_of(r, "dsv4_router_server_up", role="decode", url=d.url) == 0, timeout=10)
    assert sum(1 for c in d.calls if c[1] == "/health") >= 4, d.calls
    d.health = 200
    wait_until("the server did not come back at its first answer",
               lambda: value_of(r, "dsv4_router_server_up", role="decode", url=d.url) == 1, timeout=10)
    # A call that fails does not take a server out of rotation: only its polls do.
    d.behaviour = lambda fake, path, body: ("break", [])
    assert r.json("/generate", {"input_ids": [1]})[0] == 502
    time.sleep(0.3)
    assert value_of(r, "dsv4_router_server_up", role="decode", url=d.url) == 1


def test_a_short_health_outage_keeps_the_server(fakes):
    p, d, r = fakes(None, None, "--poll-ms", "50", "--health-misses", "1000")
    d.health = 503
    time.sleep(0.6)  # about ten failed polls
    assert value_of(r, "dsv4_router_server_up", role="decode", url=d.url) == 1
    d.health = 200


def test_server_info_models_and_metrics(fakes):
    p, d, r = fakes()
    status, _, info = r.json("/server_info")
    assert status == 200 and info["role"] == "router" and info["model"] == MODEL, info
    assert [s["url"] for s in info["prefill_servers"]] == [p.url]
    assert [s["url"] for s in info["decode_servers"]] == [d.url]
    status, _, models = r.json("/v1/models")
    assert status == 200 and models["object"] == "list", models
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [("fake-model", "model", "dsv4")]
    text = r.call("/metrics")[2]
    promtool_check(text)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    version = (router_binary().parent.parent / "lib").glob("libdsv4.so.*.*.*")
    (lib,) = [v for v in version if not v.name.endswith(".debug")]
    want = lib.name.split(".so.")[1]
    assert samples[("dsv4_build_info", (("backend", "none"), ("role", "router"), ("version", want)))] == 1
    rss = samples[("dsv4_process_resident_memory_bytes", ())]
    assert 1 << 20 < rss < 1 << 32, rss


def value_of(router, name, **labels):
    text = router.call("/metrics")[2]
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_the_router_checks_its_token_at_start_and_has_help(tmp_path):
    path, token = token_file(tmp_path)
    (tmp_path / "other").mkdir()
    other, _ = token_file(tmp_path / "other")  # a token other than the servers' own
    p, d = Fake("prefill", token), Fake("decode", token)
    try:
        run = subprocess.run([str(router_binary()), "--prefill", p.url, "--decode", d.url, "--port", "0",
                              "--router-token-file", str(other)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and f"{p.url} rejects the token in --router-token-file" in run.stderr, run.stderr
        run = subprocess.run([str(router_binary()), "--prefill", p.url, "--decode", d.url, "--port", "0"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 1 and "takes PD fields only with its router token" in run.stderr, run.stderr
    finally:
        p.stop()
        d.stop()
    run = subprocess.run([str(router_binary()), "--help"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and "--health-misses" in run.stdout and "--router-token-file" in run.stdout
