// Metal port of src/kernels/cuda/qkernels.cu: quantized attention (split-K, online softmax),
// quantized matvec and row dequantization over MLX affine 4/8-bit codes. Same algorithm, same
// parameter structs (src/kernels/cuda/params.rs), same kernel names. Launched by
// src/kernels/metal/launch.rs from the plans of src/kernels/metal/plan.rs. No Mac here: the
// source is compiled as C++ against src/kernels/metal/shim.h, which emulates the language's
// threadgroups, barriers and SIMD sums on CPU threads, and `cargo test` runs the plans through
// it against the CPU reference (tests/metal_emulation.rs).
#include <metal_stdlib>
using namespace metal;

// SIMD width: every kernel assumes simdgroups of 32 threads (all Apple GPUs; `simd_sum` and the
// lane/warp split of a threadgroup rely on it). Threadgroups are at most 256 threads; the
// launcher checks each against the pipeline's maxTotalThreadsPerThreadgroup.
//
// `bfloat` exists from Metal 3.1 (macOS 14): the bf16 kernels are compiled only there, so the
// library still compiles on macOS 13 and its f16/f32 kernels run.
#if __METAL_VERSION__ >= 310
#define QK_HAS_BFLOAT 1
#else
#define QK_HAS_BFLOAT 0
#endif

// Threadgroup arrays declared in a kernel. The CPU emulation makes them function statics: it runs
// one threadgroup at a time, so a static is that group's shared memory.
#ifndef QK_THREADGROUP
#define QK_THREADGROUP threadgroup
#endif

struct QsdpaParams {
    ulong k_codes_sh, k_codes_sk, k_sc_sh, k_sc_sk;
    ulong v_codes_sh, v_codes_sk, v_sc_sh, v_sc_sk;
    uint n_heads, kv_heads, q_len, head_dim;
    uint keys, group_size, window, q_offset;
    uint pos_mode, pos_base, pos_split, pos_base2;
    uint n_split, keys_per_split;
    float scale;
    uint long_splits;  // splits 0 .. long_splits - 1 take QS_SPLIT_STEP keys more
};

struct QmatParams {
    uint rows, out_dim, in_dim, group_size;
};

constant constexpr int QS_WARPS = 4;
constant constexpr int QS_SPLIT_STEP = 16;
constant constexpr int QS_NQ = 4;
// Query rows whose accumulators are merged at once: Apple GPUs give a threadgroup 32 KiB, and
// 4 warps x 4 rows x 512 dims of f32 is exactly that before the softmax state.
template <int HD>
constexpr int qs_merge_rows() { return HD >= 512 ? 2 : 4; }  // 4: QS_NQ
constant constexpr int QMV_WARPS = 8;

inline uint key_pos(constant QsdpaParams& p, device const uint* pos, int j) {
    if (p.pos_mode == 0) return p.pos_base + uint(j);
    if (p.pos_mode == 1)
        return uint(j) < p.pos_split ? p.pos_base + uint(j) : p.pos_base2 + (uint(j) - p.pos_split);
    return pos[j];
}

template <int BITS>
inline float code_of(thread const uint* w, int i, int shift) {
    const int bit = i * BITS + shift;
    return float((w[bit >> 5] >> (bit & 31)) & ((1u << BITS) - 1));
}

