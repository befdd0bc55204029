// Tensor-core attention over packed (4/8-bit) or dense (16-bit) K/V for f16/bf16 queries at
// head dims 256 and 512. Included by qkernels.cu after the CUDA-core kernel (it shares
// QsdpaParams, key_pos, load_words, mma_16816, MmaMagic and dequant_pair) and writes the same
// partials, so `qsdpa_combine` merges its key splits.
//
// One block = one KV head x 8 query rows (the N of mma.m16n8k16; rows ordered (query index,
// head in group) as in the CUDA-core kernel) x one key split, HD/128 warps. The block walks its
// keys in tiles of 16. Warp w owns head dims [128w, 128w + 128):
// * scores: S (16 keys x 8 rows) = K Q^T over the warp's dims, summed over the warps through
//   shared memory, so every warp holds the whole S and runs the same online softmax;
// * output: O^T (the warp's 128 dims x 8 rows) += V^T P^T, P moved from the score fragment to
//   the B fragment with movmatrix.
// Tiles reach the registers one of two ways (`tc_staging` in launch.rs picks per head dim and
// bit width): each lane loads its next tile's words from the cache while it computes the
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

template <typename T, int HD, int BITS, int STAGES = 0, int NTS = 1, bool ENTRY = false,
          bool FV = false>
