// RoPE (mirrors backend::cpu::ops::rope): interleaved pairs on the last 2·pairs channels of every
// head; row r, pair i rotates (a, b) = (x[2i], x[2i+1]) by θ = positions[r] · inv_freq[i]:
//   a' = a·cos − b·s,  b' = a·s + b·cos,  s = sin θ (−sin θ when inverse)
// The inverse frequencies (YaRN included) come from the host (model::rope::inv_freq). cos/sin
// come as a table [rows, pairs, 2] (cos, sin): the host may fill it with the CPU's own f32
// sin_cos (then rope_apply is bit-exact), or rope_cos_sin computes it on the device (f64
// sin/cos of the f32 angle, rounded: within 1 ulp of glibc's sinf/cosf, see kernels/README.md).
#include "prelude.cuh"

// inv_freq [pairs] f32, positions [rows] i32, cs [rows, pairs, 2] f32 out. 1-D grid-stride loop
// over rows·pairs. The angle is (f32)pos · inv_freq[i] rounded to f32, as on the CPU.
extern "C" __global__ void rope_cos_sin(const float* inv_freq, const i32* positions, float* cs,
                                        i32 rows, i32 pairs) {
    const i64 n = (i64)rows * pairs;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) {
        const i64 r = i / pairs, p = i % pairs;
        const float angle = (float)positions[r] * inv_freq[p];
        double s, c;
        sincos((double)angle, &s, &c);
        cs[2 * i] = (float)c;
        cs[2 * i + 1] = (float)s;
    }
}

// x [rows, heads·head_dim] f32 rotated in place, cs [rows, pairs, 2] f32, inverse 0/1. The
// rotated channels of a head are its last 2·pairs (head_dim − 2·pairs onwards). 1-D grid-stride
// loop over rows·heads·pairs.
extern "C" __global__ void rope_apply(float* x, const float* cs, i32 rows, i32 heads, i32 head_dim,
                                      i32 pairs, i32 inverse) {
    const i64 n = (i64)rows * heads * pairs;
    const i32 start = head_dim - 2 * pairs;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) {
        const i64 p = i % pairs;
        const i64 rh = i / pairs;  // row · heads + head
        const i64 r = rh / heads;
        const float c = cs[2 * (r * pairs + p)];
        const float sn = cs[2 * (r * pairs + p) + 1];
        const float s = inverse ? -sn : sn;
        float* rot = x + rh * head_dim + start;
        const float a = rot[2 * p], b = rot[2 * p + 1];
        rot[2 * p] = a * c - b * s;
        rot[2 * p + 1] = a * s + b * c;
    }
}
