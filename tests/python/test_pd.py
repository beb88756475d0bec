"""Prefill/decode disaggregation from Python: a prefill and a decode engine joined over TCP on
127.0.0.1 give a unified engine's tokens; the prefill's request ends TRANSFERRED without a
token; a decode whose peer is gone fails with KVTransferError; bad PD fields are refused."""

import socket
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_metrics import promtool_check

import dsv4

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flash-like" / "hf-f32"
PROMPT = [(i * 37 + 11) % 380 + 2 for i in range(150)]  # two pages of 128
GREEDY = dict(max_new_tokens=8, temperature=0, seed=7, logit_bias_tokens=[1],
              logit_bias_values=[-1000.0])
# Generous: nothing here should time out or look dead on a loaded machine.
PD = {"listen": "tcp://127.0.0.1:0", "heartbeat_interval_ms": 1000, "heartbeat_misses": 30,
      "bootstrap_timeout_ms": 60000, "transfer_timeout_ms": 60000}


def params(**kv):
    return {"model_path": str(FIXTURE), "threads": 2,
            "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128},
            **kv}


@pytest.fixture(scope="module")
def unified():
    with dsv4.Engine(params()) as e:
        yield e


@pytest.fixture(scope="module")
def pair():
    """A prefill and a decode engine, and the prefill's endpoint."""
    with dsv4.Engine(params(role="prefill", pd=PD)) as prefill, \
            dsv4.Engine(params(role="decode", pd=PD)) as decode:
        yield prefill, decode, prefill.pd_endpoint()


def closed_port():
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def terminal_of(engine, rid, timeout_s=60.0):
    """poll() until request rid ends: (its TOKEN events' ids, its terminal event)."""
    tokens, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in engine.poll(timeout_s=0.5):
            if e.request_id != rid:
                continue
            if not e.terminal:
                tokens.append(e.token)
            else:
                return tokens, e
    pytest.fail("request {} has no terminal event after {} s".format(rid, timeout_s))


def test_the_endpoint(pair):
    prefill, decode, endpoint = pair
    assert endpoint.startswith("tcp://127.0.0.1:") and int(endpoint.rsplit(":", 1)[1]) > 0
    assert decode.pd_endpoint().startswith("tcp://127.0.0.1:")


def test_a_pair_gives_a_unified_engines_tokens(pair, unified):
    prefill, decode, endpoint = pair
    want = unified.generate(PROMPT, **GREEDY)
    assert len(want) == 8
    # Room 1, the decode's request first: its claim is held on the prefill (and the connection
    # is up) before the prefill's request comes. (A claim arriving on a connection still being
    # set up, for a room whose state is already computed, fails on the prefill as if the
    # decode were gone, and the decode is never told: a race in src/pd/node.rs add_link.)
    rid = decode.submit(PROMPT, pd_room=1, pd_peer=endpoint, **GREEDY)
    wait_for(lambda: (prefill.metrics()["pd_early_claims"], prefill.metrics()["pd_peers"])
             == (1, 1), "the decode's claim held on the prefill")
    events = list(prefill.stream(PROMPT, pd_room=1, **GREEDY))
    assert [(e.kind, e.finish_reason) for e in events] == [
        (dsv4.EventKind.FINISHED, dsv4.FinishReason.TRANSFERRED)]
    assert events[0].finish_reason.name.lower() == "transferred"
    assert events[0].status == 0 and events[0].prompt_tokens == len(PROMPT)
    tokens, end = terminal_of(decode, rid)
    assert tokens == want
    assert (end.kind, end.finish_reason) == (dsv4.EventKind.FINISHED, dsv4.FinishReason.LENGTH)
    assert end.generated_tokens == 8

    # Room 2 the other way round, on the connection already up: the prefill's request first,
    # generate() on the decode.
    rid = prefill.submit(PROMPT, pd_room=2, **GREEDY)
    assert decode.generate(PROMPT, pd_room=2, pd_peer=endpoint, **GREEDY) == want
    tokens, end = terminal_of(prefill, rid)
    assert tokens == [] and end.finish_reason == dsv4.FinishReason.TRANSFERRED

    for e in (prefill, decode):
        m = e.metrics()
        assert m["kv_transfer_requests_total"] == 2 and m["kv_transfer_failures_total"] == 0
        assert m["kv_transfer_bytes_total"] > 0
        assert (m["num_prefill_bootstrap_queue_reqs"], m["num_prefill_inflight_queue_reqs"],
                m["num_decode_prealloc_queue_reqs"], m["num_decode_transfer_queue_reqs"],
                m["pd_pages_held"], m["pd_early_claims"], m["pd_peers"]) == (0, 0, 0, 0, 0, 0, 1)
    assert prefill.metrics()["kv_transfer_bytes_total"] == decode.metrics()[
        "kv_transfer_bytes_total"]

    # The PD histograms, read with the Prometheus client's parser, labelled with each side.
    for e, side in ((prefill, "prefill"), (decode, "decode")):
        m = e.metrics()
        got = {}
        for family in text_string_to_metric_families(e.prometheus()):
            for s in family.samples:
                got[(s.name, tuple(sorted(s.labels.items())))] = s.value
        lab = (("side", side),)
        for name in ("kv_transfer_latency_seconds", "kv_transfer_room_bytes",
                     "kv_transfer_claim_wait_seconds"):
            buckets = sorted((float(dict(k[1])["le"]), v) for k, v in got.items()
                             if k[0] == "dsv4_" + name + "_bucket")
            assert [v for _, v in buckets] == sorted(v for _, v in buckets), name
            assert buckets[-1] == (float("inf"), 2), (side, name)
            assert got[("dsv4_" + name + "_count", lab)] == 2, (side, name)
        # Each room's bytes were observed once: the histogram's sum is the byte counter, and
        # both rooms (the same prompt) fall in one bucket.
        assert got[("dsv4_kv_transfer_room_bytes_sum", lab)] == m["kv_transfer_bytes_total"]
        counts = sorted(v for (n, _), v in got.items() if n == "dsv4_kv_transfer_room_bytes_bucket")
        assert 0 in counts and 2 in counts
        assert abs(got[("dsv4_kv_transfer_latency_seconds_sum", lab)]
                   - m["kv_transfer_seconds_total"]) < 1e-6
        assert m["kv_transfer_claim_wait_count"] == 2
        assert m["kv_transfer_claim_wait_seconds_sum"] == pytest.approx(
            got[("dsv4_kv_transfer_claim_wait_seconds_sum", lab)])
        # Prometheus's own linter accepts each side's exposition.
        promtool_check(e.prometheus())


