// Prefill attention on the tensor cores: a block of 64 query rows of one KV head walks the key
// tiles with an online softmax (flash attention), so the score matrix is never written. Tiles
// no query of the block can see are skipped, and the output is written as
// [queries, heads, head_dim], the layout the output projection reads.
//
// Rows: row r of a KV head is query r / group of query head kv * group + r % group, so a block
// spans 64 / group queries and its causal and window bounds stay tight.
//
// Warps: 4 row groups of 16 rows. At head dim 512 two warps share a row group, each with half
// the dimensions: each computes the scores over its half, the halves are summed through shared
// memory, and each multiplies the probabilities into its half of the output (the output's
// accumulators of 16 rows x 512 dimensions would not fit one warp's registers).
//
// Pipeline: Q, K and V tiles in shared memory (16-byte chunks XOR-swizzled by row, so the
// 8-row matrix loads are free of bank conflicts), filled by cp.async; the next tile's keys load
// while this tile's values multiply, the next values while the next scores are computed.
//
// PrefillParams must match `PrefillParams` in `src/kernels/cuda/attention/prefill.rs`.

#include <stdint.h>

#include "async_copy.cuh"
#include "attention.cuh"
#include "common.cuh"
#include "wgmma.cuh"

struct PrefillParams {
    // Element strides of Q along heads and queries, of K and V along heads and keys.
    uint64_t q_sh, q_sq, k_sh, k_sk, v_sh, v_sk;
    uint32_t n_heads, kv_heads, q_len, keys;
    // window 0: causal only. Key positions as in QsdpaParams (mode 0 linear, 1 two runs, 2 table).
    uint32_t window, q_offset, pos_mode, pos_base, pos_split, pos_base2;
    float scale_log2;  // the score scale times log2(e)
    uint32_t pad_;
};


__device__ __forceinline__ bool pf_visible(const PrefillParams& p, uint32_t key, uint32_t query) {
    return key <= query && (p.window == 0 || key + p.window > query);
}

// 16-byte async copy, zero-filled when `valid` is false (the source is then not read).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem), "r"(n));
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Element (row, col) of a swizzled tile of rows of HD elements; col a multiple of 8.
template <int HD> __device__ __forceinline__ int pf_swz(int row, int col) {
    return row * HD + ((((col >> 3) ^ (row & 7))) << 3);
}

// Element (row, col) of a tile of `rows` rows: with WG, panels of 64 columns one after the
// other, each `rows` rows of 128 bytes whose 16-byte chunks are XOR-swizzled by row (the
// 128-byte swizzle the warpgroup products read); else `pf_swz`. col a multiple of 8.
template <int HD, bool WG> __device__ __forceinline__ int pf_off(int rows, int row, int col) {
    if constexpr (WG) {
        return (col >> 6) * rows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3);
    } else {
        return pf_swz<HD>(row, col);
    }
}

// Keeps the compiler from moving reads or writes of a product's registers across the
// warpgroup fence and wait (they are the asm statements' operands, not their memory).
template <int N> __device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Which keys of tile [j0, j1) the block's queries [q_lo, q_hi] (positions) may see:
// 0 none, 1 some (mask each score), 2 all (no mask). Uniform over the block; the table mode
// votes with block barriers.
template <int BN>
__device__ __forceinline__ int pf_tile_class(const PrefillParams& p, const uint32_t* pos, int j0,
                                             uint32_t q_lo, uint32_t q_hi) {
    const int j1 = min(j0 + BN, (int)p.keys);
    // A run of keys at positions [a, b]: any visible / all visible from every query.
    auto any_of = [&](uint32_t a, uint32_t b) {
        return a <= q_hi && (p.window == 0 || b + p.window > q_lo);
    };
    auto all_of = [&](uint32_t a, uint32_t b) {
        return b <= q_lo && (p.window == 0 || a + p.window > q_hi);
    };
    if (p.pos_mode == 2) {
        const int j = j0 + (int)threadIdx.x;
        bool any = false, all = true;
        if ((int)threadIdx.x < BN) {
            if (j < j1) {
                const uint32_t k = pos[j];
                any = any_of(k, k);
                all = all_of(k, k);
            } else {
                all = false;
            }
        }
        any = __syncthreads_or(any);
        all = __syncthreads_and(all);
        return all ? 2 : (any ? 1 : 0);
    }
    const bool full = j1 - j0 == BN;
    // Mode 0, or mode 1 as its two runs (tile parts below and from the split).
    int cut = j1;
    if (p.pos_mode == 1) cut = max(j0, min(j1, (int)p.pos_split));
    bool any = false, all = full;
    if (cut > j0) {
        const uint32_t a = key_pos(p, pos, j0), b = key_pos(p, pos, cut - 1);
        any |= any_of(a, b);
        all = all && all_of(a, b);
    }
    if (j1 > cut) {
        const uint32_t a = key_pos(p, pos, cut), b = key_pos(p, pos, j1 - 1);
        any |= any_of(a, b);
        all = all && all_of(a, b);
    }
    return all ? 2 : (any ? 1 : 0);
}

