// Quantized attention (qSDPA) and quantized weight kernels over MLX affine 4/8-bit codes.
//
// Layout (MLX affine): codes are a little-endian bit stream in u32 words (element 0 in the lowest
// bits of word 0), one scale and one bias per group of `group_size` consecutive elements along
// the last axis: x[e] = scale[e / G] * code[e] + bias[e / G].
//
// Parameter structs must match `src/kernels/cuda/params.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"

#include <type_traits>

struct QsdpaParams {
    // Element strides of K/V codes and scales/biases along heads and keys (last axis is dense).
    uint64_t k_codes_sh, k_codes_sk, k_sc_sh, k_sc_sk;
    uint64_t v_codes_sh, v_codes_sk, v_sc_sh, v_sc_sk;
    uint32_t n_heads, kv_heads, q_len, head_dim;
    uint32_t keys, group_size, window, q_offset;
    // Key positions: mode 0: base + j; mode 1: two runs (j < split: base + j, else base2 + j - split);
    // mode 2: read positions[j].
    uint32_t pos_mode, pos_base, pos_split, pos_base2;
    uint32_t n_split, keys_per_split;
    float scale;
    uint32_t pad_;
};

struct QmatParams {
    uint32_t rows, out_dim, in_dim, group_size;
};

// Streaming 16-byte load that does not allocate in L1 (keeps the small activation there).
__device__ __forceinline__ uint4 ld_stream4(const uint32_t* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Loads N consecutive u32 words (N = 1, 2 or a multiple of 4; the address is
// min(N, 4)*4-byte aligned).
template <int N> __device__ __forceinline__ void load_words(const uint32_t* p, uint32_t* w) {
    if constexpr (N > 4) {
#pragma unroll
        for (int c = 0; c < N / 4; ++c) {
            uint4 v = reinterpret_cast<const uint4*>(p)[c];
            w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
        }
    } else if constexpr (N == 4) {
        uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (N == 2) {
        uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = *p;
    }
}

// Code of element i of a lane's slice: `w` holds the lane's words, `shift` the bit offset of its
// first element inside w[0] (non-zero only when the slice is narrower than a word).
// An integer below 2^23 as f32 without the (quarter-rate) integer-to-float conversion: OR it
// into the mantissa of 2^23 and subtract 2^23 (exact).
__device__ __forceinline__ float u2f(uint32_t c) {
    return __uint_as_float(0x4B000000u | c) - 8388608.f;
}

template <int BITS, int NW>
__device__ __forceinline__ float code_of(const uint32_t* w, int i, int shift) {
    const int bit = i * BITS + shift;
    return u2f((w[bit >> 5] >> (bit & 31)) & ((1u << BITS) - 1));
}

// Element i of a lane's slice of dense K/V (BITS = 16: f16/bf16 bit patterns, 32: f32).
template <typename T, int BITS>
__device__ __forceinline__ float dense_of(const uint32_t* w, int i, int shift) {
    if constexpr (BITS == 32) {
        return __uint_as_float(w[i]);
    } else {
        const int bit = i * 16 + shift;
        const uint32_t h = (w[bit >> 5] >> (bit & 31)) & 0xffffu;
        if constexpr (sizeof(T) == 2 && std::is_same<T, __half>::value) {
            return __half2float(__ushort_as_half((unsigned short)h));
        } else {
            return __uint_as_float(h << 16);
        }
    }
}

// A K/V element: packed code (BITS 4/8, before scale and bias) or dense value (BITS 16/32).
template <typename T, int BITS, int NW>
__device__ __forceinline__ float kv_elem(const uint32_t* w, int i, int shift) {
    if constexpr (BITS >= 16) {
        return dense_of<T, BITS>(w, i, shift);
    } else {
        return code_of<BITS, NW>(w, i, shift);
    }
}

__device__ __forceinline__ uint32_t key_pos(const QsdpaParams& p, const uint32_t* pos, int j) {
    if (p.pos_mode == 0) return p.pos_base + (uint32_t)j;
    if (p.pos_mode == 1)
        return (uint32_t)j < p.pos_split ? p.pos_base + (uint32_t)j
                                          : p.pos_base2 + ((uint32_t)j - p.pos_split);
    return pos[j];
}

// ---------------------------------------------------------------------------------------------
// qSDPA: one block = one KV head x NQ query rows x one key split; 4 warps, each warp takes every
// 4th key (U keys per step for memory-level parallelism). A lane owns HD/32 consecutive elements
// of the head dimension. Rows of a KV head are ordered (query index, head in group), so rows of
// one block share their masks during decode. Online softmax in f32 per warp, warps merged in
// shared memory; with n_split > 1 the block writes an unnormalised partial (m, l, acc) and
// `qsdpa_combine` merges the splits (flash-decoding).
// ---------------------------------------------------------------------------------------------
constexpr int QS_WARPS = 4;

template <typename T, int HD, int BITS, int NQ>
__device__ __forceinline__ void qsdpa_body(const QsdpaParams& p, const T* __restrict__ q,
                                           const uint32_t* __restrict__ kc,
                                           const T* __restrict__ ks, const T* __restrict__ kb,
                                           const uint32_t* __restrict__ vc,
                                           const T* __restrict__ vs, const T* __restrict__ vb,
                                           const uint32_t* __restrict__ positions,
                                           T* __restrict__ out, float* __restrict__ part_ml,
                                           float* __restrict__ part_acc) {
    // BITS 16/32: dense K/V in T's format, read as words ("codes") with no scales or biases.
    constexpr bool DENSE = BITS >= 16;
    constexpr int E = HD / 32;
    constexpr int LANE_BITS = E * BITS;
    constexpr int NW = LANE_BITS >= 32 ? LANE_BITS / 32 : 1;
    // Keys in flight per warp step: fewer for the widest heads, to keep registers in check.
    constexpr int QS_U = HD >= 512 ? 2 : 4;
    __shared__ float sm_acc[QS_WARPS][NQ][HD];
    __shared__ float sm_m[QS_WARPS][NQ];
    __shared__ float sm_l[QS_WARPS][NQ];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = blockIdx.y;
    const int group = p.n_heads / p.kv_heads;
    const int rows = group * p.q_len;
    const int row0 = blockIdx.x * NQ;
    const int split = blockIdx.z;

    float qv[NQ][E], qsum[NQ], m[NQ], l[NQ], acc[NQ][E];
    uint32_t qpos[NQ];
    bool qok[NQ];
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
        const int r = row0 + n;
        qok[n] = r < rows;
        const int qi = qok[n] ? r / group : 0, hh = qok[n] ? r % group : 0;
        const int head = g * group + hh;
        qpos[n] = p.q_offset + qi;
        const T* qr = q + ((size_t)head * p.q_len + qi) * HD + lane * E;
        qsum[n] = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) {
            qv[n][i] = qok[n] ? to_f(qr[i]) * p.scale : 0.f;
            qsum[n] += qv[n][i];
        }
        m[n] = -INFINITY;
        l[n] = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) acc[n][i] = 0.f;
    }

    const int j0 = split * p.keys_per_split;
    const int j1 = min((int)p.keys, j0 + (int)p.keys_per_split);
    const int gidx = (lane * E) / p.group_size;
    const int word0 = (lane * E * BITS) >> 5;
    const int shift0 = (lane * E * BITS) & 31;
    const uint32_t* kcg = kc + g * p.k_codes_sh + word0;
    const uint32_t* vcg = vc + g * p.v_codes_sh + word0;
    const T* ksg = ks + g * p.k_sc_sh + gidx;
    const T* kbg = kb + g * p.k_sc_sh + gidx;
    const T* vsg = vs + g * p.v_sc_sh + gidx;
    const T* vbg = vb + g * p.v_sc_sh + gidx;

    for (int jb = j0 + warp * QS_U; jb < j1; jb += QS_WARPS * QS_U) {
        uint32_t kw[QS_U][NW], vw[QS_U][NW];
        float ksc[QS_U], kbi[QS_U], vsc[QS_U], vbi[QS_U];
        bool vis[QS_U][NQ];
        bool any[QS_U];
#pragma unroll
        for (int u = 0; u < QS_U; ++u) {
            const int j = jb + u;
            any[u] = false;
            const uint32_t pos = j < j1 ? key_pos(p, positions, j) : 0u;
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                vis[u][n] = j < j1 && qok[n] && pos <= qpos[n] &&
                            (p.window == 0 || pos + p.window > qpos[n]);
                any[u] |= vis[u][n];
            }
            if (any[u]) {
                load_words<NW>(kcg + j * p.k_codes_sk, kw[u]);
                load_words<NW>(vcg + j * p.v_codes_sk, vw[u]);
                if constexpr (DENSE) {
                    ksc[u] = 1.f; kbi[u] = 0.f; vsc[u] = 1.f; vbi[u] = 0.f;
                } else {
                    ksc[u] = to_f(ksg[j * p.k_sc_sk]);
                    kbi[u] = to_f(kbg[j * p.k_sc_sk]);
                    vsc[u] = to_f(vsg[j * p.v_sc_sk]);
                    vbi[u] = to_f(vbg[j * p.v_sc_sk]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < QS_U; ++u) {
            if (!any[u]) continue;  // uniform across the warp
            float s[NQ];
#pragma unroll
            for (int n = 0; n < NQ; ++n) s[n] = 0.f;
#pragma unroll
            for (int i = 0; i < E; ++i) {
                const float c = kv_elem<T, BITS, NW>(kw[u], i, shift0);
#pragma unroll
                for (int n = 0; n < NQ; ++n) s[n] = fmaf(c, qv[n][i], s[n]);
            }
#pragma unroll
            for (int n = 0; n < NQ; ++n) s[n] = DENSE ? s[n] : ksc[u] * s[n] + kbi[u] * qsum[n];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
                for (int n = 0; n < NQ; ++n) s[n] += __shfl_xor_sync(0xffffffffu, s[n], off);
            }
            float val[E];
#pragma unroll
            for (int i = 0; i < E; ++i)
                val[i] = DENSE ? kv_elem<T, BITS, NW>(vw[u], i, shift0)
                               : fmaf(vsc[u], kv_elem<T, BITS, NW>(vw[u], i, shift0), vbi[u]);
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                if (!vis[u][n]) continue;
                // Rescale only when the running max grows (rare once it settles).
                if (s[n] > m[n]) {
                    const float corr = __expf(m[n] - s[n]);
                    m[n] = s[n];
                    l[n] *= corr;
#pragma unroll
                    for (int i = 0; i < E; ++i) acc[n][i] *= corr;
                }
                const float pp = __expf(s[n] - m[n]);
                l[n] += pp;
#pragma unroll
                for (int i = 0; i < E; ++i) acc[n][i] = fmaf(pp, val[i], acc[n][i]);
            }
        }
    }

    // Merge the warps' states.
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
#pragma unroll
        for (int i = 0; i < E; ++i) sm_acc[warp][n][lane * E + i] = acc[n][i];
        if (lane == 0) {
            sm_m[warp][n] = m[n];
            sm_l[warp][n] = l[n];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < NQ * HD; t += blockDim.x) {
        const int n = t / HD, d = t % HD;
        const int r = row0 + n;
        if (r >= rows) continue;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < QS_WARPS; ++w)
            if (sm_l[w][n] > 0.f) M = fmaxf(M, sm_m[w][n]);
        float L = 0.f, A = 0.f;
#pragma unroll
        for (int w = 0; w < QS_WARPS; ++w) {
            if (sm_l[w][n] > 0.f) {
                const float f = __expf(sm_m[w][n] - M);
                L += f * sm_l[w][n];
                A += f * sm_acc[w][n][d];
            }
        }
        const int grow = g * rows + r;  // global row: (kv head, query index, head in group)
        if (p.n_split == 1) {
            const int qi = r / group, hh = r % group, head = g * group + hh;
            out[((size_t)head * p.q_len + qi) * HD + d] = from_f<T>(L > 0.f ? A / L : 0.f);
        } else {
            const size_t prow = (size_t)split * p.kv_heads * rows + grow;
            part_acc[prow * HD + d] = A;
            if (d == 0) {
                part_ml[prow * 2] = M;
                part_ml[prow * 2 + 1] = L;
            }
        }
    }
}

