// Packed-weight matrix-vector products for decode (at most 8 activation rows), MLX affine
// 4/8-bit W [out, in] (codes [out, in*BITS/32], scales/biases [out, in/G]): the SIMT kernel,
// the tensor-core kernel over exact codes, the tensor-core kernel over dequantized 4-bit codes,
// and the row-contiguous 4-bit kernel for one row, with its residual add + norm folded form.
// 9..32 rows of 4-bit codes: matvec_batch.cu.

#include <stdint.h>

#include "common.cuh"
#include "norm_tail.cuh"
#include "packed.cuh"
#include "async_copy.cuh"

// y[r, o] = sum_e x[r, e] * W[o, e] for rows <= MAXR: one warp per output row, each lane reads
// 16 bytes of codes per step (32 four-bit or 16 eight-bit codes, always inside one group).
constexpr int QMV_WARPS = 8;

template <typename T, typename S, int BITS, int MAXR, int UNROLL = 4>
__device__ __forceinline__ void qmatvec_body(const QmatParams p, const T* __restrict__ x,
                                             const uint32_t* __restrict__ codes,
                                             const S* __restrict__ scales,
                                             const S* __restrict__ biases, T* __restrict__ y) {
    constexpr int EPC = 128 / BITS;  // elements per 16-byte chunk
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int o = blockIdx.x * QMV_WARPS + warp;
    if (o >= (int)p.out_dim) return;
    const int words = p.in_dim * BITS / 32;
    const int chunks = words / 4;
    const int groups = p.in_dim / p.group_size;
    const uint32_t* wr = codes + (size_t)o * words;
    const S* sr = scales + (size_t)o * groups;
    const S* br = biases + (size_t)o * groups;
    float acc[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; ++r) acc[r] = 0.f;
#pragma unroll UNROLL
    for (int c = lane; c < chunks; c += 32) {
        const uint4 w4 = ld_stream4(wr + c * 4);
        const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
        const int e0 = c * EPC;
        const float sc = to_f(sr[e0 / p.group_size]);
        const float bi = to_f(br[e0 / p.group_size]);
        float cv[EPC];
#pragma unroll
        for (int k = 0; k < EPC; ++k)
            cv[k] = u2f((w[(k * BITS) >> 5] >> ((k * BITS) & 31)) & ((1u << BITS) - 1));
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            if (r < (int)p.rows) {
                float dot = 0.f, xs = 0.f;
                const T* xr = x + (size_t)r * p.in_dim + e0;
#pragma unroll
                for (int k8 = 0; k8 < EPC; k8 += 8) {
                    float xv[8];
                    load_x8<T>(xr + k8, xv);
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        dot = fmaf(cv[k8 + k], xv[k], dot);
                        xs += xv[k];
                    }
                }
                acc[r] = fmaf(sc, dot, fmaf(bi, xs, acc[r]));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < MAXR; ++r)
            if (r < (int)p.rows) y[(size_t)r * p.out_dim + o] = from_f<T>(acc[r]);
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core matrix-vector product for f16/bf16 activations (rows <= 8), MLX affine 4/8-bit W.
//
// One block = 16 output rows (the M of mma.m16n8k16) x QMMA_WARPS warps splitting the input
// dimension into contiguous ranges. The N = 8 columns are the activation rows. Codes
// enter the tensor cores as exact small integers (magic-number conversion: code | 128.0 as bf16,
// or | 1024.0 as f16, minus the magic), so products are exact and sums are f32; the group's
// scale and bias are applied afterwards: sum_k W[o,k] x[k] = s * sum_k c[o,k] x[k] + b * sum_k x[k],
// the x sums coming from a second mma against an all-ones A.
//
// Fragment order: lane = 4 * gq + q. Within one group (G consecutive k), thread q owns the G/4
// consecutive k starting at q * G / 4 and mma step s takes its k's 4s..4s+3; the quad's four
// threads together cover 16 k of one group per step, so every step lies inside one group.
// A slots (2q, 2q+1) hold k (4s, 4s+1) and slots (2q+8, 2q+9) hold k (4s+2, 4s+3); B holds x at
// the same k for activation row gq, i.e. 4 consecutive x elements (one 8-byte load).
// 8-bit codes are split into nibbles, c = lo + 16 hi, with one mma and one sum per nibble.
// ---------------------------------------------------------------------------------------------
constexpr int QMMA_WARPS = 8;

// Two 4-bit fields of `lo`/`hi` (selected by the byte_perm selector) as the pair
// (MAGIC + c0, MAGIC + c1), exact; the offset is taken out after the mma (see qmv_mma_body).
template <typename T>
__device__ __forceinline__ uint32_t code_pair(uint32_t lo, uint32_t hi, uint32_t sel) {
    return (__byte_perm(lo, hi, sel) & 0x000F000Fu) | MmaMagic<T>::MAGIC;
}

// Weights stream through shared memory: each warp copies "units" of 16 rows x 64 bytes (or one
// group, if larger) with 16-byte async copies (2-3 units in flight), then reads its fragments
// from there.
template <int GW> struct QmmaUnit {
    static constexpr int WORDS = GW > 16 ? GW : 16;  // per row, at least one group
    static constexpr int STAGES = WORDS > 16 ? 2 : 3;
    // Padded row stride (words): the quads' fragment reads hit distinct banks.
    static constexpr int STRIDE = GW <= 4 ? 20 : GW == 8 ? 24 : GW == 16 ? 16 : 36;
};

template <typename T, typename S, int BITS, int G>
__device__ __forceinline__ void qmv_mma_body(const QmatParams p, const T* __restrict__ x,
                                             const uint32_t* __restrict__ codes,
                                             const S* __restrict__ scales,
                                             const S* __restrict__ biases, T* __restrict__ y) {
    constexpr int GW = G * BITS / 32;   // code words per row per group
    constexpr int TW = GW / 4;          // ... per thread
    constexpr int STEPS = G / 16;       // mma k-steps per group
    constexpr int UW = QmmaUnit<GW>::WORDS;
    constexpr int NST = QmmaUnit<GW>::STAGES;
    constexpr int RS = QmmaUnit<GW>::STRIDE;
    constexpr int GPU = UW / GW;            // groups per unit
    constexpr int CHUNKS = 16 * UW / 4;     // 16-byte copies per unit
    __shared__ __align__(16) uint32_t stage[QMMA_WARPS][NST][16 * RS];
    __shared__ float red[QMMA_WARPS][32][4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, q = lane & 3;
    const int tile0 = blockIdx.x * 16;
    const int last = (int)p.out_dim - 1;
    const int ra = min(tile0 + gq, last), rb = min(tile0 + gq + 8, last);
    const int words = p.in_dim * BITS / 32;
    const int groups = p.in_dim / G;
    const int units = (words + UW - 1) / UW;
    const int per = (units + QMMA_WARPS - 1) / QMMA_WARPS;
    const int u0 = warp * per, u1 = min(units, u0 + per);
    const bool xok = gq < (int)p.rows;
    const T* xr = x + (size_t)(xok ? gq : 0) * p.in_dim + q * (G / 4);
    const uint32_t ones[4] = {MmaMagic<T>::ONES, MmaMagic<T>::ONES, MmaMagic<T>::ONES,
                              MmaMagic<T>::ONES};
    constexpr float M = MmaMagic<T>::MAGIC_F;
    uint32_t(*st)[16 * RS] = stage[warp];

    auto load_unit = [&](int u) {
        uint32_t* dst = st[u % NST];
#pragma unroll
        for (int i = 0; i < CHUNKS / 32; ++i) {
            const int c = i * 32 + lane, row = c / (UW / 4), col = (c % (UW / 4)) * 4;
            const int wofs = u * UW + col;
            if (wofs < words)
                cp_async16(dst + row * RS + col,
                           codes + (size_t)min(tile0 + row, last) * words + wofs);
        }
    };
#pragma unroll
    for (int i = 0; i < NST - 1; ++i) {
        if (u0 + i < u1) load_unit(u0 + i);
        cp_async_commit();
    }
    // Scales and biases (rows ra, rb) of a unit's groups, loaded one unit ahead of their use so
    // their latency hides behind the current unit's work.
    auto load_affine = [&](int u, S (*dst)[4]) {
#pragma unroll
        for (int gg = 0; gg < GPU; ++gg) {
            const int gi = min(u * GPU + gg, groups - 1);
            dst[gg][0] = scales[(size_t)ra * groups + gi];
            dst[gg][1] = biases[(size_t)ra * groups + gi];
            dst[gg][2] = scales[(size_t)rb * groups + gi];
            dst[gg][3] = biases[(size_t)rb * groups + gi];
        }
    };
    S aff[GPU][4];
    if (u0 < u1) load_affine(u0, aff);
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    for (int u = u0; u < u1; ++u) {
        S aff_next[GPU][4];
        if (u + 1 < u1) load_affine(u + 1, aff_next);
        if (u + NST - 1 < u1) load_unit(u + NST - 1);
        cp_async_commit();
        cp_async_wait<NST - 1>();
        __syncwarp();
        const uint32_t* sa_row = st[u % NST] + gq * RS + q * TW;
        const uint32_t* sb_row = sa_row + 8 * RS;
#pragma unroll
        for (int gg = 0; gg < GPU; ++gg) {
            const int gi = u * GPU + gg;
            if (gi >= groups) continue;
            uint32_t wa[TW], wb[TW];
            lds_codes<TW>(sa_row + gg * GW, wa);
            lds_codes<TW>(sb_row + gg * GW, wb);
            // c: sum (M + lo) x; ch (8-bit): sum (M + hi) x; cx: sum x.
            float c[4] = {0.f, 0.f, 0.f, 0.f}, ch[4] = {0.f, 0.f, 0.f, 0.f};
            float cx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < STEPS; ++s) {
                uint32_t b[2] = {0u, 0u};
                if (xok) {
                    const uint2 v = *reinterpret_cast<const uint2*>(xr + (size_t)gi * G + 4 * s);
                    b[0] = v.x;
                    b[1] = v.y;
                }
                if constexpr (BITS == 4) {
                    // Word s/2, bytes j and j+1: (lo, hi) nibbles = k (4s, 4s+1), (4s+2, 4s+3).
                    const uint32_t xa = wa[s >> 1], xb = wb[s >> 1];
                    const uint32_t ha = xa >> 4, hb = xb >> 4;
                    const uint32_t j = 2 * (s & 1);  // constant once unrolled
                    const uint32_t s0 = j | ((4 + j) << 8), s1 = (j + 1) | ((5 + j) << 8);
                    const uint32_t a[4] = {code_pair<T>(xa, ha, s0), code_pair<T>(xb, hb, s0),
                                           code_pair<T>(xa, ha, s1), code_pair<T>(xb, hb, s1)};
                    mma_16816<T>(c, a, b);
                } else {
                    // Word s: bytes (0, 1) = k (4s, 4s+1), bytes (2, 3) = k (4s+2, 4s+3).
                    const uint32_t xa = wa[s], xb = wb[s];
                    const uint32_t ha = xa >> 4, hb = xb >> 4;
                    constexpr uint32_t s0 = 0x0100u, s1 = 0x0302u;
                    const uint32_t alo[4] = {code_pair<T>(xa, 0u, s0), code_pair<T>(xb, 0u, s0),
                                             code_pair<T>(xa, 0u, s1), code_pair<T>(xb, 0u, s1)};
                    const uint32_t ahi[4] = {code_pair<T>(ha, 0u, s0), code_pair<T>(hb, 0u, s0),
                                             code_pair<T>(ha, 0u, s1), code_pair<T>(hb, 0u, s1)};
                    mma_16816<T>(c, alo, b);
                    mma_16816<T>(ch, ahi, b);
                }
                mma_16816<T>(cx, ones, b);
            }
            // sum W x = s * (sum c x) + b * X, with sum c x = c - M X (+ 16 (ch - M X) for 8 bits).
            const float sa = to_f(aff[gg][0]), ba = to_f(aff[gg][1]);
            const float sb = to_f(aff[gg][2]), bb = to_f(aff[gg][3]);
            const float off = BITS == 4 ? M : 17.f * M;
            const float oa = fmaf(-off, sa, ba), ob = fmaf(-off, sb, bb);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float d = BITS == 4 ? c[i] : fmaf(16.f, ch[i], c[i]);
                tot[i] = fmaf(i < 2 ? sa : sb, d, fmaf(i < 2 ? oa : ob, cx[i], tot[i]));
            }
        }
        __syncwarp();  // the slot is refilled next iteration
        if (u + 1 < u1) {
#pragma unroll
            for (int gg = 0; gg < GPU; ++gg) {
#pragma unroll
                for (int i = 0; i < 4; ++i) aff[gg][i] = aff_next[gg][i];
            }
        }
    }
    cp_async_wait<0>();
    store_mma_tiles<T, 1, QMMA_WARPS>(tot, red, tile0, last, (int)p.rows, (int)p.out_dim, y);
}

