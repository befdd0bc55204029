// MLX affine codes as the kernels read them, shared by the attention, matvec and quantization
// kernels.
//
// Layout (MLX affine): codes are a little-endian bit stream in u32 words (element 0 in the lowest
// bits of word 0), one scale and one bias per group of `group_size` consecutive elements along
// the last axis: x[e] = scale[e / G] * code[e] + bias[e / G].
//
// QmatParams must match `QmatParams` in `src/kernels/plan.rs` field for field (#[repr(C)]).

#pragma once

#include <stdint.h>

#include "common.cuh"

// Parameters of one quantized weight launch (matrix-vector, dequantization, quantization).
struct QmatParams {
    uint32_t rows, out_dim, in_dim, group_size;
};

// Loads N consecutive u32 words (N = 1, 2 or a multiple of 4; the address is
// min(N, 4)*4-byte aligned).
template <int N> __device__ __forceinline__ void load_words(const uint32_t* p, uint32_t* w) {
    if constexpr (N > 4) {
#pragma unroll
        for (int c = 0; c < N / 4; ++c) {
            uint4 v = reinterpret_cast<const uint4*>(p)[c];
            w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
        }
    } else if constexpr (N == 4) {
        uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (N == 2) {
        uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = *p;
    }
}

// Code of element i of a lane's slice: `w` holds the lane's words, `shift` the bit offset of its
// first element inside w[0] (non-zero only when the slice is narrower than a word).
// An integer below 2^23 as f32 without the (quarter-rate) integer-to-float conversion: OR it
// into the mantissa of 2^23 and subtract 2^23 (exact).
__device__ __forceinline__ float u2f(uint32_t c) {
    return __uint_as_float(0x4B000000u | c) - 8388608.f;
}

template <int BITS, int NW>
__device__ __forceinline__ float code_of(const uint32_t* w, int i, int shift) {
    const int bit = i * BITS + shift;
    return u2f((w[bit >> 5] >> (bit & 31)) & ((1u << BITS) - 1));
}

// ---------------------------------------------------------------------------------------------
// Codes as exact f16/bf16 values for the tensor cores: the magic-number conversion (code | 128.0
// as bf16, or | 1024.0 as f16, minus the magic), and dequantization of such pairs.
// ---------------------------------------------------------------------------------------------
template <typename T> struct MmaMagic;
template <> struct MmaMagic<__nv_bfloat16> {
    static constexpr uint32_t MAGIC = 0x43004300u;  // 128.0 in both halves
    static constexpr uint32_t ONES = 0x3F803F80u;   // 1.0
    static constexpr float MAGIC_F = 128.f;
};
template <> struct MmaMagic<__half> {
    static constexpr uint32_t MAGIC = 0x64006400u;  // 1024.0
    static constexpr uint32_t ONES = 0x3C003C00u;
    static constexpr float MAGIC_F = 1024.f;
};

// The low nibble of each 16-bit half of x as (MAGIC + c) in T, in one instruction: ptxas
// otherwise spends two (an AND and an OR, as lop3 takes one immediate).
template <typename T>
__device__ __forceinline__ uint32_t qt_nibbles(uint32_t x) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(0x000F000F), "r"(MmaMagic<T>::MAGIC));
    return r;
}

template <typename T> struct Half2Of;
template <> struct Half2Of<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct Half2Of<__half> { using type = __half2; };

template <typename T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t magic_pair, uint32_t scale2,
                                                 uint32_t bias2) {
    using T2 = typename Half2Of<T>::type;
    const uint32_t magic = MmaMagic<T>::MAGIC;
    T2 v = *reinterpret_cast<const T2*>(&magic_pair);
    const T2 m = *reinterpret_cast<const T2*>(&magic);
    const T2 s = *reinterpret_cast<const T2*>(&scale2);
    const T2 b = *reinterpret_cast<const T2*>(&bias2);
    v = __hfma2(__hsub2(v, m), s, b);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Fragments of the tensor-core 4-bit products (`qmv_tc4`, `qmv_tc4x`, the MoE products of
// moe_tc.cuh): from the 16-byte code chunks of rows gq (w0) and gq + 8 (w1), with their groups'
// splatted scales and biases, word j's codes as the A fragments of two m16n8k16 products, the
// codes taken as the pairs (p, p + 4), p = 0..3.
template <typename T>
__device__ __forceinline__ void qt_code_frags(const uint4 w0, const uint4 w1, int j, uint32_t sc0,
                                              uint32_t bi0, uint32_t sc1, uint32_t bi1,
                                              uint32_t (&f0)[4], uint32_t (&f1)[4]) {
    const uint4 w[2] = {w0, w1};
    const uint32_t sc[2] = {sc0, sc1}, bi[2] = {bi0, bi1};
    uint32_t d[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t wj = j == 0 ? w[h].x : j == 1 ? w[h].y : j == 2 ? w[h].z : w[h].w;
#pragma unroll
        for (int pp = 0; pp < 4; ++pp)
            d[h][pp] = dequant_pair<T>(qt_nibbles<T>(wj >> (4 * pp)), sc[h], bi[h]);
    }
    f0[0] = d[0][0]; f0[1] = d[1][0]; f0[2] = d[0][1]; f0[3] = d[1][1];
    f1[0] = d[0][2]; f1[1] = d[1][2]; f1[2] = d[0][3]; f1[3] = d[1][3];
}

// The B fragments that match `qt_code_frags`: 8 consecutive activations as (x_p, x_{p+4}).
__device__ __forceinline__ void qt_act_frags(const uint4 r, uint32_t (&b0)[2], uint32_t (&b1)[2]) {
    b0[0] = __byte_perm(r.x, r.z, 0x5410);
    b0[1] = __byte_perm(r.x, r.z, 0x7632);
    b1[0] = __byte_perm(r.y, r.w, 0x5410);
    b1[1] = __byte_perm(r.y, r.w, 0x7632);
}

template <typename T>
__device__ __forceinline__ uint32_t splat(T v) {
    const uint16_t h = *reinterpret_cast<const uint16_t*>(&v);
    return (uint32_t)h | ((uint32_t)h << 16);
}
