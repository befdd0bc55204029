// Dense-weight decode products: x · Wᵀ for at most 8 rows of f16/bf16 on the tensor cores
// (RMS-normed inputs computed inside), or one row on the CUDA cores (`_sv2`), with gated,
// RMS-normed and stacked-GeGLU inputs computed inside and the residual add + norm of the
// output folded into the last block (`_norm`).
//
// DenseMvParams must match `src/kernels/cuda/dense_matvec.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"
#include "gate.cuh"
#include "norm_tail.cuh"
#include "peer.cuh"

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
// DMV_NORMED (and DMV_GATED in the one-row kernels): the block computes its input rows into
// dynamic shared memory (rows * in_dim elements) instead of a launch of their own doing it.
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

// The folded add + norm's arguments (the one-row `_norm` kernels).
#define DMV_NORM_ARGS(T)                                                                       \
    const T *res, const T *nw, const T *scalar, const T *w2, const T *w3, T *out, T *out2,     \
        T *out3, uint32_t *counter, const MvNormParams np
// Kernels dense_mv_{T}_{MT}_{WARPS}: more warps per block for few output tiles (more loads in
// flight per multiprocessor), two tiles per block for many. `_normed`: the RMS-normed input.
// (A gated input and the folded add + norm are one-row kernels' only: at more rows each block
// would gate every row again, and one block would normalise the rows in turn.)
#define DMV_INST(TN, T, MT, WARPS)                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, DMV_MIN_BLOCKS(WARPS))            \
        dense_mv_##TN##_##MT##_##WARPS(const DenseMvParams p, const T* x, const T* w, T* y) {  \
        dense_mv_body<T, MT, WARPS, DMV_PLAIN>(p, x, x, w, y);                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, DMV_MIN_BLOCKS(WARPS))            \
        dense_mv_normed_##TN##_##MT##_##WARPS(const DenseMvParams p, const T* x, const T* nw,  \
                                              const T* w, T* y) {                              \
        dense_mv_body<T, MT, WARPS, DMV_NORMED>(p, x, nw, w, y);                               \
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
// of one row (the tensor-core kernel's fragments touch 16 rows at 64 bytes each, a pattern
// that streams well below the DRAM peak). SV_LOADS 16-byte weight loads a
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
// Two output rows a warp (`SV_ROWS_PER_WARP` in dense_matvec.rs).
DSV_INST(f16, __half, 2)
DSV_INST(bf16, __nv_bfloat16, 2)

// The one-row product of a row-parallel weight (each rank holds some of its input columns)
// with the sum over the ranks and the residual add + norm in one launch: each block sends its
// outputs to the peers as soon as it has stored them, so the exchange overlaps the other
// blocks' products, and the last block sums and adds (`last_block_peer_add_norm`). The epoch
// and the receive region are the fused peer sums' (peer_reduce.cu).
#define DSV_PEER_INST(TN, T, RPW)                                                              \
    extern "C" __global__ void __launch_bounds__(SV_WARPS * 32, 2)                             \
        dense_mv_peer_norm_##TN##_sv##RPW(const DenseMvParams p, const T* x, const T* w, T* y, \
                                          DMV_NORM_ARGS(T), const PeerArgs a,                  \
                                          unsigned int* epochs) {                              \
        dense_sv_body<T, RPW, DMV_PLAIN>(p, x, x, w, y);                                       \
        unsigned int* epoch_at = epochs + PEER_FUSED_EPOCH;                                    \
        const unsigned int epoch = *epoch_at + 1; /* after the body's wait on the kernel before */ \
        const unsigned int o0 = blockIdx.x * SV_WARPS * RPW;                                   \
        peer_send_outputs<T>(a, y, 1, p.out_dim, o0, min(p.out_dim, o0 + SV_WARPS * RPW), epoch); \
        last_block_peer_add_norm<T, SV_WARPS * 32>(a, epoch_at, epoch, p, np, y, res, nw, scalar, \
                                                   w2, w3, out, out2, out3, counter);          \
    }
DSV_PEER_INST(f16, __half, 2)
DSV_PEER_INST(bf16, __nv_bfloat16, 2)
