// Weight conversion on the device (mirrors backend::weights::WeightPart::decode_into, and the
// CPU backend's bf16 storage, backend::cpu::ops::to_bf16 = half::bf16::from_f32): checkpoint
// formats uploaded as raw bytes and widened here, one launch per WeightPart.
// Bit-exact: e4m3/e2m1 values are exact in f32 and each is multiplied by its scale once (one f32
// rounding, as on the CPU); the bf16 outputs round that f32 to nearest even, as the CPU does.
//
// A part's stored matrix is [stored_rows, cols]; a launch converts stored rows row0 .. row0 + rows
// into out[0 .. rows·cols) (pass out already offset to the part's first output row). Every kernel
// is a 1-D grid-stride loop over rows·cols.
#include "prelude.cuh"

DSV4_FN i64 div_ceil64(i64 a, i64 b) { return (a + b - 1) / b; }

// FP8 e4m3: q [stored_rows, cols] bytes; scales [ceil(stored_rows/block_rows),
// ceil(cols/block_cols)] f32 (ragged edge blocks included). Element (r, c) uses scale
// [r / block_rows, c / block_cols].
DSV4_FN float fp8_weight(const u8* q, const float* scales, i64 r, i64 c, i64 cols, i64 block_rows,
                         i64 block_cols) {
    const i64 scale_cols = div_ceil64(cols, block_cols);
    return e4m3_to_f32(q[r * cols + c]) * scales[(r / block_rows) * scale_cols + c / block_cols];
}

extern "C" __global__ void dequant_fp8_f32(const u8* q, const float* scales, float* out, i64 row0,
                                           i64 rows, i64 cols, i64 block_rows, i64 block_cols) {
    const i64 n = rows * cols;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE)
        out[i] = fp8_weight(q, scales, row0 + i / cols, i % cols, cols, block_rows, block_cols);
}

extern "C" __global__ void dequant_fp8_bf16(const u8* q, const float* scales, u16* out, i64 row0,
                                            i64 rows, i64 cols, i64 block_rows, i64 block_cols) {
    const i64 n = rows * cols;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE)
        out[i] = f32_to_bf16(fp8_weight(q, scales, row0 + i / cols, i % cols, cols, block_rows, block_cols));
}

// FP4 e2m1: q [stored_rows, cols/2] bytes, element 2j in the low nibble (cols even); scales
// [stored_rows, ceil(cols/block)] f32. Element (r, c) uses scale [r, c / block].
DSV4_FN float fp4_weight(const u8* q, const float* scales, i64 r, i64 c, i64 cols, i64 block) {
    const u8 byte = q[r * (cols / 2) + c / 2];
    const u8 code = (c % 2 == 0) ? (u8)(byte & 0x0f) : (u8)(byte >> 4);
    return e2m1_to_f32(code) * scales[r * div_ceil64(cols, block) + c / block];
}

extern "C" __global__ void dequant_fp4_f32(const u8* q, const float* scales, float* out, i64 row0,
                                           i64 rows, i64 cols, i64 block) {
    const i64 n = rows * cols;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE)
        out[i] = fp4_weight(q, scales, row0 + i / cols, i % cols, cols, block);
}

extern "C" __global__ void dequant_fp4_bf16(const u8* q, const float* scales, u16* out, i64 row0,
                                            i64 rows, i64 cols, i64 block) {
    const i64 n = rows * cols;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE)
        out[i] = f32_to_bf16(fp4_weight(q, scales, row0 + i / cols, i % cols, cols, block));
}

// Plain conversions, elementwise over n values (the float weight formats, and f32 activations
// to bf16 for a bf16 GEMM): 1-D grid-stride loops over n.
extern "C" __global__ void convert_f32_to_bf16(const float* x, u16* out, i64 n) {
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void convert_bf16_to_f32(const u16* x, float* out, i64 n) {
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) out[i] = bf16_to_f32(x[i]);
}

extern "C" __global__ void convert_f16_to_f32(const u16* x, float* out, i64 n) {
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) out[i] = f16_to_f32(x[i]);
}

extern "C" __global__ void convert_f16_to_bf16(const u16* x, u16* out, i64 n) {
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) out[i] = f32_to_bf16(f16_to_f32(x[i]));
}
