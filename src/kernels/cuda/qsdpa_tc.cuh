// Tensor-core attention over packed (4/8-bit) or dense (16-bit) K/V for f16/bf16 queries at
// head dims 256 and 512. The kernels (`attention_tc.cu`) share QsdpaParams, key_pos,
// load_words, mma_16816, MmaMagic and dequant_pair with the CUDA-core kernel and write the same
// partials, so `qsdpa_combine` (`attention.cu`) merges their key splits. This header holds the
// tile loads, fragments and staging.
//
// One block = one KV head x 8 query rows (the N of mma.m16n8k16; rows ordered (query index,
// head in group) as in the CUDA-core kernel) x one key split, HD/128 warps. The block walks its
// keys in tiles of 16. Warp w owns head dims [128w, 128w + 128):
// * scores: S (16 keys x 8 rows) = K Q^T over the warp's dims, summed over the warps through
//   shared memory, so every warp holds the whole S and runs the same online softmax;
// * output: O^T (the warp's 128 dims x 8 rows) += V^T P^T, P moved from the score fragment to
//   the B fragment with movmatrix.
// Tiles reach the registers one of two ways (`tc_staging` in attention/plan.rs picks per head
// dim and bit width): each lane loads its next tile's words from the cache while it computes the
// current one (STAGES = 0), or the block copies whole tiles into shared memory with cp.async
// one step ahead and lanes read their words from there (STAGES = 2: fewer registers, so more
// blocks or deeper pipelines; NTS = 2 attends two tiles a step, one softmax for both).
// A single-sequence block whose first keys are settled (the kernels' last argument: no running
// kernel writes them) issues their loads before it waits for the kernel ahead, so they overlap
// that kernel's tail; the queries, which that kernel may write, are read after the wait.
// K and V are dequantized into f16/bf16 fragments in registers (one rounding, as dequantizing
// the cache to the query's type would); products accumulate in f32. Only the order of the dot
// products' terms is free: lanes take the element pairs that are cheap to unpack, and the
// queries (B of the score mma) are permuted to match once per block. The folded-scale kernels
// (FV: 4-bit codes in groups of 64, tiles in registers) dequantize nothing: both mma read the
// codes as exact (MAGIC + c), the key scales apply to the scores in f32 and the value scales
// ride on P (`qt_fold_scores`, `qt_value_frag_folded`): ~12% fewer instructions a tile.
//
// Lane = 4 gq + tq. Score mma: A = K (rows = keys, k = dims): lane reads 32 consecutive dims
// [128w + 32 tq, + 32) of keys gq and gq + 8. Output mma: A = V^T (rows = dims, k = keys): lane
// reads 16 consecutive dims [128w + 16 gq, + 16) of keys 2tq, 2tq + 1, 2tq + 8, 2tq + 9; m-tile
// i takes row gq <-> dim 128w + 16 gq + i and row gq + 8 <-> dim 128w + 16 gq + 8 + i.


#pragma once

#include "attention.cuh"

constexpr int QT_ROWS = 8;
// How far (log2 units) a tile's scores may pass the running max before it moves.
constexpr float QT_MAX_SLACK = 8.f;
constexpr int QT_KEYS = 16;

template <typename T>
__device__ __forceinline__ uint32_t qt_pack(float a, float b) {
    if constexpr (std::is_same<T, __half>::value) {
        const __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<const uint32_t*>(&h);
    } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<const uint32_t*>(&h);
    }
}

// Transposes the 8x8 16-bit matrix held as (row gq, cols 2tq, 2tq + 1) by the warp's lanes.
__device__ __forceinline__ uint32_t qt_transpose(uint32_t x) {
    uint32_t r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}