// One threadgroup = one KV head x QS_NQ query rows x one key split; 4 simdgroups of 32.
template <typename T, int HD, int BITS>
inline void qsdpa_body(constant QsdpaParams& p, device const T* q, device const uint* kc,
                       device const T* ks, device const T* kb, device const uint* vc,
                       device const T* vs, device const T* vb, device const uint* positions,
                       device T* out, device float* part_ml, device float* part_acc,
                       threadgroup float* sm_acc, threadgroup float* sm_m, threadgroup float* sm_l,
                       uint3 tg, uint tid, uint lane, uint warp) {
    constexpr int E = HD / 32;
    constexpr int LANE_BITS = E * BITS;
    constexpr int NW = LANE_BITS >= 32 ? LANE_BITS / 32 : 1;
    constexpr int NQ = QS_NQ;
    constexpr int MR = qs_merge_rows<HD>();
    const int g = int(tg.y);
    const int group = int(p.n_heads / p.kv_heads);
    const int rows = group * int(p.q_len);
    const int row0 = int(tg.x) * NQ;
    const int split = int(tg.z);

    float qv[NQ][E];
    float qsum[NQ], m[NQ], l[NQ];
    float acc[NQ][E];
    uint qpos[NQ];
    bool qok[NQ];
    for (int n = 0; n < NQ; ++n) {
        const int r = row0 + n;
        qok[n] = r < rows;
        const int qi = qok[n] ? r / group : 0, hh = qok[n] ? r % group : 0;
        const int head = g * group + hh;
        qpos[n] = p.q_offset + uint(qi);
        device const T* qr = q + (ulong(head) * p.q_len + qi) * HD + lane * E;
        qsum[n] = 0.f;
        for (int i = 0; i < E; ++i) {
            qv[n][i] = qok[n] ? float(qr[i]) * p.scale : 0.f;
            qsum[n] += qv[n][i];
        }
        m[n] = -INFINITY;
        l[n] = 0.f;
        for (int i = 0; i < E; ++i) acc[n][i] = 0.f;
    }
    // The first long_splits splits take QS_SPLIT_STEP keys more (`KeySplit` in params.rs).
    const int longer = min(split, int(p.long_splits));
    const int j0 = split * int(p.keys_per_split) + longer * QS_SPLIT_STEP;
    const int j1 = min(int(p.keys), j0 + int(p.keys_per_split) +
                                        (split < int(p.long_splits) ? QS_SPLIT_STEP : 0));
    const int gidx = int(lane * E) / int(p.group_size);
    const int word0 = int(lane * E * BITS) >> 5;
    const int shift0 = int(lane * E * BITS) & 31;
    for (int j = j0 + int(warp); j < j1; j += QS_WARPS) {
        const uint pos = key_pos(p, positions, j);
        bool vis[NQ];
        bool any = false;
        for (int n = 0; n < NQ; ++n) {
            vis[n] = qok[n] && pos <= qpos[n] && (p.window == 0 || pos + p.window > qpos[n]);
            any = any || vis[n];
        }
        if (!any) continue;
        uint kw[NW], vw[NW];
        device const uint* kr = kc + g * p.k_codes_sh + ulong(j) * p.k_codes_sk + word0;
        device const uint* vr = vc + g * p.v_codes_sh + ulong(j) * p.v_codes_sk + word0;
        for (int w = 0; w < NW; ++w) {
            kw[w] = kr[w];
            vw[w] = vr[w];
        }
        const float ksc = float(ks[g * p.k_sc_sh + ulong(j) * p.k_sc_sk + gidx]);
        const float kbi = float(kb[g * p.k_sc_sh + ulong(j) * p.k_sc_sk + gidx]);
        const float vsc = float(vs[g * p.v_sc_sh + ulong(j) * p.v_sc_sk + gidx]);
        const float vbi = float(vb[g * p.v_sc_sh + ulong(j) * p.v_sc_sk + gidx]);
        float s[NQ];
        for (int n = 0; n < NQ; ++n) s[n] = 0.f;
        for (int i = 0; i < E; ++i) {
            const float c = code_of<BITS>(kw, i, shift0);
            for (int n = 0; n < NQ; ++n) s[n] = fma(c, qv[n][i], s[n]);
        }
        for (int n = 0; n < NQ; ++n) s[n] = simd_sum(ksc * s[n] + kbi * qsum[n]);
        float val[E];
        for (int i = 0; i < E; ++i) val[i] = fma(vsc, code_of<BITS>(vw, i, shift0), vbi);
        for (int n = 0; n < NQ; ++n) {
            if (!vis[n]) continue;
            const float m_new = max(m[n], s[n]);
            const float corr = exp(m[n] - m_new);
            const float pp = exp(s[n] - m_new);
            l[n] = l[n] * corr + pp;
            m[n] = m_new;
            for (int i = 0; i < E; ++i) acc[n][i] = fma(acc[n][i], corr, pp * val[i]);
        }
    }
    for (int n = 0; n < NQ; ++n) {
        if (lane == 0) {
            sm_m[warp * NQ + n] = m[n];
            sm_l[warp * NQ + n] = l[n];
        }
    }
    // The warps' accumulators meet in threadgroup memory MR rows at a time.
    for (int n0 = 0; n0 < NQ; n0 += MR) {
        for (int n = n0; n < n0 + MR; ++n)
            for (int i = 0; i < E; ++i)
                sm_acc[(warp * MR + (n - n0)) * HD + lane * E + i] = acc[n][i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int t = int(tid); t < MR * HD; t += QS_WARPS * 32) {
            const int n = n0 + t / HD, d = t % HD;
            const int r = row0 + n;
            if (r >= rows) continue;
            float M = -INFINITY;
            for (int w = 0; w < QS_WARPS; ++w)
                if (sm_l[w * NQ + n] > 0.f) M = max(M, sm_m[w * NQ + n]);
            float L = 0.f, A = 0.f;
            for (int w = 0; w < QS_WARPS; ++w) {
                if (sm_l[w * NQ + n] > 0.f) {
                    const float f = exp(sm_m[w * NQ + n] - M);
                    L += f * sm_l[w * NQ + n];
                    A += f * sm_acc[(w * MR + (n - n0)) * HD + d];
                }
            }
            const int grow = g * rows + r;
            if (p.n_split == 1) {
                const int qi = r / group, hh = r % group, head = g * group + hh;
                out[(ulong(head) * p.q_len + qi) * HD + d] = T(L > 0.f ? A / L : 0.f);
            } else {
                const ulong prow = ulong(split) * p.kv_heads * rows + grow;
                part_acc[prow * HD + d] = A;
                if (d == 0) {
                    part_ml[prow * 2] = M;
                    part_ml[prow * 2 + 1] = L;
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // sm_acc is written again next pass
    }
}

template <typename T>
inline void qsdpa_combine_body(constant QsdpaParams& p, device const float* part_ml,
                               device const float* part_acc, device T* out, uint grow_u,
                               uint tid) {
    const int hd = int(p.head_dim);
    const int group = int(p.n_heads / p.kv_heads);
    const int rows = group * int(p.q_len);
    const int total = int(p.kv_heads) * rows;
    const int grow = int(grow_u);
    const int g = grow / rows, r = grow % rows;
    const int qi = r / group, hh = r % group, head = g * group + hh;
    float M = -INFINITY;
    for (int s = 0; s < int(p.n_split); ++s) {
        device const float* ml = part_ml + (ulong(s) * total + grow) * 2;
        if (ml[1] > 0.f) M = max(M, ml[0]);
    }
    float L = 0.f;
    for (int s = 0; s < int(p.n_split); ++s) {
        device const float* ml = part_ml + (ulong(s) * total + grow) * 2;
        if (ml[1] > 0.f) L += exp(ml[0] - M) * ml[1];
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int d = int(tid); d < hd; d += 128) {
        float A = 0.f;
        for (int s = 0; s < int(p.n_split); ++s) {
            device const float* ml = part_ml + (ulong(s) * total + grow) * 2;
            if (ml[1] > 0.f) A += exp(ml[0] - M) * part_acc[(ulong(s) * total + grow) * hd + d];
        }
        out[(ulong(head) * p.q_len + qi) * hd + d] = T(A * inv);
    }
}

#define QSDPA_INST(TN, T, HD, BITS)                                                            \
    [[kernel]] void qsdpa_##TN##_##HD##_##BITS(                                                \
        constant QsdpaParams& p [[buffer(0)]], device const T* q [[buffer(1)]],                \
        device const uint* kc [[buffer(2)]], device const T* ks [[buffer(3)]],                 \
        device const T* kb [[buffer(4)]], device const uint* vc [[buffer(5)]],                 \
        device const T* vs [[buffer(6)]], device const T* vb [[buffer(7)]],                    \
        device const uint* positions [[buffer(8)]], device T* out [[buffer(9)]],               \
        device float* part_ml [[buffer(10)]], device float* part_acc [[buffer(11)]],           \
        uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],   \
        uint lane [[thread_index_in_simdgroup]], uint warp [[simdgroup_index_in_threadgroup]]) { \
        static_assert(4 * (QS_WARPS * qs_merge_rows<HD>() * HD + 2 * QS_WARPS * QS_NQ) <= 32768, \
                      "threadgroup memory over 32 KiB");                                        \
        QK_THREADGROUP float sm_acc[QS_WARPS * qs_merge_rows<HD>() * HD];                      \
        QK_THREADGROUP float sm_m[QS_WARPS * QS_NQ];                                           \
        QK_THREADGROUP float sm_l[QS_WARPS * QS_NQ];                                           \
        qsdpa_body<T, HD, BITS>(p, q, kc, ks, kb, vc, vs, vb, positions, out, part_ml,          \
                                part_acc, sm_acc, sm_m, sm_l, tg, tid, lane, warp);            \
    }

#define QSDPA_INST_HD(TN, T, BITS) \
    QSDPA_INST(TN, T, 32, BITS)    \
    QSDPA_INST(TN, T, 64, BITS)    \
    QSDPA_INST(TN, T, 128, BITS)   \
    QSDPA_INST(TN, T, 256, BITS)   \
    QSDPA_INST(TN, T, 512, BITS)

#define QSDPA_INST_T(TN, T)                                                                    \
    QSDPA_INST_HD(TN, T, 4)                                                                    \
    QSDPA_INST_HD(TN, T, 8)                                                                    \
    [[kernel]] void qsdpa_combine_##TN(constant QsdpaParams& p [[buffer(0)]],                  \
                                       device const float* part_ml [[buffer(1)]],              \
                                       device const float* part_acc [[buffer(2)]],             \
                                       device T* out [[buffer(3)]],                            \
                                       uint grow [[threadgroup_position_in_grid]],             \
                                       uint tid [[thread_index_in_threadgroup]]) {             \
        qsdpa_combine_body<T>(p, part_ml, part_acc, out, grow, tid);                           \
    }