#define QMMA_INST(TN, T, SN, S, BITS, G)                                                       \
    extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32)                               \
        qmv_mma_##TN##_##SN##_##BITS##_##G(const QmatParams p, const T* x, const uint32_t* c,    \
                                          const S* s, const S* b, T* y) {                      \
        pdl_entry();                                                                           \
        qmv_mma_body<T, S, BITS, G>(p, x, c, s, b, y);                                          \
    }
#define QMMA_INST_G(TN, T, SN, S, BITS) \
    QMMA_INST(TN, T, SN, S, BITS, 32)                                                          \
    QMMA_INST(TN, T, SN, S, BITS, 64)                                                          \
    QMMA_INST(TN, T, SN, S, BITS, 128)
#define QMMA_INST_S(TN, T, SN, S)    \
    QMMA_INST_G(TN, T, SN, S, 4)     \
    QMMA_INST_G(TN, T, SN, S, 8)
#define QMMA_INST_T(TN, T)                \
    QMMA_INST_S(TN, T, f32, float)        \
    QMMA_INST_S(TN, T, f16, __half)       \
    QMMA_INST_S(TN, T, bf16, __nv_bfloat16)
QMMA_INST_T(f16, __half)
QMMA_INST_T(bf16, __nv_bfloat16)


// ---------------------------------------------------------------------------------------------
// Tensor-core 4-bit matrix-vector product with dequantization before the mma, for f16/bf16
// activations whose scales and biases have the activation's type (rows <= 8, group >= 32).
//
// Each thread dequantizes its codes to the activation type in registers: the magic-number pair
// (128 + c as bf16, 1024 + c as f16) minus the magic is the exact code, and one fused multiply-add
// with the group's scale and bias rounds the weight once, as dequantizing W to that type would.
// The mma then accumulates whole rows in f32: no per-group flush, no sums of x.
//
// One block = 16 output rows x QMMA_WARPS warps splitting the input into contiguous runs of
// 128-element chunks. In a chunk, thread q of a quad takes 32 consecutive codes (one 16-byte
// load per row, always inside one group) for rows gq and gq + 8. The sum over k does not care
// about its order, so A and B slots take the same permuted k's: the pair (nibble p, nibble
// p + 4) of a word sits in one 32-bit slot, and x is permuted to match with byte_perm.
// ---------------------------------------------------------------------------------------------