// (s * c0 + b0, s' * c1 + b1) for an exact code pair `c` (two T values), rounded once.
template <typename T>
__device__ __forceinline__ uint32_t qt_affine(uint32_t c, uint32_t s2, uint32_t b2) {
    using T2 = typename Half2Of<T>::type;
    const T2 v = __hfma2(*reinterpret_cast<const T2*>(&c), *reinterpret_cast<const T2*>(&s2),
                         *reinterpret_cast<const T2*>(&b2));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// A T pair (low half first) as two f32.
template <typename T>
__device__ __forceinline__ float2 pair_to_float2(uint32_t x) {
    if constexpr (std::is_same<T, __half>::value) {
        return __half22float2(*reinterpret_cast<const __half2*>(&x));
    } else {
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
    }
}

// The pairwise product of two T pairs, rounded once.
template <typename T>
__device__ __forceinline__ uint32_t qt_mul2(uint32_t a, uint32_t b) {
    using T2 = typename Half2Of<T>::type;
    const T2 v = __hmul2(*reinterpret_cast<const T2*>(&a), *reinterpret_cast<const T2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Byte `k` of `x` (an 8-bit code) as f32, exact (magic-number conversion).
__device__ __forceinline__ float qt_byte_f(uint32_t x, uint32_t k) {
    return __uint_as_float(__byte_perm(x, 0x4B00u, 0x5440u | k)) - 8388608.f;
}

// Byte kb of a and byte kb of b (8-bit codes) dequantized with the scale and bias pairs.
template <typename T>
__device__ __forceinline__ uint32_t qt_byte_deq(uint32_t a, uint32_t b, uint32_t kb, uint32_t s2,
                                                uint32_t b2) {
    if constexpr (std::is_same<T, __half>::value) {
        // 1024 + c as f16 is 0x64cc: the code goes in the low byte.
        const uint32_t x = __byte_perm(a, b, kb | ((4 + kb) << 4));
        return dequant_pair<T>(__byte_perm(x, 0x64u, 0x4140u), s2, b2);
    } else {
        // bf16 holds 0..255 exactly, but no magic offset leaves them exact: convert via f32.
        return qt_affine<T>(qt_pack<T>(qt_byte_f(a, kb), qt_byte_f(b, kb)), s2, b2);
    }
}

template <typename T>
__device__ __forceinline__ uint32_t qt_pair_of(T a, T b) {
    return (uint32_t)*reinterpret_cast<const uint16_t*>(&a) |
           ((uint32_t)*reinterpret_cast<const uint16_t*>(&b) << 16);
}

// One tile's loads for one lane: K codes of keys gq, gq + 8 (32 dims each), V codes of keys
// 2tq, 2tq + 1, 2tq + 8, 2tq + 9 (16 dims each), their scales and biases, the score keys'
// positions and whether they exist.
// FV (folded scales, `qt_value_frag_folded`, `qt_fold_scores`): k[a] holds the lane's two
// runs of 16 dims, v[b] its two runs of 8, and ksw/kbw/vsw/vbw the scales and biases of both
// runs' groups (adjacent: groups of 64) in place of ks/kb/vs/vb.
template <typename T, int BITS, bool FV = false>
struct QtTile {
    uint32_t k[2][BITS];
    uint32_t v[4][BITS / 2];
    T ks[FV ? 1 : 2], kb[FV ? 1 : 2], vs[FV ? 1 : 4], vb[FV ? 1 : 4];
    uint32_t ksw[FV ? 2 : 1], kbw[FV ? 2 : 1], vsw[FV ? 4 : 1], vbw[FV ? 4 : 1];
    uint32_t pos[2];
    bool in[2];
};

// Loads one tile. The pointers address the lane's own keys in the tile (K: key gq, V: key 2tq)
// at the lane's dims (K: 32 from the score dims, V: 16 from the output dims) and groups; the
// lane's other keys are whole key strides further. `lastr` is the last key of the tile that
// exists (15 unless the split ends inside it): the lane's keys past it read key `lastr` again,
// which is real data, and are masked.
template <typename T, int BITS, bool FV = false>
__device__ __forceinline__ void qt_load(QtTile<T, BITS, FV>& tl, const QsdpaParams& p,
                                        const uint32_t* __restrict__ positions, int jt,
                                        int lastr, const uint32_t* __restrict__ kcl,
                                        const uint32_t* __restrict__ vcl,
                                        const T* __restrict__ ksl, const T* __restrict__ kbl,
                                        const T* __restrict__ vsl, const T* __restrict__ vbl,
                                        int ksk, int vsk, int kssk, int vssk, int gq, int tq) {
    constexpr bool DENSE = BITS == 16;
    const bool full = lastr == QT_KEYS - 1;  // uniform: no key of the tile is clamped
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int r = gq + 8 * a;
        tl.in[a] = r <= lastr;
        // Keys after the lane's own: 8a, or (clamped) rc - gq.
        const int d = full ? 8 * a : min(r, lastr) - gq;
        if constexpr (FV) {
            // The lane's two runs of 16 dims are 64 dims (8 words) apart.
            load_words<2>(kcl + d * ksk, tl.k[a]);
            load_words<2>(kcl + d * ksk + 8, tl.k[a] + 2);
            tl.ksw[a] = *reinterpret_cast<const uint32_t*>(ksl + d * kssk);
            tl.kbw[a] = *reinterpret_cast<const uint32_t*>(kbl + d * kssk);
        } else {
            load_words<BITS>(kcl + d * ksk, tl.k[a]);
        }
        tl.pos[a] = key_pos(p, positions, jt + gq + d);
        if constexpr (!DENSE && !FV) {
            tl.ks[a] = ksl[d * kssk];
            tl.kb[a] = kbl[d * kssk];
        }
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        const int o = (b & 1) + 8 * (b >> 1);
        const int d = full ? o : min(2 * tq + o, lastr) - 2 * tq;
        if constexpr (FV) {
            // The lane's two runs of 8 dims are 64 dims (8 words) apart; their groups'
            // scales (and biases) are adjacent, 4-byte aligned (`scales_stageable`).
            tl.v[b][0] = vcl[d * vsk];
            tl.v[b][1] = vcl[d * vsk + 8];
            tl.vsw[b] = *reinterpret_cast<const uint32_t*>(vsl + d * vssk);
            tl.vbw[b] = *reinterpret_cast<const uint32_t*>(vbl + d * vssk);
        } else {
            load_words<BITS / 2>(vcl + d * vsk, tl.v[b]);
        }
        if constexpr (!DENSE && !FV) {
            tl.vs[b] = vsl[d * vssk];
            tl.vb[b] = vbl[d * vssk];
        }
    }
}

// Where a whole tile's other keys lie from the lane's own (K: key gq + 8; V: keys 2tq + 1,
// 2tq + 8, 2tq + 9), in code words and in scale elements: set once a block, so a whole
// tile's loads take no per-key clamping or stride products.
struct QtWholeOffsets {
    int k8, ks8;
    int v[3], vs[3];
    __device__ __forceinline__ QtWholeOffsets(int ksk, int kssk, int vsk, int vssk)
        : k8(8 * ksk), ks8(8 * kssk), v{vsk, 8 * vsk, 9 * vsk}, vs{vssk, 8 * vssk, 9 * vssk} {}
};

// `qt_load` (folded scales) for a tile whose 16 keys all exist in the split.
template <typename T, int BITS, bool FV>
__device__ __forceinline__ void qt_load_whole(QtTile<T, BITS, FV>& tl, const QsdpaParams& p,
                                              const uint32_t* __restrict__ positions, int jt,
                                              const QtWholeOffsets& o,
                                              const uint32_t* __restrict__ kcl,
                                              const uint32_t* __restrict__ vcl,
                                              const T* __restrict__ ksl, const T* __restrict__ kbl,
                                              const T* __restrict__ vsl, const T* __restrict__ vbl,
                                              int gq) {
    static_assert(FV, "whole-tile loads are the folded kernels'");
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int off = a ? o.k8 : 0, soff = a ? o.ks8 : 0;
        tl.in[a] = true;
        load_words<2>(kcl + off, tl.k[a]);
        load_words<2>(kcl + off + 8, tl.k[a] + 2);
        tl.pos[a] = key_pos(p, positions, jt + gq + 8 * a);
        tl.ksw[a] = *reinterpret_cast<const uint32_t*>(ksl + soff);
        tl.kbw[a] = *reinterpret_cast<const uint32_t*>(kbl + soff);
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        const int off = b ? o.v[b - 1] : 0, soff = b ? o.vs[b - 1] : 0;
        tl.v[b][0] = vcl[off];
        tl.v[b][1] = vcl[off + 8];
        tl.vsw[b] = *reinterpret_cast<const uint32_t*>(vsl + soff);
        tl.vbw[b] = *reinterpret_cast<const uint32_t*>(vbl + soff);
    }
}

// A fragment of the score mma, k-step s (16 of the warp's 128 dims): keys gq (regs 0, 2) and
// gq + 8 (regs 1, 3), in the order `qt_query_frags` gives the queries.
template <typename T, int BITS, bool FV>
__device__ __forceinline__ void qt_key_frag(const QtTile<T, BITS, FV>& tl, int s, uint32_t* a) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        uint32_t lo, hi;
        if constexpr (FV) {
            // The codes as exact (MAGIC + c): `qt_fold_scores` applies the scales.
            const uint32_t x = tl.k[r][s >> 1] >> (8 * (s & 1));
            lo = qt_nibbles<T>(x);
            hi = qt_nibbles<T>(x >> 4);
        } else if constexpr (BITS == 4) {
            // Word s/2 holds dims 8(s/2) .. +7; pair p = nibbles (p, p + 4).
            const uint32_t x = tl.k[r][s >> 1] >> (8 * (s & 1));
            lo = dequant_pair<T>(qt_nibbles<T>(x), splat(tl.ks[r]), splat(tl.kb[r]));
            hi = dequant_pair<T>(qt_nibbles<T>(x >> 4), splat(tl.ks[r]), splat(tl.kb[r]));
        } else if constexpr (BITS == 8) {
            // Word s holds dims 4s .. 4s + 3: pairs (byte 0, byte 2), (byte 1, byte 3).
            const uint32_t x = tl.k[r][s];
            lo = qt_byte_deq<T>(x, x >> 16, 0, splat(tl.ks[r]), splat(tl.kb[r]));
            hi = qt_byte_deq<T>(x, x >> 16, 1, splat(tl.ks[r]), splat(tl.kb[r]));
        } else {
            lo = tl.k[r][2 * s];
            hi = tl.k[r][2 * s + 1];
        }
        a[r] = lo;
        a[r + 2] = hi;
    }
}