QSDPA_INST_T(f32, float)
QSDPA_INST_T(f16, half)
#if QK_HAS_BFLOAT
QSDPA_INST_T(bf16, bfloat)
#endif

// y[r, o] = sum_e x[r, e] W[o, e]: one simdgroup per output row, 4 words of codes per step.
template <typename T, typename S, int BITS, int MAXR>
inline void qmatvec_body(constant QmatParams& p, device const T* x, device const uint* codes,
                         device const S* scales, device const S* biases, device T* y, uint tg,
                         uint lane, uint warp) {
    constexpr int EPC = 128 / BITS;
    const int o = int(tg) * QMV_WARPS + int(warp);
    if (o >= int(p.out_dim)) return;
    const int words = int(p.in_dim) * BITS / 32;
    const int chunks = words / 4;
    const int groups = int(p.in_dim / p.group_size);
    device const uint* wr = codes + ulong(o) * words;
    float acc[MAXR];
    for (int r = 0; r < MAXR; ++r) acc[r] = 0.f;
    for (int c = int(lane); c < chunks; c += 32) {
        uint w[4];
        for (int i = 0; i < 4; ++i) w[i] = wr[c * 4 + i];
        const int e0 = c * EPC;
        const float sc = float(scales[ulong(o) * groups + e0 / int(p.group_size)]);
        const float bi = float(biases[ulong(o) * groups + e0 / int(p.group_size)]);
        for (int r = 0; r < MAXR; ++r) {
            if (r < int(p.rows)) {
                float dot = 0.f, xs = 0.f;
                device const T* xr = x + ulong(r) * p.in_dim + e0;
                for (int k = 0; k < EPC; ++k) {
                    const float xv = float(xr[k]);
                    const float cv = float((w[(k * BITS) >> 5] >> ((k * BITS) & 31)) & ((1u << BITS) - 1));
                    dot = fma(cv, xv, dot);
                    xs += xv;
                }
                acc[r] = fma(sc, dot, fma(bi, xs, acc[r]));
            }
        }
    }
    for (int r = 0; r < MAXR; ++r) acc[r] = simd_sum(acc[r]);
    if (lane == 0)
        for (int r = 0; r < MAXR; ++r)
            if (r < int(p.rows)) y[ulong(r) * p.out_dim + o] = T(acc[r]);
}

