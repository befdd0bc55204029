// Fused decoder-layer kernels: each replaces a chain of small candle ops (one launch and one
// pass over memory instead of several). Intermediate results are rounded to the activation type
// where the unfused chain rounds them, so both paths agree to the last rounding step.
//
// Parameter structs must match `src/kernels/cuda/fused.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"
#include "norm_tail.cuh"

constexpr int NORM_THREADS = 256;  // block_sum's default (norm_tail.cuh)
// The residual add + norm runs one row per block at decode: more threads, shorter serial loops.
constexpr int ADD_NORM_THREADS = 1024;
// Widest row of the residual add + norm: its elements stay in registers (host: ADD_NORM_MAX_WIDTH).
constexpr int ADD_NORM_PER_THREAD = 8;

struct AddNormParams {
    uint32_t rows, dim;
    float eps;
    // 1: multiply the sum by scalar[0]; 2: also write norm2(out) * w2 to out2; 4: also
    // norm2(out) * w3 to out3 (with 2).
    uint32_t flags;
};

// Widest row of the two-branch residual add + norm (moe_add_norm): it keeps more values per
// element in registers, so fewer elements a thread.
constexpr int MOE_ADD_NORM_PER_THREAD = 4;

// out = (res + rms(y) * w) [* scalar]; out2 = rms(out) * w2 [; out3 = rms(out) * w3]. One block
// per row of at most PT * ADD_NORM_THREADS elements, kept in registers: every load but w3's is
// issued before the first reduction, so the kernel waits on memory once. With TWO the branch is
// itself y = rms(a) * wa + rms(b) * wb (the 26B-A4B dense and expert outputs, each with its own
// post-norm), every step rounded to T as the unfused ops round it.
template <typename T, int THREADS, int PT, bool TWO>
__device__ __forceinline__ void add_norm_body(const AddNormParams p, const T* __restrict__ res,
                                              const T* __restrict__ y, const T* __restrict__ w,
                                              const T* __restrict__ scalar,
                                              const T* __restrict__ w2, T* __restrict__ out,
                                              T* __restrict__ out2, const T* __restrict__ w3,
                                              T* __restrict__ out3, const T* __restrict__ b,
                                              const T* __restrict__ wa,
                                              const T* __restrict__ wb) {
    __shared__ float red[THREADS / 32];
    const size_t base = (size_t)blockIdx.x * p.dim;
    float yv[PT], rv[PT], wv[PT], w2v[PT];
    float bv[TWO ? PT : 1], wav[TWO ? PT : 1], wbv[TWO ? PT : 1];
    const float s = (p.flags & 1) ? to_f(scalar[0]) : 1.f;
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int i = threadIdx.x + k * THREADS;
        const bool in = i < (int)p.dim;
        yv[k] = in ? to_f(y[base + i]) : 0.f;
        rv[k] = in ? to_f(res[base + i]) : 0.f;
        wv[k] = in ? to_f(w[i]) : 0.f;
        w2v[k] = in && (p.flags & 2) ? to_f(w2[i]) : 0.f;
        if constexpr (TWO) {
            bv[k] = in ? to_f(b[base + i]) : 0.f;
            wav[k] = in ? to_f(wa[i]) : 0.f;
            wbv[k] = in ? to_f(wb[i]) : 0.f;
        }
    }
    if constexpr (TWO) {
        float sa = 0.f, sb = 0.f;
#pragma unroll
        for (int k = 0; k < PT; ++k) {
            sa += yv[k] * yv[k];
            sb += bv[k] * bv[k];
        }
        const float ia = rsqrtf(block_sum<THREADS>(sa, red) / p.dim + p.eps);
        const float ib = rsqrtf(block_sum<THREADS>(sb, red) / p.dim + p.eps);
#pragma unroll
        for (int k = 0; k < PT; ++k)
            yv[k] = rnd<T>(rnd<T>(yv[k] * ia * wav[k]) + rnd<T>(bv[k] * ib * wbv[k]));
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < PT; ++k) ss += yv[k] * yv[k];
    const float inv = rsqrtf(block_sum<THREADS>(ss, red) / p.dim + p.eps);
    float ss2 = 0.f;
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int i = threadIdx.x + k * THREADS;
        if (i >= (int)p.dim) continue;
        const float normed = rnd<T>(yv[k] * inv * wv[k]);
        float o = rnd<T>(rv[k] + normed);
        if (p.flags & 1) o = rnd<T>(o * s);
        out[base + i] = from_f<T>(o);
        yv[k] = o;
        ss2 += o * o;
    }
    if (!(p.flags & 2)) return;
    const float inv2 = rsqrtf(block_sum<THREADS>(ss2, red) / p.dim + p.eps);
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int i = threadIdx.x + k * THREADS;
        if (i >= (int)p.dim) continue;
        out2[base + i] = from_f<T>(yv[k] * inv2 * w2v[k]);
        if (p.flags & 4) out3[base + i] = from_f<T>(yv[k] * inv2 * to_f(w3[i]));
    }
}

struct GeluMulParams {
    uint32_t rows, width;
    // Row strides (elements) of a and b; out is dense [rows, width].
    uint32_t a_stride, b_stride;
};

__device__ __forceinline__ float gelu_tanh(const float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// gelu_tanh(a) * b on eight packed elements, rounded as gelu_mul rounds.
template <typename T>
__device__ __forceinline__ uint4 gate8(const uint4 a, const uint4 b) {
    const T* pa = reinterpret_cast<const T*>(&a);
    const T* pb = reinterpret_cast<const T*>(&b);
    uint4 r;
    T* pr = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int i = 0; i < 8; ++i) pr[i] = from_f<T>(rnd<T>(gelu_tanh(to_f(pa[i]))) * to_f(pb[i]));
    return r;
}

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

