"""Values the binding passes to C are checked against their C types, never truncated.

ctypes stores 2**32 + 5 in an int32_t as 5, -1 in a uint32_t as 4294967295 and a str up to its
first NUL, so without the checks each case below would reach the library as a different, valid
request. Each is refused by the binding (InvalidArgument, a ValueError, or TypeError for a value
of the wrong kind) with the argument, the value and the C type's range in the message, and the
library never sees it (its metrics do not count a refusal)."""

import math
from pathlib import Path

import numpy as np
import pytest

import dsv4
from dsv4.requests import build_request

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flash-like" / "hf-f32"
PROMPT = [5, 17, 300, 2, 9, 44]
INT32 = "int32_t, -2147483648 to 2147483647"
UINT32 = "uint32_t, 0 to 4294967295"
UINT64 = "uint64_t, 0 to 18446744073709551615"


def params(**extra):
    return {"model_path": str(FIXTURE), "threads": 2,
            "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128},
            **extra}


@pytest.fixture(scope="module")
def engine():
    with dsv4.Engine(params()) as e:
        yield e


def refused(engine, exc, match, prompt=PROMPT, **fields):
    """submit() raises `exc` matching `match`, and the library saw no request."""
    before = engine.metrics()
    with pytest.raises(exc, match=match) as info:
        engine.submit(prompt, **fields)
    after = engine.metrics()
    for key in ("requests_total", "rejected_invalid_total"):
        assert after[key] == before[key], key
    return info.value


# --- the cases of the hardening sweep -------------------------------------------------------

def test_token_beyond_int32_is_not_taken_modulo_2_32(engine):
    err = refused(engine, dsv4.InvalidArgument, r"prompt\[1\] = 4294967301 is out of range",
                  prompt=[5, 2**32 + 5])
    assert INT32 in str(err) and err.status == dsv4.InvalidArgument.status
    assert isinstance(err, ValueError)
    for field in ("stop_tokens", "logit_bias_tokens"):
        extra = {"logit_bias_values": [0.0]} if field == "logit_bias_tokens" else {}
        refused(engine, dsv4.InvalidArgument, r"{}\[0\] = 4294967301".format(field),
                **{field: [2**32 + 5]}, **extra)
    with pytest.raises(dsv4.InvalidArgument, match=r"tokens\[2\] = 4294967301 .*" + INT32):
        engine.score([5, 6, 2**32 + 5])


def test_negative_max_new_tokens_is_not_4294967295(engine):
    err = refused(engine, dsv4.InvalidArgument, "max_new_tokens = -1 is out of range",
                  max_new_tokens=-1)
    assert UINT32 in str(err)
    refused(engine, dsv4.InvalidArgument, "max_new_tokens = 4294967296", max_new_tokens=2**32)


def test_top_k_2_32_is_not_0(engine):
    err = refused(engine, dsv4.InvalidArgument, "top_k = 4294967296 is out of range", top_k=2**32)
    assert INT32 in str(err)


def test_cache_salt_with_a_nul_is_not_cut_short(engine):
    refused(engine, dsv4.InvalidArgument, r"cache_salt = 'a\\x00b' contains a NUL at byte 1",
            cache_salt="a\0b")
    refused(engine, dsv4.InvalidArgument, "cache_salt .* NUL at byte 0", cache_salt=b"\0")
    refused(engine, TypeError, "cache_salt must be a str, not int", cache_salt=7)
    refused(engine, dsv4.InvalidArgument, r"pd_peer = 'tcp://h:1\\x00' contains a NUL at byte 9",
            pd_peer="tcp://h:1\0")
    refused(engine, TypeError, "pd_peer must be a str, not int", pd_peer=7)


