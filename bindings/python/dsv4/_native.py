"""Loads libdsv4 with ctypes and declares the C functions' signatures."""

import ctypes
import os
from pathlib import Path

_SONAME = "libdsv4.so"


def _candidates():
    env = os.environ.get("DSV4_LIBRARY")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield from sorted(here.glob(_SONAME + "*"))
    # A source checkout: bindings/python/dsv4 → repository root → target/release.
    for parent in here.parents:
        built = parent / "target" / "release" / _SONAME
        if built.exists():
            yield built
            break


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            return ctypes.CDLL(str(path))
    raise OSError(
        "libdsv4 not found (tried: {}): set DSV4_LIBRARY to the library's path, put it next to "
        "the dsv4 package, or build it with `make lib`".format(", ".join(tried) or "nothing")
    )


lib = _load()

c_char_p = ctypes.c_char_p
size_t = ctypes.c_size_t
status_t = ctypes.c_int32

lib.dsv4_last_error.restype = c_char_p
lib.dsv4_last_error.argtypes = []
lib.dsv4_status_name.restype = c_char_p
lib.dsv4_status_name.argtypes = [status_t]
lib.dsv4_version.restype = c_char_p
lib.dsv4_version.argtypes = []
lib.dsv4_params_default.restype = status_t
lib.dsv4_params_default.argtypes = [ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]
for _name in ("dsv4_params_validate", "dsv4_plan", "dsv4_plan_text"):
    _fn = getattr(lib, _name)
    _fn.restype = status_t
    _fn.argtypes = [c_char_p, ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]

lib.dsv4_engine_create.restype = status_t
lib.dsv4_engine_create.argtypes = [c_char_p, ctypes.POINTER(ctypes.c_void_p)]
lib.dsv4_engine_destroy.restype = None
lib.dsv4_engine_destroy.argtypes = [ctypes.c_void_p]
lib.dsv4_score.restype = status_t
lib.dsv4_score.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), size_t,
                           ctypes.POINTER(ctypes.c_float), size_t]
lib.dsv4_model_info.restype = status_t
lib.dsv4_model_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]
lib.dsv4_params_resolved.restype = status_t
lib.dsv4_params_resolved.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size_t,
                                     ctypes.POINTER(size_t)]
lib.dsv4_engine_state.restype = status_t
lib.dsv4_engine_state.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
                                  ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]
lib.dsv4_finish_reason_name.restype = c_char_p
lib.dsv4_finish_reason_name.argtypes = [ctypes.c_int32]
lib.dsv4_pd_endpoint.restype = status_t
lib.dsv4_pd_endpoint.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]


class Request(ctypes.Structure):
    """struct dsv4_request, version 3: version 1, the appended `pd_room` and `pd_peer`
    (version 2), then the stop sequences and `ignore_eos` (field order is the ABI)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("prompt", ctypes.POINTER(ctypes.c_int32)),
        ("prompt_len", size_t),
        ("max_new_tokens", ctypes.c_uint32),
        ("stop_tokens", ctypes.POINTER(ctypes.c_int32)),
        ("stop_tokens_len", size_t),
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("top_p", ctypes.c_float),
        ("min_p", ctypes.c_float),
        ("seed", ctypes.c_uint64),
        ("logit_bias_tokens", ctypes.POINTER(ctypes.c_int32)),
        ("logit_bias_values", ctypes.POINTER(ctypes.c_float)),
        ("logit_bias_len", size_t),
        ("priority", ctypes.c_int32),
        ("deadline_ms", ctypes.c_uint32),
        ("cache_salt", c_char_p),
        ("user_tag", ctypes.c_uint64),
        ("logprobs", ctypes.c_uint8),
        ("pd_room", ctypes.c_uint64),
        ("pd_peer", c_char_p),
        ("stop_sequences", ctypes.POINTER(ctypes.c_int32)),
        ("stop_sequence_lens", ctypes.POINTER(size_t)),
        ("stop_sequences_len", size_t),
        ("ignore_eos", ctypes.c_uint8),
    ]


class Event(ctypes.Structure):
    """struct dsv4_event (version 1 plus the appended `message`)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("request_id", ctypes.c_uint64),
        ("user_tag", ctypes.c_uint64),
        ("kind", ctypes.c_int32),
        ("token", ctypes.c_int32),
        ("logprob", ctypes.c_float),
        ("finish_reason", ctypes.c_int32),
        ("status", ctypes.c_int32),
        ("prompt_tokens", ctypes.c_uint32),
        ("cached_tokens_device", ctypes.c_uint32),
        ("cached_tokens_host", ctypes.c_uint32),
        ("generated_tokens", ctypes.c_uint32),
        ("queue_us", ctypes.c_uint64),
        ("ttft_us", ctypes.c_uint64),
        ("elapsed_us", ctypes.c_uint64),
        ("message", ctypes.c_char_p),
    ]