template <typename T, typename S, int BITS>
inline void dequant_body(constant QmatParams& p, device const uint* codes, device const S* scales,
                         device const S* biases, device const uint* idx, uint use_idx,
                         device T* out, uint t) {
    constexpr int PER = 32 / BITS;
    const ulong words = ulong(p.in_dim) * BITS / 32;
    if (ulong(t) >= words * p.rows) return;
    const ulong i = t / words, wi = t % words;
    const ulong src = use_idx != 0 ? ulong(idx[i]) : i;
    const uint w = codes[src * words + wi];
    const ulong e0 = wi * PER;
    const ulong gi = src * (p.in_dim / p.group_size) + e0 / p.group_size;
    const float sc = float(scales[gi]), bi = float(biases[gi]);
    for (int k = 0; k < PER; ++k) out[i * p.in_dim + e0 + k] = T(fma(sc, float((w >> (k * BITS)) & ((1u << BITS) - 1)), bi));
}

#define QMV_INST(TN, T, SN, S, BITS, R)                                                        \
    [[kernel]] void qmatvec_##TN##_##SN##_##BITS##_##R(                                         \
        constant QmatParams& p [[buffer(0)]], device const T* x [[buffer(1)]],                 \
        device const uint* c [[buffer(2)]], device const S* s [[buffer(3)]],                   \
        device const S* b [[buffer(4)]], device T* y [[buffer(5)]],                            \
        uint tg [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]],     \
        uint warp [[simdgroup_index_in_threadgroup]]) {                                        \
        qmatvec_body<T, S, BITS, R>(p, x, c, s, b, y, tg, lane, warp);                         \
    }

