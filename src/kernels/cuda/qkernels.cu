// Quantized attention (qSDPA) and quantized weight kernels over MLX affine 4/8-bit codes.
//
// Layout (MLX affine): codes are a little-endian bit stream in u32 words (element 0 in the lowest
// bits of word 0), one scale and one bias per group of `group_size` consecutive elements along
// the last axis: x[e] = scale[e / G] * code[e] + bias[e / G].
//
// Parameter structs must match `src/kernels/cuda/params.rs` field for field (#[repr(C)]).

#include <stdint.h>

#include "common.cuh"
#include "norm_tail.cuh"

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
    uint32_t long_splits;  // splits 0 .. long_splits - 1 take QS_SPLIT_STEP keys more
};

// One sequence of a batched attention launch (`qsdpa_batch_*`): its parameters and the device
// addresses of its K/V words, scales, biases and position table (queries and outputs are one
// [batch, n_heads, q_len, head_dim] tensor each, partials one buffer with n_split_max splits a
// sequence). Must match `QsdpaSeq` in `src/kernels/cuda/batched.rs`.
struct QsdpaSeq {
    QsdpaParams p;
    uint64_t kc, ks, kb, vc, vs, vb, pos, pad_;
};

struct QmatParams {
    uint32_t rows, out_dim, in_dim, group_size;
};

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

// Keys [x, y) of key split `split`: keys_per_split each, the first long_splits one step more
// (`KeySplit` in params.rs).
constexpr int QS_SPLIT_STEP = 16;
__device__ __forceinline__ int2 split_range(const QsdpaParams& p, int split) {
    const int first =
        split * (int)p.keys_per_split + min(split, (int)p.long_splits) * QS_SPLIT_STEP;
    const int len = (int)p.keys_per_split + (split < (int)p.long_splits ? QS_SPLIT_STEP : 0);
    return make_int2(first, min((int)p.keys, first + len));
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
                                           float* __restrict__ part_acc, const int split) {
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

    const int2 range = split_range(p, split);
    const int j0 = range.x, j1 = range.y;
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

// Merges the splits, the previous way (`CANDLE_GEMMA_COMBINE=rows`, kept for A/B runs): one
// block per global row and 128 head dims (grid y or z: the dim chunk; n_split <= QS_MAX_SPLIT,
// enforced by the host), of any whole number of warps up to QS_COMBINE_THREADS (the host picks
// it from the split count). The split weights w_s = exp(m_s - M) go to shared memory first;
// then each warp sums every W-th split (W warps) for 4 dims a lane (16-byte loads, 8 in
// flight), and the warps' sums meet in shared memory. On an H100 under ncu 342 splits took
// 8.3 us with 8 warps, 6.8 with 32; 32 splits 4.4 with 8, 5.0 with 32: a row has few blocks,
// so the sums run as rounds of dependent loads.
constexpr int QS_MAX_SPLIT = 1024;
constexpr int QS_COMBINE_THREADS = 1024;
constexpr int QS_COMBINE_DIMS = 128;

// Max or sum over the block: shuffles within each warp, then every thread reads the warps'
// results (two barriers, where a shared-memory tree over the block takes ten).
__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
    const int warps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, off);
        v = is_max ? fmaxf(v, o) : v + o;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < warps; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
    __syncthreads();  // `red` is written again by the next call
    return r;
}

// Writes four merged output dims, each times `inv` (1 / the softmax sum).
template <typename T>
__device__ __forceinline__ void store_scaled4(T* dst, const float4 v, const float inv) {
    dst[0] = from_f<T>(v.x * inv);
    dst[1] = from_f<T>(v.y * inv);
    dst[2] = from_f<T>(v.z * inv);
    dst[3] = from_f<T>(v.w * inv);
}

// A split-combining block's row (blockIdx.x): the partial rows a split holds (`total`), this
// row's index among them, its output head and query, and the splits to merge.
struct CombineRow {
    int total, grow, head, qi, n;
};
__device__ __forceinline__ CombineRow combine_row(const QsdpaParams& p) {
    const int group = p.n_heads / p.kv_heads;
    const int rows = group * p.q_len;
    const int grow = blockIdx.x, r = grow % rows;
    return CombineRow{(int)p.kv_heads * rows, grow, grow / rows * group + r % group, r / group,
                      min((int)p.n_split, QS_MAX_SPLIT)};
}

