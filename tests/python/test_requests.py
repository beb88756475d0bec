"""The request API from Python: generate, stream, submit/poll, abort, shutdown, routing of
events across threads, admission errors, the PD interface on a unified engine."""

import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

import dsv4

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flash-like" / "hf-f32"
PROMPT = [5, 17, 300, 2, 9, 44, 81, 120, 7, 66, 250, 3, 19, 200, 11]


def params(**kv):
    return {"model_path": str(FIXTURE), "threads": 2,
            "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 8, "page_size": 128},
            **kv}


@pytest.fixture(scope="module")
def engine():
    with dsv4.Engine(params()) as e:
        yield e


def test_greedy_generate_is_the_argmax_of_scoring(engine):
    tokens = engine.generate(PROMPT, max_new_tokens=8, temperature=0,
                             logit_bias_tokens=[1], logit_bias_values=[-1000.0])
    assert len(tokens) == 8
    logits = engine.score(PROMPT + tokens[:-1])
    logits[:, 1] -= 1000.0
    assert list(logits[len(PROMPT) - 1:].argmax(-1)) == tokens


def test_stream_events_carry_the_c_fields(engine):
    events = list(engine.stream(PROMPT, max_new_tokens=5, temperature=0, user_tag=9,
                                logprobs=True, logit_bias_tokens=[1],
                                logit_bias_values=[-1000.0]))
    assert [e.kind for e in events] == [dsv4.EventKind.TOKEN] * 5 + [dsv4.EventKind.FINISHED]
    end = events[-1]
    assert end.finish_reason == dsv4.FinishReason.LENGTH and end.terminal
    assert (end.prompt_tokens, end.generated_tokens, end.user_tag) == (len(PROMPT), 5, 9)
    assert all(e.logprob < 0 for e in events[:-1])
    assert end.elapsed_us >= end.ttft_us > 0


def test_generate_returns_the_tokens_and_how_the_request_ended(engine):
    greedy = dict(temperature=0, logit_bias_tokens=[1], logit_bias_values=[-1000.0])
    # LENGTH: EOS (token 1) pushed down, the budget runs out. The result is the stream's tokens,
    # as a list (old callers compare it to one), with the FINISHED event's fields.
    events = list(engine.stream(PROMPT, max_new_tokens=4, logprobs=True, **greedy))
    out = engine.generate(PROMPT, max_new_tokens=4, logprobs=True, **greedy)
    assert isinstance(out, dsv4.Generation) and isinstance(out, list)
    assert out == [e.token for e in events[:-1]] and out.tokens == list(out) and len(out) == 4
    assert out.finish_reason == dsv4.FinishReason.LENGTH == events[-1].finish_reason
    assert out.logprobs == pytest.approx([e.logprob for e in events[:-1]])
    assert all(lp < 0 for lp in out.logprobs)
    assert (out.prompt_tokens, out.generated_tokens) == (len(PROMPT), 4)
    assert out.event.kind == dsv4.EventKind.FINISHED and out.request_id == out.event.request_id
    assert out.cached_tokens == out.event.cached_tokens_device + out.event.cached_tokens_host
    assert repr(out) == "Generation({}, finish_reason=LENGTH)".format(list(out))
    # Copies keep the tokens and the finish reason (a list subclass with attributes).
    back = pickle.loads(pickle.dumps(out))
    assert back == out and back.finish_reason == out.finish_reason and back.logprobs == out.logprobs

    # STOP on a stop token: the request ends at its first occurrence, which is the last token.
    stop_at = out[2]
    stopped = engine.generate(PROMPT, max_new_tokens=8, stop_tokens=[stop_at], **greedy)
    assert stopped == out[:out.index(stop_at) + 1]
    assert stopped.finish_reason == dsv4.FinishReason.STOP and stopped.logprobs is None

    # STOP on EOS, forced.
    eos = engine.generate(PROMPT, max_new_tokens=8, temperature=0, logit_bias_tokens=[1],
                          logit_bias_values=[1000.0])
    assert (eos, eos.finish_reason) == ([1], dsv4.FinishReason.STOP)

    # TIMEOUT: a deadline far shorter than the 100000 tokens asked for; whatever was generated
    # before it is returned, not lost.
    late = engine.generate(PROMPT, max_new_tokens=100000, deadline_ms=1, **greedy)
    assert late.finish_reason == dsv4.FinishReason.TIMEOUT
    assert late.generated_tokens == len(late) < 100000


