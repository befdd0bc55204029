// The routed experts of an MoE block: router top-k with its softmax mix weights, the expert
// products grouped by expert (dense or MLX-packed experts, the GeGLU gate optionally computed
// inside), and the weighted sum of each token's picks.
//
// Parameter structs must match `src/kernels/cuda/moe.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"
#include "gate.cuh"
#include "norm_tail.cuh"
#include "packed.cuh"

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

// dot(W row m, x) for R rows wr[m] over in_dim (a multiple of 8) by one warp, 16-byte loads,
// into acc[m]. B loads a row per lane in flight: unconditional (clamped, zeroed after) so that
// the compiler issues them together instead of each right before its use.
template <typename T, int R, int B>
__device__ __forceinline__ void warp_dot_rows(const T* __restrict__ const (&wr)[R],
                                              const T* __restrict__ xr, int in_dim,
                                              float (&acc)[R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < R; ++m) acc[m] = 0.f;
    for (int e0 = lane * 8; e0 < in_dim; e0 += 32 * 8 * B) {
        float wv[B][R][8];
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int m = 0; m < R; ++m) load_x8<T>(wr[m] + min(e0 + 256 * b, in_dim - 8), wv[b][m]);
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int e = e0 + 256 * b;
            float xv[8];
            load_x8<T>(xr + min(e, in_dim - 8), xv);
            const float keep = e < in_dim ? 1.f : 0.f;
#pragma unroll
            for (int m = 0; m < R; ++m)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[m] = fmaf(wv[b][m][i] * keep, xv[i], acc[m]);
        }
    }
#pragma unroll
    for (int m = 0; m < R; ++m)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
}