template <typename T>
__device__ __forceinline__ void qsdpa_combine_rows_body(const QsdpaParams& p,
                                                   const float* __restrict__ part_ml,
                                                   const float* __restrict__ part_acc,
                                                   T* __restrict__ out, const int chunk) {
    const int threads = blockDim.x, warps = threads >> 5;  // warp i takes splits i, i + warps, ..
    __shared__ float w[QS_MAX_SPLIT];
    __shared__ float red[QS_COMBINE_THREADS / 32];
    __shared__ float4 sums[QS_COMBINE_THREADS / 32][32];
    const int hd = p.head_dim;
    const CombineRow row = combine_row(p);
    const int total = row.total, grow = row.grow, head = row.head, qi = row.qi, n = row.n;
    float mloc = -INFINITY;
    for (int s = threadIdx.x; s < n; s += threads) {
        const float* ml = part_ml + ((size_t)s * total + grow) * 2;
        if (ml[1] > 0.f) mloc = fmaxf(mloc, ml[0]);
    }
    const float M = block_reduce(mloc, red, true);
    float lloc = 0.f;
    for (int s = threadIdx.x; s < n; s += threads) {
        const float* ml = part_ml + ((size_t)s * total + grow) * 2;
        const float ws = ml[1] > 0.f ? __expf(ml[0] - M) : 0.f;
        w[s] = ws;
        lloc += ws * ml[1];
    }
    const float L = block_reduce(lloc, red, false);  // also orders the writes to w
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const int lane = threadIdx.x & 31, sl = threadIdx.x >> 5;
    const int d = chunk * QS_COMBINE_DIMS + 4 * lane;
    float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
    if (d < hd) {
        const float* a = part_acc + (size_t)grow * hd + d;
        const size_t step = (size_t)total * hd;
#pragma unroll 8
        for (int s = sl; s < n; s += warps) {
            const float4 v = *reinterpret_cast<const float4*>(a + s * step);
            const float ws = w[s];
            A.x = fmaf(ws, v.x, A.x); A.y = fmaf(ws, v.y, A.y);
            A.z = fmaf(ws, v.z, A.z); A.w = fmaf(ws, v.w, A.w);
        }
    }
    sums[sl][lane] = A;
    __syncthreads();
    if (sl == 0 && d < hd) {
        for (int o = 1; o < warps; ++o) {
            const float4 v = sums[o][lane];
            A.x += v.x; A.y += v.y; A.z += v.z; A.w += v.w;
        }
        store_scaled4(out + ((size_t)head * p.q_len + qi) * hd + d, A, inv);
    }
}

// Merges the splits: one block of QC_THREADS per global row and QC_DIMS head dims (grid y or z:
// the dim chunk), so a row's merge spreads over head_dim / 32 blocks. Thread t reads float4
// `t % 8` of the chunk for splits `t / 8 + 32 i`: each warp load covers four splits' 128-byte
// rows. Every thread issues its first P partial loads (P = 4 or 12: up to 128 or 384 splits,
// the host picks the fewest that cover the splits; 12 take ~123 registers, two blocks a
// multiprocessor; 4 are held to 48, five blocks, so the 512 blocks of a 31B full-layer decode
// fit in one wave), with their (m, l), before anything waits, so one round of loads serves. The
// block's largest split max comes from a max reduction; then each thread weighs its splits by
// exp(m - max) and the weighted sums and softmax sums are added over the block.
constexpr int QC_DIMS = 32;
constexpr int QC_THREADS = 256;
constexpr int QC_ROUND = QC_THREADS / (QC_DIMS / 4);  // splits a block reads per load round

