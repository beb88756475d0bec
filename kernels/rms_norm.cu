// RMSNorm (mirrors backend::cpu::ops::rms_norm / inv_rms): for every dim-wide vector,
//   r = 1 / sqrt((f32)(Σ (f64)x² / dim) + eps),   out = x · r (· w)
// Bit-exact: the sum of squares runs in f64 in the CPU's order (index 0 upwards, one thread);
// the squares are exact in f64, so only the order matters and it is the same. The scaling is
// (x · r) · w in f32, two roundings, as on the CPU.
#include "prelude.cuh"

// x, out [vectors, dim] f32 (out may equal x: in place), weight [dim] f32 or null. One block per
// vector (grid = vectors), any block size (256 suggested).
extern "C" __global__ void rms_norm(const float* x, const float* weight, float* out, i32 vectors,
                                    i32 dim, float eps) {
    __shared__ float inv_rms;
    const i64 v = blockIdx.x;
    if (v >= vectors) return;
    const float* xv = x + v * dim;
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (i32 i = 0; i < dim; i++) {
            const double d = (double)xv[i];
            sum = sum + d * d;
        }
        const float mean = (float)(sum / (double)dim);
        inv_rms = 1.0f / sqrtf(mean + eps);
    }
    __syncthreads();
    const float r = inv_rms;
    float* ov = out + v * dim;
    for (i32 i = threadIdx.x; i < dim; i += blockDim.x) {
        const float t = xv[i] * r;
        ov[i] = weight ? t * weight[i] : t;
    }
}
