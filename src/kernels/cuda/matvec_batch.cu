// Packed 4-bit products for 9..32 activation rows (batched decode, the tokens of one expert):
// the weight fragments of a chunk are dequantized once in registers and multiplied into
// QTC_NTILES tiles of 8 activation rows each, so W is read once for all rows instead of being
// dequantized to a dense copy for a GEMM. Same chunking, fragment layout and rounding as
// `qmv_tc4` in matvec.cu; one chunk a step (the tiles' activations take the registers a second
// chunk in flight would).
//
// A block's 8 warps split the input; each warp owns MT tiles of 16 output rows. Every block
// reads all of x (32 rows) from L2, once: with one tile a warp, x is 8 times the bytes of the
// block's weights and L2's bandwidth bounds the product, so wider outputs take MT = 2 or 4
// (`batch_tiles_per_warp` in matvec_plan.rs): a half or a quarter of the x traffic for the
// same weights, at one resident block a multiprocessor.

#include <stdint.h>

#include "common.cuh"
#include "packed.cuh"

constexpr int QTC_WARPS = 8;
constexpr int QTC_NTILES = 4;

template <typename T, int MT>
__device__ __forceinline__ void qmv_tc4x_body(const QmatParams p, const T* __restrict__ x,
                                              const uint32_t* __restrict__ codes,
                                              const T* __restrict__ scales,
                                              const T* __restrict__ biases, T* __restrict__ y) {
    __shared__ float red[QTC_WARPS][32][4 * QTC_NTILES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, q = lane & 3;
    const int tile0 = blockIdx.x * 16 * MT;
    const int last = (int)p.out_dim - 1;
    const int in_dim = (int)p.in_dim;
    const int words = in_dim / 8;
    const int groups = in_dim / (int)p.group_size;
    const int chunks = (in_dim + 127) / 128;
    const int per = (chunks + QTC_WARPS - 1) / QTC_WARPS;
    const int c0 = warp * per, c1 = min(chunks, c0 + per);
    // Output rows of this lane: tile t, halves m (rows gq and gq + 8).
    int row[MT][2];
    const uint32_t* wr[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            row[t][m] = min(tile0 + 16 * t + gq + 8 * m, last);
            wr[t][m] = codes + (size_t)row[t][m] * words + 4 * q;
        }
    }
    // Activation row 8 n + gq of tile n (row 0 where past the last, zeroed after the load).
    const T* xr[QTC_NTILES];
    bool xok[QTC_NTILES];
#pragma unroll
    for (int n = 0; n < QTC_NTILES; ++n) {
        xok[n] = 8 * n + gq < (int)p.rows;
        xr[n] = x + (size_t)(xok[n] ? 8 * n + gq : 0) * in_dim + 32 * q;
    }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float acc[MT][QTC_NTILES][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int n = 0; n < QTC_NTILES; ++n) acc[t][n][0] = acc[t][n][1] = acc[t][n][2] = acc[t][n][3] = 0.f;
    }
    for (int c = c0; c < c1; ++c) {
        const int k = c * 128 + 32 * q;
        const bool ok = k < in_dim;
        const int g = ok ? k / (int)p.group_size : 0;
        const int cc = ok ? c : 0;
        uint4 W[MT][2], X[QTC_NTILES][4];
        uint32_t sc[MT][2], bi[MT][2];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const uint4 wv = ld_stream4(wr[t][m] + cc * 16);
                W[t][m] = ok ? wv : zero;
                sc[t][m] = splat(scales[(size_t)row[t][m] * groups + g]);
                bi[t][m] = splat(biases[(size_t)row[t][m] * groups + g]);
            }
        }
#pragma unroll
        for (int n = 0; n < QTC_NTILES; ++n) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 xv = *reinterpret_cast<const uint4*>(xr[n] + cc * 128 + 8 * j);
                X[n][j] = ok && xok[n] ? xv : zero;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t f0[MT][4], f1[MT][4];
#pragma unroll
            for (int t = 0; t < MT; ++t)
                qt_code_frags<T>(W[t][0], W[t][1], j, sc[t][0], bi[t][0], sc[t][1], bi[t][1],
                                 f0[t], f1[t]);
#pragma unroll
            for (int n = 0; n < QTC_NTILES; ++n) {
                uint32_t b0[2], b1[2];
                qt_act_frags(X[n][j], b0, b1);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma_16816<T>(acc[t][n], f0[t], b0);
                    mma_16816<T>(acc[t][n], f1[t], b1);
                }
            }
        }
    }
    // Sum the warps' partial tiles, one output tile at a time: warp n reduces activation tile n
    // and writes its 8 rows.
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        if (t > 0) __syncthreads();  // the previous tile's sums are read
#pragma unroll
        for (int n = 0; n < QTC_NTILES; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][lane][4 * n + i] = acc[t][n][i];
        }
        __syncthreads();
        if (warp < QTC_NTILES) {
            float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int w = 0; w < QTC_WARPS; ++w) {
#pragma unroll
                for (int i = 0; i < 4; ++i) s[i] += red[w][lane][4 * warp + i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int out = tile0 + 16 * t + gq + (i >= 2 ? 8 : 0);
                const int col = 8 * warp + 2 * q + (i & 1);
                if (out <= last && col < (int)p.rows) y[(size_t)col * p.out_dim + out] = from_f<T>(s[i]);
            }
        }
    }
}

// qmv_tc4x{SUFFIX}_{T}: MT tiles a warp, registers capped for MINB resident blocks a
// multiprocessor: qmv_tc4x_ one tile (2 blocks, 128 registers), qmv_tc4x2_ and qmv_tc4x4_ two
// and four (one block).
#define QTC4X_ONE(TN, T, SUFFIX, MT, MINB)                                                     \
    extern "C" __global__ void __launch_bounds__(QTC_WARPS * 32, MINB)                          \
        qmv_tc4x##SUFFIX##_##TN(const QmatParams p, const T* x, const uint32_t* c, const T* s,  \
                                const T* b, T* y) {                                            \
        pdl_entry();                                                                           \
        qmv_tc4x_body<T, MT>(p, x, c, s, b, y);                                                \
    }
#define QTC4X_INST(TN, T)          \
    QTC4X_ONE(TN, T, , 1, 2)       \
    QTC4X_ONE(TN, T, 2, 2, 1)      \
    QTC4X_ONE(TN, T, 4, 4, 1)
QTC4X_INST(f16, __half)
QTC4X_INST(bf16, __nv_bfloat16)