#define QW_INST_B(TN, T, SN, S, BITS)                                                          \
    QMV_INST(TN, T, SN, S, BITS, 1)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 2)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 4)                                                            \
    QMV_INST(TN, T, SN, S, BITS, 8)                                                            \
    [[kernel]] void dequant_##TN##_##SN##_##BITS(                                               \
        constant QmatParams& p [[buffer(0)]], device const uint* c [[buffer(1)]],              \
        device const S* s [[buffer(2)]], device const S* b [[buffer(3)]],                      \
        device const uint* idx [[buffer(4)]], constant uint& use_idx [[buffer(5)]],            \
        device T* out [[buffer(6)]], uint t [[thread_position_in_grid]]) {                     \
        dequant_body<T, S, BITS>(p, c, s, b, idx, use_idx, out, t);                            \
    }

#define QW_INST_S(TN, T, SN, S) \
    QW_INST_B(TN, T, SN, S, 4)  \
    QW_INST_B(TN, T, SN, S, 8)

#if QK_HAS_BFLOAT
#define QW_INST_T(TN, T)              \
    QW_INST_S(TN, T, f32, float)      \
    QW_INST_S(TN, T, f16, half)       \
    QW_INST_S(TN, T, bf16, bfloat)
#else
#define QW_INST_T(TN, T)              \
    QW_INST_S(TN, T, f32, float)      \
    QW_INST_S(TN, T, f16, half)
#endif

QW_INST_T(f32, float)
QW_INST_T(f16, half)
#if QK_HAS_BFLOAT
QW_INST_T(bf16, bfloat)
#endif

// MLX affine quantization of rows of `x` `[rows, in_dim]` (contiguous): one thread per group of
// `group_size` elements writes the group's code words and its scale and bias (rows x groups,
// row-major). The arithmetic is MLX's CPU `quantize` (src/kernels/quant.rs `group_params`):
// f32 throughout, the larger-magnitude end snapped onto a code, round half to even (`rint`);
// with IEEE division (the library is compiled without fast math) the codes equal the CPU's.
template <typename T, int BITS>
inline void quant_body(constant QmatParams& p, device const T* x, device uint* codes,
                       device T* scales, device T* biases, uint t) {
    constexpr uint PER = 32 / BITS;
    const uint groups = p.in_dim / p.group_size;
    if (ulong(t) >= ulong(p.rows) * groups) return;
    const ulong r = t / groups, g = t % groups;
    device const T* xg = x + r * p.in_dim + g * p.group_size;
    const float n_bins = float((1u << BITS) - 1);
    float w_min = INFINITY, w_max = -INFINITY;
    for (uint i = 0; i < p.group_size; ++i) {
        const float v = float(xg[i]);
        w_max = max(w_max, v);
        w_min = min(w_min, v);
    }
    const bool at_min = fabs(w_min) > fabs(w_max);
    float scale = max((w_max - w_min) / n_bins, 1e-7f);
    if (!at_min) scale = -scale;
    const float edge = at_min ? w_min : w_max;
    const float q0 = rint(edge / scale);
    float bias = 0.f;
    if (q0 != 0.f) {
        scale = edge / q0;
        bias = edge;
    }
    device uint* cw = codes + (r * p.in_dim + g * p.group_size) / PER;
    for (uint w = 0; w < p.group_size / PER; ++w) {
        uint word = 0;
        for (uint k = 0; k < PER; ++k) {
            const float c = clamp(rint((float(xg[w * PER + k]) - bias) / scale), 0.f, n_bins);
            word |= uint(c) << (k * BITS);
        }
        cw[w] = word;
    }
    scales[t] = T(scale);
    biases[t] = T(bias);
}

#define QUANT_INST(TN, T, BITS)                                                                \
    [[kernel]] void quant_##TN##_##BITS(                                                       \
        constant QmatParams& p [[buffer(0)]], device const T* x [[buffer(1)]],                 \
        device uint* c [[buffer(2)]], device T* s [[buffer(3)]], device T* b [[buffer(4)]],    \
        uint t [[thread_position_in_grid]]) {                                                  \
        quant_body<T, BITS>(p, x, c, s, b, t);                                                 \
    }

QUANT_INST(f32, float, 4)
QUANT_INST(f32, float, 8)
QUANT_INST(f16, half, 4)
QUANT_INST(f16, half, 8)
#if QK_HAS_BFLOAT
QUANT_INST(bf16, bfloat, 4)
QUANT_INST(bf16, bfloat, 8)
#endif