// One 16-row tile a block, two chunks in flight a step.
constexpr int QTC_TILES = 1;

template <typename T, int QTC_UNROLL>
__device__ __forceinline__ void qmv_tc4_body(const QmatParams p, const T* __restrict__ x,
                                             const uint32_t* __restrict__ codes,
                                             const T* __restrict__ scales,
                                             const T* __restrict__ biases, T* __restrict__ y) {
    __shared__ float red[QMMA_WARPS][32][4 * QTC_TILES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, q = lane & 3;
    const int tile0 = blockIdx.x * 16 * QTC_TILES;
    const int last = (int)p.out_dim - 1;
    const int in_dim = (int)p.in_dim;
    const int words = in_dim / 8;
    const int groups = in_dim / (int)p.group_size;
    const int chunks = (in_dim + 127) / 128;
    const int per = (chunks + QMMA_WARPS - 1) / QMMA_WARPS;
    const int c0 = warp * per, c1 = min(chunks, c0 + per);
    const bool xok = gq < (int)p.rows;
    // Rows of this thread: gq + 8 m for m < 2 QTC_TILES (tile m / 2, half m % 2).
    int row[2 * QTC_TILES];
    const uint32_t* wr[2 * QTC_TILES];
#pragma unroll
    for (int m = 0; m < 2 * QTC_TILES; ++m) {
        row[m] = min(tile0 + gq + 8 * m, last);
        wr[m] = codes + (size_t)row[m] * words + 4 * q;
    }
    const T* xr = x + (size_t)(xok ? gq : 0) * in_dim + 32 * q;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float acc[QTC_TILES][4];
#pragma unroll
    for (int t = 0; t < QTC_TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    for (int c = c0; c < c1; c += QTC_UNROLL) {
        uint4 W[QTC_UNROLL][2 * QTC_TILES], X[QTC_UNROLL][4];
        uint32_t sc[QTC_UNROLL][2 * QTC_TILES], bi[QTC_UNROLL][2 * QTC_TILES];
#pragma unroll
        for (int i = 0; i < QTC_UNROLL; ++i) {
            const int k = (c + i) * 128 + 32 * q;
            const bool ok = c + i < c1 && k < in_dim;
            const int g = ok ? k / (int)p.group_size : 0;
            // Unconditional loads (chunk 0 when out of range), zeroed after: a branch around
            // each load lets the compiler issue them one at a time.
            const int cc = ok ? c + i : 0;
#pragma unroll
            for (int m = 0; m < 2 * QTC_TILES; ++m) {
                const uint4 wv = ld_stream4(wr[m] + cc * 16);
                W[i][m] = ok ? wv : zero;
                sc[i][m] = splat(scales[(size_t)row[m] * groups + g]);
                bi[i][m] = splat(biases[(size_t)row[m] * groups + g]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 xv = *reinterpret_cast<const uint4*>(xr + cc * 128 + 8 * j);
                X[i][j] = ok && xok ? xv : zero;
            }
        }
#pragma unroll
        for (int i = 0; i < QTC_UNROLL; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                uint32_t b0[2], b1[2];
                qt_act_frags(X[i][j], b0, b1);
#pragma unroll
                for (int t = 0; t < QTC_TILES; ++t) {
                    uint32_t f0[4], f1[4];
                    qt_code_frags<T>(W[i][2 * t], W[i][2 * t + 1], j, sc[i][2 * t], bi[i][2 * t],
                                     sc[i][2 * t + 1], bi[i][2 * t + 1], f0, f1);
                    mma_16816<T>(acc[t], f0, b0);
                    mma_16816<T>(acc[t], f1, b1);
                }
            }
        }
    }
    store_mma_tiles<T, QTC_TILES, QMMA_WARPS>(&acc[0][0], red, tile0, last, (int)p.rows,
                                       (int)p.out_dim, y);
}

// qmv_tc4_{T}_b{B}: registers capped for B resident blocks a multiprocessor (4: 64 registers,
// 32 warps an SM), U chunks a step.
#define QTC4_INST(TN, T, B, U)                                                                 \
    extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32, B)                            \
        qmv_tc4_##TN##_b##B(const QmatParams p, const T* x, const uint32_t* c, const T* s,      \
                            const T* b, T* y) {                                                \
        pdl_entry();                                                                           \
        qmv_tc4_body<T, U>(p, x, c, s, b, y);                                                  \
    }
