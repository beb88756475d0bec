// KV row codecs (mirrors formats::rows::RowCodec::{encode, decode} and the CPU backend's
// write_rows / read_rows / codec_round_trip): F32, Bf16, Fp8Kv {nope, rope}, Fp8Index, Fp4Index.
// Bit-exact, bytes included (pad bytes are written as zeros), NaN payloads aside.
//
// Row placement (backend::RowLayout, see row_offset in prelude.cuh), the same seven arguments
// on every write/read kernel:
//   u8* pool, const i32* pages (null: ring), i64 rows_per_unit, i64 unit_bytes, i64 ring_rows,
//   i64 offset, i64 row_bytes
// row_bytes must equal the codec's RowCodec::row_bytes(width). Writes encode rows
// x_row0 .. x_row0 + n of x ([_, width] f32) into rows first .. first + n of the layout; reads
// decode rows first .. first + n into out ([n, width] f32). Every kernel is a 1-D grid-stride
// loop over n · units, a unit being one value (f32, bf16) or one scale block (the FP8/FP4
// codecs: one thread quantises a whole block, so block maxima need no cross-thread reduction).
#include "prelude.cuh"

#define KV_BLOCK 64
#define INDEX_FP8_BLOCK 128
#define INDEX_FP4_BLOCK 32

#define DSV4_PLACEMENT_PARAMS                                                                  \
    u8 *pool, const i32 *pages, i64 rows_per_unit, i64 unit_bytes, i64 ring_rows, i64 offset, \
        i64 row_bytes
#define DSV4_ROW(r) (pool + row_offset((r), pages, rows_per_unit, unit_bytes, ring_rows, offset, row_bytes))

DSV4_FN void store_f32_le(u8* p, float v) {
    const u32 b = f2u(v);
    p[0] = (u8)b;
    p[1] = (u8)(b >> 8);
    p[2] = (u8)(b >> 16);
    p[3] = (u8)(b >> 24);
}
DSV4_FN float load_f32_le(const u8* p) {
    return u2f((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}
DSV4_FN void store_bf16_le(u8* p, float v) {
    const u16 h = f32_to_bf16(v);
    p[0] = (u8)h;
    p[1] = (u8)(h >> 8);
}
DSV4_FN float load_bf16_le(const u8* p) { return bf16_to_f32((u16)((u32)p[0] | ((u32)p[1] << 8))); }

// --- block quantisers (one scale block, one thread) ------------------------------------------

// Fp8Kv: the exponent e of the ue8m0 scale 2^e = 2^ceil(log2(max(amax, 1e-4) / 448)).
DSV4_FN i32 fp8_kv_exponent(const float* v, i32 len) {
    float amax = 1e-4f;
    for (i32 i = 0; i < len; i++) amax = max_f32(amax, abs_f32(v[i]));
    return ceil_log2(amax / 448.0f);
}

// Fp8Index: the f32 scale max(amax, 1e-4) / 448.
DSV4_FN float fp8_index_scale(const float* v, i32 len) {
    float amax = 1e-4f;
    for (i32 i = 0; i < len; i++) amax = max_f32(amax, abs_f32(v[i]));
    return amax / 448.0f;
}

// Fp4Index: the exponent of 2^ceil(log2(max(amax, 6·2^-126) / 6)).
DSV4_FN i32 fp4_exponent(const float* v, i32 len) {
    float amax = 6.0f * pow2i(-126);
    for (i32 i = 0; i < len; i++) amax = max_f32(amax, abs_f32(v[i]));
    return ceil_log2(amax / 6.0f);
}

DSV4_FN u8 fp8_code(float v, float scale) { return f32_to_e4m3(clamp_f32(v / scale, -448.0f, 448.0f)); }
DSV4_FN u8 fp4_code(float v, float scale) { return f32_to_e2m1(clamp_f32(v / scale, -6.0f, 6.0f)); }

DSV4_FN i32 min_i32(i32 a, i32 b) { return a < b ? a : b; }
DSV4_FN i32 div_ceil(i32 a, i32 b) { return (a + b - 1) / b; }

// --- F32 -------------------------------------------------------------------------------------

// Units: one per value (n · width).
extern "C" __global__ void kv_write_f32(const float* x, i64 x_row0, i32 n, i32 width,
                                        DSV4_PLACEMENT_PARAMS, i64 first) {
    const i64 total = (i64)n * width;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / width, c = i % width;
        store_f32_le(DSV4_ROW(first + r) + 4 * c, x[(x_row0 + r) * width + c]);
    }
}

extern "C" __global__ void kv_read_f32(float* out, i32 n, i32 width, DSV4_PLACEMENT_PARAMS,
                                       i64 first) {
    const i64 total = (i64)n * width;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / width, c = i % width;
        out[i] = load_f32_le(DSV4_ROW(first + r) + 4 * c);
    }
}

// --- Bf16 ------------------------------------------------------------------------------------