// Merges the splits: one block of 128 threads per global row. The split weights
// w_s = exp(m_s - M) go to shared memory first, so the sum over splits of each output element
// is a pipelined loop of independent loads (n_split <= QS_MAX_SPLIT, enforced by the host).
constexpr int QS_MAX_SPLIT = 1024;
constexpr int QS_COMBINE_THREADS = 128;

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int off = QS_COMBINE_THREADS / 2; off > 0; off >>= 1) {
        if ((int)threadIdx.x < off) {
            const float o = red[threadIdx.x + off];
            red[threadIdx.x] = is_max ? fmaxf(red[threadIdx.x], o) : red[threadIdx.x] + o;
        }
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ __forceinline__ void qsdpa_combine_body(const QsdpaParams& p,
                                                   const float* __restrict__ part_ml,
                                                   const float* __restrict__ part_acc,
                                                   T* __restrict__ out) {
    __shared__ float w[QS_MAX_SPLIT];
    __shared__ float red[QS_COMBINE_THREADS];
    const int hd = p.head_dim;
    const int group = p.n_heads / p.kv_heads;
    const int rows = group * p.q_len;
    const int total = p.kv_heads * rows;
    const int grow = blockIdx.x;
    const int g = grow / rows, r = grow % rows;
    const int qi = r / group, hh = r % group, head = g * group + hh;
    const int n = min((int)p.n_split, QS_MAX_SPLIT);
    float mloc = -INFINITY;
    for (int s = threadIdx.x; s < n; s += QS_COMBINE_THREADS) {
        const float* ml = part_ml + ((size_t)s * total + grow) * 2;
        if (ml[1] > 0.f) mloc = fmaxf(mloc, ml[0]);
    }
    const float M = block_reduce(mloc, red, true);
    float lloc = 0.f;
    for (int s = threadIdx.x; s < n; s += QS_COMBINE_THREADS) {
        const float* ml = part_ml + ((size_t)s * total + grow) * 2;
        const float ws = ml[1] > 0.f ? __expf(ml[0] - M) : 0.f;
        w[s] = ws;
        lloc += ws * ml[1];
    }
    const float L = block_reduce(lloc, red, false);  // also orders the writes to w
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int d = threadIdx.x; d < hd; d += QS_COMBINE_THREADS) {
        const float* a = part_acc + (size_t)grow * hd + d;
        const size_t step = (size_t)total * hd;
        float A = 0.f;
#pragma unroll 8
        for (int s = 0; s < n; ++s) A = fmaf(w[s], a[s * step], A);
        out[((size_t)head * p.q_len + qi) * hd + d] = from_f<T>(A * inv);
    }
}