// Routed expert products grouped by expert: block (e, tile) finds the pairs routed to expert
// e, then each warp takes Rows::R output rows of e and computes them for every such pair, so each
// expert row is read from memory once per call however many tokens picked it.
//   y[p, o] = W[e][o, :] . x[row(p), :]      for every pair p with idx[p] == e
//
// GATED: the pair rows are gelu_tanh(x) * xb (rows strided by x_stride and b_stride), computed
// by the block for its pairs into dynamic shared memory first.
// Rows of dense experts: W [E, out, in]. ROWS rows a warp: one for long rows (four loads a
// lane in flight), several for short ones (a down product's 352 or 704 inputs leave one row
// one to three loads a lane and a grid of many short blocks). Each row's sum runs in the same
// order either way, so both give the same bits.
template <typename T, int ROWS = 1> struct DenseExpertRows {
    static constexpr int R = ROWS;
    static constexpr bool TC = false;
    const T* __restrict__ w;
    __device__ __forceinline__ void dot(const GroupedMvParams& p, uint32_t e, int o0,
                                        const T* xrow, float (&acc)[R]) const {
        const T* base = w + (size_t)e * p.expert_stride;
        // Rows past the end repeat the last one (their sums are not stored).
        const T* __restrict__ wr[R];
#pragma unroll
        for (int m = 0; m < R; ++m)
            wr[m] = base + (size_t)(R == 1 ? o0 : min(o0 + m, (int)p.out_dim - 1)) * p.in_dim;
        // One row: four loads a lane in flight; several: two a row.
        warp_dot_rows<T, R, R == 1 ? 4 : 2>(wr, xrow, (int)p.in_dim, acc);
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
    static constexpr bool TC = false;
    const uint32_t* __restrict__ codes;
    const S* __restrict__ scales;
    const S* __restrict__ biases;
    // Chunk c (16 bytes of codes) of each of the R rows, and the scale and bias of its group g.
    __device__ __forceinline__ void load_chunk(int c, int g, const uint32_t* const (&wr)[R],
                                               const S* const (&sr)[R], const S* const (&br)[R],
                                               uint4 (&w4)[R], float (&sc)[R],
                                               float (&bi)[R]) const {
#pragma unroll
        for (int m = 0; m < R; ++m) {
            w4[m] = ld_stream4(wr[m] + c * 4);
            sc[m] = to_f(sr[m][g]);
            bi[m] = to_f(br[m][g]);
        }
    }

    // Code i of a 16-byte chunk as a float, through its bit pattern (2^23 + code, minus 2^23).
    static __device__ __forceinline__ float code_at(const uint4 w4, int i) {
        constexpr uint32_t MASK = (1u << BITS) - 1;
        const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
        const uint32_t code = (w[(i * BITS) >> 5] >> ((i * BITS) & 31)) & MASK;
        return __uint_as_float(0x4B000000u | code) - 8388608.f;
    }

    // The code, scale and bias rows of output rows o0.. of expert e; rows past the end repeat
    // the last one (their sums are not stored).
    __device__ __forceinline__ void row_ptrs(const GroupedMvParams& p, uint32_t e, int o0,
                                             const uint32_t* (&wr)[R], const S* (&sr)[R],
                                             const S* (&br)[R]) const {
        const int words = (int)p.in_dim * BITS / 32, groups = (int)(p.in_dim / p.group_size);
        const int last = (int)p.out_dim - 1;
#pragma unroll
        for (int m = 0; m < R; ++m) {
            const size_t r = (size_t)e * p.out_dim + min(o0 + m, last);
            wr[m] = codes + r * words;
            sr[m] = scales + r * groups;
            br[m] = biases + r * groups;
        }
    }

    __device__ __forceinline__ void dot(const GroupedMvParams& p, uint32_t e, int o0,
                                        const T* xrow, float (&acc)[R]) const {
        constexpr int EPC = 128 / BITS;
        const int lane = threadIdx.x & 31;
        const int words = (int)p.in_dim * BITS / 32;
        const uint32_t* wr[R];
        const S* sr[R];
        const S* br[R];
        row_ptrs(p, e, o0, wr, sr, br);
#pragma unroll
        for (int m = 0; m < R; ++m) acc[m] = 0.f;
#pragma unroll 2
        for (int c = lane; c < words / 4; c += 32) {
            const int e0 = c * EPC;
            const int g = e0 / (int)p.group_size;
            uint4 w4[R];
            float sc[R], bi[R];
            load_chunk(c, g, wr, sr, br, w4, sc, bi);
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
                        const float cf = code_at(w4[m], i);
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

    // As `dot`, for P pair rows at once: each code is decoded once for the P rows (decoding,
    // not memory, bounds the one-row form once experts have several pairs each).
    template <int P>
    __device__ __forceinline__ void dot_multi(const GroupedMvParams& p, uint32_t e, int o0,
                                              const T* const (&xrow)[P],
                                              float (&acc)[R][P]) const {
        constexpr int EPC = 128 / BITS;
        const int lane = threadIdx.x & 31;
        const int words = (int)p.in_dim * BITS / 32;
        const uint32_t* wr[R];
        const S* sr[R];
        const S* br[R];
        row_ptrs(p, e, o0, wr, sr, br);
#pragma unroll
        for (int m = 0; m < R; ++m)
#pragma unroll
            for (int j = 0; j < P; ++j) acc[m][j] = 0.f;
        for (int c = lane; c < words / 4; c += 32) {
            const int e0 = c * EPC;
            const int g = e0 / (int)p.group_size;
            uint4 w4[R];
            float sc[R], bi[R];
            load_chunk(c, g, wr, sr, br, w4, sc, bi);
            float dot[R][P], xs[P];
#pragma unroll
            for (int j = 0; j < P; ++j) {
                xs[j] = 0.f;
#pragma unroll
                for (int m = 0; m < R; ++m) dot[m][j] = 0.f;
            }
#pragma unroll
            for (int k8 = 0; k8 < EPC; k8 += 8) {
                float xv[P][8];
#pragma unroll
                for (int j = 0; j < P; ++j) load_x8<T>(xrow[j] + e0 + k8, xv[j]);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const int i = k8 + k;
#pragma unroll
                    for (int j = 0; j < P; ++j) xs[j] += xv[j][k];
#pragma unroll
                    for (int m = 0; m < R; ++m) {
                        const float cf = code_at(w4[m], i);
#pragma unroll
                        for (int j = 0; j < P; ++j) dot[m][j] = fmaf(cf, xv[j][k], dot[m][j]);
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < R; ++m)
#pragma unroll
                for (int j = 0; j < P; ++j)
                    acc[m][j] = fmaf(sc[m], dot[m][j], fmaf(bi[m], xs[j], acc[m][j]));
        }
#pragma unroll
        for (int m = 0; m < R; ++m)
#pragma unroll
            for (int j = 0; j < P; ++j)
#pragma unroll
                for (int off = 16; off > 0; off >>= 1)
                    acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], off);
    }
};

#include "moe_tc.cuh"

// P > 1 (packed rows only): the pairs of the expert go through `dot_multi` P at a time.
template <typename T, bool GATED, typename Rows, int P = 1>
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
    if constexpr (Rows::TC) {
        rows.template run<GATED>(p, e, o0, n, mine, x, sx, y);
        return;
    } else {
        // One pair at a time: each code decoded once a pair.
        auto one_by_one = [&]() {
            for (uint32_t i = 0; i < n; ++i) {
                const uint32_t q = mine[i];
                const uint32_t row = p.x_per_token ? q / p.top_k : q;
                const T* xrow = GATED ? sx + (size_t)i * p.in_dim : x + (size_t)row * p.in_dim;
                float acc[R];
                rows.dot(p, e, o0, xrow, acc);
                if (lane == 0) {
#pragma unroll
                    for (int m = 0; m < R; ++m)
                        if (o0 + m < (int)p.out_dim)
                            y[(size_t)q * p.out_dim + o0 + m] = from_f<T>(acc[m]);
                }
            }
        };
        if constexpr (P == 1) {
            one_by_one();
        } else if (n == 1) {
            // A lone pair (spread picks at small batches): P rows of it would decode each code for
            // P copies of the same row.
            one_by_one();
        } else {
            for (uint32_t i0 = 0; i0 < n; i0 += P) {
                // Past the last pair, rows repeat it (their sums are not stored).
                const T* xr[P];
                uint32_t qs[P];
#pragma unroll
                for (int j = 0; j < P; ++j) {
                    const uint32_t i = min(i0 + j, n - 1);
                    qs[j] = mine[i];
                    const uint32_t row = p.x_per_token ? qs[j] / p.top_k : qs[j];
                    xr[j] = GATED ? sx + (size_t)i * p.in_dim : x + (size_t)row * p.in_dim;
                }
                float acc[R][P];
                rows.template dot_multi<P>(p, e, o0, xr, acc);
                if (lane == 0) {
#pragma unroll
                    for (int j = 0; j < P; ++j) {
                        if (i0 + j >= n) break;
#pragma unroll
                        for (int m = 0; m < R; ++m)
                            if (o0 + m < (int)p.out_dim)
                                y[(size_t)qs[j] * p.out_dim + o0 + m] = from_f<T>(acc[m][j]);
                    }
                }
            }
        }
    }
}

// out[t, o] = sum_j mix[t, j] * y[row(t * top_k + j), o], row(q) = slot[q] when `slot` is given
// (the pairs' rows in an expert-sorted product), else q.
template <typename T>
__device__ __forceinline__ void moe_mix_body(const GroupedMvParams p, const T* __restrict__ y,
                                             const uint32_t* __restrict__ slot,
                                             const float* __restrict__ mix, T* __restrict__ out) {
    const size_t tokens = p.pairs / p.top_k;
    const size_t n = tokens * p.out_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / p.out_dim, o = i % p.out_dim;
        float acc = 0.f;
        for (uint32_t j = 0; j < p.top_k; ++j) {
            const size_t q = t * p.top_k + j;
            const size_t row = slot ? slot[q] : q;
            acc = fmaf(mix[q], to_f(y[row * p.out_dim + o]), acc);
        }
        out[i] = from_f<T>(acc);
    }
}

