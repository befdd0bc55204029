// The decoder layer's small fused kernels, each in place of a chain of candle ops (one launch
// and one pass over memory instead of several): the residual add + RMS norm, GeGLU, the
// per-head q/k/v norm + RoPE + layout step, and the copy of new K/V into a batch's cache
// slots. Intermediate results are rounded to the activation type where the unfused chain rounds
// them, so both paths agree to the last rounding step.
//
// Parameter structs (and AddNormParams, in norm_tail.cuh) must match
// `src/kernels/cuda/layer_ops.rs` and `kv_write.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"
#include "gate.cuh"
#include "norm_tail.cuh"

struct GeluMulParams {
    uint32_t rows, width;
    // Row strides (elements) of a and b; out is dense [rows, width].
    uint32_t a_stride, b_stride;
};

// out = gelu_tanh(a) * b, with gelu's output rounded to T as an unfused op would.
template <typename T>
__device__ __forceinline__ void gelu_mul_body(const GeluMulParams p, const T* __restrict__ a,
                                              const T* __restrict__ b, T* __restrict__ out) {
    const size_t n = (size_t)p.rows * p.width;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += (size_t)gridDim.x * blockDim.x) {
        const size_t r = t / p.width, i = t % p.width;
        const float g = gelu_tanh(to_f(a[r * p.a_stride + i]));
        out[t] = from_f<T>(rnd<T>(g) * to_f(b[r * p.b_stride + i]));
    }
}

// The same on 8 elements a thread (16-byte loads and stores, no index division): block row
// blockIdx.y, chunk blockIdx.x * blockDim.x + threadIdx.x of it. The host takes this form
// where the width and both row strides are multiples of 8 and the rows start 16-byte aligned.
template <typename T>
__device__ __forceinline__ void gelu_mul8_body(const GeluMulParams p, const T* __restrict__ a,
                                               const T* __restrict__ b, T* __restrict__ out) {
    const uint32_t col = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (col >= p.width) return;
    const size_t r = blockIdx.y;
    const uint4 va = *reinterpret_cast<const uint4*>(a + r * p.a_stride + col);
    const uint4 vb = *reinterpret_cast<const uint4*>(b + r * p.b_stride + col);
    *reinterpret_cast<uint4*>(out + r * p.width + col) = gate8<T>(va, vb);
}

struct QkvPrepParams {
    uint32_t batch, seq_len, n_heads, kv_heads, head_dim;
    // Row strides (elements) of the q, k and v sources.
    uint32_t q_stride, k_stride, v_stride;
    float eps;
    // Elements between consecutive heads of the k and v outputs (seq_len * head_dim when they
    // are fresh tensors; the cache's slots a head when written into the cache).
    uint32_t kv_head_stride;
};

// Where head slot `slot` of token `token` reads and writes: slots are the n_heads query heads
// (norm weight qw, RoPE), then kv_heads key heads (kw, RoPE), then kv_heads value heads (no
// weight, no RoPE); q is written [batch, heads, seq_len, head_dim], k and v kv_head_stride apart.
template <typename T> struct QkvHead {
    const T* src;
    const T* w;
    T* dst;
    bool rope;
};

template <typename T>
__device__ __forceinline__ QkvHead<T> qkv_head(const QkvPrepParams& p, int token, int slot, int hd,
                                               const T* qs, const T* ks, const T* vs,
                                               const T* qw, const T* kw, T* q, T* k, T* v) {
    const int b = token / p.seq_len, s = token % p.seq_len;
    if (slot < (int)p.n_heads)
        return {qs + (size_t)token * p.q_stride + (size_t)slot * hd, qw,
                q + (((size_t)b * p.n_heads + slot) * p.seq_len + s) * hd, true};
    if (slot < (int)(p.n_heads + p.kv_heads)) {
        const int h = slot - p.n_heads;
        return {ks + (size_t)token * p.k_stride + (size_t)h * hd, kw,
                k + ((size_t)b * p.kv_heads + h) * p.kv_head_stride + (size_t)s * hd, true};
    }
    const int h = slot - p.n_heads - p.kv_heads;
    return {vs + (size_t)token * p.v_stride + (size_t)h * hd, nullptr,
            v + ((size_t)b * p.kv_heads + h) * p.kv_head_stride + (size_t)s * hd, false};
}