struct QkvPrepParams {
    uint32_t batch, seq_len, n_heads, kv_heads, head_dim;
    // Row strides (elements) of the q, k and v sources.
    uint32_t q_stride, k_stride, v_stride;
    float eps;
    // Elements between consecutive heads of the k and v outputs (seq_len * head_dim when they
    // are fresh tensors; the cache's slots a head when written into the cache).
    uint32_t kv_head_stride;
};

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
    const int b = token / p.seq_len, s = token % p.seq_len;
    const T* src;
    const T* w;
    T* dst;
    bool rope = true;
    if (slot < (int)p.n_heads) {
        src = qs + (size_t)token * p.q_stride + (size_t)slot * hd;
        w = qw;
        dst = q + (((size_t)b * p.n_heads + slot) * p.seq_len + s) * hd;
    } else if (slot < (int)(p.n_heads + p.kv_heads)) {
        const int h = slot - p.n_heads;
        src = ks + (size_t)token * p.k_stride + (size_t)h * hd;
        w = kw;
        dst = k + ((size_t)b * p.kv_heads + h) * p.kv_head_stride + (size_t)s * hd;
    } else {
        const int h = slot - p.n_heads - p.kv_heads;
        src = vs + (size_t)token * p.v_stride + (size_t)h * hd;
        w = nullptr;
        rope = false;
        dst = v + ((size_t)b * p.kv_heads + h) * p.kv_head_stride + (size_t)s * hd;
    }
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

// Where a captured decode step writes its K and V: read from device memory at run time, so
// one CUDA graph serves every step (the cache slot moves, the graph does not change).
struct QkvDst {
    uint64_t k, v;
    uint32_t kv_head_stride, pad_;
};

// The K/V slots of up to KV_BATCH sequences of a batch cache, passed by value (kernel parameter
// space): `kv_scatter_batch` copies sequence blockIdx.z's new rows into d[blockIdx.z], one
// launch for a batch instead of two copies per sequence. `KvBatchDst` in fused.rs.
constexpr int KV_BATCH = 16;
struct KvBatchDst {
    QkvDst d[KV_BATCH];
};
// Rows of one sequence: kv_heads x n tokens x head_dim, contiguous in the source.
struct KvScatterParams {
    uint32_t kv_heads, n, head_dim, pad_;
};

template <typename T>
__device__ __forceinline__ void kv_scatter_body(const KvScatterParams p, const KvBatchDst& dst,
                                                const T* __restrict__ k,
                                                const T* __restrict__ v) {
    const QkvDst& d = dst.d[blockIdx.z];
    const bool is_v = blockIdx.y == 1;
    const size_t head = (size_t)p.n * p.head_dim, per_seq = head * p.kv_heads;
    const T* src = (is_v ? v : k) + blockIdx.z * per_seq;
    T* out = reinterpret_cast<T*>(is_v ? d.v : d.k);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < per_seq;
         i += (size_t)gridDim.x * blockDim.x) {
        out[(i / head) * d.kv_head_stride + i % head] = src[i];
    }
}

// Router top-k: per token, the top_k largest logits (ties: lower expert first), a softmax over
// them, times per_expert_scale of each pick. One warp per token; experts <= 32 * ROUTE_MAX_PER_LANE.
constexpr int ROUTE_MAX_PER_LANE = 16;

struct RouteParams {
    uint32_t tokens, experts, top_k, pad_;
};

template <typename T>
__device__ __forceinline__ void moe_route_body(const RouteParams p, const T* __restrict__ logits,
                                               const float* __restrict__ scale,
                                               uint32_t* __restrict__ idx,
                                               float* __restrict__ mix) {
    const int t = blockIdx.x, lane = threadIdx.x;
    float v[ROUTE_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
        const int e = i * 32 + lane;
        v[i] = e < (int)p.experts ? to_f(logits[(size_t)t * p.experts + e]) : -INFINITY;
    }
    // Pick j ends in lane j's registers (no per-thread arrays indexed at run time, which would
    // live in local memory).
    float mine = -INFINITY;
    int mine_e = 0;
    for (int j = 0; j < (int)p.top_k && j < 32; ++j) {
        float bv = -INFINITY;
        int be = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
            const int e = i * 32 + lane;
            if (e < (int)p.experts) argmax_step(bv, be, v[i], e);
        }
        warp_argmax(bv, be);
        if (lane == j) {
            mine = bv;
            mine_e = be;
        }
#pragma unroll
        for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i)
            if (i * 32 + lane == be) v[i] = -INFINITY;
    }
    const float top0 = __shfl_sync(0xffffffffu, mine, 0);
    const float w = (lane < (int)p.top_k) ? expf(mine - top0) : 0.f;
    // The softmax sum in pick order, as a sequential loop would add it.
    float sum = 0.f;
    for (int j = 0; j < (int)p.top_k && j < 32; ++j) sum += __shfl_sync(0xffffffffu, w, j);
    if (lane < (int)p.top_k) {
        idx[(size_t)t * p.top_k + lane] = (uint32_t)mine_e;
        mix[(size_t)t * p.top_k + lane] = w / sum * scale[mine_e];
    }
}

struct GroupedMvParams {
    // pairs = tokens * top_k routed (token, pick) pairs; x row of pair p: p / top_k when
    // x_per_token, else p.
    uint32_t pairs, top_k, out_dim, in_dim;
    uint64_t expert_stride;
    // by_slot: block x is pair slot x and takes expert idx[x] unless an earlier slot holds the
    // same expert (a grid of `pairs` blocks when fewer pairs than experts); else block x is
    // expert x.
    uint32_t x_per_token, experts, by_slot, x_stride;
    // Gated kernels: the row stride of the second input. Packed experts: inputs per scale group.
    uint32_t b_stride, group_size, pad1, pad2;
};

