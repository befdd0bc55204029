// Fused attention (qSDPA) on the CUDA cores over packed (4/8-bit) or dense K/V, and the kernels
// that merge its key splits (and those of the tensor-core kernels in `attention_tc.cu`).

#include <stdint.h>

#include "attention.cuh"

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

// The split-combining kernels: `qsdpa_combine_p{4,12}_TN` (one sequence) and
// `qsdpa_combine_p{4,12}_batch_TN` (grid y = sequence).
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
    QSDPA_COMBINE_INST_AS(qsdpa_combine_p12, qsdpa_combine_p12_body, QC_THREADS, 2, TN, T)

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
