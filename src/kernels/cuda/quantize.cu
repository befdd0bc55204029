// Affine quantization and dequantization of rows: dequantized weights for prefill GEMMs and
// embedding lookups, dense K/V for long prefills, and the quantized K/V cache writes.

#include <stdint.h>

#include "common.cuh"
#include "packed.cuh"

// Dequantizes rows of W into out [n, in] (out row i = W row `idx[i]`, or row i when idx is
// null): one thread per u32 word.
template <typename T, typename S, int BITS>
__device__ __forceinline__ void dequant_body(const QmatParams p, const uint32_t* __restrict__ codes,
                                             const S* __restrict__ scales,
                                             const S* __restrict__ biases,
                                             const uint32_t* __restrict__ idx, T* __restrict__ out) {
    constexpr int PER = 32 / BITS;
    const size_t words = (size_t)p.in_dim * BITS / 32;
    const size_t total = words * p.rows;
    const int groups = p.in_dim / p.group_size;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (size_t)gridDim.x * blockDim.x) {
        const size_t i = t / words, wi = t % words;
        const size_t src = idx ? idx[i] : i;
        const size_t e0 = wi * PER;
        // One vector store of the word's PER outputs (16 or 32 bytes for 4-bit, 8 or 16 for 8-bit).
        struct alignas(PER * sizeof(T)) Vec { T v[PER]; } vec;
        if (src >= p.out_dim) {
            // An id past the table (callers check ids on the host first): zeros, no stray read.
#pragma unroll
            for (int k = 0; k < PER; ++k) vec.v[k] = from_f<T>(0.f);
        } else {
            const uint32_t w = codes[src * words + wi];
            const int gi = (int)(e0 / p.group_size);
            const float sc = to_f(scales[src * groups + gi]);
            const float bi = to_f(biases[src * groups + gi]);
#pragma unroll
            for (int k = 0; k < PER; ++k)
                vec.v[k] = from_f<T>(fmaf(sc, u2f((w >> (k * BITS)) & ((1u << BITS) - 1)), bi));
        }
        *reinterpret_cast<Vec*>(out + i * p.in_dim + e0) = vec;
    }
}

#define DEQUANT_INST(TN, T, SN, S, BITS)                                                       \
    extern "C" __global__ void dequant_##TN##_##SN##_##BITS(const QmatParams p,                 \
                                                             const uint32_t* c, const S* s,     \
                                                             const S* b, const uint32_t* idx,   \
                                                             T* out) {                         \
        pdl_entry();                                                                           \
        dequant_body<T, S, BITS>(p, c, s, b, idx, out);                                        \
    }
#define DEQUANT_INST_S(TN, T, SN, S) DEQUANT_INST(TN, T, SN, S, 4) DEQUANT_INST(TN, T, SN, S, 8)
#define DEQUANT_INST_T(TN, T)                   \
    DEQUANT_INST_S(TN, T, f32, float)           \
    DEQUANT_INST_S(TN, T, f16, __half)          \
    DEQUANT_INST_S(TN, T, bf16, __nv_bfloat16)
DEQUANT_INST_T(f32, float)
DEQUANT_INST_T(f16, __half)
DEQUANT_INST_T(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Affine quantization of rows (the KV cache's appends), bit-exact with the CPU reference
// (`src/kernels/quant.rs`): f32 arithmetic in the same order, round-half-even, then the scale
// and bias rounded to T for storage. One thread per group; p.rows = number of groups,
// p.group_size elements each.
// ---------------------------------------------------------------------------------------------
// One group of `g` elements at `xs`: its scale and bias to `sc`/`bi`, its codes to `cw`.
template <typename T, int BITS>
__device__ __forceinline__ void quantize_group(const T* __restrict__ xs, const int g,
                                               uint32_t* __restrict__ cw, T* __restrict__ sc,
                                               T* __restrict__ bi) {
    const float n_bins = (float)((1u << BITS) - 1);
    float w_min = INFINITY, w_max = -INFINITY;
    for (int e = 0; e < g; ++e) {
        const float v = to_f(xs[e]);
        w_max = fmaxf(w_max, v);
        w_min = fminf(w_min, v);
    }
    const bool mask = fabsf(w_min) > fabsf(w_max);
    float scale = fmaxf(__fdiv_rn(w_max - w_min, n_bins), 1e-7f);
    if (!mask) scale = -scale;
    const float edge = mask ? w_min : w_max;
    const float q0 = rintf(__fdiv_rn(edge, scale));
    float bias = 0.f;
    if (q0 != 0.f) {
        scale = __fdiv_rn(edge, q0);
        bias = edge;
    }
    *sc = from_f<T>(scale);
    *bi = from_f<T>(bias);
    constexpr int PER = 32 / BITS;
    for (int w = 0; w < g / PER; ++w) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const float v = to_f(xs[w * PER + k]);
            const float c = fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(v, bias), scale)), 0.f), n_bins);
            word |= ((uint32_t)c) << (k * BITS);
        }
        cw[w] = word;
    }
}