__device__ __forceinline__ void qsdpa_tc_body(const QsdpaParams& p, const T* __restrict__ q,
                                              const uint32_t* __restrict__ kc,
                                              const T* __restrict__ ks, const T* __restrict__ kb,
                                              const uint32_t* __restrict__ vc,
                                              const T* __restrict__ vs, const T* __restrict__ vb,
                                              const uint32_t* __restrict__ positions,
                                              T* __restrict__ out, float* __restrict__ part_ml,
                                              float* __restrict__ part_acc, const int split,
                                              const uint64_t settled = 0) {
    constexpr bool DENSE = BITS == 16;
    constexpr int NWARP = HD / 128;
    static_assert(!FV || (BITS == 4 && STAGES == 0), "folded scales: 4-bit tiles in registers");
    using Tile = QtTile<T, BITS, FV>;
    __shared__ float4 xs[2][NWARP][NTS][32];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    const int g = blockIdx.y;
    const int group = p.n_heads / p.kv_heads;
    const int rows = group * p.q_len;
    const int row0 = blockIdx.x * QT_ROWS;

    // Score dims of this lane: 32 from kd0, or (FV) 16 from kd0 and 16 from kd0 + 64.
    const int kd0 = 128 * warp + (FV ? 16 : 32) * tq;
    // Output dims of this lane: 16 from vd0, or (FV) 8 from vd0 and 8 from vd0 + 64.
    const int vd0 = 128 * warp + (FV ? 8 : 16) * gq;
    // The queries' B fragments, read once the first tile's loads are issued (`load_queries`):
    // the two reads' latencies then overlap at the block's start.
    uint32_t qb[8][2];
    float qsum[2][2];  // FV: run r's query sum of row 2tq + c
    auto load_queries = [&] {
        const int r = row0 + gq;
        const bool ok = r < rows;
        const int qi = ok ? r / group : 0, head = g * group + (ok ? r % group : 0);
        qt_query_frags<T, BITS, FV>(q + ((size_t)head * p.q_len + qi) * HD + kd0, ok, qb);
        if constexpr (FV) {
            // Each run's query sums (rows 2tq, 2tq + 1), by mma against ones.
            const uint32_t ones[4] = {MmaMagic<T>::ONES, MmaMagic<T>::ONES, MmaMagic<T>::ONES,
                                      MmaMagic<T>::ONES};
            float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                mma_16816<T>(s0, ones, qb[s]);
                mma_16816<T>(s1, ones, qb[s + 4]);
            }
            qsum[0][0] = s0[0]; qsum[0][1] = s0[1];
            qsum[1][0] = s1[0]; qsum[1][1] = s1[1];
        }
    };
    // Score C fragment rows: 2tq, 2tq + 1.
    // Row c sees the keys at positions lo[c] .. lo[c] + span[c] (causal, and the sliding
    // window): one unsigned compare a key. Rows past the block's end have zero queries and are
    // never written out, so they may see keys like row 0.
    uint32_t lo[2], span[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int r = row0 + 2 * tq + c;
        const uint32_t qpos = p.q_offset + (r < rows ? r / group : 0);
        lo[c] = p.window != 0 && qpos >= p.window ? qpos - p.window + 1 : 0u;
        span[c] = qpos - lo[c];
    }

    const int2 range = split_range(p, split);
    const int j0 = range.x, j1 = range.y;
    const uint32_t* kcg = kc + g * p.k_codes_sh + (kd0 * BITS) / 32;
    const uint32_t* vcg = vc + g * p.v_codes_sh + (vd0 * BITS) / 32;
    const int kgi = DENSE ? 0 : kd0 / (int)p.group_size;
    const int vgi = DENSE ? 0 : vd0 / (int)p.group_size;
    const T* ksg = ks + g * p.k_sc_sh + kgi;
    const T* kbg = kb + g * p.k_sc_sh + kgi;
    const T* vsg = vs + g * p.v_sc_sh + vgi;
    const T* vbg = vb + g * p.v_sc_sh + vgi;

    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    // FV: the corrections, C rows 0 / 1 = runs 0 / 1 (held by lanes gq = 0 / 1), columns the
    // query rows as in acc; and the A fragments that add -MAGIC * (p s) of run 0 / 1 there.
    float cor[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t neg_magic = MmaMagic<T>::MAGIC | 0x80008000u;
    const uint32_t am0 = gq == 0 ? neg_magic : 0u, am1 = gq == 1 ? neg_magic : 0u;
    // A lane's correction row is run gq % 2 (only rows 0 and 1 are read): its biases' half.
    const uint32_t bias_half = (gq & 1) ? 0x7632u : 0x5410u;
    // Running maxima in base 2 (scores times log2 e); written out in base e for the combine.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const float scale2 = p.scale * LOG2E;

    // Strides as int: keys are at most 2^31 words apart.
    const int ksk = (int)p.k_codes_sk, vsk = (int)p.v_codes_sk;
    const int kssk = (int)p.k_sc_sk, vssk = (int)p.v_sc_sk;
    // The lane's own keys of the first tile: K key gq, V key 2tq.
    const uint32_t* kct = kcg + (size_t)(j0 + gq) * p.k_codes_sk;
    const uint32_t* vct = vcg + (size_t)(j0 + 2 * tq) * p.v_codes_sk;
    const T* kst = ksg + (size_t)(j0 + gq) * p.k_sc_sk;
    const T* kbt = kbg + (size_t)(j0 + gq) * p.k_sc_sk;
    const T* vst = vsg + (size_t)(j0 + 2 * tq) * p.v_sc_sk;
    const T* vbt = vbg + (size_t)(j0 + 2 * tq) * p.v_sc_sk;
    // Loads the tile at jt and moves the pointers to the next one.
    const QtWholeOffsets whole(ksk, kssk, vsk, vssk);
    auto load = [&](Tile& tl, int jt) {
        if constexpr (FV) {
            if (jt + QT_KEYS <= j1) {
                qt_load_whole<T, BITS, FV>(tl, p, positions, jt, whole, kct, vct, kst, kbt, vst,
                                           vbt, gq);
            } else {
                qt_load<T, BITS, FV>(tl, p, positions, jt, j1 - 1 - jt, kct, vct, kst, kbt,
                                     vst, vbt, ksk, vsk, kssk, vssk, gq, tq);
            }
        } else {
            qt_load<T, BITS, FV>(tl, p, positions, jt, min(QT_KEYS - 1, j1 - 1 - jt), kct, vct,
                                 kst, kbt, vst, vbt, ksk, vsk, kssk, vssk, gq, tq);
        }
        kct += QT_KEYS * ksk;
        vct += QT_KEYS * vsk;
        if constexpr (!DENSE) {
            kst += QT_KEYS * kssk;
            kbt += QT_KEYS * kssk;
            vst += QT_KEYS * vssk;
            vbt += QT_KEYS * vssk;
        }
    };
    // Attends NT tiles at once (`ntc`: std::integral_constant<int, NT>): their score mma
    // chains are independent, and one exchange, max reduction and rescale serve all of them.
    auto tiles = [&](auto ntc, const Tile* cur, const int par) {
        constexpr int NT = decltype(ntc)::value;
        // Partial scores over this warp's dims.
        // Two accumulators a tile halve the chain of dependent mma.
        float sc[NT][4], sd[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[n][i] = sd[n][i] = 0.f;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                uint32_t a[4];
                qt_key_frag<T, BITS, FV>(cur[n], s, a);
                // FV: runs 0 and 1 (steps 0-3 and 4-7) apart, for their scales.
                mma_16816<T>((FV ? s >= 4 : (s & 1)) ? sd[n] : sc[n], a, qb[s]);
            }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            if constexpr (FV) {
                qt_fold_scores<T>(cur[n].ksw, cur[n].kbw, qsum, sc[n], sd[n]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) sc[n][i] += sd[n][i];
            }
        }
        if constexpr (NWARP > 1) {
#pragma unroll
            for (int n = 0; n < NT; ++n)
                xs[par][warp][n][lane] = make_float4(sc[n][0], sc[n][1], sc[n][2], sc[n][3]);
            __syncthreads();
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                if constexpr (NWARP == 2) {
                    // Own partial plus the other warp's: both warps add the same two numbers.
                    const float4 o = xs[par][warp ^ 1][n][lane];
                    sc[n][0] += o.x; sc[n][1] += o.y; sc[n][2] += o.z; sc[n][3] += o.w;
                } else {
                    // One order of the warps' partials for all, so every warp's scores agree.
                    float4 t = xs[par][0][n][lane];
#pragma unroll
                    for (int w = 1; w < NWARP; ++w) {
                        const float4 o = xs[par][w][n][lane];
                        t.x += o.x; t.y += o.y; t.z += o.z; t.w += o.w;
                    }
                    sc[n][0] = t.x; sc[n][1] = t.y; sc[n][2] = t.z; sc[n][3] = t.w;
                }
            }
        }
        // Scale and mask: sc[n][2a + c] is key gq + 8a of tile n, row 2tq + c.
        float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int a = 0; a < 2; ++a) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const bool vis = cur[n].in[a] && cur[n].pos[a] - lo[c] <= span[c];
                    const float v = vis ? sc[n][2 * a + c] * scale2 : -INFINITY;
                    sc[n][2 * a + c] = v;
                    tmax[c] = fmaxf(tmax[c], v);
                }
            }
        }
        // `ms`: the new maximum, or 0 while a row has seen no key (its scores are all -inf, and
        // 2^(-inf - 0) = 0 where -inf - -inf would be NaN).
        float corr[2], ms[2];
        // The running max moves only when some score of the tile passes it by more than
        // QT_MAX_SLACK (log2 units): below that the tile's weights stay at most 2^QT_MAX_SLACK
        // against the kept max, and one vote replaces the lanes' max reduction and rescale.
        if (__any_sync(0xffffffffu, tmax[0] > m[0] + QT_MAX_SLACK ||
                                        tmax[1] > m[1] + QT_MAX_SLACK)) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