// dst[r] = src[idx[r]] for rows of `units` 16-byte units (rows 16-byte aligned).
__device__ __forceinline__ void gather_rows_body(const uint4* __restrict__ src,
                                                 const uint32_t* __restrict__ idx,
                                                 uint4* __restrict__ dst, uint32_t rows,
                                                 uint32_t units) {
    const size_t n = (size_t)rows * units;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / units, u = i % units;
        dst[i] = src[(size_t)idx[r] * units + u];
    }
}

// Dense experts, R rows a warp (suffix V names R > 1).
#define GROUPED_MV_DENSE(TN, T, V, R)                                                          \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_mv_##TN##V(const GroupedMvParams p, const T* w, const uint32_t* idx,           \
                           const T* x, T* y) {                                                 \
        pdl_entry();                                                                           \
        grouped_mv_body<T, false>(p, DenseExpertRows<T, R>{w}, idx, x, x, y);                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_mv_gated_##TN##V(const GroupedMvParams p, const T* w, const uint32_t* idx,     \
                                 const T* x, const T* xb, T* y) {                              \
        pdl_entry();                                                                           \
        grouped_mv_body<T, true>(p, DenseExpertRows<T, R>{w}, idx, x, xb, y);                  \
    }

#define MOE_INST(TN, T)                                                                        \
    extern "C" __global__ void moe_route_##TN(const RouteParams p, const T* logits,            \
                                              const float* scale, uint32_t* idx, float* mix) { \
        pdl_entry();                                                                           \
        moe_route_body<T>(p, logits, scale, idx, mix);                                         \
    }                                                                                          \
    GROUPED_MV_DENSE(TN, T, , 1)                                                               \
    GROUPED_MV_DENSE(TN, T, _r4, 4)                                                            \
    extern "C" __global__ void moe_mix_##TN(const GroupedMvParams p, const T* y,               \
                                            const float* mix, T* out) {                        \
        pdl_entry();                                                                           \
        moe_mix_body<T>(p, y, nullptr, mix, out);                                              \
    }                                                                                          \
    extern "C" __global__ void moe_mix_rows_##TN(const GroupedMvParams p, const T* y,          \
                                                 const uint32_t* slot, const float* mix,       \
                                                 T* out) {                                     \
        pdl_entry();                                                                           \
        moe_mix_body<T>(p, y, slot, mix, out);                                                 \
    }