#define QSDPA_INST_NQ(TN, T, HD, BITS, NQ)                                                     \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32)                                \
        qsdpa_##TN##_##HD##_##BITS##_##NQ(const QsdpaParams p, const T* q, const uint32_t* kc,         \
                                   const T* ks, const T* kb, const uint32_t* vc, const T* vs,   \
                                   const T* vb, const uint32_t* positions, T* out,              \
                                   float* part_ml, float* part_acc) {                          \
        qsdpa_body<T, HD, BITS, NQ>(p, q, kc, ks, kb, vc, vs, vb, positions, out, part_ml,      \
                                    part_acc);                                                 \
    }

#define QSDPA_INST(TN, T, HD, BITS)      \
    QSDPA_INST_NQ(TN, T, HD, BITS, 2)    \
    QSDPA_INST_NQ(TN, T, HD, BITS, 4)

#define QSDPA_INST_HD(TN, T, BITS)  \
    QSDPA_INST(TN, T, 32, BITS)     \
    QSDPA_INST(TN, T, 64, BITS)     \
    QSDPA_INST(TN, T, 128, BITS)    \
    QSDPA_INST(TN, T, 256, BITS)    \
    QSDPA_INST(TN, T, 512, BITS)

#define QSDPA_INST_T(TN, T)                                                                    \
    QSDPA_INST_HD(TN, T, 4)                                                                    \
    QSDPA_INST_HD(TN, T, 8)                                                                    \
    extern "C" __global__ void qsdpa_combine_##TN(const QsdpaParams p, const float* part_ml,    \
                                                  const float* part_acc, T* out) {             \
        qsdpa_combine_body<T>(p, part_ml, part_acc, out);                                      \
    }

