// dsv4 kernel prelude: integer types, bit casts and the number formats of DeepSeek V4, written
// without any CUDA header. NVRTC receives this file as the in-memory header "prelude.cuh"; every
// kernel file includes it. Each conversion mirrors a Rust function bit for bit (NaN payloads
// aside: the GPU produces canonical NaNs where x86 propagates an operand's payload):
//
//   bf16_to_f32 / f32_to_bf16   half::bf16::to_f32 / from_f32 (round to nearest even)
//   f16_to_f32                  half::f16::to_f32
//   e4m3_to_f32 / f32_to_e4m3   formats::e4m3_decode / e4m3_encode
//   e8m0_to_f32                 formats::e8m0_decode
//   e2m1_to_f32 / f32_to_e2m1   formats::E2M1 / e2m1_encode
//   ceil_log2, pow2i            formats::ceil_log2, 2f32.powi(e)
//   total_order_key             f32::total_cmp
//
// Only IEEE basic operations are used (kernels are compiled with --fmad=false --ftz=false
// --prec-div=true --prec-sqrt=true), so the results equal the CPU's. The file also compiles as
// host C++ (src/backend/cuda/emulate.rs supplies the CUDA built-ins first) so every kernel is
// checked against the CPU backend without a GPU.

#ifndef DSV4_PRELUDE_CUH
#define DSV4_PRELUDE_CUH

#ifndef DSV4_FN
#define DSV4_FN __device__ __forceinline__
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

// --- bits ------------------------------------------------------------------------------------

DSV4_FN u32 f2u(float x) { return __float_as_uint(x); }
DSV4_FN float u2f(u32 x) { return __uint_as_float(x); }

// Rust's f32::NAN (0x7fc00000).
DSV4_FN float quiet_nan() { return u2f(0x7fc00000u); }

DSV4_FN bool is_nan(float x) { return x != x; }

// The sign bit (f32::is_sign_negative: true for -0.0 and for NaNs with the sign bit set).
DSV4_FN bool sign_bit(float x) { return (f2u(x) >> 31) != 0; }

// f32::min / f32::max: a NaN operand is ignored (the other one is returned).
DSV4_FN float min_f32(float a, float b) {
    if (is_nan(a)) return b;
    if (is_nan(b)) return a;
    return a < b ? a : b;
}
DSV4_FN float max_f32(float a, float b) {
    if (is_nan(a)) return b;
    if (is_nan(b)) return a;
    return a > b ? a : b;
}

// f32::clamp: a NaN input stays NaN.
DSV4_FN float clamp_f32(float x, float lo, float hi) {
    if (x < lo) x = lo;
    if (x > hi) x = hi;
    return x;
}

// The |f32::abs|: clears the sign bit (NaN stays NaN).
DSV4_FN float abs_f32(float x) { return u2f(f2u(x) & 0x7fffffffu); }

// f32::round_ties_even for |x| < 2^23 (the only range the encoders use): rintf in the default
// rounding mode (nearest, ties to even).
DSV4_FN float round_even(float x) { return rintf(x); }

// f32::total_cmp as a signed integer key: a < b in the total order iff key(a) < key(b)
// (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN).
DSV4_FN i32 total_order_key(float x) {
    i32 k = (i32)f2u(x);
    k ^= (i32)(((u32)(k >> 31)) >> 1);
    return k;
}

// --- powers of two -----------------------------------------------------------------------------

// 2f32.powi(e) as Rust computes it (compiler-builtins' __powisf2: repeated squaring, then 1/r
// for a negative exponent): exact 2^e for -127 <= e <= 127, +inf for e >= 128, and 0 for
// e <= -128 (2^128 overflows before the reciprocal). The codecs only need -127..=128.
DSV4_FN float pow2i(i32 e) {
    if (e >= 128) return u2f(0x7f800000u);
    if (e >= -126) return u2f((u32)(e + 127) << 23);
    if (e == -127) return u2f(0x00400000u);
    return 0.0f;
}

// formats::ceil_log2: ceil(log2 v) exactly for finite positive v (normal or subnormal); v <= 0
// gives -149 (the smallest subnormal's exponent); +inf gives 128. (The CPU function never sees a
// NaN: the block maxima ignore NaNs and start from a positive floor; here a NaN gives 128.)
DSV4_FN i32 ceil_log2(float v) {
    if (v <= 0.0f) return -149;
    u32 bits = f2u(v);
    i32 e = (i32)((bits >> 23) & 0xffu);
    u32 m = bits & 0x7fffffu;
    if (e == 0xff) return 128;
    if (e != 0) return (e - 127) + (m != 0 ? 1 : 0);
    // Subnormal: v = m * 2^-149, so ceil(log2 v) = ceil(log2 m) - 149.
    i32 c = 0;
    while ((1u << c) < m) c++;
    return c - 149;
}

// --- bf16 / f16 ----------------------------------------------------------------------------------

// half::bf16::to_f32: the upper half of an f32; a NaN gets its quiet bit set.
DSV4_FN float bf16_to_f32(u16 h) {
    u32 i = (u32)h;
    if ((h & 0x7fffu) > 0x7f80u) i |= 0x0040u;
    return u2f(i << 16);
}