def test_threads_never_steal_each_others_events(engine):
    results = {}

    def run(i):
        prompt = PROMPT[i:] + PROMPT[:i]
        results[i] = (prompt, engine.generate(prompt, max_new_tokens=6, temperature=0,
                                              logit_bias_tokens=[1], logit_bias_values=[-1e3]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (prompt, tokens) in results.items():
        assert len(tokens) == 6
        alone = engine.generate(prompt, max_new_tokens=6, temperature=0,
                                logit_bias_tokens=[1], logit_bias_values=[-1e3])
        assert tokens == alone, i


def test_submit_poll_abort(engine):
    rid = engine.submit(PROMPT, max_new_tokens=100000, logit_bias_tokens=[1],
                        logit_bias_values=[-1e3], user_tag=3)
    engine.abort(rid)
    seen = []
    while not any(e.terminal for e in seen):
        seen += [e for e in engine.poll(timeout_s=5.0) if e.request_id == rid]
    assert seen[-1].finish_reason == dsv4.FinishReason.ABORTED
    with pytest.raises(dsv4.NotFound):
        engine.abort(rid)
    with pytest.raises(TypeError, match="unknown request field"):
        engine.submit(PROMPT, max_tokens=3)
    with pytest.raises(dsv4.InvalidArgument, match="outside the vocabulary"):
        engine.submit([1, 999])


def test_queue_full_and_shutdown():
    with dsv4.Engine(params(admission={"max_queued_requests": 1},
                            kv={"device_memory_bytes": "32MiB", "max_running_requests": 1,
                                "page_size": 128})) as e:
        long = dict(max_new_tokens=100000, logit_bias_tokens=[1], logit_bias_values=[-1e3])
        e.submit(PROMPT, **long)
        while not e.poll(timeout_s=2.0):
            pass  # running once a token arrives
        e.submit(PROMPT, **long)  # waits
        with pytest.raises(dsv4.QueueFull, match="admission.max_queued_requests = 1"):
            e.submit(PROMPT, **long)
        e.shutdown(dsv4.ShutdownMode.ABORT, timeout_s=30)
        with pytest.raises(dsv4.ShutDown):
            e.submit(PROMPT)
        ends = []
        while True:
            got = e.poll(timeout_s=0.5)
            if not got:
                break
            ends += [x for x in got if x.terminal]
        assert len(ends) == 2
        assert all(x.finish_reason == dsv4.FinishReason.ABORTED for x in ends)


def test_stream_closed_early_aborts(engine):
    it = engine.stream(PROMPT, max_new_tokens=100000, logit_bias_tokens=[1],
                       logit_bias_values=[-1e3])
    first = next(it)
    assert first.kind == dsv4.EventKind.TOKEN
    it.close()
    with pytest.raises(dsv4.NotFound):
        engine.abort(first.request_id)
    assert np.isfinite(engine.score(PROMPT)).all()


def test_cache_stats_and_flush_with_a_host_tier():
    with dsv4.Engine(params(hicache={"enabled": True, "ratio": 2.0,
                                     "write_policy": "write_through"})) as e:
        prompt = (PROMPT * 20)[:300]
        first = e.generate(prompt, max_new_tokens=4, temperature=0)
        e.cache_flush("device")
        events = list(e.stream(prompt, max_new_tokens=4, temperature=0))
        assert [x.token for x in events[:-1]] == first
        assert (events[-1].cached_tokens_device, events[-1].cached_tokens_host) == (0, 256)
        stats = e.cache_stats()
        assert stats["hits"]["host"] == 1 and stats["loadback"]["bytes"] > 0
        assert stats["pools"]["c4_kv"]["host"]["total_units"] > 0
        with pytest.raises(dsv4.InvalidArgument, match='use "device", "host" or "all"'):
            e.cache_flush("disk")
        e.cache_flush("all")
        assert e.cache_stats()["tree"]["host_pages"] == 0


def test_a_unified_engine_has_no_pd_endpoint(engine):
    with pytest.raises(dsv4.InvalidArgument, match="role") as info:
        engine.pd_endpoint()
    assert info.value.status == dsv4.InvalidArgument.status
    assert dsv4.status_name(info.value.status) == "DSV4_ERR_INVALID_ARGUMENT"
    assert "unified" in info.value.message


def test_a_unified_engine_refuses_pd_fields(engine):
    before = engine.metrics()
    with pytest.raises(dsv4.InvalidArgument, match="pd_room = 7") as info:
        engine.submit(PROMPT, pd_room=7)
    assert info.value.status == dsv4.InvalidArgument.status and "unified" in info.value.message
    # generate() and stream() pass the fields through the same way; pd_peer alone is refused too.
    with pytest.raises(dsv4.InvalidArgument, match="pd_room = 7"):
        engine.generate(PROMPT, max_new_tokens=1, pd_room=7)
    with pytest.raises(dsv4.InvalidArgument, match="pd_peer") as info:
        next(engine.stream(PROMPT, max_new_tokens=1, pd_peer="tcp://127.0.0.1:9"))
    assert "tcp://127.0.0.1:9" in info.value.message
    after = engine.metrics()
    assert after["requests_total"] == before["requests_total"]
    assert after["rejected_invalid_total"] == before["rejected_invalid_total"] + 3
    # The defaults (pd_room=0, pd_peer=None) are what a unified engine takes.
    assert len(engine.generate(PROMPT, max_new_tokens=2, pd_room=0, pd_peer=None,
                               logit_bias_tokens=[1], logit_bias_values=[-1e3])) == 2


def test_finish_reason_transferred():
    assert dsv4.FinishReason(5) is dsv4.FinishReason.TRANSFERRED
    assert dsv4.FinishReason.TRANSFERRED.name.lower() == "transferred"
