// Plain tensor moves and adds (mirror the CPU backend's add_assign, split and take_rows):
// bit-exact (a copy is a copy; a + b is one f32 rounding, as on the CPU).
#include "prelude.cuh"

// a[i] += b[i] for i < n. 1-D grid-stride loop over n.
extern "C" __global__ void add_f32(float* a, const float* b, i64 n) {
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) a[i] = a[i] + b[i];
}

// out [rows, width] = columns start .. start + width of x [rows, total]. 1-D grid-stride loop
// over rows · width.
extern "C" __global__ void copy_cols(const float* x, float* out, i64 rows, i64 total, i64 start,
                                     i64 width) {
    const i64 n = rows * width;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) {
        const i64 r = i / width, c = i % width;
        out[i] = x[r * total + start + c];
    }
}

// out [n, cols] = rows index[0 .. n) of x [_, cols]. 1-D grid-stride loop over n · cols.
extern "C" __global__ void gather_rows(const float* x, const i32* index, float* out, i64 n,
                                       i64 cols) {
    const i64 total = n * cols;
    for (i64 i = DSV4_GRID_START; i < total; i += DSV4_GRID_STRIDE) {
        const i64 r = i / cols, c = i % cols;
        out[i] = x[(i64)index[r] * cols + c];
    }
}