extern "C" __global__ void gather_rows_u4(const uint4* src, const uint32_t* idx, uint4* dst,
                                          uint32_t rows, uint32_t units) {
    pdl_entry();
    gather_rows_body(src, idx, dst, rows, units);
}

MOE_INST(f32, float)
MOE_INST(f16, __half)
MOE_INST(bf16, __nv_bfloat16)

// Grouped products over MLX-packed experts (names grouped_qmv[_gated]_{T}_{S}_{BITS}_r{R}, R
// output rows a warp); the gated form only for 16-bit activations, as with dense experts.
#define GROUPED_QMV_KERNELS(TN, T, SN, S, BITS, R, P, MINB, V)                                 \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, MINB)                         \
        grouped_qmv_##TN##_##SN##_##BITS##_##V(const GroupedMvParams p, const uint32_t* c,     \
                                               const S* s, const S* b, const uint32_t* idx,    \
                                               const T* x, T* y) {                             \
        pdl_entry();                                                                           \
        grouped_mv_body<T, false, PackedExpertRows<T, S, BITS, R>, P>(                         \
            p, PackedExpertRows<T, S, BITS, R>{c, s, b}, idx, x, x, y);                        \
    }
#define GROUPED_QMV_GATED_KERNELS(TN, T, SN, S, BITS, R, P, MINB, V)                           \
    GROUPED_QMV_KERNELS(TN, T, SN, S, BITS, R, P, MINB, V)                                     \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, MINB)                         \
        grouped_qmv_gated_##TN##_##SN##_##BITS##_##V(                                          \
            const GroupedMvParams p, const uint32_t* c, const S* s, const S* b,                \
            const uint32_t* idx, const T* x, const T* xb, T* y) {                              \
        pdl_entry();                                                                           \
        grouped_mv_body<T, true, PackedExpertRows<T, S, BITS, R>, P>(                          \
            p, PackedExpertRows<T, S, BITS, R>{c, s, b}, idx, x, xb, y);                       \
    }