// Per head of one token: RMS norm (q and k with their weights, v without), rotate-half RoPE
// on q and k from the step's cos/sin tables ([batch * seq_len, head_dim / 2]), and the write to
// [batch, heads, seq_len, head_dim] (k and v heads kv_head_stride apart). One block per (token, head slot): slots are the n_heads
// query heads, then kv_heads key heads, then kv_heads value heads.
template <typename T>
__device__ __forceinline__ void qkv_prep_body(const QkvPrepParams p, const T* __restrict__ qs,
                                              const T* __restrict__ ks, const T* __restrict__ vs,
                                              const T* __restrict__ qw, const T* __restrict__ kw,
                                              const T* __restrict__ cos,
                                              const T* __restrict__ sin, T* __restrict__ q,
                                              T* __restrict__ k, T* __restrict__ v) {
    extern __shared__ float x[];
    __shared__ float red[NORM_THREADS / 32];
    const int token = blockIdx.x, slot = blockIdx.y;
    const int hd = p.head_dim, half = hd / 2;
    const QkvHead<T> head = qkv_head(p, token, slot, hd, qs, ks, vs, qw, kw, q, k, v);
    const T* src = head.src;
    const T* w = head.w;
    T* dst = head.dst;
    const bool rope = head.rope;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hd; i += NORM_THREADS) {
        const float val = to_f(src[i]);
        x[i] = val;
        ss += val * val;
    }
    const float inv = rsqrtf(block_sum(ss, red) / hd + p.eps);
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += NORM_THREADS)
        x[i] = rnd<T>(x[i] * inv * (w ? to_f(w[i]) : 1.f));
    __syncthreads();
    if (!rope) {
        for (int i = threadIdx.x; i < hd; i += NORM_THREADS) dst[i] = from_f<T>(x[i]);
        return;
    }
    const T* c = cos + (size_t)token * half;
    const T* sn = sin + (size_t)token * half;
    for (int i = threadIdx.x; i < half; i += NORM_THREADS) {
        const float cc = to_f(c[i]), ssn = to_f(sn[i]);
        const float x1 = x[i], x2 = x[i + half];
        dst[i] = from_f<T>(x1 * cc - x2 * ssn);
        dst[i + half] = from_f<T>(x2 * cc + x1 * ssn);
    }
}

// Eight elements from f32 to T, stored 16 (16-bit T) or 32 bytes at once.
template <typename T>
__device__ __forceinline__ void store_x8(T* p, const float (&v)[8]) {
    if constexpr (sizeof(T) == 2) {
        *reinterpret_cast<uint4*>(p) = pack8<T>(v);
    } else {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

// qkv_prep_body with one warp per (token, head slot) instead of a block, for head_dim 32 * EPL
// (EPL 8 or 16: the 256- and 512-wide heads): each lane keeps EPL consecutive elements in
// registers, the norm is a warp reduction, and RoPE's partner of element i (i + half) sits in
// lane ^ 16. No shared memory and no barrier: a block of 256 threads prepares 8 heads. Every
// element is rounded where the block version rounds it; only the order of the sum of squares
// differs.
template <typename T, int EPL>
__device__ __forceinline__ void qkv_prep_warp_body(const QkvPrepParams p,
                                                   const T* __restrict__ qs,
                                                   const T* __restrict__ ks,
                                                   const T* __restrict__ vs,
                                                   const T* __restrict__ qw,
                                                   const T* __restrict__ kw,
                                                   const T* __restrict__ cos,
                                                   const T* __restrict__ sin, T* __restrict__ q,
                                                   T* __restrict__ k, T* __restrict__ v) {
    const int lane = threadIdx.x & 31;
    const int slots = (int)(p.n_heads + 2 * p.kv_heads);
    const int wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int tokens = (int)(p.batch * p.seq_len);
    if (wid >= tokens * slots) return;  // uniform across the warp
    const int token = wid / slots, slot = wid % slots;
    const int hd = 32 * EPL, half = hd / 2;
    const QkvHead<T> head = qkv_head(p, token, slot, hd, qs, ks, vs, qw, kw, q, k, v);
    const T* src = head.src;
    const T* w = head.w;
    T* dst = head.dst;
    const bool rope = head.rope;
    const int e0 = lane * EPL;
    float x[EPL];
#pragma unroll
    for (int c = 0; c < EPL / 8; ++c) load_x8<T>(src + e0 + 8 * c, x + 8 * c);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) ss += x[i] * x[i];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float inv = rsqrtf(ss / hd + p.eps);
    float wv[EPL];
    if (w) {
#pragma unroll
        for (int c = 0; c < EPL / 8; ++c) load_x8<T>(w + e0 + 8 * c, wv + 8 * c);
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) x[i] = rnd<T>(x[i] * inv * (w ? wv[i] : 1.f));
    float o[EPL];
    if (!rope) {
#pragma unroll
        for (int i = 0; i < EPL; ++i) o[i] = x[i];
    } else {
        // Lanes 0-15 hold x1 = x[i], lanes 16-31 x2 = x[i + half], for i = (lane & 15) * EPL + e.
        const int c0 = (lane & 15) * EPL;
        float cc[EPL], sn[EPL];
#pragma unroll
        for (int c = 0; c < EPL / 8; ++c) {
            load_x8<T>(cos + (size_t)token * half + c0 + 8 * c, cc + 8 * c);
            load_x8<T>(sin + (size_t)token * half + c0 + 8 * c, sn + 8 * c);
        }
        const bool first = lane < 16;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const float other = __shfl_xor_sync(0xffffffffu, x[i], 16);
            o[i] = first ? x[i] * cc[i] - other * sn[i] : x[i] * cc[i] + other * sn[i];
        }
    }
#pragma unroll
    for (int c = 0; c < EPL / 8; ++c) {
        float chunk[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) chunk[i] = o[8 * c + i];
        store_x8<T>(dst + e0 + 8 * c, chunk);
    }
}