// Units: one per value (n · width).
extern "C" __global__ void kv_write_bf16(const float* x, i64 x_row0, i32 n, i32 width,
                                         DSV4_PLACEMENT_PARAMS, i64 first) {
    const i64 total = (i64)n * width;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / width, c = i % width;
        store_bf16_le(DSV4_ROW(first + r) + 2 * c, x[(x_row0 + r) * width + c]);
    }
}

extern "C" __global__ void kv_read_bf16(float* out, i32 n, i32 width, DSV4_PLACEMENT_PARAMS,
                                        i64 first) {
    const i64 total = (i64)n * width;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / width, c = i % width;
        out[i] = load_bf16_le(DSV4_ROW(first + r) + 2 * c);
    }
}

// x [n_values] f32 in place: bf16 round trip of every value.
extern "C" __global__ void kv_round_trip_bf16(float* x, i64 n_values) {
    for (i64 i = DSV4_GRID_START; i < n_values; i += DSV4_GRID_STRIDE)
        x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

// --- Fp8Kv {nope, rope}: [nope e4m3][rope bf16][ceil(nope/64) ue8m0][zero pad to row_bytes] ---

// Units per row: ceil(nope/64) scale blocks, plus one for the rope channels, scales' tail and pad
// (that unit writes bytes nope .. row_bytes except the scale bytes, which their blocks write).
extern "C" __global__ void kv_write_fp8(const float* x, i64 x_row0, i32 n, i32 nope, i32 rope,
                                        DSV4_PLACEMENT_PARAMS, i64 first) {
    const i32 blocks = div_ceil(nope, KV_BLOCK);
    const i32 units = blocks + 1;
    const i32 width = nope + rope;
    const i64 total = (i64)n * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        const float* xr = x + (x_row0 + r) * width;
        u8* row = DSV4_ROW(first + r);
        if (u < blocks) {
            const i32 c0 = u * KV_BLOCK, len = min_i32(KV_BLOCK, nope - c0);
            const i32 e = fp8_kv_exponent(xr + c0, len);
            const float scale = pow2i(e);
            row[nope + 2 * rope + u] = e8m0_byte(e);
            for (i32 j = 0; j < len; j++) row[c0 + j] = fp8_code(xr[c0 + j], scale);
        } else {
            for (i32 j = 0; j < rope; j++) store_bf16_le(row + nope + 2 * j, xr[nope + j]);
            for (i64 b = nope + 2 * rope + blocks; b < row_bytes; b++) row[b] = 0;
        }
    }
}

extern "C" __global__ void kv_read_fp8(float* out, i32 n, i32 nope, i32 rope, DSV4_PLACEMENT_PARAMS,
                                       i64 first) {
    const i32 blocks = div_ceil(nope, KV_BLOCK);
    const i32 units = blocks + 1;
    const i32 width = nope + rope;
    const i64 total = (i64)n * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        float* o = out + r * width;
        const u8* row = DSV4_ROW(first + r);
        if (u < blocks) {
            const i32 c0 = u * KV_BLOCK, len = min_i32(KV_BLOCK, nope - c0);
            const float scale = e8m0_to_f32(row[nope + 2 * rope + u]);
            for (i32 j = 0; j < len; j++) o[c0 + j] = e4m3_to_f32(row[c0 + j]) * scale;
        } else {
            for (i32 j = 0; j < rope; j++) o[nope + j] = load_bf16_le(row + nope + 2 * j);
        }
    }
}

// x [rows, nope + rope] f32 in place: encode then decode (codec_round_trip). Units as kv_write_fp8.
extern "C" __global__ void kv_round_trip_fp8(float* x, i32 rows, i32 nope, i32 rope) {
    const i32 blocks = div_ceil(nope, KV_BLOCK);
    const i32 units = blocks + 1;
    const i32 width = nope + rope;
    const i64 total = (i64)rows * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        float* xr = x + r * width;
        if (u < blocks) {
            const i32 c0 = u * KV_BLOCK, len = min_i32(KV_BLOCK, nope - c0);
            const i32 e = fp8_kv_exponent(xr + c0, len);
            const float scale = pow2i(e);
            const float stored = e8m0_to_f32(e8m0_byte(e));
            for (i32 j = 0; j < len; j++) xr[c0 + j] = e4m3_to_f32(fp8_code(xr[c0 + j], scale)) * stored;
        } else {
            for (i32 j = 0; j < rope; j++) xr[nope + j] = bf16_to_f32(f32_to_bf16(xr[nope + j]));
        }
    }
}

// --- Fp8Index: [width e4m3][ceil(width/128) f32 scales, little-endian] -------------------------

// Units per row: ceil(width/128) scale blocks.
extern "C" __global__ void kv_write_fp8_index(const float* x, i64 x_row0, i32 n, i32 width,
                                              DSV4_PLACEMENT_PARAMS, i64 first) {
    const i32 units = div_ceil(width, INDEX_FP8_BLOCK);
    const i64 total = (i64)n * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        const float* xr = x + (x_row0 + r) * width;
        u8* row = DSV4_ROW(first + r);
        const i32 c0 = u * INDEX_FP8_BLOCK, len = min_i32(INDEX_FP8_BLOCK, width - c0);
        const float scale = fp8_index_scale(xr + c0, len);
        store_f32_le(row + width + 4 * u, scale);
        for (i32 j = 0; j < len; j++) row[c0 + j] = fp8_code(xr[c0 + j], scale);
    }
}