QTC4_INST(f16, __half, 4, 2)
QTC4_INST(bf16, __nv_bfloat16, 4, 2)

// ---------------------------------------------------------------------------------------------
// 4-bit matrix-vector product for one activation row (decode at batch 1), read row-contiguous.
//
// qmv_tc4's fragments touch 16 rows at 64 bytes each per warp-wide load; here each warp-wide
// load covers 512 contiguous bytes of one row (lane l takes 32 codes, 16 bytes, at byte 16 l of
// a 1024-code step), which streams the weight closer to the copy bandwidth. The mma still does the multiply-adds: A row gq (and gq + 8) of the tile holds
// the codes of quad gq's four lanes for output row r (and r + 1), and B column gq holds the same
// lanes' x at the same k. D[gq][gq] is then quad gq's partial dot product of row r; the
// off-diagonal entries are ignored, and the warp sums the eight diagonal entries at the end.
// Each lane's 32 codes lie in one group: it dequantizes them with that group's scale and bias
// exactly as qmv_tc4 does (the weight rounded once to the activation type), so one row and a
// batch of rows round alike.
//
// A warp owns two consecutive rows and issues U steps' loads before their math (`_u2`: two,
// with registers capped at 80 so that ptxas keeps them together). Variants ending in `e` issue
// the first round's weight loads before the PDL wait and read x after it (for weights the host
// marks settled), so they overlap the previous kernel's tail.
//
// Split input (blockDim.y > 1): the blockDim.y warps at one threadIdx.x warp index share the
// same two rows, warp y taking steps y, y + blockDim.y, ...; their partial sums meet in shared
// memory. For launches with too few row pairs to fill the device (`row_matvec_split_for`).
// ---------------------------------------------------------------------------------------------
constexpr int QROW_MAX_WARPS = 8;  // blockDim.x / 32 * blockDim.y, 1-8 (QMATVEC_ROW_WARPS)