constexpr int GMV_WARPS = 8;
constexpr int GMV_MAX_PAIRS = 4096;

// dot(W row, x) over in_dim (a multiple of 8) by one warp, 16-byte loads.
template <typename T>
__device__ __forceinline__ float warp_dot(const T* __restrict__ wr, const T* __restrict__ xr,
                                          int in_dim) {
    // Four weight loads a lane in flight: unconditional (clamped, zeroed after) so that the
    // compiler issues them together instead of each right before its use.
    constexpr int B = 4;
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
    for (int e0 = lane * 8; e0 < in_dim; e0 += 32 * 8 * B) {
        float wv[B][8];
#pragma unroll
        for (int b = 0; b < B; ++b) load_x8<T>(wr + min(e0 + 256 * b, in_dim - 8), wv[b]);
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int e = e0 + 256 * b;
            float xv[8];
            load_x8<T>(xr + min(e, in_dim - 8), xv);
            const float keep = e < in_dim ? 1.f : 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc = fmaf(wv[b][i] * keep, xv[i], acc);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
}

// Routed expert products grouped by expert: block (e, tile) finds the pairs routed to expert
// e, then each warp takes Rows::R output rows of e and computes them for every such pair, so each
// expert row is read from memory once per call however many tokens picked it.
//   y[p, o] = W[e][o, :] . x[row(p), :]      for every pair p with idx[p] == e
//
// GATED: the pair rows are gelu_tanh(x) * xb (rows strided by x_stride and b_stride), computed
// by the block for its pairs into dynamic shared memory first.
// Rows of dense experts: W [E, out, in]. One row a warp.
template <typename T> struct DenseExpertRows {
    static constexpr int R = 1;
    const T* __restrict__ w;
    __device__ __forceinline__ void dot(const GroupedMvParams& p, uint32_t e, int o0,
                                        const T* xrow, float (&acc)[R]) const {
        acc[0] = warp_dot(w + (size_t)e * p.expert_stride + (size_t)o0 * p.in_dim, xrow, p.in_dim);
    }
};

// Rows of MLX-packed experts, flattened to [E * out, in]: codes [E * out, in * BITS / 32],
// scales/biases [E * out, in / group]. A warp computes R rows at once: each lane reads 16 bytes
// of codes of every row a step (32 four-bit or 16 eight-bit codes, inside one group), so R loads
// are in flight together, and the activations and their sum are read once for the R rows. The
// group's scale and bias apply to the partial sums, as in the one-row qmatvec. Codes become
// floats through their bit pattern (2^23 + code, minus 2^23): exact, and without the integer to
// float conversion, whose low throughput bounded the kernel.
template <typename T, typename S, int BITS, int ROWS> struct PackedExpertRows {
    static constexpr int R = ROWS;
    const uint32_t* __restrict__ codes;
    const S* __restrict__ scales;
    const S* __restrict__ biases;
    __device__ __forceinline__ void dot(const GroupedMvParams& p, uint32_t e, int o0,
                                        const T* xrow, float (&acc)[R]) const {
        constexpr int EPC = 128 / BITS;
        constexpr uint32_t MASK = (1u << BITS) - 1;
        const int lane = threadIdx.x & 31;
        const int words = (int)p.in_dim * BITS / 32, groups = (int)(p.in_dim / p.group_size);
        const int last = (int)p.out_dim - 1;
        const uint32_t* wr[R];
        const S* sr[R];
        const S* br[R];
#pragma unroll
        for (int m = 0; m < R; ++m) {
            // Rows past the end repeat the last one (their sums are not stored).
            const size_t r = (size_t)e * p.out_dim + min(o0 + m, last);
            wr[m] = codes + r * words;
            sr[m] = scales + r * groups;
            br[m] = biases + r * groups;
            acc[m] = 0.f;
        }
#pragma unroll 2
        for (int c = lane; c < words / 4; c += 32) {
            const int e0 = c * EPC;
            const int g = e0 / (int)p.group_size;
            uint4 w4[R];
            float sc[R], bi[R];
#pragma unroll
            for (int m = 0; m < R; ++m) {
                w4[m] = ld_stream4(wr[m] + c * 4);
                sc[m] = to_f(sr[m][g]);
                bi[m] = to_f(br[m][g]);
            }
            float dot[R], xs = 0.f;
#pragma unroll
            for (int m = 0; m < R; ++m) dot[m] = 0.f;
#pragma unroll
            for (int k8 = 0; k8 < EPC; k8 += 8) {
                float xv[8];
                load_x8<T>(xrow + e0 + k8, xv);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const int i = k8 + k;
                    xs += xv[k];
#pragma unroll
                    for (int m = 0; m < R; ++m) {
                        const uint32_t w[4] = {w4[m].x, w4[m].y, w4[m].z, w4[m].w};
                        const uint32_t code = (w[(i * BITS) >> 5] >> ((i * BITS) & 31)) & MASK;
                        const float cf = __uint_as_float(0x4B000000u | code) - 8388608.f;
                        dot[m] = fmaf(cf, xv[k], dot[m]);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < R; ++m) acc[m] = fmaf(sc[m], dot[m], fmaf(bi[m], xs, acc[m]));
        }
#pragma unroll
        for (int m = 0; m < R; ++m) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
        }
    }
};

template <typename T, bool GATED, typename Rows>
__device__ __forceinline__ void grouped_mv_body(const GroupedMvParams p, const Rows rows,
                                                const uint32_t* __restrict__ idx,
                                                const T* __restrict__ x,
                                                const T* __restrict__ xb, T* __restrict__ y) {
    __shared__ uint32_t mine[GMV_MAX_PAIRS];
    __shared__ uint32_t count, taken;
    const uint32_t e = p.by_slot ? idx[blockIdx.x] : blockIdx.x;
    if (e >= p.experts) return;  // uniform across the block
    if (threadIdx.x == 0) count = taken = 0;
    __syncthreads();
    for (uint32_t q = threadIdx.x; q < p.pairs; q += blockDim.x) {
        if (idx[q] == e) {
            mine[atomicAdd(&count, 1u)] = q;
            if (p.by_slot && q < blockIdx.x) taken = 1;
        }
    }
    __syncthreads();
    const uint32_t n = count;
    if (n == 0 || taken) return;
    extern __shared__ __align__(16) unsigned char gmv_smem[];
    T* sx = reinterpret_cast<T*>(gmv_smem);
    if constexpr (GATED) {
        const int n8 = (int)(n * p.in_dim / 8);
        for (int t = threadIdx.x; t < n8; t += blockDim.x) {
            const int el = t * 8, i = el / (int)p.in_dim, c = el % (int)p.in_dim;
            const uint32_t q = mine[i];
            const uint4 av = *reinterpret_cast<const uint4*>(x + (size_t)q * p.x_stride + c);
            const uint4 bv = *reinterpret_cast<const uint4*>(xb + (size_t)q * p.b_stride + c);
            *reinterpret_cast<uint4*>(sx + el) = gate8<T>(av, bv);
        }
        __syncthreads();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int R = Rows::R;
    const int o0 = (blockIdx.y * GMV_WARPS + warp) * R;
    if (o0 >= (int)p.out_dim) return;
    for (uint32_t i = 0; i < n; ++i) {
        const uint32_t q = mine[i];
        const uint32_t row = p.x_per_token ? q / p.top_k : q;
        const T* xrow = GATED ? sx + (size_t)i * p.in_dim : x + (size_t)row * p.in_dim;
        float acc[R];
        rows.dot(p, e, o0, xrow, acc);
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < R; ++m)
                if (o0 + m < (int)p.out_dim) y[(size_t)q * p.out_dim + o0 + m] = from_f<T>(acc[m]);
        }
    }
}

