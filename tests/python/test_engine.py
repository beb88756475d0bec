"""dsv4.Engine over the real library, against the transformers goldens (read with a small
independent safetensors reader)."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import dsv4

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def read_safetensors(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    kinds = {"F32": np.float32, "I32": np.int32}
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], kinds[meta["dtype"]]).reshape(meta["shape"])
    return out


def params(variant):
    return {"model_path": str(FIXTURES / variant), "threads": 2,
            "kv": {"device_memory_bytes": "256MiB", "max_running_requests": 4}}


@pytest.mark.parametrize("variant,golden", [("flash-like/hf-f32", "logits_f32"),
                                            ("flash-like/official-fp8", "logits_q")])
def test_score_matches_transformers(variant, golden):
    gold = read_safetensors(FIXTURES / "flash-like" / "golden.safetensors")
    with dsv4.Engine(params(variant)) as engine:
        logits = engine.score(gold["input_ids"])
    assert logits.shape == gold[golden].shape and logits.dtype == np.float32
    assert np.abs(logits - gold[golden]).max() <= 1e-3
    assert (logits.argmax(-1) == gold[golden].argmax(-1)).all()


def test_model_info_and_close():
    engine = dsv4.Engine(json.dumps(params("pro-like/official-fp8")))
    info = engine.model_info()
    assert info["layer_kinds"] == ["hca", "hca", "csa", "hca", "csa", "swa"]
    assert info["mtp_layers_loaded"] == 1
    assert info["parameters"] > 0 and info["bytes_by_dtype"]["f32"] > 0
    engine.close()
    engine.close()
    with pytest.raises(dsv4.InvalidArgument):
        engine.score([1, 2])


def test_bad_input_raises_the_matching_exception():
    with pytest.raises(dsv4.FileError):
        dsv4.Engine({"model_path": "/nonexistent/model"})
    with pytest.raises(dsv4.Unsupported, match="`backend` = cuda.*use backend = cpu"):
        dsv4.Engine({**params("flash-like/hf-f32"), "backend": "cuda",
                     "kv": {"device_memory_bytes": "1GiB", "dtype": "f32", "indexer_dtype": "f32"}})
    with dsv4.Engine(params("flash-like/hf-f32")) as engine:
        with pytest.raises(dsv4.InvalidArgument, match="token id 384 at position 1"):
            engine.score([3, 384])
        with pytest.raises(dsv4.InvalidArgument, match="n_tokens is 0"):
            engine.score([])