// U: steps whose loads a warp issues before their math (1 or 2). LATE_X: x is read in the
// math (from L1) rather than with the step's weight loads, for fewer live registers. EARLY:
// the first round's weight loads are issued before the PDL wait (the kernel entry then skips
// it): weights are never written by the kernel before (see `pdl_entry`), x may be.
// TRIGGER_FIRST (with EARLY): the next kernel may launch before this one has waited for the
// one before; taken by `_u2le` alone, whose row pairs fit one wave (its dependents then never
// hold slots its own blocks wait for, as they would in a launch of several waves).
template <typename T, int U, bool LATE_X, bool EARLY = false, bool TRIGGER_FIRST = false>
__device__ __forceinline__ void qmv_row4_body(const QmatParams p, const T* __restrict__ x,
                                              const uint32_t* __restrict__ codes,
                                              const T* __restrict__ scales,
                                              const T* __restrict__ biases,
                                              T* __restrict__ y) {
    // The next kernel may launch at once (it waits for this one before reading its output).
    if constexpr (EARLY && TRIGGER_FIRST) pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int part = threadIdx.y, parts = blockDim.y;
    const int gq = lane >> 2;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 2;  // any block of whole warps
    const int last = (int)p.out_dim - 1;
    const int in_dim = (int)p.in_dim;
    const int gs = (int)p.group_size;
    const int groups = in_dim / gs;
    const int gstep = 1024 / gs * parts;  // groups a warp's step advances
    const uint4* wp[2];
    const T* sp[2];
    const T* bp[2];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const size_t row = (size_t)min(row0 + m, last);
        wp[m] = reinterpret_cast<const uint4*>(codes + row * (in_dim / 8)) + 32 * part + lane;
        sp[m] = scales + row * groups + (1024 * part + 32 * lane) / gs;
        bp[m] = biases + row * groups + (1024 * part + 32 * lane) / gs;
    }
    const uint4* xp = reinterpret_cast<const uint4*>(x) + 128 * part + 4 * lane;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};

    // A step's operands: the lane's 16 bytes of codes of each row, their groups' scale and bias
    // (splatted), and the lane's 32 x values.
    struct Step {
        uint4 w[2], xv[LATE_X ? 1 : 4];
        uint32_t sc[2], bi[2];
        const uint4* xs;
        bool ok;
    };
    // x is written by the kernel ahead: the early forms keep its loads after the wait.
    auto load_xv = [](const uint4* q) { return EARLY ? ld_after_wait4(q) : *q; };
    auto load_x = [&](Step& t) {
        if constexpr (!LATE_X) {
#pragma unroll
            for (int j = 0; j < 4; ++j) t.xv[j] = t.ok ? load_xv(t.xs + j) : uint4{};
        }
    };
    // Loads one step's weights (`ok` false: zeros, nothing read) and advances the pointers, and
    // its x unless LATE_X (read in the math) or EARLY (read after the round's weights, `round`).
    auto load = [&](Step& t, const bool ok) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            if (ok) {
                t.w[m] = ld_stream4(reinterpret_cast<const uint32_t*>(wp[m]));
                t.sc[m] = splat(*sp[m]);
                t.bi[m] = splat(*bp[m]);
            } else {
                t.w[m] = make_uint4(0u, 0u, 0u, 0u);
                t.sc[m] = t.bi[m] = 0u;
            }
            wp[m] += 32 * parts;
            sp[m] += gstep;
            bp[m] += gstep;
        }
        t.xs = xp;
        t.ok = ok;
        xp += 128 * parts;
        if constexpr (!EARLY) load_x(t);
    };
    bool waiting = EARLY;  // x and y wait for the previous kernel; the first weights need not
    auto wait_once = [&] {
        if (waiting) {
            if constexpr (TRIGGER_FIRST) {
                pdl_wait();
            } else {
                pdl_entry();
            }
            waiting = false;
        }
    };
    auto round = [&](Step (&t)[U]) {
        if constexpr (EARLY) {
            wait_once();
#pragma unroll
            for (int u = 0; u < U; ++u) load_x(t[u]);
        }
    };
    auto math = [&](const Step& t) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint4 r;
            if constexpr (LATE_X) {
                r = t.ok ? load_xv(t.xs + j) : uint4{};
            } else {
                r = t.xv[j];
            }
            uint32_t b0[2], b1[2], f0[4], f1[4];
            qt_act_frags(r, b0, b1);
            qt_code_frags<T>(t.w[0], t.w[1], j, t.sc[0], t.bi[0], t.sc[1], t.bi[1], f0, f1);
            mma_16816<T>(acc, f0, b0);
            mma_16816<T>(acc, f1, b1);
        }
    };
    // Steps of 1024 codes, U a round: whole rounds of whole steps, then at most one round with
    // the last steps, where only the lanes whose 32 codes exist load (in_dim is a multiple of
    // the group size, so of 32) and steps past the end load nothing and add zeros.
    const int full = in_dim / 1024, steps = (in_dim + 1023) / 1024;
    int s = part;
    for (; s + (U - 1) * parts < full; s += U * parts) {
        Step t[U];
#pragma unroll
        for (int u = 0; u < U; ++u) load(t[u], true);
        round(t);
#pragma unroll
        for (int u = 0; u < U; ++u) math(t[u]);
    }
    if (s < steps) {
        Step t[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = s + u * parts;
            load(t[u], k < steps && k * 1024 + 32 * lane < in_dim);
        }
        round(t);
#pragma unroll
        for (int u = 0; u < U; ++u) math(t[u]);
    }

    wait_once();  // a warp with no step has not waited yet
    // D[gq][gq] sits in lane q = gq / 2 of the quad, column gq % 2; D[gq + 8][gq] likewise.
    const bool diag = (lane & 3) == (gq >> 1);
    float v0 = diag ? ((gq & 1) ? acc[1] : acc[0]) : 0.f;
    float v1 = diag ? ((gq & 1) ? acc[3] : acc[2]) : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v0 += __shfl_xor_sync(0xffffffffu, v0, off);
        v1 += __shfl_xor_sync(0xffffffffu, v1, off);
    }
    if (parts > 1) {
        __shared__ float2 red[QROW_MAX_WARPS];
        const int wx = blockDim.x >> 5;
        if (lane == 0) red[part * wx + warp] = make_float2(v0, v1);
        __syncthreads();
        for (int k = 1; k < parts; ++k) {
            v0 += red[k * wx + warp].x;
            v1 += red[k * wx + warp].y;
        }
    }
    if (lane == 0 && part == 0) {
        if (row0 <= last) y[row0] = from_f<T>(v0);
        if (row0 + 1 <= last) y[row0 + 1] = from_f<T>(v1);
    }
}