// out[t, o] = sum_j mix[t, j] * y[t * top_k + j, o]
template <typename T>
__device__ __forceinline__ void moe_mix_body(const GroupedMvParams p, const T* __restrict__ y,
                                             const float* __restrict__ mix, T* __restrict__ out) {
    const size_t tokens = p.pairs / p.top_k;
    const size_t n = tokens * p.out_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / p.out_dim, o = i % p.out_dim;
        float acc = 0.f;
        for (uint32_t j = 0; j < p.top_k; ++j)
            acc = fmaf(mix[t * p.top_k + j], to_f(y[(t * p.top_k + j) * p.out_dim + o]), acc);
        out[i] = from_f<T>(acc);
    }
}

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
    auto visible = [&](uint32_t j) {
        const uint32_t k = softmax_key_pos(p, positions, j);
        return k <= qpos && (p.window == 0 || k + p.window > qpos);
    };
    float m = -INFINITY;
    for (uint32_t j = threadIdx.x; j < p.keys; j += NORM_THREADS)
        if (visible(j)) m = fmaxf(m, to_f(sr[j]) * p.scale);
    // Block max.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        __syncthreads();
        if (lane == 0) red[warp] = m;
        __syncthreads();
        m = -INFINITY;
#pragma unroll
        for (int w = 0; w < NORM_THREADS / 32; ++w) m = fmaxf(m, red[w]);
    }
    float sum = 0.f;
    for (uint32_t j = threadIdx.x; j < p.keys; j += NORM_THREADS)
        if (visible(j)) sum += __expf(to_f(sr[j]) * p.scale - m);
    sum = block_sum(sum, red);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (uint32_t j = threadIdx.x; j < p.keys; j += NORM_THREADS)
        orow[j] = from_f<T>(visible(j) ? __expf(to_f(sr[j]) * p.scale - m) * inv : 0.f);
}

// Device-to-device copy through the SMs (16-byte loads and stores, grid-stride): the
// bandwidth reference of the benches, the access pattern of a bandwidth-bound kernel.
extern "C" __global__ void copy_u4(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                   uint64_t n) {
    pdl_entry();
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// Greedy pick: the index of the largest f32 of each row (ties: the lowest index; NaN never
// wins). One block of 1024 threads per row.
extern "C" __global__ void __launch_bounds__(1024)
    argmax_rows_f32(const float* __restrict__ x, uint32_t cols, uint32_t* __restrict__ out) {
    pdl_entry();
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    const float* r = x + (size_t)blockIdx.x * cols;
    float bv = -INFINITY;
    uint32_t bi = 0xffffffffu;
    for (uint32_t j = threadIdx.x; j < cols; j += blockDim.x) argmax_step(bv, bi, r[j], j);
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
        if (lane == 0) out[blockIdx.x] = bi == 0xffffffffu ? 0u : bi;
    }
}

