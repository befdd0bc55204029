// Row reductions: the softmax of attention scores under a causal / sliding mask built from key
// positions inside the kernel, the argmax of each row (greedy decoding), and each row's
// tempered draw (the Gumbel-max argmax of src/generate/noise.rs).
//
// SoftmaxParams must match `src/kernels/cuda/reduce.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"
#include "norm_tail.cuh"

struct SoftmaxParams {
    // rows = kv_heads * group * q_len score rows; row r is query (r % q_len) of its head.
    uint32_t rows, keys, q_len, q_offset;
    // window 0: causal only. Key positions as in QsdpaParams (mode 0 linear, 1 two runs, 2 table).
    uint32_t window, pos_mode, pos_base, pos_split;
    uint32_t pos_base2;
    float scale;
};

__device__ __forceinline__ uint32_t softmax_key_pos(const SoftmaxParams& p,
                                                    const uint32_t* pos, uint32_t j) {
    if (p.pos_mode == 0) return p.pos_base + j;
    if (p.pos_mode == 1) return j < p.pos_split ? p.pos_base + j : p.pos_base2 + (j - p.pos_split);
    return pos[j];
}

// Whether key j is visible to the query at position qpos: causal, and inside the sliding
// window when there is one.
__device__ __forceinline__ bool softmax_visible(const SoftmaxParams& p, const uint32_t* pos,
                                                uint32_t j, uint32_t qpos) {
    const uint32_t k = softmax_key_pos(p, pos, j);
    return k <= qpos && (p.window == 0 || k + p.window > qpos);
}

// Max over the block (NORM_THREADS threads); `red` holds NORM_THREADS / 32 floats.
__device__ __forceinline__ float block_max(float m, float* red) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = -INFINITY;
#pragma unroll
    for (int w = 0; w < NORM_THREADS / 32; ++w) m = fmaxf(m, red[w]);
    return m;
}

// Softmax over each score row with the causal / sliding mask computed from key positions (no
// mask tensor), in f32, written in T. One block per row; a row with no visible key gets zeros.
template <typename T>
__device__ __forceinline__ void masked_softmax_body(const SoftmaxParams p,
                                                    const T* __restrict__ scores,
                                                    const uint32_t* __restrict__ positions,
                                                    T* __restrict__ out) {
    __shared__ float red[NORM_THREADS / 32];
    const size_t row = blockIdx.x;
    const uint32_t qpos = p.q_offset + (uint32_t)(row % p.q_len);
    const T* sr = scores + row * p.keys;
    T* orow = out + row * p.keys;
    auto visible = [&](uint32_t j) { return softmax_visible(p, positions, j, qpos); };
    float m = -INFINITY;
    for (uint32_t j = threadIdx.x; j < p.keys; j += NORM_THREADS)
        if (visible(j)) m = fmaxf(m, to_f(sr[j]) * p.scale);
    m = block_max(m, red);
    float sum = 0.f;
    for (uint32_t j = threadIdx.x; j < p.keys; j += NORM_THREADS)
        if (visible(j)) sum += __expf(to_f(sr[j]) * p.scale - m);
    sum = block_sum(sum, red);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (uint32_t j = threadIdx.x; j < p.keys; j += NORM_THREADS)
        orow[j] = from_f<T>(visible(j) ? __expf(to_f(sr[j]) * p.scale - m) * inv : 0.f);
}

// masked_softmax_body for rows of at most KPT * NORM_THREADS keys: each thread reads its keys
// once into registers (the body above reads each score three times). Same visible set, same
// per-thread order of the sums, same block reductions: the same bits.
template <typename T, int KPT>
__device__ __forceinline__ void masked_softmax_reg_body(const SoftmaxParams p,
                                                        const T* __restrict__ scores,
                                                        const uint32_t* __restrict__ positions,
                                                        T* __restrict__ out) {
    __shared__ float red[NORM_THREADS / 32];
    const size_t row = blockIdx.x;
    const uint32_t qpos = p.q_offset + (uint32_t)(row % p.q_len);
    const T* sr = scores + row * p.keys;
    T* orow = out + row * p.keys;
    float v[KPT];
    bool vis[KPT];
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
        const uint32_t j = threadIdx.x + k * NORM_THREADS;
        vis[k] = false;
        v[k] = 0.f;
        if (j < p.keys) {
            vis[k] = softmax_visible(p, positions, j, qpos);
            v[k] = to_f(sr[j]) * p.scale;
            if (vis[k]) m = fmaxf(m, v[k]);
        }
    }
    m = block_max(m, red);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
        v[k] = vis[k] ? __expf(v[k] - m) : 0.f;
        sum += v[k];
    }
    sum = block_sum(sum, red);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
        const uint32_t j = threadIdx.x + k * NORM_THREADS;
        if (j < p.keys) orow[j] = from_f<T>(v[k] * inv);
    }
}

// Greedy pick: the index of the largest f32 of each row (ties: the lowest index; NaN never
// wins), in two launches: block (c, r) takes the best of chunk c of row r (ARGMAX_CHUNK
// columns, eight loads a thread in flight), then one warp a row merges the chunks' bests. One
// block a whole vocabulary row was bound by one multiprocessor's bandwidth (about 0.1 ms).
constexpr int ARGMAX_THREADS = 256;
constexpr int ARGMAX_CHUNK = 4096;