extern "C" __global__ void kv_read_fp8_index(float* out, i32 n, i32 width, DSV4_PLACEMENT_PARAMS,
                                             i64 first) {
    const i32 units = div_ceil(width, INDEX_FP8_BLOCK);
    const i64 total = (i64)n * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        float* o = out + r * width;
        const u8* row = DSV4_ROW(first + r);
        const i32 c0 = u * INDEX_FP8_BLOCK, len = min_i32(INDEX_FP8_BLOCK, width - c0);
        const float scale = load_f32_le(row + width + 4 * u);
        for (i32 j = 0; j < len; j++) o[c0 + j] = e4m3_to_f32(row[c0 + j]) * scale;
    }
}

// x [rows, width] f32 in place: encode then decode. Units as kv_write_fp8_index.
extern "C" __global__ void kv_round_trip_fp8_index(float* x, i32 rows, i32 width) {
    const i32 units = div_ceil(width, INDEX_FP8_BLOCK);
    const i64 total = (i64)rows * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        float* xr = x + r * width;
        const i32 c0 = u * INDEX_FP8_BLOCK, len = min_i32(INDEX_FP8_BLOCK, width - c0);
        const float scale = fp8_index_scale(xr + c0, len);
        for (i32 j = 0; j < len; j++) xr[c0 + j] = e4m3_to_f32(fp8_code(xr[c0 + j], scale)) * scale;
    }
}

// --- Fp4Index: [ceil(width/2) packed e2m1, element 2j in the low nibble][ceil(width/32) ue8m0] ---

// Units per row: ceil(width/32) scale blocks (a block's 32 values fill 16 whole bytes; an odd
// width leaves the last byte's high nibble 0).
extern "C" __global__ void kv_write_fp4_index(const float* x, i64 x_row0, i32 n, i32 width,
                                              DSV4_PLACEMENT_PARAMS, i64 first) {
    const i32 units = div_ceil(width, INDEX_FP4_BLOCK);
    const i32 packed = div_ceil(width, 2);
    const i64 total = (i64)n * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        const float* xr = x + (x_row0 + r) * width;
        u8* row = DSV4_ROW(first + r);
        const i32 c0 = u * INDEX_FP4_BLOCK, len = min_i32(INDEX_FP4_BLOCK, width - c0);
        const i32 e = fp4_exponent(xr + c0, len);
        const float scale = pow2i(e);
        row[packed + u] = e8m0_byte(e);
        for (i32 j = 0; j < len; j += 2) {
            const u8 lo = fp4_code(xr[c0 + j], scale);
            const u8 hi = j + 1 < len ? fp4_code(xr[c0 + j + 1], scale) : (u8)0;
            row[(c0 + j) / 2] = (u8)(lo | (hi << 4));
        }
    }
}

extern "C" __global__ void kv_read_fp4_index(float* out, i32 n, i32 width, DSV4_PLACEMENT_PARAMS,
                                             i64 first) {
    const i32 units = div_ceil(width, INDEX_FP4_BLOCK);
    const i32 packed = div_ceil(width, 2);
    const i64 total = (i64)n * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        float* o = out + r * width;
        const u8* row = DSV4_ROW(first + r);
        const i32 c0 = u * INDEX_FP4_BLOCK, len = min_i32(INDEX_FP4_BLOCK, width - c0);
        const float scale = e8m0_to_f32(row[packed + u]);
        for (i32 j = 0; j < len; j++) {
            const u8 byte = row[(c0 + j) / 2];
            const u8 code = ((c0 + j) % 2 == 0) ? (u8)(byte & 0x0f) : (u8)(byte >> 4);
            o[c0 + j] = e2m1_to_f32(code) * scale;
        }
    }
}

// x [rows, width] f32 in place: encode then decode. Units as kv_write_fp4_index.
extern "C" __global__ void kv_round_trip_fp4_index(float* x, i32 rows, i32 width) {
    const i32 units = div_ceil(width, INDEX_FP4_BLOCK);
    const i64 total = (i64)rows * units;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / units;
        const i32 u = (i32)(i % units);
        float* xr = x + r * width;
        const i32 c0 = u * INDEX_FP4_BLOCK, len = min_i32(INDEX_FP4_BLOCK, width - c0);
        const i32 e = fp4_exponent(xr + c0, len);
        const float scale = pow2i(e);
        const float stored = e8m0_to_f32(e8m0_byte(e));
        for (i32 j = 0; j < len; j++) xr[c0 + j] = e2m1_to_f32(fp4_code(xr[c0 + j], scale)) * stored;
    }
}