#define FUSED_INST(TN, T)                                                                      \
    extern "C" __global__ void kv_scatter_batch_##TN(const KvScatterParams p,                  \
                                                     const KvBatchDst dst, const T* k,         \
                                                     const T* v) {                             \
        pdl_entry();                                                                           \
        kv_scatter_body<T>(p, dst, k, v);                                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS)                             \
        add_norm_##TN(const AddNormParams p, const T* res, const T* y, const T* w,             \
                      const T* scalar, const T* w2, T* out, T* out2, const T* w3, T* out3) {   \
        pdl_entry();                                                                           \
        add_norm_body<T, ADD_NORM_THREADS, ADD_NORM_PER_THREAD, false>(                        \
            p, res, y, w, scalar, w2, out, out2, w3, out3, y, w, w);                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS)                             \
        moe_add_norm_##TN(const AddNormParams p, const T* res, const T* y, const T* w,         \
                          const T* scalar, const T* w2, T* out, T* out2, const T* w3, T* out3, \
                          const T* b, const T* wa, const T* wb) {                              \
        pdl_entry();                                                                           \
        add_norm_body<T, ADD_NORM_THREADS, MOE_ADD_NORM_PER_THREAD, true>(                     \
            p, res, y, w, scalar, w2, out, out2, w3, out3, b, wa, wb);                         \
    }                                                                                          \
    extern "C" __global__ void gelu_mul_##TN(const GeluMulParams p, const T* a, const T* b,    \
                                             T* out) {                                         \
        pdl_entry();                                                                           \
        gelu_mul_body<T>(p, a, b, out);                                                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                 \
        qkv_prep_##TN(const QkvPrepParams p, const T* qs, const T* ks, const T* vs,            \
                      const T* qw, const T* kw, const T* cos, const T* sin, T* q, T* k, T* v) { \
        pdl_entry();                                                                            \
        qkv_prep_body<T>(p, qs, ks, vs, qw, kw, cos, sin, q, k, v);                            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                 \
        qkv_prep_dyn_##TN(const QkvPrepParams p, const QkvDst* dst, const T* qs, const T* ks,  \
                          const T* vs, const T* qw, const T* kw, const T* cos, const T* sin,    \
                          T* q) {                                                               \
        pdl_entry();                                                                            \
        QkvPrepParams pd = p;                                                                   \
        pd.kv_head_stride = dst->kv_head_stride;                                                \
        qkv_prep_body<T>(pd, qs, ks, vs, qw, kw, cos, sin, q, reinterpret_cast<T*>(dst->k),     \
                         reinterpret_cast<T*>(dst->v));                                         \
    }                                                                                          \
    extern "C" __global__ void moe_route_##TN(const RouteParams p, const T* logits,             \
                                              const float* scale, uint32_t* idx, float* mix) {  \
        pdl_entry();                                                                            \
        moe_route_body<T>(p, logits, scale, idx, mix);                                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_mv_##TN(const GroupedMvParams p, const T* w, const uint32_t* idx, const T* x,  \
                        T* y) {                                                                \
        pdl_entry();                                                                           \
        grouped_mv_body<T, false>(p, DenseExpertRows<T>{w}, idx, x, x, y);                                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_mv_gated_##TN(const GroupedMvParams p, const T* w, const uint32_t* idx,        \
                              const T* x, const T* xb, T* y) {                                 \
        pdl_entry();                                                                           \
        grouped_mv_body<T, true>(p, DenseExpertRows<T>{w}, idx, x, xb, y);                                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                 \
        masked_softmax_##TN(const SoftmaxParams p, const T* scores, const uint32_t* positions,  \
                            T* out) {                                                          \
        pdl_entry();                                                                           \
        masked_softmax_body<T>(p, scores, positions, out);                                     \
    }                                                                                          \
    extern "C" __global__ void moe_mix_##TN(const GroupedMvParams p, const T* y,               \
                                            const float* mix, T* out) {                        \
        pdl_entry();                                                                           \
        moe_mix_body<T>(p, y, mix, out);                                                       \
    }

FUSED_INST(f32, float)
FUSED_INST(f16, __half)
FUSED_INST(bf16, __nv_bfloat16)

// Grouped products over MLX-packed experts (names grouped_qmv[_gated]_{T}_{S}_{BITS}_r{R}, R
// output rows a warp); the gated form only for 16-bit activations, as with dense experts.
#define GROUPED_QMV_KERNELS(TN, T, SN, S, BITS, R, MINB, V)                                    \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, MINB)                         \
        grouped_qmv_##TN##_##SN##_##BITS##_##V(const GroupedMvParams p, const uint32_t* c,     \
                                               const S* s, const S* b, const uint32_t* idx,    \
                                               const T* x, T* y) {                             \
        pdl_entry();                                                                           \
        grouped_mv_body<T, false>(p, PackedExpertRows<T, S, BITS, R>{c, s, b}, idx, x, x, y);  \
    }
#define GROUPED_QMV_GATED_KERNELS(TN, T, SN, S, BITS, R, MINB, V)                              \
    GROUPED_QMV_KERNELS(TN, T, SN, S, BITS, R, MINB, V)                                        \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, MINB)                         \
        grouped_qmv_gated_##TN##_##SN##_##BITS##_##V(                                          \
            const GroupedMvParams p, const uint32_t* c, const S* s, const S* b,                \
            const uint32_t* idx, const T* x, const T* xb, T* y) {                              \
        pdl_entry();                                                                           \
        grouped_mv_body<T, true>(p, PackedExpertRows<T, S, BITS, R>{c, s, b}, idx, x, xb, y);  \
    }
// 4 rows a warp, 3 blocks a multiprocessor (80 registers a thread, no spills): against 1 or 2
// rows and 2 blocks, the fastest measured (bench-results/h100-s10-grouped-experts-variants.jsonl).
#define GROUPED_QMV_INST(TN, T, SN, S, BITS) GROUPED_QMV_KERNELS(TN, T, SN, S, BITS, 4, 3, r4)
#define GROUPED_QMV_GATED_INST(TN, T, SN, S, BITS) \
    GROUPED_QMV_GATED_KERNELS(TN, T, SN, S, BITS, 4, 3, r4)
#define GROUPED_QMV_BITS(INST, TN, T, SN, S) INST(TN, T, SN, S, 4) INST(TN, T, SN, S, 8)
#define GROUPED_QMV_SCALES(INST, TN, T)                   \
    GROUPED_QMV_BITS(INST, TN, T, f32, float)             \
    GROUPED_QMV_BITS(INST, TN, T, f16, __half)            \
    GROUPED_QMV_BITS(INST, TN, T, bf16, __nv_bfloat16)