QSDPA_INST_T(f32, float)
QSDPA_INST_T(f16, __half)
QSDPA_INST_T(bf16, __nv_bfloat16)
// Dense K/V (same kernel, BITS = the element width).
QSDPA_INST_HD(f32, float, 32)
QSDPA_INST_HD(f16, __half, 16)
QSDPA_INST_HD(bf16, __nv_bfloat16, 16)

// ---------------------------------------------------------------------------------------------
// Quantized weights W [out, in] (codes [out, in*BITS/32], scales/biases [out, in/G]).
// ---------------------------------------------------------------------------------------------

// y[r, o] = sum_e x[r, e] * W[o, e] for rows <= MAXR: one warp per output row, each lane reads
// 16 bytes of codes per step (32 four-bit or 16 eight-bit codes, always inside one group).
constexpr int QMV_WARPS = 8;

template <typename T, typename S, int BITS, int MAXR>
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
#pragma unroll 4
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
        const uint32_t w = codes[src * words + wi];
        const size_t e0 = wi * PER;
        const int gi = (int)(e0 / p.group_size);
        const float sc = to_f(scales[src * groups + gi]);
        const float bi = to_f(biases[src * groups + gi]);
        // One vector store of the word's PER outputs (16 or 32 bytes for 4-bit, 8 or 16 for 8-bit).
        struct alignas(PER * sizeof(T)) Vec { T v[PER]; } vec;
