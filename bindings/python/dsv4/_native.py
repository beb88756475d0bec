"""Loads libdsv4 with ctypes and declares the C functions' signatures.

The package is pure Python: the native library is installed separately (`make install
PREFIX=...`) and found at import time, in this order:

1. `DSV4_LIBRARY`: the library file (or a directory holding it). When set it is the only place
   looked, so a wrong setting is an error rather than a silent fallback to another copy.
2. Next to the package (`dsv4/libdsv4.so*`, for a bundle that ships the two together).
3. When the package is imported from a source checkout (bindings/python/dsv4, or an editable
   install of it): the checkout's own build, `$CARGO_TARGET_DIR/release` then `target/release`.
   It comes before any installed copy because the binding's structs match that build's header.
4. Installed prefixes: `<sys.prefix>/lib` (a virtualenv or conda prefix), the `libdir` of
   `pkg-config dsv4` (honours PKG_CONFIG_PATH), `/usr/local/lib` (`make install`'s default),
   then the dynamic linker's own search (ldconfig's cache, LD_LIBRARY_PATH) through
   ctypes.util.find_library.

In each directory the soname `libdsv4.so.<MAJOR>` is preferred to the development symlink
`libdsv4.so`, which a runtime-only install may lack. If nothing is found, the OSError names
every place looked and how to fix it.
"""

import ctypes
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

from ._version import __version__

#: The soname's major version this binding's struct layouts belong to.
ABI_MAJOR = int(__version__.split(".")[0])
_NAMES = ("libdsv4.so.{}".format(ABI_MAJOR), "libdsv4.so")
_FIX = ("set DSV4_LIBRARY to the library file (e.g. /opt/dsv4/lib/libdsv4.so.{0}), install it "
        "into one of the prefixes above (`make install PREFIX=...`; for another prefix add "
        "<prefix>/lib/pkgconfig to PKG_CONFIG_PATH), or in a source checkout build it with "
        "`make lib`".format(ABI_MAJOR))


def _in_dir(directory: Path) -> List[Path]:
    return [directory / name for name in _NAMES]


def _checkout_root(here: Path) -> Optional[Path]:
    """The repository root when `here` (the package directory) is bindings/python/dsv4 of a
    dsv4 checkout, else None (an installed package never looks for a `target` directory)."""
    root = here.parent.parent.parent
    if here.parent.name == "python" and here.parent.parent.name == "bindings" \
            and (root / "Cargo.toml").is_file():
        return root
    return None


def _pkg_config_libdir() -> Tuple[str, Optional[Path]]:
    """(what pkg-config said, its libdir or None)."""
    try:
        out = subprocess.run(["pkg-config", "--variable=libdir", "dsv4"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return "pkg-config: not usable ({})".format(e.__class__.__name__), None
    libdir = out.stdout.strip()
    if out.returncode != 0 or not libdir:
        return "pkg-config --variable=libdir dsv4: no dsv4.pc on PKG_CONFIG_PATH", None
    return "pkg-config --variable=libdir dsv4", Path(libdir)


def _places(here: Path) -> Iterator[Tuple[str, List[Path]]]:
    """(description, candidate files) of every place after DSV4_LIBRARY, in search order;
    lazily, so pkg-config only runs when the earlier places had nothing."""
    # The pattern itself stands for "nothing matched" in the error (it is never a file).
    yield "next to the package", sorted(here.glob("libdsv4.so*")) or [here / "libdsv4.so*"]
    root = _checkout_root(here)
    if root is not None:
        target = os.environ.get("CARGO_TARGET_DIR")
        if target:
            yield "the checkout's build ($CARGO_TARGET_DIR/release)", \
                _in_dir((root / target).resolve() / "release")
        yield "the checkout's build (target/release)", _in_dir(root / "target" / "release")
    yield "the Python prefix (<sys.prefix>/lib)", _in_dir(Path(sys.prefix) / "lib")
    what, libdir = _pkg_config_libdir()
    yield what, _in_dir(libdir) if libdir else []
    yield "make install's default prefix", _in_dir(Path("/usr/local/lib"))


def _open(path: str) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        # A file that exists but does not load: another architecture, a missing dependency.
        raise OSError("libdsv4 at {} exists but did not load: {}".format(path, e)) from e


def _load() -> ctypes.CDLL:
    here = Path(__file__).resolve().parent
    env = os.environ.get("DSV4_LIBRARY")
    if env:
        path = Path(env)
        files = [p for p in _in_dir(path) if p.exists()] if path.is_dir() else [path]
        if files and files[0].is_file():
            return _open(str(files[0]))
        raise OSError("libdsv4 not found: DSV4_LIBRARY={} {}; point it at the library file (e.g. "
                      "<prefix>/lib/libdsv4.so.{}) or unset it to search the usual places".format(
                          env, "holds no libdsv4.so" if path.is_dir() else "does not exist",
                          ABI_MAJOR))
    looked = ["DSV4_LIBRARY: not set"]
    for what, paths in _places(here):
        for p in paths:
            if p.is_file():
                return _open(str(p))
        # pkg-config without a dsv4.pc has no paths: its description says why.
        looked.append("{}: {}".format(what, ", ".join(map(str, paths))) if paths else what)
    found = ctypes.util.find_library("dsv4")  # a soname for dlopen's own search, not a path
    if found:
        return _open(found)
    looked.append("the dynamic linker's search path (ldconfig, LD_LIBRARY_PATH): no libdsv4")
    raise OSError("libdsv4 not found. Looked in:\n  {}\nFix: {}.".format(
        "\n  ".join(looked), _FIX))


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


def _metric_fields() -> List[Tuple[str, Any]]:
    u64, f64 = ctypes.c_uint64, ctypes.c_double
    fields: List[Tuple[str, Any]] = [("struct_size", ctypes.c_uint32)]
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
               ("kv_transfer_early_bytes_total", u64),
               ("kv_transfer_rma_bytes_total", u64)]
    return fields


class Metrics(ctypes.Structure):
    """struct dsv4_metrics, version 1 (field order is the ABI)."""

    _fields_ = _metric_fields()


lib.dsv4_metrics_get.restype = status_t
lib.dsv4_metrics_get.argtypes = [ctypes.c_void_p, ctypes.POINTER(Metrics)]
lib.dsv4_metrics_prometheus.restype = status_t
lib.dsv4_metrics_prometheus.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size_t,
                                        ctypes.POINTER(size_t)]
lib.dsv4_tokenize.restype = status_t
lib.dsv4_tokenize.argtypes = [ctypes.c_void_p, c_char_p, ctypes.c_int32,
                              ctypes.POINTER(ctypes.c_int32), size_t, ctypes.POINTER(size_t)]
lib.dsv4_detokenize.restype = status_t
lib.dsv4_detokenize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), size_t,
                                ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]
lib.dsv4_chat_apply.restype = status_t
lib.dsv4_chat_apply.argtypes = [ctypes.c_void_p, c_char_p, ctypes.c_int32, ctypes.c_void_p, size_t,
                                ctypes.POINTER(size_t)]
lib.dsv4_detokenizer_create.restype = status_t
lib.dsv4_detokenizer_create.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
lib.dsv4_detokenizer_feed.restype = status_t
lib.dsv4_detokenizer_feed.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, size_t,
                                      ctypes.POINTER(size_t)]
lib.dsv4_detokenizer_destroy.restype = None
lib.dsv4_detokenizer_destroy.argtypes = [ctypes.c_void_p]