GROUPED_QMV_SCALES(GROUPED_QMV_INST, f32, float)
GROUPED_QMV_SCALES(GROUPED_QMV_GATED_INST, f16, __half)
GROUPED_QMV_SCALES(GROUPED_QMV_GATED_INST, bf16, __nv_bfloat16)
struct DenseMvParams {
    uint32_t rows, out_dim, in_dim;
    // Row strides (elements) of x and, in the gated kernels, of the second input.
    uint32_t x_stride, b_stride;
    // The normed-input kernels' RMS norm epsilon.
    float eps;
};

// What the product reads as its input: x itself, gelu_tanh(x) * xb (the MLP's or PLE's gate),
// or rms_norm(x) * xb (the MoE router's input norm, xb its weight).
constexpr int DMV_PLAIN = 0, DMV_GATED = 1, DMV_NORMED = 2;
// The one-row kernels' GeGLU product: W is a stacked [gate; up] weight ([2 * width, in]) and
// the output is gelu_tanh(x · gateᵀ) * (x · upᵀ) ([width]), rounded as the unfused ops round.
constexpr int DMV_GEGLU = 3;


constexpr int DMV_UNROLL = 4;
// Resident blocks the register budget is set for: without it the compiler trades loads in
// flight for registers, interleaving each weight load with the mma that consumes it.
#define DMV_MIN_BLOCKS(WARPS) (512 / ((WARPS) * 32))

// Dense y = x · Wᵀ for at most 8 activation rows (decode) on the tensor cores: a block owns
// 16 * MT output rows (MT m16n8k16 tiles sharing one x fragment) and its WARPS warps split
// the input dimension into contiguous runs of 32-element chunks; the N = 8 columns are the
// activation rows. The sum over k does not care about its order, so a thread's A and B slots
// take the same permuted k's: thread q of a quad reads 8 consecutive elements (one 16-byte load)
// of its W rows and of its x row per chunk, the first 4 for the first mma, the rest for the
// second. W is streamed past L1; in_dim must be a multiple of 8 (16-byte aligned rows).
//
// DMV_GATED / DMV_NORMED: the block computes its input rows into dynamic shared memory
// (rows * in_dim elements) instead of a launch of their own doing it.
// The staged input of the gated and normed products, written once a block to shared memory
// `sx` (p.rows rows of in_dim, rows strided by x_stride and b_stride): gelu_tanh(x) * xb, or
// rms_norm(x) * xb with xb the norm weight. Callers issue their first weight loads before.
template <typename T, int MODE, int THREADS>
__device__ __forceinline__ void stage_input(const DenseMvParams& p, const T* __restrict__ x,
                                            const T* __restrict__ xb, T* __restrict__ sx) {
    const int in_dim = (int)p.in_dim;
    if constexpr (MODE == DMV_GATED) {
        const int n8 = (int)p.rows * in_dim / 8;
        for (int t = threadIdx.x; t < n8; t += THREADS) {
            const int e = t * 8, r = e / in_dim, c = e % in_dim;
            const uint4 av = *reinterpret_cast<const uint4*>(x + (size_t)r * p.x_stride + c);
            const uint4 bv = *reinterpret_cast<const uint4*>(xb + (size_t)r * p.b_stride + c);
            *reinterpret_cast<uint4*>(sx + e) = gate8<T>(av, bv);
        }
    } else if constexpr (MODE == DMV_NORMED) {
        __shared__ float nred[THREADS / 32];
        for (int r = 0; r < (int)p.rows; ++r) {
            const T* xrow = x + (size_t)r * p.x_stride;
            float ss = 0.f;
            for (int c = threadIdx.x; c < in_dim; c += THREADS) {
                const float v = to_f(xrow[c]);
                ss += v * v;
            }
            const float inv = rsqrtf(block_sum<THREADS>(ss, nred) / in_dim + p.eps);
            for (int c = threadIdx.x; c < in_dim; c += THREADS)
                sx[(size_t)r * in_dim + c] = from_f<T>(to_f(xrow[c]) * inv * to_f(xb[c]));
        }
    }
    __syncthreads();
}

