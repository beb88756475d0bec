"""What a host needs besides requests, from Python: the engine state through a shutdown,
finish reason names, the resolved params, the model facts, ignore_eos and stop sequences."""

from pathlib import Path

import pytest

import dsv4

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flash-like" / "hf-f32"
PROMPT = [5, 17, 300, 2, 9, 44, 81, 120, 7, 66, 250, 3, 19, 200, 11]
NO_EOS = dict(logit_bias_tokens=[1], logit_bias_values=[-1000.0])
ALL_EOS = dict(logit_bias_tokens=[1], logit_bias_values=[1000.0])


def params():
    return {"model_path": str(FIXTURE), "threads": 2,
            "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128}}


@pytest.fixture(scope="module")
def engine():
    with dsv4.Engine(params()) as e:
        yield e


def finish(engine, **fields):
    """(tokens, finish reason) of one greedy request."""
    tokens, reason = [], None
    for e in engine.stream(PROMPT, temperature=0, **fields):
        if e.kind == dsv4.EventKind.TOKEN:
            tokens.append(e.token)
        else:
            assert e.kind == dsv4.EventKind.FINISHED, e
            reason = e.finish_reason
    return tokens, reason


def test_finish_reason_names_match_the_enum():
    for r in dsv4.FinishReason:
        assert dsv4.finish_reason_name(r) == r.name.lower()
    assert dsv4.finish_reason_name(6) == "unknown"
    assert dsv4.finish_reason_name(-1) == "unknown"
    with pytest.raises(dsv4.InvalidArgument):
        dsv4.finish_reason_name(2**31)


def test_model_info_has_the_server_facts(engine):
    info = engine.model_info()
    assert info["vocab_size"] == 384
    assert info["eos_token_ids"] == [1]
    assert "bos_token_id" in info
    assert info["context_limit"] > 0
    assert info["has_tokenizer"] is False and info["has_chat_template"] is False


def test_params_resolved_validate_to_themselves(engine):
    resolved = engine.params_resolved()
    assert resolved["kv"]["max_running_requests"] == 4
    assert dsv4.validate_params(resolved) == resolved


def test_ignore_eos_generates_past_the_eos(engine):
    assert finish(engine, max_new_tokens=5, **ALL_EOS) == ([1], dsv4.FinishReason.STOP)
    assert finish(engine, max_new_tokens=5, ignore_eos=True, **ALL_EOS) == \
        ([1] * 5, dsv4.FinishReason.LENGTH)


def test_stop_sequences(engine):
    free, reason = finish(engine, max_new_tokens=12, **NO_EOS)
    assert len(free) == 12 and reason == dsv4.FinishReason.LENGTH
    absent = next(t for t in range(2, 384) if t not in free)

    def expected(seqs):
        for i in range(len(free)):
            if any(free[:i + 1][-len(s):] == s for s in seqs):
                return free[:i + 1], dsv4.FinishReason.STOP
        return free, dsv4.FinishReason.LENGTH

    for seqs in ([[free[3]]], [[free[4], free[5]]], [free[6:9]], [[free[2], absent]],
                 [[free[2], absent], free[8:10]]):
        assert finish(engine, max_new_tokens=12, stop_sequences=seqs, **NO_EOS) == \
            expected(seqs), seqs
    with pytest.raises(dsv4.InvalidArgument, match=r"stop_sequence_lens\[1\] is 0"):
        engine.generate(PROMPT, stop_sequences=[[3], []])
    with pytest.raises(TypeError, match="list of token-id lists"):
        engine.generate(PROMPT, stop_sequences=[3, 4])


def test_state_through_a_drain_shutdown():
    with dsv4.Engine(params()) as engine:
        assert engine.state() == (dsv4.EngineState.READY, "ready: 0 requests in flight")
        rid = engine.submit(PROMPT, max_new_tokens=1_000_000, temperature=0, **NO_EOS)
        with pytest.raises(dsv4.Timeout):
            engine.shutdown(dsv4.ShutdownMode.DRAIN, timeout_s=0)
        assert engine.state() == (dsv4.EngineState.DRAINING,
                                  "shutting down (drain): 1 request still running")
        engine.shutdown(dsv4.ShutdownMode.ABORT)
        state, reason = engine.state()
        assert state == dsv4.EngineState.STOPPED and "stopped" in reason
        events = engine.poll(timeout_s=1.0)
        assert any(e.request_id == rid and e.finish_reason == dsv4.FinishReason.ABORTED
                   for e in events)


def test_a_shut_down_engine_is_idle_and_a_poll_for_ever_returns():
    """After a shutdown the router takes the last event and stops (it used to spin on
    dsv4_poll, which returns at once from a stopped engine), and poll(None) returns."""
    import resource
    import time

    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    with dsv4.Engine(params()) as engine:
        rid = engine.submit(PROMPT, max_new_tokens=2, temperature=0, **NO_EOS)
        engine.shutdown(dsv4.ShutdownMode.DRAIN)
        events = engine.poll(timeout_s=None)
        while not any(e.terminal for e in events):
            events += engine.poll(timeout_s=None)
        assert [e.request_id for e in events] == [rid] * 3
        assert engine.poll(timeout_s=None) == []
        before, start = cpu(), time.monotonic()
        time.sleep(0.4)
        used, wall = cpu() - before, time.monotonic() - start
        assert used < 0.5 * wall, f"an idle shut-down engine used {used:.3f} s CPU in {wall:.3f} s"