// The B fragments of the score mma for one lane: query row gq at dims [c0, c0 + 32), permuted
// as `qt_key_frag` pairs the key's dims. Rows past the block's end are zero.
// FV: the lane's dims are two runs of 16, 64 apart.
template <typename T, int BITS, bool FV = false>
__device__ __forceinline__ void qt_query_frags(const T* __restrict__ qr, bool ok,
                                               uint32_t (*qb)[2]) {
    uint32_t u[16];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const T* at = FV && c >= 2 ? qr + 48 : qr;
        uint4 v = ok ? reinterpret_cast<const uint4*>(at)[c] : make_uint4(0u, 0u, 0u, 0u);
        u[4 * c] = v.x; u[4 * c + 1] = v.y; u[4 * c + 2] = v.z; u[4 * c + 3] = v.w;
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        if constexpr (BITS == 4) {
            // Step s: dims 8j + 2h + (0, 4) and 8j + 2h + (1, 5), j = s / 2, h = s % 2.
            const int j = s >> 1, h = s & 1;
            qb[s][0] = __byte_perm(u[4 * j + h], u[4 * j + h + 2], 0x5410);
            qb[s][1] = __byte_perm(u[4 * j + h], u[4 * j + h + 2], 0x7632);
        } else if constexpr (BITS == 8) {
            // Step s: dims 4s + (0, 2) and 4s + (1, 3).
            qb[s][0] = __byte_perm(u[2 * s], u[2 * s + 1], 0x5410);
            qb[s][1] = __byte_perm(u[2 * s], u[2 * s + 1], 0x7632);
        } else {
            qb[s][0] = u[2 * s];
            qb[s][1] = u[2 * s + 1];
        }
    }
}

