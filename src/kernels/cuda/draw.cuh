// What the tempered draws share (`reduce.cu` over whole rows, `top_k.cu` over a row's best
// logits): the host sampler's noise (src/generate/noise.rs), Philox4x32-10 and the Gumbel value
// of one of its words, the same float operations rounded the same way (no contraction; only
// logf may differ from the host's by an ulp), each row's draw parameters, and the block-wide
// (value, index) argmax that picks the largest sum.
#pragma once

#include <stdint.h>

#include "common.cuh"

// Words of one row's draw parameters (DRAW_WORDS in reduce.rs): the temperature's bits, the
// noise key's two words, the draw index's low and high words, then the filters of a draw from
// a row's best logits: the top-k (0: no filter, a draw over the whole row), the top-p's and
// the min-p's bits (a NaN: that filter is off).
constexpr int DRAW_WORDS = 8;
// Above every Gumbel value (GUMBEL_MAX in noise.rs): a column whose key plus this is below the
// best sum so far cannot win, and skips its noise.
constexpr float DRAW_GUMBEL_MAX = 17.0f;

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

__device__ __forceinline__ float gumbel_of_bits(uint32_t bits) {
    const float u = __fmul_rn(__fadd_rn((float)(bits >> 9), 0.5f), 1.0f / 8388608.0f);
    return -logf(-logf(u));
}

// The noise of token `id` at the draw whose parameters are `d` (DRAW_WORDS words).
__device__ __forceinline__ float draw_noise(const uint32_t* d, uint32_t id) {
    return gumbel_of_bits(philox4x32_10(make_uint4(id, d[3], d[4], 0u), d[1], d[2]).x);
}

// (value, index) argmax of a block, left in thread 0 (ties: the lower index).
__device__ __forceinline__ void block_argmax(float& bv, uint32_t& bi) {
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    warp_argmax(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x / 32;
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0xffffffffu;
        warp_argmax(bv, bi);
    }
}
