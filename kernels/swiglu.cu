// SwiGLU with DeepSeek's clamp (mirrors backend::cpu::ops::swiglu / swiglu_row):
//   g' = min(g, L), u' = clamp(u, -L, L) when L > 0;   out = g' / (1 + exp(-g')) · u'
// exp is evaluated in f64 and rounded to f32 (the correctly rounded expf in all but
// astronomically rare cases); the CPU calls glibc's expf, which is within 0.502 ulp but not
// always correctly rounded, so an output may differ by a few ulp (see kernels/README.md).
#include "prelude.cuh"

// gate_up [rows, 2·inter] f32 (gate then up per row), out [rows, inter] f32. 1-D grid-stride
// loop over rows·inter.
extern "C" __global__ void swiglu(const float* gate_up, float* out, i32 rows, i32 inter,
                                  float limit) {
    const i64 n = (i64)rows * inter;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) {
        const i64 r = i / inter, c = i % inter;
        float g = gate_up[r * 2 * inter + c];
        float u = gate_up[r * 2 * inter + inter + c];
        if (limit > 0.0f) {
            g = min_f32(g, limit);
            u = clamp_f32(u, -limit, limit);
        }
        const float e = (float)exp((double)(-g));
        out[i] = g / (1.0f + e) * u;
    }
}