template <typename T, int BITS>
__device__ __forceinline__ void quantize_body(const QmatParams p, const T* __restrict__ x,
                                              uint32_t* __restrict__ codes, T* __restrict__ scales,
                                              T* __restrict__ biases) {
    const size_t gi = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= p.rows) return;
    const int g = p.group_size;
    quantize_group<T, BITS>(x + gi * g, g, codes + gi * g / (32 / BITS), scales + gi, biases + gi);
}

// Where new K and V rows are quantized to: the six slot addresses of one sequence and their
// head strides (heads `c_sh` code words and `s_sh` scales apart, the same for K and V, scales
// and biases; within a head the slots' groups are contiguous). `KvqDst` in kv_write.rs.
struct KvqDst {
    uint64_t kc, ks, kb, vc, vs, vb;
    uint32_t c_sh, s_sh;
};

// The slots of up to KVQ_BATCH sequences, passed by value (kernel parameter space). `KvqBatch`
// in kv_write.rs.
constexpr int KVQ_BATCH = 16;
struct KvqBatch {
    KvqDst d[KVQ_BATCH];
};

// One sequence's new K and V rows (`[1, kv_heads, n, head_dim]`, contiguous) quantized straight
// into its slots `d`: blockIdx.y 0 = K, 1 = V; p.rows = groups a side, p.out_dim = groups a
// head (n x head_dim / group).
template <typename T, int BITS>
__device__ __forceinline__ void quantize_into_body(const QmatParams p, const KvqDst& d,
                                                   const T* __restrict__ k,
                                                   const T* __restrict__ v) {
    const size_t gi = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= p.rows) return;
    const bool is_v = blockIdx.y == 1;
    const size_t h = gi / p.out_dim, r = gi % p.out_dim;
    const int g = p.group_size;
    uint32_t* codes = reinterpret_cast<uint32_t*>(is_v ? d.vc : d.kc);
    T* scales = reinterpret_cast<T*>(is_v ? d.vs : d.ks);
    T* biases = reinterpret_cast<T*>(is_v ? d.vb : d.kb);
    quantize_group<T, BITS>((is_v ? v : k) + gi * g, g, codes + h * d.c_sh + r * (g / (32 / BITS)),
                            scales + h * d.s_sh + r, biases + h * d.s_sh + r);
}

// quantize_into_dyn: sequence blockIdx.z into dst[blockIdx.z], its slots read from device memory
// (a captured decode step's parameter area: the slots move from step to step, the graph does
// not). quantize_into_batch: sequence blockIdx.z of a batch into dst.d[blockIdx.z], the table
// passed by value (one launch for a whole batch).
#define QUANT_INST(TN, T, BITS)                                                                \
    extern "C" __global__ void quantize_##TN##_##BITS(const QmatParams p, const T* x,          \
                                                       uint32_t* codes, T* scales, T* biases) { \
        pdl_entry();                                                                            \
        quantize_body<T, BITS>(p, x, codes, scales, biases);                                   \
    }                                                                                          \
    extern "C" __global__ void quantize_into_dyn_##TN##_##BITS(const QmatParams p,             \
                                                                const KvqDst* dst, const T* k, \
                                                                const T* v) {                  \
        pdl_entry();                                                                           \
        const size_t seq = (size_t)blockIdx.z * p.rows * p.group_size;                         \
        quantize_into_body<T, BITS>(p, dst[blockIdx.z], k + seq, v + seq);                     \
    }                                                                                          \
    extern "C" __global__ void quantize_into_batch_##TN##_##BITS(                              \
        const QmatParams p, const KvqBatch dst, const T* k, const T* v) {                      \
        pdl_entry();                                                                           \
        const size_t seq = (size_t)blockIdx.z * p.rows * p.group_size;                         \
        quantize_into_body<T, BITS>(p, dst.d[blockIdx.z], k + seq, v + seq);                   \
    }
QUANT_INST(f32, float, 4)
QUANT_INST(f32, float, 8)
QUANT_INST(f16, __half, 4)
QUANT_INST(f16, __half, 8)
QUANT_INST(bf16, __nv_bfloat16, 4)
QUANT_INST(bf16, __nv_bfloat16, 8)