#pragma unroll
                for (int off = 4; off < 32; off <<= 1)
                    tmax[c] = fmaxf(tmax[c], __shfl_xor_sync(0xffffffffu, tmax[c], off));
                const float mn = fmaxf(m[c], tmax[c]);
                corr[c] = mn == -INFINITY ? 1.f : fast_exp2(m[c] - mn);
                ms[c] = mn == -INFINITY ? 0.f : mn;
                m[c] = mn;
            }
        } else {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                corr[c] = 1.f;
                ms[c] = m[c] == -INFINITY ? 0.f : m[c];
            }
        }
        float pr[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int a = 0; a < 2; ++a) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    pr[n][2 * a + c] = fast_exp2(sc[n][2 * a + c] - ms[c]);
                }
            }
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float add = 0.f;
#pragma unroll
            for (int n = 0; n < NT; ++n) add += pr[n][c] + pr[n][2 + c];
            l[c] = fmaf(l[c], corr[c], add);
        }
        // Rescale only when a running max grew (rare once it settles).
        if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc[i][0] *= corr[0]; acc[i][1] *= corr[1];
                acc[i][2] *= corr[0]; acc[i][3] *= corr[1];
            }
            if constexpr (FV) {
                cor[0] *= corr[0]; cor[1] *= corr[1];
            }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            // P^T as the B fragment of the output mma: (keys 2tq, 2tq + 1 | + 8, row gq).
            const uint32_t pb[2] = {qt_transpose(qt_pack<T>(pr[n][0], pr[n][1])),
                                    qt_transpose(qt_pack<T>(pr[n][2], pr[n][3]))};
            if constexpr (FV) {
                // P scaled by each run's group scales (keys as in pb), one rounding.
                uint32_t pbs[2][2], ab[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int kp = 0; kp < 2; ++kp) {
                    const uint32_t sa = cur[n].vsw[2 * kp], sb = cur[n].vsw[2 * kp + 1];
                    pbs[0][kp] = qt_mul2<T>(pb[kp], __byte_perm(sa, sb, 0x5410));
                    pbs[1][kp] = qt_mul2<T>(pb[kp], __byte_perm(sa, sb, 0x7632));
                    ab[2 * kp] = __byte_perm(cur[n].vbw[2 * kp], cur[n].vbw[2 * kp + 1], bias_half);
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    uint32_t a[4];
                    qt_value_frag_folded<T, BITS, FV>(cur[n], i, a);
                    mma_16816<T>(acc[i], a, pbs[i >> 2]);
                }
                const uint32_t a0[4] = {am0, 0u, am0, 0u}, a1[4] = {am1, 0u, am1, 0u};
                mma_16816<T>(cor, ab, pb);
                mma_16816<T>(cor, a0, pbs[0]);
                mma_16816<T>(cor, a1, pbs[1]);
                continue;
            }
            uint32_t vs2[2], vb2[2];
            if constexpr (DENSE) {
                vs2[0] = vs2[1] = vb2[0] = vb2[1] = 0u;
            } else {
                vs2[0] = qt_pair_of(cur[n].vs[0], cur[n].vs[1]);
                vs2[1] = qt_pair_of(cur[n].vs[2], cur[n].vs[3]);
                vb2[0] = qt_pair_of(cur[n].vb[0], cur[n].vb[1]);
                vb2[1] = qt_pair_of(cur[n].vb[2], cur[n].vb[3]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                uint32_t a[4];
                qt_value_frag<T, BITS, FV>(cur[n], vs2, vb2, i, a);
                mma_16816<T>(acc[i], a, pb);
            }
        }
    };
    auto tile = [&](const Tile& cur, const int par) {
        tiles(std::integral_constant<int, 1>(), &cur, par);
    };
    // Single-sequence kernels (ENTRY) wait for the kernel ahead after the loads of the keys
    // they read first when those are settled (no running kernel writes them), else before
    // them too (a second wait returns at once). The queries come after the wait either way.
    constexpr int FIRST_KEYS = STAGES > 0 ? (STAGES - 1) * NTS * QT_KEYS : QT_KEYS;
    // `settled`: keys settled_lo | settled_hi << 32 (`SeqPlan::settled` in launch.rs).
    // Whether keys [j0, end) are all settled.
    auto settled_to = [&](int end) {
        return (uint32_t)j0 >= (uint32_t)settled && (uint32_t)end <= (uint32_t)(settled >> 32);
    };
    if (ENTRY && !settled_to(min(j0 + FIRST_KEYS, j1))) pdl_wait();
    // Packed keys [jt, jt + n) (clipped to the split) into L2 before the wait, where settled.
    auto prefetch_settled = [&](int jt, int n) {
        const int je = min(jt + n, j1);
        if (jt < je && settled_to(je))
            qt_prefetch_keys<T, HD, BITS>(p, g, jt, je - jt, kc, ks, kb, vc, vs, vb);
    };
    if constexpr (STAGES > 0) {
        static_assert(!DENSE && STAGES >= 2, "staged tiles are for packed K/V");
        extern __shared__ __align__(16) uint8_t qt_stages[];
        constexpr int SK = NTS * QT_KEYS;  // keys a stage
        constexpr int SB = NTS * qt_stage_bytes<HD, BITS>();
        constexpr int ROWW = QtStage<T, HD, BITS>::ROWW;
        const int ng = HD / (int)p.group_size;
        const int nsteps = j1 > j0 ? (j1 - j0 + SK - 1) / SK : 0;
        auto stage = [&](int t) {
            return QtStage<T, HD, BITS>(qt_stages + (t % STAGES) * SB, ng, SK);
        };
        auto copy = [&](int t) {
            if (t < nsteps) {
                const int jt = j0 + t * SK;
                qt_stage_copy<T, HD, BITS>(stage(t), p, g, jt, min(SK, j1 - jt), kc, ks, kb, vc,
                                           vs, vb);
            }
            qt_cp_commit();  // empty groups too: the wait below counts groups
        };
#pragma unroll
        for (int t = 0; t < STAGES - 1; ++t) copy(t);
        if constexpr (ENTRY) pdl_entry();
        load_queries();
        int par = 0;
        for (int t = 0; t < nsteps; ++t) {
            qt_cp_wait<STAGES - 2>();
            __syncthreads();  // step t is in for every thread; stage (t - 1) % STAGES is free
            const QtStage<T, HD, BITS> st = stage(t);
            const int jt = j0 + t * SK, nk = min(SK, j1 - jt);
            Tile cur[NTS];
#pragma unroll
            for (int n = 0; n < NTS; ++n) {
                if (n * QT_KEYS < nk) {
                    const int r = n * QT_KEYS;
                    qt_load<T, BITS>(cur[n], p, positions, jt + r, min(QT_KEYS - 1, nk - 1 - r),
                                     st.kc + (r + gq) * ROWW + (kd0 * BITS) / 32,
                                     st.vc + (r + 2 * tq) * ROWW + (vd0 * BITS) / 32,
                                     st.ks + (r + gq) * ng + kgi, st.kb + (r + gq) * ng + kgi,
                                     st.vs + (r + 2 * tq) * ng + vgi,
                                     st.vb + (r + 2 * tq) * ng + vgi, ROWW, ROWW, ng, ng, gq, tq);
                }
            }
            copy(t + STAGES - 1);
            if constexpr (NTS == 2) {
                if (nk > QT_KEYS) {
                    tiles(std::integral_constant<int, 2>(), cur, par);
                } else {
                    tile(cur[0], par);
                }
            } else {
                tile(cur[0], par);
            }
            par ^= 1;
        }
    } else {
        // Two tile buffers in turn: the next tile's loads are in flight during this one's
        // math (deeper register pipelines cost blocks and ran slower). `par` alternates the
        // score exchange buffer from tile to tile.
        constexpr int NB = 2;
        Tile tb[NB];
#pragma unroll
        for (int b = 0; b < NB - 1; ++b)
            if (j0 + b * QT_KEYS < j1) load(tb[b], j0 + b * QT_KEYS);
        if constexpr (ENTRY) {
            // Dense kernels measured slower with it (h100-s24-attn-prefetch.md).
            if constexpr (!DENSE) prefetch_settled(j0 + QT_KEYS, QT_KEYS);
            pdl_entry();
        }
        load_queries();
        int par = 0;
        for (int jt = j0; jt < j1; jt += NB * QT_KEYS) {
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const int jc = jt + b * QT_KEYS;
                if (jc < j1) {
                    const int jn = jc + (NB - 1) * QT_KEYS;
                    if (jn < j1) load(tb[(b + NB - 1) % NB], jn);
                    tile(tb[b], par);
                    par ^= 1;
                }
            }
        }
    }

    if constexpr (FV) {
        // Each run's correction (from lane gq = run, same tq) into its dims.
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float b0 = __shfl_sync(0xffffffffu, cor[c], tq);
            const float b1 = __shfl_sync(0xffffffffu, cor[c], 4 + tq);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc[i][c] += i < 4 ? b0 : b1;
                acc[i][2 + c] += i < 4 ? b0 : b1;
            }
        }
    }
    // Row sums over the lanes that share rows (same tq).
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) l[c] += __shfl_xor_sync(0xffffffffu, l[c], off);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int r = row0 + 2 * tq + c;
        if (r >= rows) continue;
        const int grow = g * rows + r;
        if (p.n_split == 1) {
            const int qi = r / group, head = g * group + r % group;
            const float inv = l[c] > 0.f ? 1.f / l[c] : 0.f;
            T* o = out + ((size_t)head * p.q_len + qi) * HD + vd0;
            if constexpr (FV) {
                // Run r: dims vd0 + 64 r + n, n = 2j + h <-> acc[4r + j][2h + c].
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    uint4 w;
                    w.x = qt_pack<T>(acc[4 * r][c] * inv, acc[4 * r][2 + c] * inv);
                    w.y = qt_pack<T>(acc[4 * r + 1][c] * inv, acc[4 * r + 1][2 + c] * inv);
                    w.z = qt_pack<T>(acc[4 * r + 2][c] * inv, acc[4 * r + 2][2 + c] * inv);
                    w.w = qt_pack<T>(acc[4 * r + 3][c] * inv, acc[4 * r + 3][2 + c] * inv);
                    *reinterpret_cast<uint4*>(o + 64 * r) = w;
                }
                continue;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                uint4 w;
                w.x = qt_pack<T>(acc[0][2 * h + c] * inv, acc[1][2 * h + c] * inv);
                w.y = qt_pack<T>(acc[2][2 * h + c] * inv, acc[3][2 * h + c] * inv);
                w.z = qt_pack<T>(acc[4][2 * h + c] * inv, acc[5][2 * h + c] * inv);
                w.w = qt_pack<T>(acc[6][2 * h + c] * inv, acc[7][2 * h + c] * inv);
                *reinterpret_cast<uint4*>(o + 8 * h) = w;
            }
        } else {
            const size_t prow = (size_t)split * p.kv_heads * rows + grow;
            float* o = part_acc + prow * HD + vd0;
            if constexpr (FV) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    reinterpret_cast<float4*>(o + 64 * r)[0] =
                        make_float4(acc[4 * r][c], acc[4 * r][2 + c], acc[4 * r + 1][c],
                                    acc[4 * r + 1][2 + c]);
                    reinterpret_cast<float4*>(o + 64 * r)[1] =
                        make_float4(acc[4 * r + 2][c], acc[4 * r + 2][2 + c], acc[4 * r + 3][c],
                                    acc[4 * r + 3][2 + c]);
                }
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    reinterpret_cast<float4*>(o + 8 * h)[0] =
                        make_float4(acc[0][2 * h + c], acc[1][2 * h + c], acc[2][2 * h + c],
                                    acc[3][2 * h + c]);
                    reinterpret_cast<float4*>(o + 8 * h)[1] =
                        make_float4(acc[4][2 * h + c], acc[5][2 * h + c], acc[6][2 * h + c],
                                    acc[7][2 * h + c]);
                }
            }
            if (warp == 0 && gq == 0) {
                part_ml[prow * 2] = m[c] * LN2;
                part_ml[prow * 2 + 1] = l[c];
            }
        }
    }
}