// (value, index) argmax of a block, left in thread 0.
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

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_chunks_f32(const float* __restrict__ x, uint32_t cols, float* __restrict__ best_v,
                      uint32_t* __restrict__ best_i) {
    pdl_entry();
    const float* r = x + (size_t)blockIdx.y * cols;
    const uint32_t c0 = blockIdx.x * ARGMAX_CHUNK;
    const uint32_t c1 = min(c0 + ARGMAX_CHUNK, cols);
    float bv = -INFINITY;
    uint32_t bi = 0xffffffffu;
    constexpr int U = 8;
    for (uint32_t j0 = c0 + threadIdx.x; j0 < c1; j0 += ARGMAX_THREADS * U) {
        float v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t j = j0 + u * ARGMAX_THREADS;
            v[u] = j < c1 ? r[j] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t j = j0 + u * ARGMAX_THREADS;
            if (j < c1) argmax_step(bv, bi, v[u], j);
        }
    }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        const size_t o = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
        best_v[o] = bv;
        best_i[o] = bi;
    }
}

extern "C" __global__ void argmax_merge_f32(const float* __restrict__ best_v,
                                            const uint32_t* __restrict__ best_i,
                                            uint32_t chunks, uint32_t* __restrict__ out) {
    pdl_entry();
    const size_t row = blockIdx.x;
    float bv = -INFINITY;
    uint32_t bi = 0xffffffffu;
    for (uint32_t c = threadIdx.x; c < chunks; c += 32)
        argmax_step(bv, bi, best_v[row * chunks + c], best_i[row * chunks + c]);
    warp_argmax(bv, bi);
    if (threadIdx.x == 0) out[row] = bi == 0xffffffffu ? 0u : bi;
}

// A tempered draw of each row, the host sampler's (src/generate/noise.rs): the largest
// s / t + g(j), g the Gumbel noise of Philox4x32-10 at the counter (j, draw, draw >> 32, 0)
// under the row's key, the lowest column among equal sums, NaN and -inf logits left out. The
// same float operations as the host, rounded the same way (no contraction): only logf may
// differ by an ulp. Each row's parameters are five words (DRAW_WORDS): the temperature's
// bits, the key, the draw's low and high words. The first launch writes each chunk's best
// pair; argmax_merge_f32 picks each row's (id 0 where every logit is NaN or -inf).
constexpr int DRAW_WORDS = 5;
// Above every Gumbel value (GUMBEL_MAX in noise.rs): a column whose key plus this is below the
// thread's best sum cannot win, and skips its noise.
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

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    draw_chunks_f32(const float* x, uint32_t cols, const uint32_t* draws, float* __restrict__ best_v,
                    uint32_t* __restrict__ best_i) {
    pdl_entry();
    const float* r = x + (size_t)blockIdx.y * cols;
    const uint32_t* d = draws + (size_t)blockIdx.y * DRAW_WORDS;
    const float t = __uint_as_float(d[0]);
    const uint32_t k0 = d[1], k1 = d[2], draw_lo = d[3], draw_hi = d[4];
    const uint32_t c0 = blockIdx.x * ARGMAX_CHUNK;
    const uint32_t c1 = min(c0 + ARGMAX_CHUNK, cols);
    float bv = -INFINITY;
    uint32_t bi = 0xffffffffu;
    constexpr int U = 8;
    for (uint32_t j0 = c0 + threadIdx.x; j0 < c1; j0 += ARGMAX_THREADS * U) {
        float v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t j = j0 + u * ARGMAX_THREADS;
            v[u] = j < c1 ? r[j] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t j = j0 + u * ARGMAX_THREADS;
            if (j >= c1 || !(v[u] > -INFINITY)) continue;
            const float key = __fdiv_rn(v[u], t);
            if (__fadd_rn(key, DRAW_GUMBEL_MAX) < bv) continue;
            const uint4 bits = philox4x32_10(make_uint4(j, draw_lo, draw_hi, 0u), k0, k1);
            argmax_step(bv, bi, __fadd_rn(key, gumbel_of_bits(bits.x)), j);
        }
    }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        const size_t o = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
        best_v[o] = bv;
        best_i[o] = bi;
    }
}

#define REDUCE_INST(TN, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                 \
        masked_softmax_##TN(const SoftmaxParams p, const T* scores, const uint32_t* positions, \
                            T* out) {                                                          \
        pdl_entry();                                                                           \
        masked_softmax_body<T>(p, scores, positions, out);                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                 \
        masked_softmax_r16_##TN(const SoftmaxParams p, const T* scores,                        \
                                const uint32_t* positions, T* out) {                           \
        pdl_entry();                                                                           \
        masked_softmax_reg_body<T, 16>(p, scores, positions, out);                             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                 \
        masked_softmax_r32_##TN(const SoftmaxParams p, const T* scores,                        \
                                const uint32_t* positions, T* out) {                           \
        pdl_entry();                                                                           \
        masked_softmax_reg_body<T, 32>(p, scores, positions, out);                             \
    }

REDUCE_INST(f32, float)
REDUCE_INST(f16, __half)
REDUCE_INST(bf16, __nv_bfloat16)
