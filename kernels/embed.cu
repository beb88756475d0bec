// Embedding gather (mirrors backend::cpu::ops::embed): out[r, :] = table[ids[r], :] as f32.
// Bit-exact (bf16 widens exactly). An id outside [0, vocab) fills its row with NaN (the CPU
// indexes out of bounds and panics there; the engine only passes ids below the vocabulary).
#include "prelude.cuh"

// table [vocab, cols] f32, ids [rows] i32, out [rows, cols] f32. 1-D grid-stride loop over
// rows·cols.
extern "C" __global__ void embed_f32(const float* table, const i32* ids, float* out, i32 rows,
                                     i32 cols, i32 vocab) {
    const i64 n = (i64)rows * cols;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) {
        const i64 r = i / cols, c = i % cols;
        const i32 id = ids[r];
        out[i] = (id >= 0 && id < vocab) ? table[(i64)id * cols + c] : quiet_nan();
    }
}

// table [vocab, cols] bf16 (u16 bits), otherwise as embed_f32.
extern "C" __global__ void embed_bf16(const u16* table, const i32* ids, float* out, i32 rows,
                                      i32 cols, i32 vocab) {
    const i64 n = (i64)rows * cols;
    for (i64 i = DSV4_GRID_START; i < n; i += DSV4_GRID_STRIDE) {
        const i64 r = i / cols, c = i % cols;
        const i32 id = ids[r];
        out[i] = (id >= 0 && id < vocab) ? bf16_to_f32(table[(i64)id * cols + c]) : quiet_nan();
    }
}
