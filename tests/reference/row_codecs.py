#!/usr/bin/env python3
"""Encoded KV rows for dsv4's row-codec tests, computed independently with numpy + ml_dtypes.

For each codec (docs/kv-cache.md "Row formats", src/formats/rows.rs) and a few widths, writes
random rows (with edge cases: zeros, tiny and huge values, exact rounding ties) and their encoded
bytes to tests/fixtures/row_codecs.safetensors. dsv4 must produce the same bytes.

    python tests/reference/row_codecs.py        # needs numpy and ml_dtypes
"""

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "row_codecs.safetensors"
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
BF16 = ml_dtypes.bfloat16


def ceil_log2(v):
    """ceil(log2 v) exactly (v > 0): v = m·2^e with m in [0.5, 1)."""
    m, e = math.frexp(float(v))
    return e - 1 if m == 0.5 else e


def e4m3_bytes(values):
    return np.asarray(values, np.float32).astype(E4M3).view(np.uint8)


def bf16_bytes(values):
    return np.asarray(values, np.float32).astype(BF16).view(np.uint8)


def encode_fp8_kv(row, nope, rope):
    size = nope + 2 * rope + math.ceil(nope / 64)
    size += -size % 8
    out = np.zeros(size, np.uint8)
    scales = []
    for b in range(0, nope, 64):
        block = row[b:min(b + 64, nope)]
        amax = max(float(np.abs(block).max()), np.float32(1e-4))
        e = ceil_log2(np.float32(amax) / np.float32(448.0))
        scale = np.float32(2.0 ** e)
        out[b:b + len(block)] = e4m3_bytes(np.clip(block / scale, -448, 448))
        scales.append(e + 127)
    out[nope:nope + 2 * rope] = bf16_bytes(row[nope:])
    out[nope + 2 * rope:nope + 2 * rope + len(scales)] = scales
    return out


def encode_fp8_index(row):
    width = len(row)
    out = np.zeros(width + 4 * math.ceil(width / 128), np.uint8)
    for i, b in enumerate(range(0, width, 128)):
        block = row[b:b + 128]
        amax = np.float32(max(float(np.abs(block).max()), np.float32(1e-4)))
        scale = np.float32(amax / np.float32(448.0))
        out[b:b + len(block)] = e4m3_bytes(np.clip(block / scale, -448, 448))
        out[width + 4 * i:width + 4 * i + 4] = np.frombuffer(struct.pack("<f", scale), np.uint8)
    return out


def encode_fp4_index(row):
    width = len(row)
    codes = np.zeros(width, np.uint8)
    scales = []
    for b in range(0, width, 32):
        block = row[b:b + 32]
        amax = max(float(np.abs(block).max()), 6.0 * 2.0 ** -126)
        e = ceil_log2(np.float32(amax) / np.float32(6.0))
        scale = np.float32(2.0 ** e)
        q = np.clip(block / scale, -6, 6).astype(np.float32).astype(E2M1)
        codes[b:b + len(block)] = q.view(np.uint8) & 0x0F
        scales.append(e + 127)
    packed = codes[0::2] | (codes[1::2] << 4)
    return np.concatenate([packed.astype(np.uint8), np.array(scales, np.uint8)])


def rows(width, n, seed):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((n, width)).astype(np.float32)
    out *= np.exp(rng.uniform(-8, 8, (n, 1))).astype(np.float32)  # scales from 3e-4 to 3e3
    out[0] = 0.0                                                    # amax floor
    out[1] = 1e-9                                                   # tiny
    out[2, :] = np.float32(1e4)                                     # saturating values
    out[3, ::2] = np.float32(1.0625)                                # e4m3 ties (1 + 1/16)
    out[3, 1::2] = np.float32(448.0)
    out[4, :] = np.tile(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]), width // 8)
    return out


def write(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}[array.dtype]
        blob = array.tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    tensors = {}
    cases = [
        ("fp8kv_512", 512, lambda r: encode_fp8_kv(r, 448, 64)),
        ("fp8kv_64", 64, lambda r: encode_fp8_kv(r, 48, 16)),
        ("fp8index_128", 128, encode_fp8_index),
        ("fp8index_32", 32, encode_fp8_index),
        ("fp4index_128", 128, encode_fp4_index),
        ("fp4index_32", 32, encode_fp4_index),
        ("bf16_64", 64, bf16_bytes),
    ]
    for seed, (name, width, encode) in enumerate(cases):
        inputs = rows(width, 64, seed)
        tensors[f"{name}.input"] = inputs
        tensors[f"{name}.bytes"] = np.stack([encode(r) for r in inputs])
    write(OUT, tensors)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