template <typename T, int QC_PREFETCH>
__device__ __forceinline__ void qsdpa_combine_body(const QsdpaParams& p,
                                                   const float* __restrict__ part_ml,
                                                   const float* __restrict__ part_acc,
                                                   T* __restrict__ out, const int chunk) {
    __shared__ float red_m[QC_THREADS / 32], red_l[QC_THREADS / 32];
    __shared__ float4 sums[QC_THREADS / 32][QC_DIMS / 4];
    const int hd = p.head_dim;
    const CombineRow row = combine_row(p);
    const int total = row.total, grow = row.grow, head = row.head, qi = row.qi, n = row.n;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int quad = t % (QC_DIMS / 4), sub = t / (QC_DIMS / 4);
    const int d = chunk * QC_DIMS + 4 * quad;  // head_dim is a multiple of 32: always < hd
    const float* acc = part_acc + (size_t)grow * hd + d;
    const size_t acc_step = (size_t)total * hd;
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + grow;
    float4 pre[QC_PREFETCH];
    float2 pml[QC_PREFETCH];
#pragma unroll
    for (int i = 0; i < QC_PREFETCH; ++i) {
        const int s = sub + QC_ROUND * i;
        if (s < n) {
            pre[i] = __ldcg(reinterpret_cast<const float4*>(acc + s * acc_step));
            pml[i] = __ldcg(ml + (size_t)s * total);
        } else {
            pre[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            pml[i] = make_float2(-INFINITY, 0.f);
        }
    }
    // The largest split max first (a max reduction, no exponentials in the chain); then every
    // thread weighs its own splits at once.
    float mloc = -INFINITY;
#pragma unroll
    for (int i = 0; i < QC_PREFETCH; ++i) mloc = fmaxf(mloc, pml[i].x);
    for (int s = sub + QC_ROUND * QC_PREFETCH; s < n; s += QC_ROUND)
        mloc = fmaxf(mloc, __ldcg(ml + (size_t)s * total).x);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        mloc = fmaxf(mloc, __shfl_xor_sync(0xffffffffu, mloc, off));
    if (lane == 0) red_m[warp] = mloc;
    __syncthreads();
    float M = red_m[0];
#pragma unroll
    for (int w = 1; w < QC_THREADS / 32; ++w) M = fmaxf(M, red_m[w]);
    // No split saw a key: every weight is 2^-inf = 0, and so is the output.
    const float Ms = M == -INFINITY ? 0.f : M;
    float L = 0.f;
    float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](const float2 v, const float4 a) {
        const float w = fast_exp2((v.x - Ms) * LOG2E);
        L = fmaf(w, v.y, L);
        A.x = fmaf(w, a.x, A.x); A.y = fmaf(w, a.y, A.y);
        A.z = fmaf(w, a.z, A.z); A.w = fmaf(w, a.w, A.w);
    };
#pragma unroll
    for (int i = 0; i < QC_PREFETCH; ++i) add(pml[i], pre[i]);
    for (int s = sub + QC_ROUND * QC_PREFETCH; s < n; s += QC_ROUND)
        add(__ldcg(ml + (size_t)s * total),
            __ldcg(reinterpret_cast<const float4*>(acc + s * acc_step)));
    // Lanes q, q + 8, q + 16, q + 24 of a warp hold the same dims (and L over other splits).
#pragma unroll
    for (int off = QC_DIMS / 4; off < 32; off <<= 1) {
        A.x += __shfl_xor_sync(0xffffffffu, A.x, off);
        A.y += __shfl_xor_sync(0xffffffffu, A.y, off);
        A.z += __shfl_xor_sync(0xffffffffu, A.z, off);
        A.w += __shfl_xor_sync(0xffffffffu, A.w, off);
        L += __shfl_xor_sync(0xffffffffu, L, off);
    }
    if (lane < QC_DIMS / 4) sums[warp][lane] = A;
    if (lane == 0) red_l[warp] = L;
    __syncthreads();
    if (t < QC_DIMS / 4) {
        float4 S = sums[0][t];
        float Lt = red_l[0];
#pragma unroll
        for (int w = 1; w < QC_THREADS / 32; ++w) {
            const float4 v = sums[w][t];
            S.x += v.x; S.y += v.y; S.z += v.z; S.w += v.w;
            Lt += red_l[w];
        }
        store_scaled4(out + ((size_t)head * p.q_len + qi) * hd + d, S, Lt > 0.f ? 1.f / Lt : 0.f);
    }
}

// Entry of the batch kernels: the block's sequence (grid z = sequence x split) from its
// descriptor, with its slices of the queries, outputs and partials, handed to `body` (a kernel
// body taking the single-sequence kernel's arguments and the split).
template <typename T, int HD, typename Body>
__device__ __forceinline__ void qsdpa_batch_entry(const QsdpaSeq* seqs, uint32_t n_split_max,
                                                  const T* q, T* out, float* part_ml,
                                                  float* part_acc, Body body) {
    const uint32_t seq = blockIdx.z / n_split_max, split = blockIdx.z % n_split_max;
    const QsdpaSeq& s = seqs[seq];
    const QsdpaParams p = s.p;
    if (split >= p.n_split) return;
    const size_t qn = (size_t)p.n_heads * p.q_len * HD;
    const size_t pr = (size_t)n_split_max * p.n_heads * p.q_len;
    body(p, q + seq * qn, reinterpret_cast<const uint32_t*>(s.kc),
         reinterpret_cast<const T*>(s.ks), reinterpret_cast<const T*>(s.kb),
         reinterpret_cast<const uint32_t*>(s.vc), reinterpret_cast<const T*>(s.vs),
         reinterpret_cast<const T*>(s.vb), reinterpret_cast<const uint32_t*>(s.pos),
         out + seq * qn, part_ml + seq * pr * 2, part_acc + seq * pr * HD, (int)split);
}