// Row groups of 16 query rows a block: one warpgroup's 64 rows.
constexpr int PF_ROW_GROUPS = 4;

template <typename T, int HD, int BN, bool WG>
__device__ __forceinline__ void prefill_attention(const PrefillParams& p, const T* __restrict__ q,
                                                  const T* __restrict__ k, const T* __restrict__ v,
                                                  const uint32_t* __restrict__ pos, T* __restrict__ out) {
    constexpr int WPR = HD > 256 ? HD / 256 : 1;  // warps sharing a row group
    constexpr int DW = HD / WPR;                  // dimensions of a warp
    constexpr int RG = PF_ROW_GROUPS;
    constexpr int ROWS = 16 * RG;                 // query rows a block
    constexpr int NW = RG * WPR;
    constexpr int THREADS = NW * 32;
    constexpr int CH = HD / 8;  // 16-byte chunks of a row
    constexpr int NT = BN / 8;  // score tiles of 8 keys
    constexpr int DT = DW / 8;  // output tiles of 8 dimensions
    static_assert(BN <= THREADS, "one thread a key for the table vote");
    static_assert(!WG || DW == 256, "the warpgroup products cover 256 dimensions a warp");

    extern __shared__ __align__(16) unsigned char pf_smem[];
    unsigned char* base = pf_smem;
    if constexpr (WG) {  // panels start on 1024 bytes, where the hardware's swizzle repeats
        const uint32_t a = (uint32_t)__cvta_generic_to_shared(pf_smem);
        base += ((a + 1023u) & ~1023u) - a;
    }
    T* qs = reinterpret_cast<T*>(base);
    T* ks = qs + ROWS * HD;
    T* vs = ks + BN * HD;
    float* xs = reinterpret_cast<float*>(vs + BN * HD);  // WPR > 1: [NW][NT * 4][32]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    const int rg = warp % RG, part = warp / RG;
    const int kvh = blockIdx.y;
    const int group = p.n_heads / p.kv_heads;
    const int rows = group * p.q_len;
    // Blocks of later queries see more keys: they start first.
    const int row0 = (gridDim.x - 1 - blockIdx.x) * ROWS;
    const uint32_t q_lo = p.q_offset + row0 / group;
    const uint32_t q_hi = p.q_offset + (min(row0 + ROWS, rows) - 1) / group;
    const int n_tiles = ((int)p.keys + BN - 1) / BN;
    // Tiles that can hold a key some query of the block sees: with keys in one linear run, the
    // positions (q_lo - window, q_hi]; otherwise every tile is classified (the scan below).
    int t_begin = 0, t_end = n_tiles;
    if (p.pos_mode == 0) {
        const long long hi = (long long)q_hi - p.pos_base;
        const long long lo = p.window ? (long long)q_lo + 1 - p.window - p.pos_base : 0;
        t_end = hi < 0 ? 0 : (int)min((long long)n_tiles, hi / BN + 1);
        t_begin = lo <= 0 ? 0 : (int)min((long long)t_end, lo / BN);
    }

#if defined(PF_WGMMA)
    // The warpgroup products' operands at their first step: the block's 64 rows of Q and this
    // warp's columns of Q, K and V (panels 4 * part on).
    uint64_t q_desc = 0, k_desc = 0, v_desc = 0;
    if constexpr (WG) {
        // With one warpgroup covering the whole head this is 0, and the descriptors stay in
        // the uniform datapath (the compiler cannot tell warp / 4 is 0 by itself).
        const int wg_part = WPR == 1 ? 0 : part;
        q_desc = wg_desc(qs + wg_part * 4 * ROWS * 64, 16, 1024);
        k_desc = wg_desc(ks + wg_part * 4 * BN * 64, 16, 1024);
        v_desc = wg_desc(vs + wg_part * 4 * BN * 64, BN * 128, 1024);
    }
#endif

    pdl_entry();

    auto load_q = [&] {
        for (int i = tid; i < ROWS * CH; i += THREADS) {
            const int row = i / CH, c = i % CH, r = row0 + row;
            const bool ok = r < rows;
            const int qi = ok ? r / group : 0, head = kvh * group + (ok ? r % group : 0);
            cp_async16_zfill(qs + pf_off<HD, WG>(ROWS, row, c * 8),
                             q + head * p.q_sh + (size_t)qi * p.q_sq + c * 8, ok);
        }
    };
    // K/V tile copies: a thread always copies the same 16-byte column chunk `kc` of rows kr0,
    // kr0 + KV_STEP, ..., so its global address steps by a fixed stride and its shared one by
    // immediates: with kr0 < KV_STEP dividing 8, row & 7 is kr0 ^ (i * KV_STEP & 7). (Each
    // chunk's address recomputed cost about as many instructions as the rest of a tile.)
    constexpr int KV_STEP = THREADS / CH;        // rows between a thread's chunks
    constexpr int KV_CHUNKS = BN * CH / THREADS;  // chunks a thread copies a tile
    static_assert(THREADS % CH == 0 && (BN * CH) % THREADS == 0 && 8 % KV_STEP == 0,
                  "whole rows a pass, the swizzle repeating within 8 rows");
    const int kc = tid % CH, kr0 = tid / CH;
    constexpr int ROW = WG ? 64 : HD;  // elements from one row of a K/V tile to the next
    const int k_chunk = WG ? kc & 7 : kc;
    const int k_row = (WG ? (kc >> 3) * BN * 64 : 0) + kr0 * ROW;  // this thread's first row
    const int k_swz = (k_chunk ^ kr0) << 3;
    auto load_kv = [&](T* dst, const T* src, uint64_t sh, uint64_t sk, int j0) {
        const T* g = src + kvh * sh + (size_t)(j0 + kr0) * sk + kc * 8;
        const size_t step = (size_t)KV_STEP * sk;
        T* d = dst + k_row;
        if (j0 + BN <= (int)p.keys) {  // a whole tile: no bounds
#pragma unroll
            for (int i = 0; i < KV_CHUNKS; ++i, g += step)
                cp_async16(d + i * KV_STEP * ROW + (k_swz ^ (((i * KV_STEP) & 7) << 3)), g);
            return;
        }
#pragma unroll
        for (int i = 0; i < KV_CHUNKS; ++i, g += step) {
            const bool ok = j0 + kr0 + i * KV_STEP < (int)p.keys;
            cp_async16_zfill(d + i * KV_STEP * ROW + (k_swz ^ (((i * KV_STEP) & 7) << 3)),
                             ok ? g : src, ok);
        }
    };
    auto next_tile = [&](int t, int& cls) {
        for (; t < t_end; ++t) {
            cls = pf_tile_class<BN>(p, pos, t * BN, q_lo, q_hi);
            if (cls) break;
        }
        return t < t_end ? t : n_tiles;
    };

    // This lane's two rows (gq, gq + 8 of its row group): their query positions.
    uint32_t qpos[2];
    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + rg * 16 + gq + 8 * h;
        row_ok[h] = r < rows;
        qpos[h] = p.q_offset + (row_ok[h] ? r / group : 0);
    }

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    int cls = 0;
    int t = next_tile(t_begin, cls);
    if (t < n_tiles) {
        load_q();
        cp_async_commit();
        load_kv(ks, k, p.k_sh, p.k_sk, t * BN);
        cp_async_commit();
        load_kv(vs, v, p.v_sh, p.v_sk, t * BN);
        cp_async_commit();
    }
    while (t < n_tiles) {
        int next_cls = 0;
        const int next = next_tile(t + 1, next_cls);
        cp_async_wait<1>();
        if constexpr (WG) fence_proxy_async();
        __syncthreads();  // Q and this tile's keys are in

        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#if defined(PF_WGMMA)
        if constexpr (WG) {
            // The warpgroup's 64 rows against the tile's 64 keys over this warp's dimensions,
            // 16 at a time: A from Q's panels, B from K's (both K-major, rows of 128 bytes,
            // 8-row groups 1024 bytes apart).
            static_assert(BN == 64, "one m64n64 product a step");
            float(&sf)[NT * 4] = *reinterpret_cast<float(*)[NT * 4]>(&s[0][0]);
            pin(sf);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < DW / 16; ++kk) {
                // A step's operands: 16 columns on (16 * 2 bytes within a panel's rows, the
                // next panel every four steps); descriptors count 16-byte units.
                const int q_step = ((kk >> 2) * ROWS * 128 + (kk & 3) * 32) >> 4;
                const int k_step = ((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4;
                wg_scores<T>(sf, q_desc + q_step, k_desc + k_step, kk > 0);
            }
            wg_commit();
            wg_wait_all();
            pin(sf);
        } else
#endif
#pragma unroll 4
        for (int kk = 0; kk < DW / 16; ++kk) {
            const int col = part * DW + kk * 16;
            uint32_t a[4];
            ldsm_x4(a, qs + pf_swz<HD>(rg * 16 + (lane & 15), col + (lane >> 4) * 8));
#pragma unroll
            for (int n2 = 0; n2 < NT / 2; ++n2) {
                uint32_t b[4];
                ldsm_x4(b, ks + pf_swz<HD>(n2 * 16 + (lane >> 4) * 8 + (lane & 7),
                                           col + ((lane >> 3) & 1) * 8));
                mma_16816<T>(s[2 * n2], a, b);
                mma_16816<T>(s[2 * n2 + 1], a, b + 2);
            }
        }
        if constexpr (WPR > 1) {
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) xs[(warp * NT * 4 + n * 4 + i) * 32 + lane] = s[n][i];
        }
        __syncthreads();  // every warp is done with the keys (and has posted its partial scores)
        if (next < n_tiles) {
            load_kv(ks, k, p.k_sh, p.k_sk, next * BN);
            cp_async_commit();
        }
        if constexpr (WPR > 1) {
#pragma unroll
            for (int w = 0; w < WPR; ++w) {
                if (w == part) continue;
                const int other = w * RG + rg;
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) s[n][i] += xs[(other * NT * 4 + n * 4 + i) * 32 + lane];
            }
        }

        // Scale into the base-2 domain, mask, and fold the tile into the running softmax.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float x = s[n][i] * p.scale_log2;
                if (cls == 1) {
                    const int j = t * BN + n * 8 + 2 * tq + (i & 1);
                    const bool vis =
                        j < (int)p.keys && pf_visible(p, key_pos(p, pos, j), qpos[i >> 1]);
                    x = vis ? x : -INFINITY;
                }
                s[n][i] = x;
                mx[i >> 1] = fmaxf(mx[i >> 1], x);
            }
        }
        float ref[2], alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float mn = fmaxf(m[h], mx[h]);
            ref[h] = mn == -INFINITY ? 0.f : mn;
            alpha[h] = fast_exp2(m[h] - ref[h]);
            m[h] = mn;
            l[h] *= alpha[h];
        }
        // Once the running maxima settle, most tiles leave every row's at 1: skip the rescale
        // when no row of the warp moved (the branch is uniform over the warp).
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int d = 0; d < DT; ++d) {
                o[d][0] *= alpha[0];
                o[d][1] *= alpha[0];
                o[d][2] *= alpha[1];
                o[d][3] *= alpha[1];
            }
        }
        uint32_t pa[NT][2];  // probabilities as A-fragment halves: (row gq, row gq + 8) a tile
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float p0 = fast_exp2(s[n][0] - ref[0]), p1 = fast_exp2(s[n][1] - ref[0]);
            const float p2 = fast_exp2(s[n][2] - ref[1]), p3 = fast_exp2(s[n][3] - ref[1]);
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            pa[n][0] = pack2<T>(p0, p1);
            pa[n][1] = pack2<T>(p2, p3);
        }

        if (next < n_tiles) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        if constexpr (WG) fence_proxy_async();
        __syncthreads();  // this tile's values are in