def test_a_missing_peer_fails_with_a_kv_transfer_error(pair):
    prefill, decode, _ = pair
    dead = "tcp://127.0.0.1:{}".format(closed_port())
    before = decode.metrics()["kv_transfer_failures_peer_dead_total"]
    with pytest.raises(dsv4.KVTransferError, match="peer_dead") as info:
        decode.generate(PROMPT, pd_room=3, pd_peer=dead, **GREEDY)
    assert info.value.status == dsv4.KVTransferError.status
    assert dead in info.value.message
    # stream() ends with the ERROR event itself.
    events = list(decode.stream(PROMPT, pd_room=4, pd_peer=dead, **GREEDY))
    assert [e.kind for e in events] == [dsv4.EventKind.ERROR]
    assert events[0].status == dsv4.KVTransferError.status
    assert dsv4.status_name(events[0].status) == "DSV4_ERR_KV_TRANSFER"
    assert "peer_dead" in events[0].message and dead in events[0].message
    assert decode.metrics()["kv_transfer_failures_peer_dead_total"] == before + 2


def test_bad_pd_fields_are_refused(pair):
    prefill, decode, endpoint = pair
    with pytest.raises(dsv4.InvalidArgument, match="pd_room is 0"):
        prefill.submit(PROMPT, **GREEDY)
    with pytest.raises(dsv4.InvalidArgument, match="pd_room is 0"):
        decode.generate(PROMPT, pd_peer=endpoint, **GREEDY)
    with pytest.raises(dsv4.InvalidArgument, match="pd_peer is not set"):
        decode.submit(PROMPT, pd_room=5, **GREEDY)
    with pytest.raises(dsv4.InvalidArgument, match="only decode engines name a peer"):
        prefill.submit(PROMPT, pd_room=5, pd_peer=endpoint, **GREEDY)
    # The same room twice while the first is live (waiting for a claim that never comes).
    rid = prefill.submit(PROMPT, pd_room=6, **GREEDY)
    with pytest.raises(dsv4.InvalidArgument, match="pd_room 6 is already in use"):
        prefill.submit(PROMPT, pd_room=6, **GREEDY)
    prefill.abort(rid)
    tokens, end = terminal_of(prefill, rid)
    assert tokens == [] and end.finish_reason == dsv4.FinishReason.ABORTED
    # Once it ended, the room is free again (here: aborted at once).
    rid = prefill.submit(PROMPT, pd_room=6, **GREEDY)
    prefill.abort(rid)
    assert terminal_of(prefill, rid)[1].finish_reason == dsv4.FinishReason.ABORTED
    m = prefill.metrics()
    assert m["num_prefill_bootstrap_queue_reqs"] == 0 and m["num_running_reqs"] == 0