// candle `Q4_1` blocks (20 bytes: `d` and `m` as half, then 16 bytes, element j in the low
// nibble of byte j and element j + 16 in the high one) to dense `[rows, in_dim]`: one thread
// per block, blocks row-major, so block t holds dense elements t * 32 .. t * 32 + 32. The
// prefill products of matrices held only as `Q4_1` blocks dequantize through it. `d` and `m`
// are read as two ushort halves of the block's first word (the block is 4-byte aligned only
// every other block).
template <typename T>
inline void dequant_q41_body(constant QmatParams& p, device const uchar* blocks, device T* out,
                             uint t) {
    const ulong n_blocks = ulong(p.rows) * (p.in_dim / 32);
    if (ulong(t) >= n_blocks) return;
    device const uchar* b = blocks + ulong(t) * 20;
    const ushort d_bits = ushort(b[0]) | ushort(ushort(b[1]) << 8);
    const ushort m_bits = ushort(b[2]) | ushort(ushort(b[3]) << 8);
    const float d = float(as_type<half>(d_bits));
    const float m = float(as_type<half>(m_bits));
    device T* o = out + ulong(t) * 32;
    for (int j = 0; j < 16; ++j) {
        const uint q = uint(b[4 + j]);
        o[j] = T(fma(float(q & 15u), d, m));
        o[j + 16] = T(fma(float(q >> 4), d, m));
    }
}

#define DEQ_Q41_INST(TN, T)                                                                    \
    [[kernel]] void dequant_q41_##TN(constant QmatParams& p [[buffer(0)]],                     \
                                     device const uchar* blocks [[buffer(1)]],                 \
                                     device T* out [[buffer(2)]],                              \
                                     uint t [[thread_position_in_grid]]) {                     \
        dequant_q41_body<T>(p, blocks, out, t);                                                \
    }

DEQ_Q41_INST(f32, float)
DEQ_Q41_INST(f16, half)
#if QK_HAS_BFLOAT
DEQ_Q41_INST(bf16, bfloat)
#endif

// Mixture-of-experts routing and routed expert products, all on the device (no read of the
// routing back to the host). Three launches per product pair:
// * `moe_route_f32`: one thread per token picks the top_k router logits (f32) in Rust's
//   `total_cmp` order, descending, ties to the lower expert (the CPU reference's sort), and
//   writes the picks `[tokens, top_k]` (u32) and their weights (softmax over the picks times
//   the expert's scale; f32, the CPU's operation order);
// * `moe_group`: one thread sorts the pairs (token, pick) by expert, stably: `offsets[e] ..
//   offsets[e + 1]` are expert e's slots in `order` (pair ids, ascending), and `used` holds
//   the count of picked experts, then the picked experts in ascending order;
// * `moe_qmatvec_*` / `moe_matvec_*`: threadgroup (x, u) computes output rows x * QMV_WARPS ..
//   (one per simdgroup) of the u-th picked expert for every pair routed to it, 8 pairs at a
//   time, so each of the expert's rows is read once per 8 pairs; y is `[pairs, out_dim]` in
//   pair order. A pair's activation row is its token's (`x_per_token`: the gate/up product) or
//   its own (the down product).
struct MoeParams {
    uint pairs, top_k, experts, out_dim;
    uint in_dim, group_size, x_per_token, pad;
};

constant constexpr int MOE_PAIRS = 8;

// Rust's `f32::total_cmp` as an integer order (NaN above +inf, -0 below +0).
inline int total_key(float v) {
    int k = as_type<int>(v);
    return k ^ int(uint(k >> 31) >> 1);
}

inline void moe_route_body(constant MoeParams& p, device const float* logits,
                           device const float* scale, device uint* idx, device float* weight,
                           uint t) {
    const uint tokens = p.pairs / p.top_k;
    if (t >= tokens) return;
    device const float* row = logits + ulong(t) * p.experts;
    device uint* picks = idx + ulong(t) * p.top_k;
    device float* w = weight + ulong(t) * p.top_k;
    // Pick j is the largest logit strictly after pick j - 1 in the order (key desc, index asc).
    int prev_key = 0;
    uint prev = 0;
    for (uint j = 0; j < p.top_k; ++j) {
        uint best = p.experts;
        int best_key = 0;
        for (uint e = 0; e < p.experts; ++e) {
            const int k = total_key(row[e]);
            const bool after = j == 0 || k < prev_key || (k == prev_key && e > prev);
            if (after && (best == p.experts || k > best_key)) {
                best = e;
                best_key = k;
            }
        }
        picks[j] = best;
        prev = best;
        prev_key = best_key;
    }
    const float top = row[picks[0]];
    float sum = 0.f;
    for (uint j = 0; j < p.top_k; ++j) {
        w[j] = exp(row[picks[j]] - top);
        sum += w[j];
    }
    for (uint j = 0; j < p.top_k; ++j) w[j] = w[j] / sum * scale[picks[j]];
}

