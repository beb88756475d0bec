// MoE routing (mirrors backend::cpu::moe::route / score): per token row, scores from the router
// logits, the chosen experts (top-k over score + bias, or the hash table), and their weights.
//   sqrtsoftplus: sqrt(x > 20 ? x : log1p(exp(x)))   sigmoid: 1 / (1 + exp(-x))
//   softmax: exp(x - max) / Σ exp(x - max)   (max and the sum in expert order, f32)
//   top-k: experts ordered by (score + bias) descending in f32::total_cmp order, ties to the
//          lower expert id (the CPU's stable sort); bias only affects the choice
//   hash: table[token_id, 0..k]
//   weights: picked scores, divided by (Σ picked + 1e-20) when normalize, times scale
// exp / log1p are evaluated in f64 and rounded to f32 (one rounding per step, like the CPU's f32
// expf / log1pf); glibc's f32 functions are within 1 ulp but not always correctly rounded, so a
// score may differ by an ulp and a near-tie (keys within an ulp or two) may pick a different
// expert. Everything else (sums, order, tie-break) is exact; see kernels/README.md.
#include "prelude.cuh"

#define ROUTE_MAX_EXPERTS 1024

DSV4_FN float exp_f32(float x) { return (float)exp((double)x); }

DSV4_FN float route_score(float x, i32 scoring) {
    if (scoring == 0) {  // sqrtsoftplus: softplus as torch computes it (linear above 20)
        const float sp = x > 20.0f ? x : (float)log1p((double)exp_f32(x));
        return sqrtf(sp);
    }
    if (scoring == 1) return 1.0f / (1.0f + exp_f32(-x));  // sigmoid
    return x;                                              // softmax: normalised below
}

// logits [rows, experts] f32; bias [experts] f32 or null; hash_table [vocab, top_k] i32 or null
// (null: top-k routing); token_ids [rows] i32 (hash routing only); experts_out [rows, top_k] i32,
// weights_out [rows, top_k] f32; bad_row: one i32 the caller sets to INT_MAX (0x7fffffff) before
// the launch, lowered (atomicMin) to the first row that cannot be routed: a token id outside
// [0, vocab), a table entry outside [0, experts), or experts > 1024 or top_k outside
// [1, experts] (such a row's outputs are left unwritten). scoring: 0 sqrtsoftplus, 1 sigmoid,
// 2 softmax; normalize 0/1. One block per row (grid = rows), any block size (256 suggested);
// 12 KiB of static shared memory.
extern "C" __global__ void moe_route(const float* logits, const float* bias, const i32* hash_table,
                                 const i32* token_ids, i32* experts_out, float* weights_out,
                                 i32* bad_row, i32 rows, i32 experts, i32 top_k, i32 scoring,
                                 i32 normalize, float scale, i32 vocab) {
    __shared__ float scores[ROUTE_MAX_EXPERTS];
    __shared__ i32 keys[ROUTE_MAX_EXPERTS];
    __shared__ i32 chosen[ROUTE_MAX_EXPERTS];
    __shared__ float softmax_max, softmax_sum, picked_sum;
    __shared__ i32 row_ok;
    const i32 r = blockIdx.x;
    if (r >= rows) return;
    const i32 tid = threadIdx.x, nt = blockDim.x;
    if (experts > ROUTE_MAX_EXPERTS || experts < 1 || top_k < 1 || top_k > experts) {
        if (tid == 0) atomicMin(bad_row, r);
        return;
    }
    const float* row = logits + (i64)r * experts;
    for (i32 e = tid; e < experts; e += nt) scores[e] = route_score(row[e], scoring);
    __syncthreads();
    if (scoring == 2) {
        if (tid == 0) {
            float m = u2f(0xff800000u);  // -inf
            for (i32 e = 0; e < experts; e++) m = max_f32(m, scores[e]);
            float s = -0.0f;  // Rust's f32 Sum starts at -0.0
            for (i32 e = 0; e < experts; e++) s = s + exp_f32(scores[e] - m);
            softmax_max = m;
            softmax_sum = s;
        }
        __syncthreads();
        const float m = softmax_max, s = softmax_sum;
        for (i32 e = tid; e < experts; e += nt) scores[e] = exp_f32(scores[e] - m) / s;
        __syncthreads();
    }
    if (hash_table) {
        if (tid == 0) {
            const i32 id = token_ids[r];
            i32 ok = id >= 0 && id < vocab;
            for (i32 j = 0; ok && j < top_k; j++) {
                const i32 x = hash_table[(i64)id * top_k + j];
                if (x < 0 || x >= experts) ok = 0;
                else chosen[j] = x;
            }
            row_ok = ok;
            if (!ok) atomicMin(bad_row, r);
        }
        __syncthreads();
        if (!row_ok) return;
    } else {
        for (i32 e = tid; e < experts; e += nt) {
            const float b = bias ? bias[e] : 0.0f;
            keys[e] = total_order_key(scores[e] + b);
        }
        __syncthreads();
        // Rank of expert e in the CPU's order (key descending, then id ascending); ranks are
        // distinct, so the first top_k land in chosen[0 .. top_k) in order.
        for (i32 e = tid; e < experts; e += nt) {
            const i32 ke = keys[e];
            i32 rank = 0;
            for (i32 j = 0; j < experts; j++) {
                const i32 kj = keys[j];
                rank += (kj > ke || (kj == ke && j < e)) ? 1 : 0;
            }
            if (rank < top_k) chosen[rank] = e;
        }
        __syncthreads();
    }
    if (tid == 0) {
        float s = -0.0f;
        for (i32 j = 0; j < top_k; j++) s = s + scores[chosen[j]];
        picked_sum = s;
    }
    __syncthreads();
    const float sum = picked_sum;
    for (i32 j = tid; j < top_k; j += nt) {
        const float w = scores[chosen[j]];
        const float wn = normalize ? w / (sum + 1e-20f) : w;
        experts_out[(i64)r * top_k + j] = chosen[j];
        weights_out[(i64)r * top_k + j] = wn * scale;
    }
}