// 4 rows a warp, one pair at a time, 3 blocks a multiprocessor (80 registers a thread, no
// spills); and 4 rows a warp for 4 pairs at once, 2 blocks a multiprocessor (128 registers;
// 72 bytes of stack in the plain form), which beat 2 rows a warp by 1.07-1.22x at batches of
// 16-64 (26B-A4B, one H100).
#define GROUPED_QMV_INST(TN, T, SN, S, BITS)                   \
    GROUPED_QMV_KERNELS(TN, T, SN, S, BITS, 4, 1, 3, r4)       \
    GROUPED_QMV_KERNELS(TN, T, SN, S, BITS, 4, 4, 2, r4p4)
#define GROUPED_QMV_GATED_INST(TN, T, SN, S, BITS)             \
    GROUPED_QMV_GATED_KERNELS(TN, T, SN, S, BITS, 4, 1, 3, r4) \
    GROUPED_QMV_GATED_KERNELS(TN, T, SN, S, BITS, 4, 4, 2, r4p4)
#define GROUPED_QMV_BITS(INST, TN, T, SN, S) INST(TN, T, SN, S, 4) INST(TN, T, SN, S, 8)
#define GROUPED_QMV_SCALES(INST, TN, T)                   \
    GROUPED_QMV_BITS(INST, TN, T, f32, float)             \
    GROUPED_QMV_BITS(INST, TN, T, f16, __half)            \
    GROUPED_QMV_BITS(INST, TN, T, bf16, __nv_bfloat16)
GROUPED_QMV_SCALES(GROUPED_QMV_INST, f32, float)
GROUPED_QMV_SCALES(GROUPED_QMV_GATED_INST, f16, __half)
GROUPED_QMV_SCALES(GROUPED_QMV_GATED_INST, bf16, __nv_bfloat16)

// Grouped products on the tensor cores (moe_tc.cuh): grouped_qmv_tc[_gated]_{T} over 4-bit
// packed experts (scales and biases of the activations' type), grouped_mv_tc[_gated]_{T} over
// dense experts.
#define GROUPED_TC_INST(TN, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_qmv_tc_##TN(const GroupedMvParams p, const uint32_t* c, const T* s, const T* b, \
                            const uint32_t* idx, const T* x, T* y) {                           \
        pdl_entry();                                                                           \
        grouped_mv_body<T, false>(p, TcRows<T, PackedTcSource<T>>{{c, s, b}}, idx, x, x, y);   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_qmv_tc_gated_##TN(const GroupedMvParams p, const uint32_t* c, const T* s,      \
                                  const T* b, const uint32_t* idx, const T* x, const T* xb,    \
                                  T* y) {                                                      \
        pdl_entry();                                                                           \
        grouped_mv_body<T, true>(p, TcRows<T, PackedTcSource<T>>{{c, s, b}}, idx, x, xb, y);   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_mv_tc_##TN(const GroupedMvParams p, const T* w, const uint32_t* idx,           \
                           const T* x, T* y) {                                                 \
        pdl_entry();                                                                           \
        grouped_mv_body<T, false>(p, TcRows<T, DenseTcSource<T>>{{w}}, idx, x, x, y);          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GMV_WARPS * 32, 2)                            \
        grouped_mv_tc_gated_##TN(const GroupedMvParams p, const T* w, const uint32_t* idx,     \
                                 const T* x, const T* xb, T* y) {                              \
        pdl_entry();                                                                           \
        grouped_mv_body<T, true>(p, TcRows<T, DenseTcSource<T>>{{w}}, idx, x, xb, y);          \
    }
GROUPED_TC_INST(bf16, __nv_bfloat16)
GROUPED_TC_INST(f16, __half)