[[kernel]] void moe_route_f32(constant MoeParams& p [[buffer(0)]],
                              device const float* logits [[buffer(1)]],
                              device const float* scale [[buffer(2)]],
                              device uint* idx [[buffer(3)]], device float* weight [[buffer(4)]],
                              uint t [[thread_position_in_grid]]) {
    moe_route_body(p, logits, scale, idx, weight, t);
}

// One thread (thread 0 of a single threadgroup) sorts the pairs by expert. `cursor` is
// `experts` u32 of scratch; picks outside the experts are dropped (the route kernel makes none).
inline void moe_group_body(constant MoeParams& p, device const uint* idx, device uint* offsets,
                           device uint* order, device uint* used, device uint* cursor, uint t) {
    if (t != 0) return;
    for (uint e = 0; e <= p.experts; ++e) offsets[e] = 0;
    for (uint i = 0; i < p.pairs; ++i)
        if (idx[i] < p.experts) offsets[idx[i] + 1] += 1;
    uint n = 0;
    for (uint e = 0; e < p.experts; ++e) {
        if (offsets[e + 1] > 0) used[1 + n++] = e;
        offsets[e + 1] += offsets[e];
        cursor[e] = offsets[e];
    }
    used[0] = n;
    for (uint i = 0; i < p.pairs; ++i)
        if (idx[i] < p.experts) order[cursor[idx[i]]++] = i;
}

[[kernel]] void moe_group(constant MoeParams& p [[buffer(0)]], device const uint* idx [[buffer(1)]],
                          device uint* offsets [[buffer(2)]], device uint* order [[buffer(3)]],
                          device uint* used [[buffer(4)]], device uint* cursor [[buffer(5)]],
                          uint t [[thread_position_in_grid]]) {
    moe_group_body(p, idx, offsets, order, used, cursor, t);
}

// The activation row of slot `s` (see MoeParams::x_per_token).
inline ulong moe_x_row(constant MoeParams& p, device const uint* order, uint s) {
    const uint pair = order[s];
    return p.x_per_token != 0 ? ulong(pair / p.top_k) : ulong(pair);
}

// Packed experts: codes `[experts * out_dim, in_dim * BITS / 32]`, scales and biases
// `[experts * out_dim, in_dim / group_size]`; one code word per lane and step.
template <typename T, typename S, int BITS>
inline void moe_qmatvec_body(constant MoeParams& p, device const T* x, device const uint* codes,
                             device const S* scales, device const S* biases,
                             device const uint* offsets, device const uint* order,
                             device const uint* used, device T* y, uint2 tg, uint lane,
                             uint warp) {
    constexpr int PER = 32 / BITS;
    if (tg.y >= used[0]) return;
    const uint e = used[1 + tg.y];
    const uint o = tg.x * QMV_WARPS + warp;
    if (o >= p.out_dim) return;
    const ulong row = ulong(e) * p.out_dim + o;
    const uint words = p.in_dim * BITS / 32;
    const uint groups = p.in_dim / p.group_size;
    device const uint* wr = codes + row * words;
    for (uint s0 = offsets[e]; s0 < offsets[e + 1]; s0 += MOE_PAIRS) {
        const uint n = min(uint(MOE_PAIRS), offsets[e + 1] - s0);
        float acc[MOE_PAIRS];
        for (int r = 0; r < MOE_PAIRS; ++r) acc[r] = 0.f;
        for (uint wi = lane; wi < words; wi += 32) {
            const uint w = wr[wi];
            const uint e0 = wi * PER;
            const float sc = float(scales[row * groups + e0 / p.group_size]);
            const float bi = float(biases[row * groups + e0 / p.group_size]);
            for (uint r = 0; r < n; ++r) {
                device const T* xr = x + moe_x_row(p, order, s0 + r) * p.in_dim + e0;
                float dot = 0.f, xs = 0.f;
                for (int k = 0; k < PER; ++k) {
                    const float xv = float(xr[k]);
                    dot = fma(float((w >> (k * BITS)) & ((1u << BITS) - 1)), xv, dot);
                    xs += xv;
                }
                acc[r] = fma(sc, dot, fma(bi, xs, acc[r]));
            }
        }
        for (uint r = 0; r < n; ++r) acc[r] = simd_sum(acc[r]);
        if (lane == 0)
            for (uint r = 0; r < n; ++r) y[ulong(order[s0 + r]) * p.out_dim + o] = T(acc[r]);
    }
}