#define QSDPA_TC_INST(TN, T, HD, BITS)                                                          \
    extern "C" __global__ void __launch_bounds__(HD / 128 * 32)                                 \
        qsdpa_tc_##TN##_##HD##_##BITS(const QsdpaParams p, const T* q, const uint32_t* kc,      \
                                      const T* ks, const T* kb, const uint32_t* vc,             \
                                      const T* vs, const T* vb, const uint32_t* positions,      \
                                      T* out, float* part_ml, float* part_acc,                  \
                                      uint64_t settled) {                                       \
        qsdpa_tc_body<T, HD, BITS, 0, 1, true>(p, q, kc, ks, kb, vc, vs, vb, positions, out,    \
                                               part_ml, part_acc, blockIdx.z, settled);         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(HD / 128 * 32)                                 \
        qsdpa_tc_batch_##TN##_##HD##_##BITS(const QsdpaSeq* seqs, uint32_t n_split_max,         \
                                            const T* q, T* out, float* part_ml,                 \
                                            float* part_acc) {                                  \
        pdl_entry();                                                                            \
        qsdpa_batch_entry<T, HD>(seqs, n_split_max, q, out, part_ml, part_acc,                 \
                                 [](const auto&... a) { qsdpa_tc_body<T, HD, BITS>(a...); });          \
    }