// A fragment of the output mma, m-tile i: V^T at dims (16 gq + i, 16 gq + 8 + i) of the lane's
// run, keys (2tq, 2tq + 1) in regs 0/1 and (2tq + 8, 2tq + 9) in regs 2/3.
template <typename T, int BITS, bool FV>
__device__ __forceinline__ void qt_value_frag(const QtTile<T, BITS, FV>& tl, const uint32_t* vs2,
                                              const uint32_t* vb2, int i, uint32_t* a) {
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int d = 8 * half + i;  // dim within the lane's 16
            uint32_t r;
            if constexpr (BITS == 4) {
                const uint32_t wa = tl.v[2 * kp][half], wb = tl.v[2 * kp + 1][half];
                // Nibble i of both words into one 16-bit lane each.
                const uint32_t xy = __byte_perm(wa, wb, i < 4 ? 0x5410 : 0x7632) >> (4 * (i & 3));
                r = dequant_pair<T>(qt_nibbles<T>(xy), vs2[kp], vb2[kp]);
            } else if constexpr (BITS == 8) {
                const uint32_t wa = tl.v[2 * kp][d >> 2], wb = tl.v[2 * kp + 1][d >> 2];
                r = qt_byte_deq<T>(wa, wb, d & 3, vs2[kp], vb2[kp]);
            } else {
                const uint32_t wa = tl.v[2 * kp][d >> 1], wb = tl.v[2 * kp + 1][d >> 1];
                r = __byte_perm(wa, wb, (d & 1) ? 0x7632 : 0x5410);
            }
            a[half + 2 * kp] = r;
        }
    }
}