// Where a captured decode step writes its K and V: read from device memory at run time, so
// one CUDA graph serves every step (the cache slot moves, the graph does not change).
struct QkvDst {
    uint64_t k, v;
    uint32_t kv_head_stride, pad_;
};

// The K/V slots of up to KV_BATCH sequences of a batch cache, passed by value (kernel parameter
// space): `kv_scatter_batch` copies sequence blockIdx.z's new rows into d[blockIdx.z], one
// launch for a batch instead of two copies per sequence. `KvBatchDst` in kv_write.rs.
constexpr int KV_BATCH = 16;
struct KvBatchDst {
    QkvDst d[KV_BATCH];
};
// Rows of one sequence: kv_heads x n tokens x head_dim, contiguous in the source.
// Token rows [1, heads, tokens, row] from one strided view into another (a prompt's newest
// K or V tokens into a ring cache's slots), 16 bytes a thread; strides in 16-byte units.
struct TokenRowsParams {
    uint32_t heads, tokens, chunks, pad_;  // chunks: 16-byte units a token row
    uint64_t src_head, src_token, dst_head, dst_token;
};

extern "C" __global__ void copy_token_rows(const TokenRowsParams p, const uint4* __restrict__ src,
                                           uint4* __restrict__ dst) {
    pdl_entry();
    const uint32_t per_head = p.tokens * p.chunks, n = p.heads * per_head;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint32_t h = i / per_head, r = i - h * per_head, t = r / p.chunks, c = r - t * p.chunks;
        dst[h * p.dst_head + t * p.dst_token + c] = src[h * p.src_head + t * p.src_token + c];
    }
}

struct KvScatterParams {
    uint32_t kv_heads, n, head_dim, pad_;
};

template <typename T>
__device__ __forceinline__ void kv_scatter_body(const KvScatterParams p, const QkvDst& d,
                                                const T* __restrict__ k,
                                                const T* __restrict__ v) {
    const bool is_v = blockIdx.y == 1;
    const size_t head = (size_t)p.n * p.head_dim, per_seq = head * p.kv_heads;
    const T* src = (is_v ? v : k) + blockIdx.z * per_seq;
    T* out = reinterpret_cast<T*>(is_v ? d.v : d.k);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < per_seq;
         i += (size_t)gridDim.x * blockDim.x) {
        out[(i / head) * d.kv_head_stride + i % head] = src[i];
    }
}

// The warp-per-head qkv_prep kernels (`_w{EPL}`), plain and with recorded K/V destinations.
#define QKV_PREP_WARP(TN, T, EPL)                                                               \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
        qkv_prep_w##EPL##_##TN(const QkvPrepParams p, const T* qs, const T* ks, const T* vs,    \
                               const T* qw, const T* kw, const T* cos, const T* sin, T* q,      \
                               T* k, T* v) {                                                    \
        pdl_entry();                                                                            \
        qkv_prep_warp_body<T, EPL>(p, qs, ks, vs, qw, kw, cos, sin, q, k, v);                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
        qkv_prep_dyn_w##EPL##_##TN(const QkvPrepParams p, const QkvDst* dst, const T* qs,       \
                                   const T* ks, const T* vs, const T* qw, const T* kw,          \
                                   const T* cos, const T* sin, T* q) {                          \
        pdl_entry();                                                                            \
        QkvPrepParams pd = p;                                                                   \
        pd.kv_head_stride = dst->kv_head_stride;                                                \
        qkv_prep_warp_body<T, EPL>(pd, qs, ks, vs, qw, kw, cos, sin, q,                         \
                                   reinterpret_cast<T*>(dst->k), reinterpret_cast<T*>(dst->v)); \
    }