template <typename T, int MT, int WARPS, int MODE>
__device__ __forceinline__ void dense_mv_body(const DenseMvParams p, const T* __restrict__ x,
                                              const T* __restrict__ xb,
                                              const T* __restrict__ w, T* __restrict__ y) {
    __shared__ float red[WARPS][32][4 * MT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, q = lane & 3;
    const int tile0 = blockIdx.x * 16 * MT;
    const int last = (int)p.out_dim - 1;
    const int in_dim = (int)p.in_dim;
    const int chunks = (in_dim + 31) / 32;
    const int per = (chunks + WARPS - 1) / WARPS;
    const int c0 = warp * per, c1 = min(chunks, c0 + per);
    const bool xok = gq < (int)p.rows;
    const T* rowp[2 * MT];
#pragma unroll
    for (int m = 0; m < 2 * MT; ++m)
        rowp[m] = w + (size_t)min(tile0 + 8 * m + gq, last) * in_dim + 8 * q;
    const T* xr = x + (size_t)(xok ? gq : 0) * p.x_stride + 8 * q;
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
    uint4 a[DMV_UNROLL][2 * MT];
    auto load_w = [&](const int c) {
#pragma unroll
        for (int i = 0; i < DMV_UNROLL; ++i) {
            const int k = (c + i) * 32;
            const bool ok = c + i < c1 && k + 8 * q < in_dim;
            const int kc = ok ? k : 0;  // unconditional loads, zeroed after (no branches)
#pragma unroll
            for (int m = 0; m < 2 * MT; ++m) {
                const uint4 v = ld_stream4(reinterpret_cast<const uint32_t*>(rowp[m] + kc));
                a[i][m] = ok ? v : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    // The block first writes its input rows to shared memory (each element once, not once per
    // lane that reads it), with its first weight loads already in flight.
    extern __shared__ __align__(16) unsigned char dmv_smem[];
    T* sx = reinterpret_cast<T*>(dmv_smem);
    // The first weight loads go out before waiting for the kernel before (see dense_sv_body).
    load_w(c0);
    pdl_entry();
    if constexpr (MODE == DMV_GATED || MODE == DMV_NORMED)
        stage_input<T, MODE, WARPS * 32>(p, x, xb, sx);
    const T* sxr = sx + (size_t)(xok ? gq : 0) * in_dim + 8 * q;
    for (int c = c0; c < c1; c += DMV_UNROLL) {
        if (c != c0) load_w(c);  // the first step's loads went out above
        uint4 xv[DMV_UNROLL];
#pragma unroll
        for (int i = 0; i < DMV_UNROLL; ++i) {
            const int k = (c + i) * 32;
            const bool ok = c + i < c1 && k + 8 * q < in_dim && xok;
            if constexpr (MODE != DMV_PLAIN)
                xv[i] = ok ? *reinterpret_cast<const uint4*>(sxr + k) : make_uint4(0u, 0u, 0u, 0u);
            else
                xv[i] = ok ? *reinterpret_cast<const uint4*>(xr + k) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int i = 0; i < DMV_UNROLL; ++i) {
            const uint32_t b0[2] = {xv[i].x, xv[i].y}, b1[2] = {xv[i].z, xv[i].w};
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const uint4 ra = a[i][2 * m], rb = a[i][2 * m + 1];
                const uint32_t f0[4] = {ra.x, rb.x, ra.y, rb.y}, f1[4] = {ra.z, rb.z, ra.w, rb.w};
                mma_16816<T>(acc[m], f0, b0);
                mma_16816<T>(acc[m], f1, b1);
            }
        }
    }
    store_mma_tiles<T, MT, WARPS>(&acc[0][0], red, tile0, last, (int)p.rows, (int)p.out_dim,
                                  y);
}

// Kernels dense_mv_{T}_{MT}_{WARPS}: more warps per block for few output tiles (more loads in
// flight per multiprocessor), two tiles per block for many. `_gated`: gated input; `_norm`: the
// residual add + norm of the output folded in.
#define DMV_NORM_ARGS(T)                                                                       \
    const T *res, const T *nw, const T *scalar, const T *w2, const T *w3, T *out, T *out2,     \
        T *out3, uint32_t *counter, const MvNormParams np
#define DMV_INST(TN, T, MT, WARPS)                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, DMV_MIN_BLOCKS(WARPS))                                   \
        dense_mv_##TN##_##MT##_##WARPS(const DenseMvParams p, const T* x, const T* w, T* y) {  \
        dense_mv_body<T, MT, WARPS, DMV_PLAIN>(p, x, x, w, y);                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, DMV_MIN_BLOCKS(WARPS))                                   \
        dense_mv_gated_##TN##_##MT##_##WARPS(const DenseMvParams p, const T* x, const T* xb,   \
                                             const T* w, T* y) {                               \
        dense_mv_body<T, MT, WARPS, DMV_GATED>(p, x, xb, w, y);                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, DMV_MIN_BLOCKS(WARPS))                                   \
        dense_mv_normed_##TN##_##MT##_##WARPS(const DenseMvParams p, const T* x, const T* nw,  \
                                              const T* w, T* y) {                              \
        dense_mv_body<T, MT, WARPS, DMV_NORMED>(p, x, nw, w, y);                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, DMV_MIN_BLOCKS(WARPS)) dense_mv_norm_##TN##_##MT##_##WARPS( \
        const DenseMvParams p, const T* x, const T* w, T* y, DMV_NORM_ARGS(T)) {                  \
        dense_mv_body<T, MT, WARPS, DMV_PLAIN>(p, x, x, w, y);                                     \
        last_block_add_norm<T, WARPS * 32>(p, np, y, res, nw, scalar, w2, w3, out, out2, out3, \
                                           counter);                                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, DMV_MIN_BLOCKS(WARPS))                                   \
        dense_mv_gated_norm_##TN##_##MT##_##WARPS(const DenseMvParams p, const T* x,           \
                                                  const T* xb, const T* w, T* y,               \
                                                  DMV_NORM_ARGS(T)) {                             \
        dense_mv_body<T, MT, WARPS, DMV_GATED>(p, x, xb, w, y);                                     \
        last_block_add_norm<T, WARPS * 32>(p, np, y, res, nw, scalar, w2, w3, out, out2, out3, \
                                           counter);                                           \
    }
#define DMV_INST_T(TN, T)     \
    DMV_INST(TN, T, 1, 16)    \
    DMV_INST(TN, T, 1, 8)     \
    DMV_INST(TN, T, 2, 8)
DMV_INST_T(f16, __half)
DMV_INST_T(bf16, __nv_bfloat16)

// sum of the eight products of two packed 16-byte vectors, added to acc.
template <typename T>
__device__ __forceinline__ float dot8(const uint4 a, const float (&xf)[8], float acc) {
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 f = unpack2<T>(w[j]);
        acc = fmaf(f.x, xf[2 * j], acc);
        acc = fmaf(f.y, xf[2 * j + 1], acc);
    }
    return acc;
}

// Dense y = x · Wᵀ for one activation row on the CUDA cores (`_sv{RPW}` kernels): each warp owns
// RPW output rows and reads each of them whole, a warp-wide load covering 512 contiguous bytes
// of one row (the tensor-core kernel's fragments touch 16 rows at 64 bytes each: the same bytes,
// measured at ~60% of the DRAM peak against cuBLAS's 85-95%). SV_LOADS 16-byte weight loads a
// lane are in flight per step. Staged inputs (gated, normed) go to shared memory first, as in
// the tensor-core kernel.
constexpr int SV_WARPS = 8, SV_LOADS = 8;