def test_huge_shutdown_timeout_is_refused_not_1_ms():
    with dsv4.Engine(params()) as e:
        for bad in (1e12, 2**31 / 1000, float("inf"), float("nan"), -0.5, 10**400):
            with pytest.raises(dsv4.InvalidArgument,
                               match=r"timeout_s = .* out of range: use None \(no limit\) or 0 "
                                     r"to 2147483\.647 seconds"):
                e.shutdown(dsv4.ShutdownMode.ABORT, timeout_s=bad)
        with pytest.raises(TypeError, match="timeout_s must be a number"):
            e.shutdown(timeout_s="1")
        # None of them reached the library: the engine still takes requests.
        assert len(e.generate(PROMPT, max_new_tokens=2, temperature=0,
                              logit_bias_tokens=[1], logit_bias_values=[-1e3])) == 2
        # The largest timeout is accepted (and the shutdown, on an idle engine, is immediate).
        e.shutdown(dsv4.ShutdownMode.DRAIN, timeout_s=2147483.647)
        with pytest.raises(dsv4.ShutDown):
            e.submit(PROMPT)


# --- more of the same kind --------------------------------------------------------------------

def test_negative_ids(engine):
    with pytest.raises(dsv4.InvalidArgument, match=r"request_id = -1 is out of range.*" + UINT64):
        engine.abort(-1)
    with pytest.raises(dsv4.InvalidArgument, match="request_id = 18446744073709551616"):
        engine.abort(2**64)
    for field in ("seed", "user_tag"):
        refused(engine, dsv4.InvalidArgument, field + r" = -1 .*" + UINT64, **{field: -1})
    refused(engine, dsv4.InvalidArgument, "deadline_ms = -5 .*" + UINT32, deadline_ms=-5)
    refused(engine, dsv4.InvalidArgument, r"pd_room = -1 .*" + UINT64, pd_room=-1)
    refused(engine, dsv4.InvalidArgument, "pd_room = 18446744073709551616", pd_room=2**64)
    # A negative token id fits int32_t: it reaches the library, which refuses it.
    with pytest.raises(dsv4.InvalidArgument, match="prompt token id -1 at index 0 is negative"):
        engine.submit([-1, 5])
    with pytest.raises(dsv4.InvalidArgument, match=r"prompt\[0\] = -2147483649 .*" + INT32):
        engine.submit([-2**31 - 1])


def test_floats_where_integers_are_expected(engine):
    refused(engine, TypeError, r"prompt\[1\] must be an integer \(int32_t\), not float: 2.5",
            prompt=[5, 2.5])
    refused(engine, TypeError, r"prompt\[0\] must be an integer .* not float: 3.0",
            prompt=[3.0])
    refused(engine, TypeError, r"max_new_tokens must be an integer \(uint32_t\), not float",
            max_new_tokens=4.0)
    refused(engine, TypeError, "top_k must be an integer", top_k=1.5)
    refused(engine, TypeError, "priority must be an integer .* not str", priority="1")
    refused(engine, TypeError, "max_new_tokens must be an integer .* not NoneType",
            max_new_tokens=None)
    with pytest.raises(TypeError, match=r"tokens must hold integers \(int32_t\), not float64"):
        engine.score(np.array([5.0, 6.0]))
    with pytest.raises(TypeError, match="request_id must be an integer"):
        engine.abort(1.0)


def test_bools_are_not_integers(engine):
    refused(engine, TypeError, r"prompt\[0\] must be an integer \(int32_t\), not a bool: True",
            prompt=[True, 5])
    refused(engine, TypeError, "max_new_tokens must be an integer .* not a bool",
            max_new_tokens=True)
    refused(engine, TypeError, r"temperature must be a number \(float\), not bool",
            temperature=False)
    refused(engine, TypeError, "seed must be an integer .* not a bool", seed=np.bool_(True))
    with pytest.raises(TypeError, match="tokens must hold integers"):
        engine.score(np.array([True, False]))


def test_floats_beyond_float32_are_refused_not_made_infinite(engine):
    refused(engine, dsv4.InvalidArgument,
            r"temperature = 1e\+300 is out of range: the C type is float, at most 3.40282e\+38",
            temperature=1e300)
    refused(engine, dsv4.InvalidArgument, r"logit_bias_values\[1\] = -1e\+39 is out of range",
            logit_bias_tokens=[1, 2], logit_bias_values=[0.5, -1e39])
    refused(engine, dsv4.InvalidArgument, "top_p = 1000000000000000000000000000000000000000 is",
            top_p=10**39)
    refused(engine, TypeError, r"min_p must be a number \(float\), not str", min_p="0.1")


