// Tensor-core attention kernels: the body over a key split and its instantiations (one
// sequence, batched, staged and value-folding forms). The design is described in qsdpa_tc.cuh.

#include <stdint.h>

#include "attention.cuh"
#include "qsdpa_tc.cuh"

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
    // `settled`: keys settled_lo | settled_hi << 32 (`SeqPlan::settled` in attention/plan.rs).
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
            // Packed tiles only: dense ones are read at full width anyway.
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

// The staged kernels `tc_staging` (attention/plan.rs) picks.
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