#define QSDPA_INST_NQ(TN, T, HD, BITS, NQ)                                                     \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32)                                \
        qsdpa_##TN##_##HD##_##BITS##_##NQ(const QsdpaParams p, const T* q, const uint32_t* kc,         \
                                   const T* ks, const T* kb, const uint32_t* vc, const T* vs,   \
                                   const T* vb, const uint32_t* positions, T* out,              \
                                   float* part_ml, float* part_acc, uint64_t) {                \
        pdl_entry();                                                                           \
        qsdpa_body<T, HD, BITS, NQ>(p, q, kc, ks, kb, vc, vs, vb, positions, out, part_ml,      \
                                    part_acc, blockIdx.z);                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32)                                \
        qsdpa_batch_##TN##_##HD##_##BITS##_##NQ(const QsdpaSeq* seqs, uint32_t n_split_max,     \
                                                const T* q, T* out, float* part_ml,             \
                                                float* part_acc) {                              \
        pdl_entry();                                                                            \
        qsdpa_batch_entry<T, HD>(seqs, n_split_max, q, out, part_ml, part_acc,                 \
                                 [](const auto&... a) { qsdpa_body<T, HD, BITS, NQ>(a...); });         \
    }

#define QSDPA_INST(TN, T, HD, BITS)                                                            \
    QSDPA_INST_NQ(TN, T, HD, BITS, 2)    \
    QSDPA_INST_NQ(TN, T, HD, BITS, 4)

#define QSDPA_INST_HD(TN, T, BITS)  \
    QSDPA_INST(TN, T, 32, BITS)                                                                \
    QSDPA_INST(TN, T, 64, BITS)                                                                \
    QSDPA_INST(TN, T, 128, BITS)                                                               \
    QSDPA_INST(TN, T, 256, BITS)                                                               \
    QSDPA_INST(TN, T, 512, BITS)

// The split-combining kernels: `qsdpa_combine_TN` (one sequence) and `qsdpa_combine_batch_TN`
// (grid y = sequence), and the previous ones as `qsdpa_combine_rows_..` (A/B runs).
#define QSDPA_COMBINE_INST_AS(NAME, BODY, THREADS, MINB, TN, T)                               \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB)                                \
        NAME##_##TN(const QsdpaParams p, const float* part_ml, const float* part_acc, T* out) { \
        pdl_entry();                                                                           \
        BODY<T>(p, part_ml, part_acc, out, blockIdx.y);                                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB)                                \
        NAME##_batch_##TN(const QsdpaSeq* seqs, uint32_t n_split_max, T* out,                   \
                          const float* part_ml, const float* part_acc) {                       \
        pdl_entry();                                                                           \
        const QsdpaParams p = seqs[blockIdx.y].p;                                              \
        if (p.n_split <= 1) return;                                                            \
        const size_t qn = (size_t)p.n_heads * p.q_len * p.head_dim;                            \
        const size_t pr = (size_t)n_split_max * p.n_heads * p.q_len;                           \
        BODY<T>(p, part_ml + blockIdx.y * pr * 2, part_acc + blockIdx.y * pr * p.head_dim,     \
                out + blockIdx.y * qn, blockIdx.z);                                            \
    }
template <typename T>
__device__ __forceinline__ void qsdpa_combine_p4_body(const QsdpaParams& p, const float* ml,
                                                      const float* acc, T* out, int chunk) {
    qsdpa_combine_body<T, 4>(p, ml, acc, out, chunk);
}
template <typename T>
__device__ __forceinline__ void qsdpa_combine_p12_body(const QsdpaParams& p, const float* ml,
                                                       const float* acc, T* out, int chunk) {
    qsdpa_combine_body<T, 12>(p, ml, acc, out, chunk);
}
#define QSDPA_COMBINE_INST(TN, T)                                                              \
    QSDPA_COMBINE_INST_AS(qsdpa_combine_p4, qsdpa_combine_p4_body, QC_THREADS, 5, TN, T)       \
    QSDPA_COMBINE_INST_AS(qsdpa_combine_p12, qsdpa_combine_p12_body, QC_THREADS, 2, TN, T)     \
    QSDPA_COMBINE_INST_AS(qsdpa_combine_rows, qsdpa_combine_rows_body, QS_COMBINE_THREADS, 1, TN, T)