#if defined(PF_WGMMA)
        if constexpr (WG) {
            // O (64 rows x this warp's 256 dimensions) += P (registers, 16 keys a step) x V
            // (N-major: 64-column panels BN * 128 bytes apart, 8-key groups 1024 apart).
            float(&of)[DT * 4] = *reinterpret_cast<float(*)[DT * 4]>(&o[0][0]);
            uint32_t a[BN / 16][4];  // the A fragments, in place before the fence
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                a[kk][0] = pa[2 * kk][0];
                a[kk][1] = pa[2 * kk][1];
                a[kk][2] = pa[2 * kk + 1][0];
                a[kk][3] = pa[2 * kk + 1][1];
#pragma unroll
                for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[kk][i])::"memory");
            }
            pin(of);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)  // 16 keys of 128 bytes a step
                wg_values<T>(of, a[kk], v_desc + kk * 16 * 128 / 16, 1);
            wg_commit();
            wg_wait_all();
            pin(of);
        } else
#endif
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint32_t a[4] = {pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0],
                                   pa[2 * kk + 1][1]};
#pragma unroll
            for (int d2 = 0; d2 < DT / 2; ++d2) {
                uint32_t b[4];
                ldsm_x4_trans(b, vs + pf_swz<HD>(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                                 part * DW + d2 * 16 + (lane >> 4) * 8));
                mma_16816<T>(o[2 * d2], a, b);
                mma_16816<T>(o[2 * d2 + 1], a, b + 2);
            }
        }
        __syncthreads();  // every warp is done with the values
        if (next < n_tiles) {
            load_kv(vs, v, p.v_sh, p.v_sk, next * BN);
            cp_async_commit();
        }
        t = next;
        cls = next_cls;
    }

    // Each row's sum over its quad of lanes; rows that saw no key write zeros.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        if (!row_ok[h]) continue;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        const int r = row0 + rg * 16 + gq + 8 * h;
        const int qi = r / group, head = kvh * group + r % group;
        T* dst = out + ((size_t)qi * p.n_heads + head) * HD + part * DW + 2 * tq;