// Warps a block of the many-row residual add + norm (host: ADD_NORM_ROWS_WARPS).
constexpr int ADD_NORM_ROWS_WARPS = 8;

// The residual add + norm of `add_norm_body` (same steps, same roundings) for many rows at once
// (prefill): one warp a row, 16-byte loads, warp-only reductions, and nothing held in registers
// across the passes (the row's second and third reads hit the cache). A block of 1024 threads
// a row spends most of a short row's time in its barriers; this form runs a 1024-token chunk in
// one wave. Rows of a multiple of 8 elements, 16-byte aligned.
template <typename T>
__device__ __forceinline__ void add_norm_rows_body(const AddNormParams p, const T* __restrict__ res,
                                                   const T* __restrict__ y,
                                                   const T* __restrict__ w,
                                                   const T* __restrict__ scalar,
                                                   const T* __restrict__ w2, T* __restrict__ out,
                                                   T* __restrict__ out2,
                                                   const T* __restrict__ w3,
                                                   T* __restrict__ out3) {
    const int lane = threadIdx.x & 31;
    const uint32_t row = blockIdx.x * ADD_NORM_ROWS_WARPS + (threadIdx.x >> 5);
    if (row >= p.rows) return;
    const int nv = (int)p.dim / 8;
    const size_t base = (size_t)row * p.dim;
    const uint4* yr = reinterpret_cast<const uint4*>(y + base);
    const uint4* rr = reinterpret_cast<const uint4*>(res + base);
    const uint4* wr = reinterpret_cast<const uint4*>(w);
    uint4* outr = reinterpret_cast<uint4*>(out + base);
    const float s = (p.flags & 1) ? to_f(scalar[0]) : 1.f;
    auto warp_sum = [](float v) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    };
    float ss = 0.f;
#pragma unroll 4
    for (int i = lane; i < nv; i += 32) {
        float v[8];
        unpack8<T>(yr[i], v);
#pragma unroll
        for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
    }
    const float inv = rsqrtf(warp_sum(ss) / p.dim + p.eps);
    float ss2 = 0.f;
#pragma unroll 4
    for (int i = lane; i < nv; i += 32) {
        float v[8], r[8], wf[8], o[8];
        unpack8<T>(yr[i], v);
        unpack8<T>(rr[i], r);
        unpack8<T>(wr[i], wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            o[j] = rnd<T>(r[j] + rnd<T>(v[j] * inv * wf[j]));
            if (p.flags & 1) o[j] = rnd<T>(o[j] * s);
            ss2 += o[j] * o[j];
        }
        outr[i] = pack8<T>(o);
    }
    if (!(p.flags & 2)) return;
    const float inv2 = rsqrtf(warp_sum(ss2) / p.dim + p.eps);
    const uint4* w2r = reinterpret_cast<const uint4*>(w2);
    const uint4* w3r = reinterpret_cast<const uint4*>(w3);
    uint4* out2r = reinterpret_cast<uint4*>(out2 + base);
    uint4* out3r = reinterpret_cast<uint4*>(out3 + base);
#pragma unroll 4
    for (int i = lane; i < nv; i += 32) {
        float o[8], a[8], b[8];
        unpack8<T>(outr[i], o);  // this lane's own store
        unpack8<T>(w2r[i], a);
#pragma unroll
        for (int j = 0; j < 8; ++j) b[j] = o[j] * inv2 * a[j];
        out2r[i] = pack8<T>(b);
        if (p.flags & 4) {
            unpack8<T>(w3r[i], a);
#pragma unroll
            for (int j = 0; j < 8; ++j) b[j] = o[j] * inv2 * a[j];
            out3r[i] = pack8<T>(b);
        }
    }
}