// half::bf16::from_f32: round to nearest, ties to even; a NaN keeps its top mantissa bits and
// gets the quiet bit.
DSV4_FN u16 f32_to_bf16(float v) {
    u32 x = f2u(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);
    const u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) return (u16)((x >> 16) + 1u);
    return (u16)(x >> 16);
}

// half::f16::to_f32 (exact: every f16 is an f32).
DSV4_FN float f16_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1fu;
    u32 man = (u32)h & 0x3ffu;
    if (exp == 0x1f) {
        if (man == 0) return u2f(sign | 0x7f800000u);
        return u2f(sign | 0x7fc00000u | (man << 13));
    }
    if (exp == 0) {
        if (man == 0) return u2f(sign);
        // Subnormal: man * 2^-24, a normal f32 (exact product of two exact values).
        float mag = (float)man * 5.9604644775390625e-8f;
        return sign ? -mag : mag;
    }
    return u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

// --- FP8 e4m3fn ----------------------------------------------------------------------------------

// formats::e4m3_decode: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN (always
// the positive quiet NaN, as on the CPU).
DSV4_FN float e4m3_to_f32(u8 b) {
    u32 e = ((u32)b >> 3) & 0x0fu;
    u32 m = (u32)b & 0x07u;
    if (e == 0x0f && m == 0x07) return quiet_nan();
    float mag = e == 0 ? (float)m * 0.001953125f  // m/8 * 2^-6 = m * 2^-9
                       : u2f(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -mag : mag;
}

// formats::e4m3_encode: round to nearest even, saturating at ±448, NaN → 0x7f.
DSV4_FN u8 f32_to_e4m3(float x) {
    if (is_nan(x)) return 0x7f;
    u8 sign = sign_bit(x) ? 0x80 : 0x00;
    float a = min_f32(abs_f32(x), 448.0f);
    if (a < 0.015625f) {  // below 2^-6: subnormal codes, multiples of 2^-9
        u8 q = (u8)round_even(a * 512.0f);
        return (u8)(sign | q);
    }
    i32 e = (i32)((f2u(a) >> 23) & 0xffu) - 127;
    i32 m = (i32)round_even((a / pow2i(e) - 1.0f) * 8.0f);
    if (m == 8) {
        e += 1;
        m = 0;
    }
    return (u8)(sign | (u8)((e + 7) << 3) | (u8)m);
}

// --- ue8m0 scales --------------------------------------------------------------------------------

// formats::e8m0_decode: 2^(byte - 127); 0xff is NaN.
DSV4_FN float e8m0_to_f32(u8 b) {
    if (b == 0xff) return quiet_nan();
    return pow2i((i32)b - 127);
}

// The ue8m0 byte of the scale 2^e (the CPU's `(e + 127) as u8`, wrapping like it).
DSV4_FN u8 e8m0_byte(i32 e) { return (u8)(e + 127); }

// --- FP4 e2m1 ------------------------------------------------------------------------------------

// formats::E2M1[code]: bit 3 is the sign; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
DSV4_FN float e2m1_to_f32(u8 code) {
    u32 m = (u32)code & 7u;
    u32 e = m >> 1;
    float mag = e == 0 ? 0.5f * (float)(m & 1u) : (1.0f + 0.5f * (float)(m & 1u)) * pow2i((i32)e - 1);
    return (code & 8u) ? -mag : mag;
}

// formats::e2m1_encode: nearest value, ties to the even code; the sign bit of x sets bit 3.
DSV4_FN u8 f32_to_e2m1(float x) {
    const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    float a = abs_f32(x);
    u8 code = 0;
    for (int i = 0; i < 7; i++) {
        u8 upper = (u8)(i + 1);
        if (a > mids[i] || (a == mids[i] && (upper % 2) == 0)) code = upper;
    }
    return sign_bit(x) ? (u8)(code | 8u) : code;
}

// --- KV row placement ----------------------------------------------------------------------------

// backend::RowLayout::row_offset: the byte offset of row r inside a pool buffer. `pages` non-null:
// paged rows (row r is row r % rows_per_unit of unit pages[r / rows_per_unit], units unit_bytes
// apart); `pages` null: a ring of ring_rows rows (row r stored at r % ring_rows).
DSV4_FN i64 row_offset(i64 r, const i32* pages, i64 rows_per_unit, i64 unit_bytes, i64 ring_rows,
                       i64 offset, i64 row_bytes) {
    if (pages) return (i64)pages[r / rows_per_unit] * unit_bytes + offset + (r % rows_per_unit) * row_bytes;
    return offset + (r % ring_rows) * row_bytes;
}

// --- launch helpers ------------------------------------------------------------------------------

// The first index and stride of a 1-D grid-stride loop.
#define DSV4_GRID_START ((i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x)
#define DSV4_GRID_STRIDE ((i64)gridDim.x * (i64)blockDim.x)

#endif  // DSV4_PRELUDE_CUH
