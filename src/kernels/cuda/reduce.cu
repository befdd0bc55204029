// Row reductions: the softmax of attention scores under a causal / sliding mask built from key
// positions inside the kernel, the argmax of each row (greedy decoding), and each row's
// tempered draw over the whole row (the Gumbel-max argmax of src/generate/noise.rs).
//
// SoftmaxParams must match `src/kernels/cuda/reduce.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"
#include "draw.cuh"
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
// A tempered draw of each row (the host sampler's, src/generate/noise.rs) takes the same two
// launches over the sums s / t + g(j) (draw.cuh), the lowest column among equal sums, NaN and
// -inf logits left out; argmax_merge_f32 picks each row's (id 0 where every logit is NaN or
// -inf).
constexpr int ARGMAX_THREADS = 256;
constexpr int ARGMAX_CHUNK = 4096;

// Block (c, r)'s best (value, column) of chunk c of row r, where `consider(bv, bi, v, j)`
// folds column j's logit v into the thread's best pair.
template <typename Consider>
__device__ __forceinline__ void chunk_best(const float* x, uint32_t cols, Consider consider,
                                           float* __restrict__ best_v,
                                           uint32_t* __restrict__ best_i) {
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
            if (j < c1) consider(bv, bi, v[u], j);
        }
    }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        const size_t o = (size_t)blockIdx.y * gridDim.x + blockIdx.x;
        best_v[o] = bv;
        best_i[o] = bi;
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_chunks_f32(const float* x, uint32_t cols, float* __restrict__ best_v,
                      uint32_t* __restrict__ best_i) {
    pdl_entry();
    chunk_best(
        x, cols, [](float& bv, uint32_t& bi, float v, uint32_t j) { argmax_step(bv, bi, v, j); },
        best_v, best_i);
}

// Each row's parameters are DRAW_WORDS words (draw.cuh); the filter words are not read.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    draw_chunks_f32(const float* x, uint32_t cols, const uint32_t* draws, float* __restrict__ best_v,
                    uint32_t* __restrict__ best_i) {
    pdl_entry();
    const uint32_t* d = draws + (size_t)blockIdx.y * DRAW_WORDS;
    const float t = __uint_as_float(d[0]);
    chunk_best(
        x, cols,
        [&](float& bv, uint32_t& bi, float v, uint32_t j) {
            if (!(v > -INFINITY)) return;
            const float key = __fdiv_rn(v, t);
            if (__fadd_rn(key, DRAW_GUMBEL_MAX) < bv) return;
            argmax_step(bv, bi, __fadd_rn(key, draw_noise(d, j)), j);
        },
        best_v, best_i);
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

// out = logits where the token's bit is set in its row of `bits` (bit t % 32 of word t / 32,
// `words` words a row), else -inf: a constrained step's mask, uploaded as bits.
extern "C" __global__ void mask_bits_f32(const float* __restrict__ logits,
                                         const uint32_t* __restrict__ bits, uint32_t rows,
                                         uint32_t vocab, uint32_t words,
                                         float* __restrict__ out) {
    pdl_entry();
    const size_t n = (size_t)rows * vocab;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / vocab, t = i % vocab;
        const uint32_t w = bits[r * words + t / 32];
        out[i] = (w >> (t % 32)) & 1u ? logits[i] : -INFINITY;
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