// qmv_row4_{T}_u1 / _u2 (and their `e` forms): one or two steps' loads before their math (two:
// registers capped at 80, 24 warps an SM); _u2le: two steps, x read in the math, registers
// capped at 64 (32 warps), loads before the PDL wait.
#define QROW4_PLAIN(TN, T, SUFFIX, U, LATE, MINB)                                              \
    extern "C" __global__ void __launch_bounds__(QROW_MAX_WARPS * 32, MINB)                    \
        qmv_row4_##TN##SUFFIX(const QmatParams p, const T* x, const uint32_t* c, const T* s,   \
                             const T* b, T* y) {                                              \
        pdl_entry();                                                                           \
        qmv_row4_body<T, U, LATE>(p, x, c, s, b, y);                                           \
    }
#define QROW4_EARLY(TN, T, SUFFIX, U, LATE, MINB)                                              \
    extern "C" __global__ void __launch_bounds__(QROW_MAX_WARPS * 32, MINB)                    \
        qmv_row4_##TN##SUFFIX##e(const QmatParams p, const T* x, const uint32_t* c,            \
                                 const T* s, const T* b, T* y) {                               \
        qmv_row4_body<T, U, LATE, true, LATE>(p, x, c, s, b, y);                               \
    }

// qmv_row4 with the residual add + norm of its output folded in (`last_block_add_norm`, as the
// dense `_norm` kernels): one launch instead of two. Blocks of QROW_NORM_WARPS warps.
constexpr int QROW_NORM_WARPS = 4;  // QMATVEC_ROW_WARPS
#define QROW4_NORM_INST(TN, T, SUFFIX, U, LATE, MINB)                                          \
    extern "C" __global__ void __launch_bounds__(QROW_NORM_WARPS * 32, MINB * 2)               \
        qmv_row4_norm_##TN##SUFFIX(const QmatParams p, const T* x, const uint32_t* c,          \
                                   const T* s, const T* b, T* y, const T* res, const T* nw,    \
                                   const T* scalar, const T* w2, const T* w3, T* out, T* out2, \
                                   T* out3, uint32_t* counter, const MvNormParams np) {        \
        pdl_entry();                                                                           \
        qmv_row4_body<T, U, LATE>(p, x, c, s, b, y);                                           \
        last_block_add_norm<T, QROW_NORM_WARPS * 32>(p, np, y, res, nw, scalar, w2, w3, out,   \
                                                     out2, out3, counter);                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(QROW_NORM_WARPS * 32, MINB * 2)               \
        qmv_row4_norm_##TN##SUFFIX##e(const QmatParams p, const T* x, const uint32_t* c,       \
                                      const T* s, const T* b, T* y, const T* res,              \
                                      const T* nw, const T* scalar, const T* w2, const T* w3,  \
                                      T* out, T* out2, T* out3, uint32_t* counter,             \
                                      const MvNormParams np) {                                 \
        qmv_row4_body<T, U, LATE, true, LATE>(p, x, c, s, b, y);                               \
        last_block_add_norm<T, QROW_NORM_WARPS * 32>(p, np, y, res, nw, scalar, w2, w3, out,   \
                                                     out2, out3, counter);                     \
    }