#define LAYER_OPS_INST(TN, T)                                                                   \
    extern "C" __global__ void kv_scatter_batch_##TN(const KvScatterParams p,                   \
                                                     const KvBatchDst dst, const T* k,          \
                                                     const T* v) {                              \
        pdl_entry();                                                                            \
        kv_scatter_body<T>(p, dst.d[blockIdx.z], k, v);                                         \
    }                                                                                           \
    /* A captured batched decode step: sequence blockIdx.z's slots read from device memory. */ \
    extern "C" __global__ void kv_scatter_dyn_##TN(const KvScatterParams p, const QkvDst* dst,  \
                                                   const T* k, const T* v) {                    \
        pdl_entry();                                                                            \
        kv_scatter_body<T>(p, dst[blockIdx.z], k, v);                                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS)                              \
        add_norm_##TN(const AddNormParams p, const T* res, const T* y, const T* w,              \
                      const T* scalar, const T* w2, T* out, T* out2, const T* w3, T* out3) {    \
        pdl_entry();                                                                            \
        add_norm_body<T, ADD_NORM_THREADS, ADD_NORM_PER_THREAD, false>(                         \
            p, blockIdx.x, res, y, w, scalar, w2, out, out2, w3, out3, y, w, w);                            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS)                              \
        moe_add_norm_##TN(const AddNormParams p, const T* res, const T* y, const T* w,          \
                          const T* scalar, const T* w2, T* out, T* out2, const T* w3, T* out3,  \
                          const T* b, const T* wa, const T* wb) {                               \
        pdl_entry();                                                                            \
        add_norm_body<T, ADD_NORM_THREADS, MOE_ADD_NORM_PER_THREAD, true>(                      \
            p, blockIdx.x, res, y, w, scalar, w2, out, out2, w3, out3, b, wa, wb);                          \
    }                                                                                           \
    extern "C" __global__ void gelu_mul_##TN(const GeluMulParams p, const T* a, const T* b,     \
                                             T* out) {                                          \
        pdl_entry();                                                                            \
        gelu_mul_body<T>(p, a, b, out);                                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
        qkv_prep_##TN(const QkvPrepParams p, const T* qs, const T* ks, const T* vs,             \
                      const T* qw, const T* kw, const T* cos, const T* sin, T* q, T* k, T* v) { \
        pdl_entry();                                                                            \
        qkv_prep_body<T>(p, qs, ks, vs, qw, kw, cos, sin, q, k, v);                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
        qkv_prep_dyn_##TN(const QkvPrepParams p, const QkvDst* dst, const T* qs, const T* ks,   \
                          const T* vs, const T* qw, const T* kw, const T* cos, const T* sin,    \
                          T* q) {                                                               \
        pdl_entry();                                                                            \
        QkvPrepParams pd = p;                                                                   \
        pd.kv_head_stride = dst->kv_head_stride;                                                \
        qkv_prep_body<T>(pd, qs, ks, vs, qw, kw, cos, sin, q, reinterpret_cast<T*>(dst->k),     \
                         reinterpret_cast<T*>(dst->v));                                         \
    }                                                                                           \
    QKV_PREP_WARP(TN, T, 8)                                                                     \
    QKV_PREP_WARP(TN, T, 16)

LAYER_OPS_INST(f32, float)

// 16-bit types only: eight elements are one 16-byte load.
#define GELU_MUL8_INST(TN, T)                                                                \
    extern "C" __global__ void gelu_mul8_##TN(const GeluMulParams p, const T* a, const T* b, \
                                              T* out) {                                      \
        pdl_entry();                                                                         \
        gelu_mul8_body<T>(p, a, b, out);                                                     \
    }
GELU_MUL8_INST(bf16, __nv_bfloat16)
GELU_MUL8_INST(f16, __half)
LAYER_OPS_INST(f16, __half)
LAYER_OPS_INST(bf16, __nv_bfloat16)

// The many-row add + norm, for the 2-byte types its 8-element chunks are written for.
#define ADD_NORM_ROWS_INST(TN, T)                                                               \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_ROWS_WARPS * 32)                      \
        add_norm_rows_##TN(const AddNormParams p, const T* res, const T* y, const T* w,         \
                           const T* scalar, const T* w2, T* out, T* out2, const T* w3,          \
                           T* out3) {                                                           \
        pdl_entry();                                                                            \
        add_norm_rows_body<T>(p, res, y, w, scalar, w2, out, out2, w3, out3);                   \
    }

ADD_NORM_ROWS_INST(bf16, __nv_bfloat16)
ADD_NORM_ROWS_INST(f16, __half)
