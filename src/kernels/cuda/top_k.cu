// Each row's k best logits for sampling, so that a sampled decode step copies k (id, logit)
// pairs a row to the host instead of the whole vocabulary (or draws from them on the device,
// `draw_best_f32`), and each row's softmax mass (for top-p and min-p filters drawn from those
// candidates). The order is the host sampler's:
// the key s / t (t the row's temperature, IEEE division), largest first, the lowest id first
// among equal keys, NaN and -inf logits last. One block a row:
//   1. a radix select over the keys' order-preserving bits, 8 bits a pass from the top, finds
//      the k-th largest key;
//   2. each thread takes a contiguous range of ids, counts its keys above that key and equal
//      to it, and a block scan gives every thread its slots: all keys above, then the ties in
//      id order until k are taken (so the set is exactly the host's, ties included);
//   3. a bitonic sort of the k candidates in shared memory, then the raw logits and ids out.
// Rows longer than a chunk take two launches: each chunk's best (a block a chunk, so a row is
// not bound by one multiprocessor), then the best of those, which hold the row's.
// The logits and temperatures are read through plain pointers: a `const __restrict__` load may
// be moved above the dependent-launch wait (common.cuh).
#include "common.cuh"
#include "draw.cuh"

constexpr int TOPK_THREADS = 1024;
constexpr int TOPK_WARPS = TOPK_THREADS / 32;
// Most candidates a row (TOPK_MAX in top_k.rs).
constexpr int TOPK_MAX = 1024;

// Larger float, larger u32 (-0 below +0, like the host's total order), and above 0 for every
// float but NaN.
__device__ __forceinline__ uint32_t order_bits(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A logit's key: s / t, or s itself (zeros of either sign equal) where t <= 0 (a greedy row).
// NaN and -inf logits, which the host sampler leaves out, sort below every other key (0), even
// below a finite logit whose division overflows to -inf.
__device__ __forceinline__ uint32_t key_bits(float s, float t) {
    if (!(s > -INFINITY)) return 0u;
    return order_bits(t > 0.f ? __fdiv_rn(s, t) : __fadd_rn(s, 0.f));
}

// Exclusive prefix sum of `v` over the block's threads; `total` gets the sum.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t& total) {
    __shared__ uint32_t warp_sums[TOPK_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        uint32_t w = lane < TOPK_WARPS ? warp_sums[lane] : 0u;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const uint32_t y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        if (lane < TOPK_WARPS) warp_sums[lane] = w;
    }
    __syncthreads();
    const uint32_t before = (warp > 0 ? warp_sums[warp - 1] : 0u) + x - v;
    total = warp_sums[TOPK_WARPS - 1];
    __syncthreads();
    return before;
}

// What a block selects from: `n` entries, entry j the logit `value(j)` of id `id(j)`, where
// equal keys come in increasing id order (a row's columns; or chunks' candidate lists, each
// sorted, in chunk order).
struct Columns {
    const float* r;
    uint32_t n, base;
    __device__ __forceinline__ uint32_t id(uint32_t j) const { return base + j; }
    __device__ __forceinline__ uint32_t key(uint32_t j, float t) const { return key_bits(r[j], t); }
};
// Sentinel id: a short chunk's unused candidate slots (always after every real candidate).
constexpr uint32_t NO_ID = 0xffffffffu;
struct Listed {
    const float* r;
    const uint32_t* ids;
    uint32_t n;
    __device__ __forceinline__ uint32_t id(uint32_t j) const { return ids[j]; }
    __device__ __forceinline__ uint32_t key(uint32_t j, float t) const {
        const uint32_t i = ids[j];
        return i == NO_ID ? 0u : key_bits(r[i], t);
    }
};