#define QROW4_INST(TN, T, SUFFIX, U, LATE, MINB) \
    QROW4_PLAIN(TN, T, SUFFIX, U, LATE, MINB)     \
    QROW4_EARLY(TN, T, SUFFIX, U, LATE, MINB)
#define QROW4_VARIANTS(TN, T)                   \
    QROW4_INST(TN, T, _u1, 1, false, 1)         \
    QROW4_INST(TN, T, _u2, 2, false, 3)         \
    QROW4_EARLY(TN, T, _u2l, 2, true, 4)        \
    QROW4_NORM_INST(TN, T, _u1, 1, false, 1)    \
    QROW4_NORM_INST(TN, T, _u2, 2, false, 3)
QROW4_VARIANTS(f16, __half)
QROW4_VARIANTS(bf16, __nv_bfloat16)

// Chunks a lane's loop unrolls: 8 for one row of 8-bit codes, else 4.
#define QMV_UNROLL(BITS, R) ((BITS) == 8 && (R) == 1 ? 8 : 4)
#define QMV_INST(TN, T, SN, S, BITS, R)                                                        \
    extern "C" __global__ void __launch_bounds__(QMV_WARPS * 32)                               \
        qmatvec_##TN##_##SN##_##BITS##_##R(const QmatParams p, const T* x, const uint32_t* c,  \
                                           const S* s, const S* b, T* y) {                    \
        pdl_entry();                                                                          \
        qmatvec_body<T, S, BITS, R, QMV_UNROLL(BITS, R)>(p, x, c, s, b, y);                    \
    }