def test_status_mode_tier_and_params_are_checked_too(engine):
    # status_name(2**32) used to name status 0.
    with pytest.raises(dsv4.InvalidArgument, match="status = 4294967296 .*" + INT32):
        dsv4.status_name(2**32)
    assert dsv4.status_name(-2**31) == "DSV4_STATUS_UNKNOWN"
    # A mode of 2**32 used to be DRAIN (0).
    with pytest.raises(dsv4.InvalidArgument, match="mode = 4294967296 .*" + INT32):
        engine.shutdown(2**32)
    with pytest.raises(dsv4.InvalidArgument, match=r"tier = 'device\\x00host' contains a NUL"):
        engine.cache_flush("device\0host")
    with pytest.raises(TypeError, match="tier must be a str, not NoneType"):
        engine.cache_flush(None)
    # JSON text with a NUL used to be validated up to the NUL only.
    with pytest.raises(dsv4.InvalidArgument, match="params = .* contains a NUL at byte 14"):
        dsv4.validate_params('{"threads": 4}\0{"threads": "x"}')
    with pytest.raises(dsv4.InvalidArgument, match="params .* NUL"):
        dsv4.plan(b'{}\0')
    # A dict is serialised with NUL escaped, so a NUL inside a value reaches the parser intact.
    with pytest.raises(dsv4.FileError):
        dsv4.plan({"model_path": "/nonexistent\0/model"})


def test_the_limits_themselves_are_accepted_exactly(engine):
    req, _keep = build_request(
        [0, 2**31 - 1], {"max_new_tokens": 2**32 - 1, "top_k": 2**31 - 1, "seed": 2**64 - 1,
                         "user_tag": 2**64 - 1, "priority": -2**31, "deadline_ms": 2**32 - 1,
                         "temperature": 3.4028234663852886e38, "stop_tokens": [-2**31],
                         "logit_bias_tokens": [7], "logit_bias_values": [-math.inf],
                         "cache_salt": "ü", "logprobs": True, "pd_room": 2**64 - 1,
                         "pd_peer": "tcp://[::1]:65535"})
    assert (req.prompt[0], req.prompt[1], req.prompt_len) == (0, 2**31 - 1, 2)
    assert (req.max_new_tokens, req.top_k, req.seed) == (2**32 - 1, 2**31 - 1, 2**64 - 1)
    assert (req.user_tag, req.priority, req.deadline_ms) == (2**64 - 1, -2**31, 2**32 - 1)
    assert req.temperature == 3.4028234663852886e38 and req.stop_tokens[0] == -2**31
    assert req.logit_bias_values[0] == -math.inf and req.logit_bias_len == 1
    assert req.cache_salt == "ü".encode() and req.logprobs == 1
    assert (req.pd_room, req.pd_peer) == (2**64 - 1, b"tcp://[::1]:65535")
    # numpy integers of any width are accepted when they fit, refused when they do not.
    assert engine.score(np.array(PROMPT, dtype=np.int64)).shape == (len(PROMPT), 384)
    assert engine.score(np.array(PROMPT, dtype=np.uint16)).shape == (len(PROMPT), 384)
    with pytest.raises(dsv4.InvalidArgument, match=r"tokens\[1\] = 4294967301 .*" + INT32):
        engine.score(np.array([5, 2**32 + 5, 6], dtype=np.int64))
    with pytest.raises(TypeError, match="must be one-dimensional"):
        engine.score(np.array([PROMPT]))
    # The largest user_tag comes back in the events unchanged.
    events = list(engine.stream(PROMPT, max_new_tokens=1, user_tag=2**64 - 1, seed=2**64 - 1))
    assert {e.user_tag for e in events} == {2**64 - 1}