// Folded key scales (FV): the score mma took the codes as exact (MAGIC + c) over each run of the
// lane's dims (sc: run 0, sd: run 1), so a key's partial score is
//   sum_r s_r (C_r - MAGIC Q_r) + b_r Q_r = sum_r s_r C_r + (b_r - MAGIC s_r) Q_r
// with Q_r the run's query sum; in f32, so only the scale and bias roundings stay. Writes sc.
template <typename T>
__device__ __forceinline__ void qt_fold_scores(const uint32_t* ksw, const uint32_t* kbw,
                                               const float (*qsum)[2], float* sc,
                                               const float* sd) {
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const float2 sf = pair_to_float2<T>(ksw[a]), bf = pair_to_float2<T>(kbw[a]);
        const float b0 = fmaf(-MmaMagic<T>::MAGIC_F, sf.x, bf.x);
        const float b1 = fmaf(-MmaMagic<T>::MAGIC_F, sf.y, bf.y);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int i = 2 * a + c;
            sc[i] = fmaf(sf.x, sc[i], fmaf(b0, qsum[0][c], fmaf(sf.y, sd[i], b1 * qsum[1][c])));
        }
    }
}

// Folded values (FV: 4-bit codes, groups of 64): the output mma reads the codes as
// exact (MAGIC + c) and the group scales ride on P instead, so no value is dequantized:
//   sum_k p_k (s_k c_k + b_k) = sum_k (MAGIC + c_k) (p_k s_k) + sum_k (b_k p_k - MAGIC (p_k s_k)),
// the last sum (one number a group and query row) accumulated by three small mma on the side
// with the same rounded p_k s_k, so the MAGIC terms cancel exactly. An m-tile must then lie in
// one group: lane gq reads dims [8 gq, + 8) and [64 + 8 gq, + 8) of the warp's 128 (runs 0 and
// 1); m-tile i takes run i / 4, row gq <-> its dim 2 (i % 4) and row gq + 8 <-> the next.
template <typename T, int BITS, bool FV>
__device__ __forceinline__ void qt_value_frag_folded(const QtTile<T, BITS, FV>& tl, int i,
                                                     uint32_t* a) {
    static_assert(BITS == 4 && FV, "folded values are for 4-bit codes");
    const int r = i >> 2, j = i & 3;
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const uint32_t wa = tl.v[2 * kp][r], wb = tl.v[2 * kp + 1][r];
            // Nibble 2j + half of both words into one 16-bit lane each.
            const uint32_t xy =
                __byte_perm(wa, wb, j < 2 ? 0x5410 : 0x7632) >> (8 * (j & 1) + 4 * half);
            a[half + 2 * kp] = qt_nibbles<T>(xy);
        }
    }
}

// Staged tiles (STAGES > 0): the block copies each tile's K/V codes, scales and biases into
// shared memory with cp.async, STAGES - 1 tiles ahead of the one it computes, so the bytes in
// flight do not cost registers; lanes then read their fragments' words from the stage as they
// would from the cache. A stage holds QT_KEYS keys: K codes, V codes (the whole head dim,
// key-major), then K scales, K biases, V scales, V biases (sized for groups of 32, the
// smallest; `ng` groups a key are used).
template <int HD, int BITS>
__host__ __device__ constexpr int qt_stage_bytes() {
    return QT_KEYS * (2 * HD * BITS / 8 + 4 * (HD / 32) * 2);
}

__device__ __forceinline__ void qt_cp16(void* dst, const void* src) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src));
}

__device__ __forceinline__ void qt_cp4(void* dst, const void* src) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(src));
}

__device__ __forceinline__ void qt_cp_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void qt_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// The stage's parts: codes as words, scales/biases as T, `ng` groups a key.
template <typename T, int HD, int BITS>
struct QtStage {
    static constexpr int ROWW = HD * BITS / 32;  // code words a key
    uint32_t* kc;
    uint32_t* vc;
    T* ks;
    T* kb;
    T* vs;
    T* vb;
    __device__ __forceinline__ QtStage(uint8_t* base, int ng, int keys) {
        kc = reinterpret_cast<uint32_t*>(base);
        vc = kc + keys * ROWW;
        ks = reinterpret_cast<T*>(vc + keys * ROWW);
        kb = ks + keys * ng;
        vs = kb + keys * ng;
        vb = vs + keys * ng;
    }
};