#define QW_INST_B(TN, T, SN, S, BITS)                                                          \
    QMV_INST(TN, T, SN, S, BITS, 1)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 2)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 4)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 8)

// One row of 8-bit codes held to 32 registers (8 blocks a multiprocessor instead of 6), for
// grids that then fit one wave (`choose` in matvec_plan.rs). It unrolls 4: 8 spills at 32.
#define QMV_INST_1W(TN, T, SN, S)                                                              \
    extern "C" __global__ void __launch_bounds__(QMV_WARPS * 32, 8)                            \
        qmatvec_##TN##_##SN##_8_1w(const QmatParams p, const T* x, const uint32_t* c,          \
                                   const S* s, const S* b, T* y) {                             \
        pdl_entry();                                                                           \
        qmatvec_body<T, S, 8, 1>(p, x, c, s, b, y);                                            \
    }

#define QW_INST_S(TN, T, SN, S) \
    QW_INST_B(TN, T, SN, S, 4)  \
    QW_INST_B(TN, T, SN, S, 8)  \
    QMV_INST_1W(TN, T, SN, S)

#define QW_INST_T(TN, T)                   \
    QW_INST_S(TN, T, f32, float)           \
    QW_INST_S(TN, T, f16, __half)          \
    QW_INST_S(TN, T, bf16, __nv_bfloat16)

QW_INST_T(f32, float)
QW_INST_T(f16, __half)
QW_INST_T(bf16, __nv_bfloat16)