#pragma unroll
        for (int k = 0; k < PER; ++k)
            vec.v[k] = from_f<T>(fmaf(sc, u2f((w >> (k * BITS)) & ((1u << BITS) - 1)), bi));
        *reinterpret_cast<Vec*>(out + i * p.in_dim + e0) = vec;
    }
}

#define QMV_INST(TN, T, SN, S, BITS, R)                                                        \
    extern "C" __global__ void __launch_bounds__(QMV_WARPS * 32)                               \
        qmatvec_##TN##_##SN##_##BITS##_##R(const QmatParams p, const T* x, const uint32_t* c,  \
                                           const S* s, const S* b, T* y) {                    \
        qmatvec_body<T, S, BITS, R>(p, x, c, s, b, y);                                         \
    }

#define QW_INST_B(TN, T, SN, S, BITS)                                                          \
    QMV_INST(TN, T, SN, S, BITS, 1)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 2)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 4)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 8)                                                            \
    extern "C" __global__ void dequant_##TN##_##SN##_##BITS(const QmatParams p,                 \
                                                             const uint32_t* c, const S* s,     \
                                                             const S* b, const uint32_t* idx,   \
                                                             T* out) {                         \
        dequant_body<T, S, BITS>(p, c, s, b, idx, out);                                        \
    }

#define QW_INST_S(TN, T, SN, S) \
    QW_INST_B(TN, T, SN, S, 4)  \
    QW_INST_B(TN, T, SN, S, 8)

#define QW_INST_T(TN, T)                   \
    QW_INST_S(TN, T, f32, float)           \
    QW_INST_S(TN, T, f16, __half)          \
    QW_INST_S(TN, T, bf16, __nv_bfloat16)

QW_INST_T(f32, float)
QW_INST_T(f16, __half)
QW_INST_T(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// Affine quantization of rows (the KV cache's appends), bit-exact with the CPU reference
// (`src/kernels/quant.rs`): f32 arithmetic in the same order, round-half-even, then the scale
// and bias rounded to T for storage. One thread per group; p.rows = number of groups,
// p.group_size elements each.
// ---------------------------------------------------------------------------------------------
template <typename T, int BITS>
__device__ __forceinline__ void quantize_body(const QmatParams p, const T* __restrict__ x,
                                              uint32_t* __restrict__ codes, T* __restrict__ scales,
                                              T* __restrict__ biases) {
    const size_t gi = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (gi >= p.rows) return;
    const int g = p.group_size;
    const T* xs = x + gi * g;
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
    scales[gi] = from_f<T>(scale);
    biases[gi] = from_f<T>(bias);
    constexpr int PER = 32 / BITS;
    uint32_t* cw = codes + gi * g / PER;
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

#define QUANT_INST(TN, T, BITS)                                                                \
    extern "C" __global__ void quantize_##TN##_##BITS(const QmatParams p, const T* x,          \
                                                       uint32_t* codes, T* scales, T* biases) { \
        quantize_body<T, BITS>(p, x, codes, scales, biases);                                   \
    }
QUANT_INST(f32, float, 4)
QUANT_INST(f32, float, 8)
QUANT_INST(f16, __half, 4)
QUANT_INST(f16, __half, 8)
QUANT_INST(bf16, __nv_bfloat16, 4)
QUANT_INST(bf16, __nv_bfloat16, 8)