// Folded scales (4-bit codes, tiles in registers, groups of 64): one sequence and batch.
// Held to the registers that keep the blocks a multiprocessor of the unfolded kernels (6 / 3
// one-sequence, 5 / 2 batch at head dim 256 / 512): unheld, the folds took 9-14 more.
#define QSDPA_TC_FV_INST(TN, T, HD)                                                             \
    extern "C" __global__ void __launch_bounds__(HD / 128 * 32, 1536 / HD)                      \
        qsdpa_tc_fv_##TN##_##HD##_4(const QsdpaParams p, const T* q, const uint32_t* kc,        \
                                    const T* ks, const T* kb, const uint32_t* vc, const T* vs,  \
                                    const T* vb, const uint32_t* positions, T* out,             \
                                    float* part_ml, float* part_acc, uint64_t settled) {        \
        qsdpa_tc_body<T, HD, 4, 0, 1, true, true>(p, q, kc, ks, kb, vc, vs, vb, positions, out, \
                                                  part_ml, part_acc, blockIdx.z, settled);      \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(HD / 128 * 32, 1280 / HD)                      \
        qsdpa_tc_fv_batch_##TN##_##HD##_4(const QsdpaSeq* seqs, uint32_t n_split_max,           \
                                          const T* q, T* out, float* part_ml,                   \
                                          float* part_acc) {                                    \
        pdl_entry();                                                                            \
        qsdpa_batch_entry<T, HD>(                                                               \
            seqs, n_split_max, q, out, part_ml, part_acc,                                       \
            [](const auto&... a) { qsdpa_tc_body<T, HD, 4, 0, 1, false, true>(a...); });      \
    }