#define QSDPA_INST_T(TN, T)                                                                    \
    QSDPA_INST_HD(TN, T, 4)                                                                    \
    QSDPA_INST_HD(TN, T, 8)                                                                    \
    QSDPA_COMBINE_INST(TN, T)

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

template <typename T> struct MmaMagic;
template <> struct MmaMagic<__nv_bfloat16> {
    static constexpr uint32_t MAGIC = 0x43004300u;  // 128.0 in both halves
    static constexpr uint32_t ONES = 0x3F803F80u;   // 1.0
    static constexpr float MAGIC_F = 128.f;
};
template <> struct MmaMagic<__half> {
    static constexpr uint32_t MAGIC = 0x64006400u;  // 1024.0
    static constexpr uint32_t ONES = 0x3C003C00u;
    static constexpr float MAGIC_F = 1024.f;
};

// The low nibble of each 16-bit half of x as (MAGIC + c) in T, in one instruction: ptxas
// otherwise spends two (an AND and an OR, as lop3 takes one immediate).
template <typename T>
__device__ __forceinline__ uint32_t qt_nibbles(uint32_t x) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(0x000F000F), "r"(MmaMagic<T>::MAGIC));
    return r;
}

// Two 4-bit fields of `lo`/`hi` (selected by the byte_perm selector) as the pair
// (MAGIC + c0, MAGIC + c1), exact; the offset is taken out after the mma (see qmv_mma_body).
template <typename T>
__device__ __forceinline__ uint32_t code_pair(uint32_t lo, uint32_t hi, uint32_t sel) {
    return (__byte_perm(lo, hi, sel) & 0x000F000Fu) | MmaMagic<T>::MAGIC;
}

// Async 16-byte global -> shared copies (bypassing L1), committed and waited per warp.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// A thread's TW consecutive code words from shared memory (16-byte aligned for TW >= 4).
template <int TW> __device__ __forceinline__ void lds_codes(const uint32_t* p, uint32_t* w) {
    if constexpr (TW >= 4) {
#pragma unroll
        for (int c = 0; c < TW / 4; ++c) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[c];
            w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
        }
    } else if constexpr (TW == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = *p;
    }
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
template <typename T> struct Half2Of;
template <> struct Half2Of<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct Half2Of<__half> { using type = __half2; };

template <typename T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t magic_pair, uint32_t scale2,
                                                 uint32_t bias2) {
    using T2 = typename Half2Of<T>::type;
    const uint32_t magic = MmaMagic<T>::MAGIC;
    T2 v = *reinterpret_cast<const T2*>(&magic_pair);
    const T2 m = *reinterpret_cast<const T2*>(&magic);
    const T2 s = *reinterpret_cast<const T2*>(&scale2);
    const T2 b = *reinterpret_cast<const T2*>(&bias2);
    v = __hfma2(__hsub2(v, m), s, b);
    return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ uint32_t splat(T v) {
    const uint16_t h = *reinterpret_cast<const uint16_t*>(&v);
    return (uint32_t)h | ((uint32_t)h << 16);
}

// One 16-row tile a block, two chunks in flight a step: measured best of 1 or 2 tiles and 2 or 4
// chunks on the 31B projections (2 tiles helped q_proj but cost down_proj, with half the blocks).
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
                const uint4 r = X[i][j];
                // (x_p, x_{p+4}) for p = 0..3: the order the code pairs come in.
                const uint32_t b0[2] = {__byte_perm(r.x, r.z, 0x5410), __byte_perm(r.x, r.z, 0x7632)};
                const uint32_t b1[2] = {__byte_perm(r.y, r.w, 0x5410), __byte_perm(r.y, r.w, 0x7632)};
#pragma unroll
                for (int t = 0; t < QTC_TILES; ++t) {
                    uint32_t d[2][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const uint4 w4 = W[i][2 * t + h];
                        const uint32_t wj = j == 0 ? w4.x : j == 1 ? w4.y : j == 2 ? w4.z : w4.w;
#pragma unroll
                        for (int pp = 0; pp < 4; ++pp)
                            d[h][pp] = dequant_pair<T>(qt_nibbles<T>(wj >> (4 * pp)),
                                                       sc[i][2 * t + h], bi[i][2 * t + h]);
                    }
                    const uint32_t f0[4] = {d[0][0], d[1][0], d[0][1], d[1][1]};
                    const uint32_t f1[4] = {d[0][2], d[1][2], d[0][3], d[1][3]};
                    mma_16816<T>(acc[t], f0, b0);
                    mma_16816<T>(acc[t], f1, b1);
                }
            }
        }
    }
    store_mma_tiles<T, QTC_TILES, QMMA_WARPS>(&acc[0][0], red, tile0, last, (int)p.rows,
                                       (int)p.out_dim, y);
}