lib.dsv4_request_init.restype = status_t
lib.dsv4_request_init.argtypes = [ctypes.POINTER(Request), size_t]
lib.dsv4_submit.restype = status_t
lib.dsv4_submit.argtypes = [ctypes.c_void_p, ctypes.POINTER(Request), ctypes.POINTER(ctypes.c_uint64)]
lib.dsv4_poll.restype = status_t
lib.dsv4_poll.argtypes = [ctypes.c_void_p, ctypes.POINTER(Event), size_t, ctypes.POINTER(size_t),
                          ctypes.c_int32]
lib.dsv4_abort.restype = status_t
lib.dsv4_abort.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
lib.dsv4_engine_shutdown.restype = status_t
lib.dsv4_engine_shutdown.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
lib.dsv4_cache_stats.restype = status_t
lib.dsv4_cache_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]
lib.dsv4_cache_flush.restype = status_t
lib.dsv4_cache_flush.argtypes = [ctypes.c_void_p, c_char_p]


class Units(ctypes.Structure):
    """struct dsv4_units."""

    _fields_ = [(name, ctypes.c_uint64) for name in ("used", "total", "used_bytes", "total_bytes")]


def _metric_fields():
    u64, f64 = ctypes.c_uint64, ctypes.c_double
    fields = [("struct_size", ctypes.c_uint32)]
    fields += [(n, u64) for n in ("num_running_reqs", "num_loading_reqs", "num_queue_reqs",
                                  "num_queue_tokens")]
    fields += [(n, Units) for n in ("device_pages", "device_slots", "device_snapshots",
                                    "host_pages", "host_snapshots")]
    fields += [(n, u64) for n in (
        "requests_total", "finished_stop_total", "finished_length_total", "aborted_total",
        "timed_out_total", "failed_total", "rejected_queue_full_total",
        "rejected_capacity_total", "rejected_invalid_total", "rejected_shutdown_total",
        "retractions_total", "prompt_tokens_total", "generation_tokens_total",
        "cached_tokens_device_total", "cached_tokens_host_total", "forward_steps_total",
        "forward_tokens_total", "loadback_tokens_total", "loadback_bytes_total")]
    fields += [("loadback_seconds_total", f64), ("backup_tokens_total", u64),
               ("backup_bytes_total", u64), ("backup_seconds_total", f64)]
    fields += [(n, u64) for n in ("evictions_device_to_host_total",
                                  "evictions_device_dropped_total", "evictions_host_total",
                                  "kv_transfer_requests_total", "kv_transfer_bytes_total")]
    fields += [("kv_transfer_seconds_total", f64), ("kv_transfer_failures_total", u64)]
    for name in ("ttft", "itl", "e2e", "queue"):
        fields += [(name + "_seconds_sum", f64), (name + "_count", u64)]
    # Appended after version 1: prefill/decode rooms.
    fields += [(n, u64) for n in (
        "num_prefill_bootstrap_queue_reqs", "num_prefill_inflight_queue_reqs",
        "num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs", "pd_pages_held",
        "pd_early_claims", "pd_peers")]
    fields += [("kv_transfer_failures_%s_total" % r, u64) for r in (
        "timeout", "peer_dead", "aborted", "layout", "mismatch", "checksum", "capacity")]
    fields += [("kv_transfer_claim_wait_seconds_sum", f64), ("kv_transfer_claim_wait_count", u64),
               ("kv_transfer_early_bytes_total", u64)]
    return fields


class Metrics(ctypes.Structure):
    """struct dsv4_metrics, version 1 (field order is the ABI)."""

    _fields_ = _metric_fields()


lib.dsv4_metrics_get.restype = status_t
lib.dsv4_metrics_get.argtypes = [ctypes.c_void_p, ctypes.POINTER(Metrics)]
lib.dsv4_metrics_prometheus.restype = status_t
lib.dsv4_metrics_prometheus.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size_t,
                                        ctypes.POINTER(size_t)]