QSDPA_TC_FV_INST(f16, __half, 256)
QSDPA_TC_FV_INST(f16, __half, 512)
QSDPA_TC_FV_INST(bf16, __nv_bfloat16, 256)
QSDPA_TC_FV_INST(bf16, __nv_bfloat16, 512)

// Staged tiles (STAGES in shared memory, dynamic size STAGES x qt_stage_bytes), one sequence
// and batch entries. MINB holds the one-sequence 8-bit kernels at the registers (128) that
// give 8 (head dim 256) or 4 (512) blocks a multiprocessor: copying the first stage before the
// wait took them to 152-156 unheld.
#define QSDPA_TC_ST_INST(TN, T, HD, BITS, S, NTS, MINB)                                         \
    extern "C" __global__ void __launch_bounds__(HD / 128 * 32, MINB)                           \
        qsdpa_tc_s##S##x##NTS##_##TN##_##HD##_##BITS(                                           \
            const QsdpaParams p, const T* q, const uint32_t* kc, const T* ks, const T* kb,      \
            const uint32_t* vc, const T* vs, const T* vb, const uint32_t* positions, T* out,    \
            float* part_ml, float* part_acc, uint64_t settled) {                                \
        qsdpa_tc_body<T, HD, BITS, S, NTS, true>(p, q, kc, ks, kb, vc, vs, vb, positions, out,  \
                                                 part_ml, part_acc, blockIdx.z, settled);       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(HD / 128 * 32)                                 \
        qsdpa_tc_s##S##x##NTS##_batch_##TN##_##HD##_##BITS(                                     \
            const QsdpaSeq* seqs, uint32_t n_split_max, const T* q, T* out, float* part_ml,     \
            float* part_acc) {                                                                  \
        pdl_entry();                                                                            \
        qsdpa_batch_entry<T, HD>(                                                               \
            seqs, n_split_max, q, out, part_ml, part_acc,                                       \
            [](const auto&... a) { qsdpa_tc_body<T, HD, BITS, S, NTS>(a...); });             \
    }

// The staged kernels `tc_staging` (launch.rs) picks.
#define QSDPA_TC_ST_INST_T(TN, T)            \
    QSDPA_TC_ST_INST(TN, T, 256, 8, 2, 1, 8) \
    QSDPA_TC_ST_INST(TN, T, 512, 8, 2, 1, 4) \
    QSDPA_TC_ST_INST(TN, T, 512, 4, 2, 2, 1) \
    QSDPA_TC_ST_INST(TN, T, 256, 4, 2, 2, 1)

QSDPA_TC_ST_INST_T(f16, __half)
QSDPA_TC_ST_INST_T(bf16, __nv_bfloat16)

#define QSDPA_TC_INST_T(TN, T)     \
    QSDPA_TC_INST(TN, T, 256, 4)   \
    QSDPA_TC_INST(TN, T, 256, 8)   \
    QSDPA_TC_INST(TN, T, 256, 16)  \
    QSDPA_TC_INST(TN, T, 512, 4)   \
    QSDPA_TC_INST(TN, T, 512, 8)   \
    QSDPA_TC_INST(TN, T, 512, 16)

QSDPA_TC_INST_T(f16, __half)
QSDPA_TC_INST_T(bf16, __nv_bfloat16)