#pragma unroll
        for (int d = 0; d < DT; ++d)
            *reinterpret_cast<uint32_t*>(dst + d * 8) =
                pack2<T>(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
    }
}

// Shared memory of one block: Q, K and V tiles, and the partial scores when warps split the
// head (host: `launch_shape`); the warpgroup kernels take 1 KiB more to align their panels.
#define PF_KERNEL(NAME, T, HD, BN, MINB, WG)                                              \
    extern "C" __global__ void __launch_bounds__(PF_ROW_GROUPS * (HD > 256 ? HD / 256 : 1) * 32, \
                                                 MINB)                                      \
        NAME(const PrefillParams p, const T* __restrict__ q, const T* __restrict__ k,       \
             const T* __restrict__ v, const uint32_t* __restrict__ pos, T* __restrict__ out) { \
        prefill_attention<T, HD, BN, WG>(p, q, k, v, pos, out);                        \
    }

#define PF_KERNELS(TN, T)                                     \
    PF_KERNEL(prefill_attn_128_##TN, T, 128, 64, 2, false) \
    PF_KERNEL(prefill_attn_256_##TN, T, 256, 64, 2, false) \
    PF_KERNEL(prefill_attn_512_##TN, T, 512, 64, 1, false)

PF_KERNELS(bf16, __nv_bfloat16)
PF_KERNELS(f16, __half)

// The warpgroup-product forms, on sm_90a only (the host calls them on compute capability 9.0
// when the build targeted it).
#if defined(PF_WGMMA)
#define PF_WG_KERNELS(TN, T)                                             \
    PF_KERNEL(prefill_attn_wg_256_##TN, T, 256, 64, 2, true)          \
    PF_KERNEL(prefill_attn_wg_512_##TN, T, 512, 64, 1, true)

PF_WG_KERNELS(bf16, __nv_bfloat16)
PF_WG_KERNELS(f16, __half)
#endif