// Copies keys [jt, jt + nk) of head g into a stage: codes in 16-byte chunks, scales and biases
// in 4-byte ones (a key's `ng` values, an even count; the host checks the alignment).
template <typename T, int HD, int BITS>
__device__ __forceinline__ void qt_stage_copy(const QtStage<T, HD, BITS>& st, const QsdpaParams& p,
                                              int g, int jt, int nk,
                                              const uint32_t* __restrict__ kc,
                                              const T* __restrict__ ks, const T* __restrict__ kb,
                                              const uint32_t* __restrict__ vc,
                                              const T* __restrict__ vs, const T* __restrict__ vb) {
    constexpr int ROWW = QtStage<T, HD, BITS>::ROWW, ROWC = ROWW / 4;
    const int nt = blockDim.x;
    const uint32_t* kg = kc + g * p.k_codes_sh + (size_t)jt * p.k_codes_sk;
    const uint32_t* vg = vc + g * p.v_codes_sh + (size_t)jt * p.v_codes_sk;
    for (int c = threadIdx.x; c < nk * ROWC; c += nt) {
        const int r = c / ROWC, w = 4 * (c % ROWC);
        qt_cp16(st.kc + r * ROWW + w, kg + (size_t)r * p.k_codes_sk + w);
        qt_cp16(st.vc + r * ROWW + w, vg + (size_t)r * p.v_codes_sk + w);
    }
    const int ng = HD / (int)p.group_size, pw = ng / 2;  // 4-byte words a key's scales
    const size_t k0 = g * p.k_sc_sh + (size_t)jt * p.k_sc_sk;
    const size_t v0 = g * p.v_sc_sh + (size_t)jt * p.v_sc_sk;
    for (int c = threadIdx.x; c < nk * pw; c += nt) {
        const int r = c / pw, w = 2 * (c % pw);
        qt_cp4(st.ks + r * ng + w, ks + k0 + r * p.k_sc_sk + w);
        qt_cp4(st.kb + r * ng + w, kb + k0 + r * p.k_sc_sk + w);
        qt_cp4(st.vs + r * ng + w, vs + v0 + r * p.v_sc_sk + w);
        qt_cp4(st.vb + r * ng + w, vb + v0 + r * p.v_sc_sk + w);
    }
}

// Asks L2 for keys [jt, jt + nk) of head g (codes, scales and biases), one request a
// 128-byte line shared out over the block's threads; no registers wait for them.
template <typename T, int HD, int BITS>
__device__ __forceinline__ void qt_prefetch_keys(const QsdpaParams& p, int g, int jt, int nk,
                                                 const uint32_t* __restrict__ kc,
                                                 const T* __restrict__ ks,
                                                 const T* __restrict__ kb,
                                                 const uint32_t* __restrict__ vc,
                                                 const T* __restrict__ vs,
                                                 const T* __restrict__ vb) {
    auto pf = [](const void* a) { asm volatile("prefetch.global.L2 [%0];" ::"l"(a)); };
    constexpr int LINES = (HD * BITS / 8 + 127) / 128;  // lines of one key's codes
    const int t = threadIdx.x, nt = blockDim.x;
    for (int c = t; c < 2 * nk * LINES; c += nt) {
        const int r = (c / LINES) % nk, l = c % LINES;
        const uint32_t* row = c < nk * LINES
                                  ? kc + g * p.k_codes_sh + (size_t)(jt + r) * p.k_codes_sk
                                  : vc + g * p.v_codes_sh + (size_t)(jt + r) * p.v_codes_sk;
        pf(row + 32 * l);
    }
    if constexpr (BITS != 16) {
        // Scales and biases: the lines of the first and the last key of each array.
        if (t < 8) {
            const int key = jt + ((t & 1) ? nk - 1 : 0);
            const T* arr = (t >> 1) == 0   ? ks + g * p.k_sc_sh + (size_t)key * p.k_sc_sk
                           : (t >> 1) == 1 ? kb + g * p.k_sc_sh + (size_t)key * p.k_sc_sk
                           : (t >> 1) == 2 ? vs + g * p.v_sc_sh + (size_t)key * p.v_sc_sk
                                           : vb + g * p.v_sc_sh + (size_t)key * p.v_sc_sk;
            pf(arr);
        }
    }
}