// qmv_tc4_{T}_b{B}: registers capped for B resident blocks a multiprocessor, U chunks a step
// (b1 and b4: 2; b2: 4, eight 16-byte weight loads a thread in flight).
#define QTC4_INST(TN, T, B, U)                                                                 \
    extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32, B)                            \
        qmv_tc4_##TN##_b##B(const QmatParams p, const T* x, const uint32_t* c, const T* s,      \
                            const T* b, T* y) {                                                \
        pdl_entry();                                                                           \
        qmv_tc4_body<T, U>(p, x, c, s, b, y);                                                  \
    }
#define QTC4_INST_T(TN, T) \
    QTC4_INST(TN, T, 1, 2)                                                                     \
    QTC4_INST(TN, T, 2, 4)                                                                     \
    QTC4_INST(TN, T, 4, 2)
QTC4_INST_T(f16, __half)
QTC4_INST_T(bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------------
// 4-bit matrix-vector product for one activation row (decode at batch 1), read row-contiguous.
//
// qmv_tc4's fragments touch 16 rows at 64 bytes each per warp-wide load, measured at 0.50-0.63
// of the copy bandwidth on the 31B projections; here each warp-wide load covers 512 contiguous
// bytes of one row (lane l takes 32 codes, 16 bytes, at byte 16 l of a 1024-code step), measured
// at 0.55-0.75. The mma still does the multiply-adds: A row gq (and gq + 8) of the tile holds
// the codes of quad gq's four lanes for output row r (and r + 1), and B column gq holds the same
// lanes' x at the same k. D[gq][gq] is then quad gq's partial dot product of row r; the
// off-diagonal entries are ignored, and the warp sums the eight diagonal entries at the end.
// Each lane's 32 codes lie in one group: it dequantizes them with that group's scale and bias
// exactly as qmv_tc4 does (the weight rounded once to the activation type), so one row and a
// batch of rows round alike.
//
// A warp owns two consecutive rows and issues U steps' loads before their math (`_u2`: two,
// with registers capped at 80 so that ptxas keeps them together; 1-2% faster than one step on
// every 31B point, H100). Variants ending in `e` issue the first round's weight loads before
// the PDL wait and read x after it (for weights the host marks settled): 3-8% faster on the
// 31B shapes, 16% with `_u2le` on the q_proj (`bench-results/h100-s22-qrow-early.md`).
// Measured slower on the H100 (bench_kernels, 31B shapes): the next step's loads before this
// step's math, cp.async through shared memory with 2 or 4 steps in flight, L2 prefetches 2 or
// 4 steps ahead (and of 1 or 2 steps before the PDL wait: no gain), four rows a warp, and
// copy-engine (cp.async.bulk) loads of whole row pairs (`h100-s22-qmv-bulk.patch`).
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
// hold slots its own blocks wait for; as the rule for every `e` variant it cost E4B 4-bit
// decode 1-2%).
template <typename T, int U, bool LATE_X, bool EARLY = false, bool TRIGGER_FIRST = false>
__device__ __forceinline__ void qmv_row4_body(const QmatParams p, const T* __restrict__ x,
                                              const uint32_t* __restrict__ codes,
                                              const T* __restrict__ scales,
                                              const T* __restrict__ biases,
                                              T* __restrict__ y) {
    // The next kernel may launch at once (it waits for this one before reading what this one
    // writes); its settled weights' loads then overlap this kernel's tail.
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
    auto load_x = [&](Step& t) {
        if constexpr (!LATE_X) {
#pragma unroll
            for (int j = 0; j < 4; ++j) t.xv[j] = t.ok ? t.xs[j] : make_uint4(0u, 0u, 0u, 0u);
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
                r = t.ok ? t.xs[j] : make_uint4(0u, 0u, 0u, 0u);
            } else {
                r = t.xv[j];
            }
            // (x_p, x_{p+4}) for p = 0..3: the order the code pairs come in.
            const uint32_t b0[2] = {__byte_perm(r.x, r.z, 0x5410), __byte_perm(r.x, r.z, 0x7632)};
            const uint32_t b1[2] = {__byte_perm(r.y, r.w, 0x5410), __byte_perm(r.y, r.w, 0x7632)};
            uint32_t d[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 w = t.w[h];
                const uint32_t wj = j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
#pragma unroll
                for (int pp = 0; pp < 4; ++pp)
                    d[h][pp] = dequant_pair<T>(qt_nibbles<T>(wj >> (4 * pp)), t.sc[h], t.bi[h]);
            }
            const uint32_t f0[4] = {d[0][0], d[1][0], d[0][1], d[1][1]};
            const uint32_t f1[4] = {d[0][2], d[1][2], d[0][3], d[1][3]};
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

// qmv_row4_{T}_u1 / _u2: one or two steps' loads before their math (two: registers capped at
// 80, 24 warps an SM); _u2l: two steps, x read in the math, registers capped at 64 (32 warps).
#define QROW4_INST(TN, T, SUFFIX, U, LATE, MINB)                                               \
    extern "C" __global__ void __launch_bounds__(QROW_MAX_WARPS * 32, MINB)                    \
        qmv_row4_##TN##SUFFIX(const QmatParams p, const T* x, const uint32_t* c, const T* s,   \
                             const T* b, T* y) {                                              \
        pdl_entry();                                                                           \
        qmv_row4_body<T, U, LATE>(p, x, c, s, b, y);                                           \
    }                                                                                          \
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
#define QROW4_VARIANTS(INST, TN, T)                                                            \
    INST(TN, T, _u1, 1, false, 1)                                                              \
    INST(TN, T, _u2, 2, false, 3)                                                              \
    INST(TN, T, _u2l, 2, true, 4)
QROW4_VARIANTS(QROW4_INST, f16, __half)
QROW4_VARIANTS(QROW4_INST, bf16, __nv_bfloat16)
QROW4_VARIANTS(QROW4_NORM_INST, f16, __half)
QROW4_VARIANTS(QROW4_NORM_INST, bf16, __nv_bfloat16)

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

// Chunks a lane's loop unrolls: 8 for one row of 8-bit codes (measured 1-2% faster on the
// 31B shapes than 4, h100-s24-qmv8.md), else 4.
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
    QMV_INST(TN, T, SN, S, BITS, 8)                                                            \
    extern "C" __global__ void dequant_##TN##_##SN##_##BITS(const QmatParams p,                 \
                                                             const uint32_t* c, const S* s,     \
                                                             const S* b, const uint32_t* idx,   \
                                                             T* out) {                         \
        pdl_entry();                                                                           \
        dequant_body<T, S, BITS>(p, c, s, b, idx, out);                                        \
    }

// One row of 8-bit codes held to 32 registers (8 blocks a multiprocessor instead of 6), for
// grids that then fit one wave (`qmatvec` in launch.rs). It unrolls 4: 8 spills at 32.
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
// and biases; within a head the slots' groups are contiguous). `KvqDst` in launch.rs.
struct KvqDst {
    uint64_t kc, ks, kb, vc, vs, vb;
    uint32_t c_sh, s_sh;
};

// The slots of up to KVQ_BATCH sequences, passed by value (kernel parameter space). `KvqBatch`
// in launch.rs.
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

// quantize_into_dyn: one sequence, its slots read from device memory (a captured decode step's
// parameter area: the slots move from step to step, the graph does not). quantize_into_batch:
// sequence blockIdx.z of a batch into dst.d[blockIdx.z] (one launch for a whole batch).
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
        quantize_into_body<T, BITS>(p, *dst, k, v);                                            \
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

#include "qsdpa_tc.cuh"

// One thread that returns `ns` nanoseconds after it starts (device clock): work a benchmark
// enqueues behind it then runs back to back, timed on the GPU without the host's enqueue time.
extern "C" __global__ void gpu_spin(const unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