// Dense experts `[experts * out_dim, in_dim]` in the activations' dtype.
template <typename T>
inline void moe_matvec_body(constant MoeParams& p, device const T* x, device const T* weights,
                            device const uint* offsets, device const uint* order,
                            device const uint* used, device T* y, uint2 tg, uint lane,
                            uint warp) {
    if (tg.y >= used[0]) return;
    const uint e = used[1 + tg.y];
    const uint o = tg.x * QMV_WARPS + warp;
    if (o >= p.out_dim) return;
    device const T* wr = weights + (ulong(e) * p.out_dim + o) * p.in_dim;
    for (uint s0 = offsets[e]; s0 < offsets[e + 1]; s0 += MOE_PAIRS) {
        const uint n = min(uint(MOE_PAIRS), offsets[e + 1] - s0);
        float acc[MOE_PAIRS];
        for (int r = 0; r < MOE_PAIRS; ++r) acc[r] = 0.f;
        for (uint i = lane; i < p.in_dim; i += 32) {
            const float wv = float(wr[i]);
            for (uint r = 0; r < n; ++r)
                acc[r] = fma(wv, float(x[moe_x_row(p, order, s0 + r) * p.in_dim + i]), acc[r]);
        }
        for (uint r = 0; r < n; ++r) acc[r] = simd_sum(acc[r]);
        if (lane == 0)
            for (uint r = 0; r < n; ++r) y[ulong(order[s0 + r]) * p.out_dim + o] = T(acc[r]);
    }
}

#define MOE_QMV_INST(TN, T, SN, S, BITS)                                                       \
    [[kernel]] void moe_qmatvec_##TN##_##SN##_##BITS(                                           \
        constant MoeParams& p [[buffer(0)]], device const T* x [[buffer(1)]],                  \
        device const uint* c [[buffer(2)]], device const S* s [[buffer(3)]],                   \
        device const S* b [[buffer(4)]], device const uint* offsets [[buffer(5)]],             \
        device const uint* order [[buffer(6)]], device const uint* used [[buffer(7)]],         \
        device T* y [[buffer(8)]], uint2 tg [[threadgroup_position_in_grid]],                  \
        uint lane [[thread_index_in_simdgroup]], uint warp [[simdgroup_index_in_threadgroup]]) { \
        moe_qmatvec_body<T, S, BITS>(p, x, c, s, b, offsets, order, used, y, tg, lane, warp);  \
    }

#define MOE_MV_INST(TN, T)                                                                     \
    [[kernel]] void moe_matvec_##TN(                                                           \
        constant MoeParams& p [[buffer(0)]], device const T* x [[buffer(1)]],                  \
        device const T* w [[buffer(2)]], device const uint* offsets [[buffer(3)]],             \
        device const uint* order [[buffer(4)]], device const uint* used [[buffer(5)]],         \
        device T* y [[buffer(6)]], uint2 tg [[threadgroup_position_in_grid]],                  \
        uint lane [[thread_index_in_simdgroup]], uint warp [[simdgroup_index_in_threadgroup]]) { \
        moe_matvec_body<T>(p, x, w, offsets, order, used, y, tg, lane, warp);                  \
    }

#define MOE_INST_S(TN, T, SN, S)        \
    MOE_QMV_INST(TN, T, SN, S, 4)       \
    MOE_QMV_INST(TN, T, SN, S, 8)

#if QK_HAS_BFLOAT
#define MOE_INST_T(TN, T)               \
    MOE_INST_S(TN, T, f32, float)       \
    MOE_INST_S(TN, T, f16, half)        \
    MOE_INST_S(TN, T, bf16, bfloat)     \
    MOE_MV_INST(TN, T)
#else
#define MOE_INST_T(TN, T)               \
    MOE_INST_S(TN, T, f32, float)       \
    MOE_INST_S(TN, T, f16, half)        \
    MOE_MV_INST(TN, T)
#endif

MOE_INST_T(f32, float)
MOE_INST_T(f16, half)
#if QK_HAS_BFLOAT
MOE_INST_T(bf16, bfloat)
#endif