template <typename T, int RPW, int MODE>
__device__ __forceinline__ void dense_sv_body(const DenseMvParams p, const T* __restrict__ x,
                                              const T* __restrict__ xb,
                                              const T* __restrict__ w, T* __restrict__ y) {
    constexpr int U = SV_LOADS / RPW;  // steps of 32 units per load batch
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * SV_WARPS + warp) * RPW;
    const int last = (int)p.out_dim - 1;
    const int in_dim = (int)p.in_dim;
    const int units = in_dim / 8;
    // GeGLU: output j of the warp reads gate row i0 + j and up row width + i0 + j.
    const int width = (int)p.out_dim / 2, i0 = row0 / 2;
    const uint4* wr[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int row = MODE == DMV_GEGLU ? min(i0 + r / 2, width - 1) + (r & 1) * width
                                          : min(row0 + r, last);
        wr[r] = reinterpret_cast<const uint4*>(w + (size_t)row * in_dim);
    }
    uint4 a[U][RPW];
    auto load_w = [&](const int u0) {
#pragma unroll
        for (int i = 0; i < U; ++i) {
            // Unconditional loads (a clamped address, zeroed after): a branch around each
            // load would let the compiler serialise them.
            const int u = u0 + 32 * i + lane, uc = min(u, units - 1);
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
                const uint4 v = ld_stream4(reinterpret_cast<const uint32_t*>(wr[r] + uc));
                a[i][r] = u < units ? v : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    extern __shared__ __align__(16) unsigned char dmv_smem[];
    T* sx = reinterpret_cast<T*>(dmv_smem);
    // The weights are constant: the first loads go out before waiting for the kernel before
    // (programmatic dependent launch), overlapping its tail.
    load_w(0);
    pdl_entry();
    if constexpr (MODE == DMV_GATED || MODE == DMV_NORMED)
        stage_input<T, MODE, SV_WARPS * 32>(p, x, xb, sx);
    const uint4* xs =
        reinterpret_cast<const uint4*>(MODE == DMV_PLAIN || MODE == DMV_GEGLU ? x : sx);
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    for (int u0 = 0; u0 < units; u0 += 32 * U) {
        if (u0 != 0) load_w(u0);  // the first step's loads went out above
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int u = u0 + 32 * i + lane;
            const uint4 xv = u < units ? xs[u] : make_uint4(0u, 0u, 0u, 0u);
            float xf[8];
            unpack8<T>(xv, xf);
#pragma unroll
            for (int r = 0; r < RPW; ++r) acc[r] = dot8<T>(a[i][r], xf, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    }
    if constexpr (MODE == DMV_GEGLU) {
#pragma unroll
        for (int j = 0; j < RPW / 2; ++j) {
            if (lane == j && i0 + j < width) {
                const float g = rnd<T>(acc[2 * j]), u = rnd<T>(acc[2 * j + 1]);
                y[i0 + j] = from_f<T>(rnd<T>(gelu_tanh(g)) * u);
            }
        }
    } else {
#pragma unroll
        for (int r = 0; r < RPW; ++r)
            if (lane == r && row0 + r <= last) y[row0 + r] = from_f<T>(acc[r]);
    }
}

#define DSV_INST(TN, T, RPW)                                                                   \
    extern "C" __global__ void __launch_bounds__(SV_WARPS * 32, 2)                                \
        dense_mv_##TN##_sv##RPW(const DenseMvParams p, const T* x, const T* w, T* y) {         \
        dense_sv_body<T, RPW, DMV_PLAIN>(p, x, x, w, y);                                       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SV_WARPS * 32, 2)                                \
        dense_mv_gated_##TN##_sv##RPW(const DenseMvParams p, const T* x, const T* xb,          \
                                      const T* w, T* y) {                                      \
        dense_sv_body<T, RPW, DMV_GATED>(p, x, xb, w, y);                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SV_WARPS * 32, 2)                                \
        dense_mv_normed_##TN##_sv##RPW(const DenseMvParams p, const T* x, const T* nw,         \
                                       const T* w, T* y) {                                     \
        dense_sv_body<T, RPW, DMV_NORMED>(p, x, nw, w, y);                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SV_WARPS * 32, 2)                             \
        dense_mv_geglu_##TN##_sv##RPW(const DenseMvParams p, const T* x, const T* w, T* y) {   \
        dense_sv_body<T, RPW, DMV_GEGLU>(p, x, x, w, y);                                       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SV_WARPS * 32, 2) dense_mv_norm_##TN##_sv##RPW(  \
        const DenseMvParams p, const T* x, const T* w, T* y, DMV_NORM_ARGS(T)) {               \
        dense_sv_body<T, RPW, DMV_PLAIN>(p, x, x, w, y);                                       \
        last_block_add_norm<T, SV_WARPS * 32>(p, np, y, res, nw, scalar, w2, w3, out, out2,    \
                                              out3, counter);                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SV_WARPS * 32, 2)                                \
        dense_mv_gated_norm_##TN##_sv##RPW(const DenseMvParams p, const T* x, const T* xb,     \
                                           const T* w, T* y, DMV_NORM_ARGS(T)) {               \
        dense_sv_body<T, RPW, DMV_GATED>(p, x, xb, w, y);                                      \
        last_block_add_norm<T, SV_WARPS * 32>(p, np, y, res, nw, scalar, w2, w3, out, out2,    \
                                              out3, counter);                                  \
    }
#define DSV_INST_T(TN, T) \
    DSV_INST(TN, T, 1)    \
    DSV_INST(TN, T, 2)    \
    DSV_INST(TN, T, 4)

DSV_INST_T(f16, __half)
DSV_INST_T(bf16, __nv_bfloat16)