// Leaves the `want` (<= TOPK_MAX, <= src.n) best entries of `src` in cand[0, want), best
// first, as (key << 32 | ~id); every thread of the block must call it.
template <typename Src>
__device__ void select_best(const Src& src, float t, uint32_t want, unsigned long long* cand) {
    __shared__ uint32_t hist[TOPK_WARPS][256];
    __shared__ uint32_t sel;
    __shared__ uint32_t need_s;
    const uint32_t n = src.n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // 1. The want-th largest key: `prefix` under `mask` after each pass, `need` the keys still
    // to take among those equal to it so far.
    uint32_t prefix = 0, mask = 0, need = want;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < TOPK_WARPS * 256; i += TOPK_THREADS) (&hist[0][0])[i] = 0;
        __syncthreads();
        for (uint32_t j0 = 0; j0 < n; j0 += TOPK_THREADS) {
            const uint32_t j = j0 + threadIdx.x;
            uint32_t bin = 256;
            if (j < n) {
                const uint32_t u = src.key(j, t);
                if ((u & mask) == prefix) bin = (u >> shift) & 255u;
            }
            // Lanes of one bin add once (same-address shared atomics serialize).
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[warp][bin], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            uint32_t s = 0;
            for (int w = 0; w < TOPK_WARPS; ++w) s += hist[w][threadIdx.x];
            hist[0][threadIdx.x] = s;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t above = 0;
            int d = 255;
            for (; d > 0; --d) {
                if (above + hist[0][d] >= need) break;
                above += hist[0][d];
            }
            sel = (uint32_t)d;
            need_s = need - above;
        }
        __syncthreads();
        prefix |= sel << shift;
        mask |= 255u << shift;
        need = need_s;
        __syncthreads();
    }
    const uint32_t kth = prefix;
    const uint32_t ties = need;  // keys equal to kth to take, lowest ids first

    // 2. Every key above kth, then the first `ties` keys equal to it, in slots by entry order.
    const uint32_t per = (n + TOPK_THREADS - 1) / TOPK_THREADS;
    const uint32_t lo = min(n, threadIdx.x * per), hi = min(n, lo + per);
    uint32_t gt = 0, eq = 0;
    for (uint32_t j = lo; j < hi; ++j) {
        const uint32_t u = src.key(j, t);
        gt += u > kth;
        eq += u == kth;
    }
    uint32_t gt_total, eq_total;
    uint32_t gt_at = block_exclusive_scan(gt, gt_total);
    uint32_t eq_at = block_exclusive_scan(eq, eq_total);
    if (gt > 0 || (eq > 0 && eq_at < ties)) {
        for (uint32_t j = lo; j < hi; ++j) {
            const uint32_t u = src.key(j, t);
            uint32_t slot = TOPK_MAX;
            if (u > kth) {
                slot = gt_at++;
            } else if (u == kth) {
                if (eq_at < ties) slot = gt_total + eq_at;
                ++eq_at;
            }
            // Descending on the pair sorts keys down and ids up.
            if (slot < want) cand[slot] = ((unsigned long long)u << 32) | (uint32_t)~src.id(j);
        }
    }
    // Padding after every candidate (key 0 with the largest id).
    uint32_t n2 = 1;
    while (n2 < want) n2 <<= 1;
    for (uint32_t i = want + threadIdx.x; i < n2; i += TOPK_THREADS) cand[i] = 0ull;
    __syncthreads();

    // 3. Bitonic sort, descending.
    for (uint32_t size = 2; size <= n2; size <<= 1) {
        for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (uint32_t i = threadIdx.x; i < n2; i += TOPK_THREADS) {
                const uint32_t p = i ^ stride;
                if (p > i) {
                    const unsigned long long a = cand[i], b = cand[p];
                    const bool down = (i & size) == 0;
                    if (down ? a < b : a > b) {
                        cand[i] = b;
                        cand[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// One row a block (rows of at most a chunk): the row's best, as raw logits and ids.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    top_k_rows_f32(const float* x, uint32_t cols, const float* temps, uint32_t k,
                   float* __restrict__ out_v, uint32_t* __restrict__ out_i) {
    pdl_entry();
    __shared__ unsigned long long cand[TOPK_MAX];
    const float* r = x + (size_t)blockIdx.x * cols;
    const uint32_t want = min(k, cols);
    if (want == 0) return;
    select_best(Columns{r, cols, 0}, temps[blockIdx.x], want, cand);
    for (uint32_t i = threadIdx.x; i < want; i += TOPK_THREADS) {
        const uint32_t id = ~(uint32_t)cand[i];
        out_v[(size_t)blockIdx.x * k + i] = r[id];
        out_i[(size_t)blockIdx.x * k + i] = id;
    }
}

// Long rows, first launch: block (c, row) takes chunk c (`chunk` columns) of the row and
// leaves its best ids, best first, in ids[row][c][0, k) (NO_ID past a short last chunk's).
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    top_k_chunks_f32(const float* x, uint32_t cols, const float* temps, uint32_t k,
                     uint32_t chunk, uint32_t* __restrict__ ids) {
    pdl_entry();
    __shared__ unsigned long long cand[TOPK_MAX];
    const float* r = x + (size_t)blockIdx.y * cols;
    const uint32_t c0 = blockIdx.x * chunk;
    const uint32_t len = min(chunk, cols - c0);
    const uint32_t want = min(k, len);
    select_best(Columns{r + c0, len, c0}, temps[blockIdx.y], want, cand);
    uint32_t* o = ids + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * k;
    for (uint32_t i = threadIdx.x; i < k; i += TOPK_THREADS) o[i] = i < want ? ~(uint32_t)cand[i] : NO_ID;
}

// Long rows, second launch: one row a block, its best among the chunks' candidates.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    top_k_merge_f32(const float* x, uint32_t cols, const float* temps, uint32_t k,
                    uint32_t chunks, const uint32_t* ids, float* __restrict__ out_v,
                    uint32_t* __restrict__ out_i) {
    pdl_entry();
    __shared__ unsigned long long cand[TOPK_MAX];
    const float* r = x + (size_t)blockIdx.x * cols;
    const uint32_t want = min(k, cols);
    const uint32_t* listed = ids + (size_t)blockIdx.x * chunks * k;
    select_best(Listed{r, listed, chunks * k}, temps[blockIdx.x], want, cand);
    for (uint32_t i = threadIdx.x; i < want; i += TOPK_THREADS) {
        const uint32_t id = ~(uint32_t)cand[i];
        out_v[(size_t)blockIdx.x * k + i] = r[id];
        out_i[(size_t)blockIdx.x * k + i] = id;
    }
}

// Each row's softmax mass under the sampler's key, for top-p and min-p filters drawn from the
// candidates above: the sum over the row's logits (NaN and -inf left out) of
// exp((s / t - M) as f64), M the row's largest key, the f32 difference then the f64
// exponential, as the host sampler sums them. Two launches of (chunk, row) blocks: each
// chunk's largest key, then each chunk's sum against the row's largest (the merge of the
// first launch's chunk maxima); the host adds the chunks' sums. t > 0.
constexpr int MASS_THREADS = 256;
constexpr int MASS_CHUNK = 4096;

extern "C" __global__ void __launch_bounds__(MASS_THREADS)
    key_max_chunks_f32(const float* x, uint32_t cols, const float* temps,
                       float* __restrict__ chunk_max) {
    pdl_entry();
    __shared__ float warp_max[MASS_THREADS / 32];
    const float* r = x + (size_t)blockIdx.y * cols;
    const float t = temps[blockIdx.y];
    const uint32_t c0 = blockIdx.x * MASS_CHUNK, c1 = min(c0 + MASS_CHUNK, cols);
    float m = -INFINITY;
    for (uint32_t j = c0 + threadIdx.x; j < c1; j += MASS_THREADS) {
        const float s = r[j];
        if (s > -INFINITY) m = fmaxf(m, __fdiv_rn(s, t));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < MASS_THREADS / 32; ++w) m = fmaxf(m, warp_max[w]);
        chunk_max[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = m;
    }
}

extern "C" __global__ void __launch_bounds__(MASS_THREADS)
    key_mass_chunks_f32(const float* x, uint32_t cols, const float* temps, const float* chunk_max,
                        double* __restrict__ chunk_sum) {
    pdl_entry();
    __shared__ double warp_sum[MASS_THREADS / 32];
    const float* r = x + (size_t)blockIdx.y * cols;
    const float t = temps[blockIdx.y];
    float top = -INFINITY;
    for (uint32_t c = 0; c < gridDim.x; ++c)
        top = fmaxf(top, chunk_max[(size_t)blockIdx.y * gridDim.x + c]);
    const uint32_t c0 = blockIdx.x * MASS_CHUNK, c1 = min(c0 + MASS_CHUNK, cols);
    double acc = 0.0;
    for (uint32_t j = c0 + threadIdx.x; j < c1; j += MASS_THREADS) {
        const float s = r[j];
        if (s > -INFINITY) acc += exp((double)__fsub_rn(__fdiv_rn(s, t), top));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) warp_sum[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < MASS_THREADS / 32; ++w) acc += warp_sum[w];
        chunk_sum[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = acc;
    }
}

// A tempered draw from each row's best logits (top_k_rows_f32's or top_k_merge_f32's output:
// `k` raw logits and ids a row, in the sampler's order) under the row's top-k, top-p and min-p
// filters: the host sampler's draw_from_pool on those pairs (src/generate/sampling/mod.rs), the
// same operations in the same order. One block a row, a thread a candidate:
//   - the pool: the row's first min(k, top-k) pairs whose logit is neither NaN nor -inf (they
//     come last), keys s / t;
//   - with top-p or min-p: each key's exp((key - first key) as f64), rounded to f32; their f64
//     sum in order (one thread); each probability (p as f64 / sum) rounded to f32; the top-p
//     cut where the f32 running sum first reaches top-p, the min-p cut after the leading
//     probabilities at least min-p times the first (one thread), the smaller kept, at least 1;
//   - the Gumbel-max argmax over the kept pairs (draw.cuh), id 0 for an empty pool.
// Only exp and logf may differ from the host's, by an ulp.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    draw_best_f32(const float* values, const uint32_t* ids, uint32_t k, const uint32_t* draws,
                  uint32_t* __restrict__ out) {
    pdl_entry();
    __shared__ double mass[TOPK_MAX];
    __shared__ float prob[TOPK_MAX];
    __shared__ float first_key;
    __shared__ double total;
    __shared__ uint32_t kept;
    const size_t row = blockIdx.x;
    const uint32_t* d = draws + row * DRAW_WORDS;
    const float t = __uint_as_float(d[0]);
    const float top_p = __uint_as_float(d[6]), min_p = __uint_as_float(d[7]);
    const uint32_t i = threadIdx.x;
    const uint32_t lim = min(k, d[5]);
    float s = -INFINITY;
    uint32_t id = 0;
    if (i < lim) {
        s = values[row * k + i];
        id = ids[row * k + i];
    }
    const bool valid = i < lim && s > -INFINITY;
    const uint32_t n = __syncthreads_count(valid);
    if (n == 0) {
        if (i == 0) out[row] = 0;
        return;
    }
    const float key = valid ? __fdiv_rn(s, t) : -INFINITY;
    uint32_t keep = n;
    const bool cut_p = !isnan(top_p), cut_min = !isnan(min_p);
    if (cut_p || cut_min) {
        if (i == 0) first_key = key;
        __syncthreads();
        if (valid) {
            const double p = exp((double)__fsub_rn(key, first_key));
            mass[i] = p;
            prob[i] = __double2float_rn(p);
        }
        __syncthreads();
        if (i == 0) {
            double sum = 0.0;
            for (uint32_t j = 0; j < n; ++j) sum = __dadd_rn(sum, mass[j]);
            total = sum;
        }
        __syncthreads();
        if (valid) prob[i] = __double2float_rn(__ddiv_rn((double)prob[i], total));
        __syncthreads();
        if (i == 0) {
            uint32_t cut = n;
            if (cut_p) {
                float cumulative = 0.f;
                for (uint32_t j = 0; j < n; ++j) {
                    cumulative = __fadd_rn(cumulative, prob[j]);
                    if (cumulative >= top_p) {
                        cut = j + 1;
                        break;
                    }
                }
            }
            if (cut_min) {
                const float threshold = __fmul_rn(prob[0], min_p);
                uint32_t m = 0;
                while (m < n && prob[m] >= threshold) ++m;
                cut = min(cut, m);
            }
            kept = max(cut, 1u);
        }
        __syncthreads();
        keep = kept;
    }
    float bv = -INFINITY;
    uint32_t bi = 0xffffffffu;
    if (i < keep) argmax_step(bv, bi, __fadd_rn(key, draw_noise(d, id)), id);
    block_argmax(bv, bi);
    if (i == 0) out[row] = bi == 0xffffffffu ? 0u : bi;
}
