// One-shot all-reduce over the GPUs of one process, through peer memory (NVLink). Each rank
// writes its part straight into every peer's receive buffer, one 4-byte word at a time
// packed with the call's epoch into one 8-byte store (which lands whole), so the receiver
// needs no separate flag: it polls its own memory until every word carries this call's
// epoch, then sums every rank's words in rank order (so every rank computes the same bits).
// Used for the small sums of decode steps, where NCCL's latency is most of the cost, and for
// the head's all-gather of a decode step's logits (`peer_all_gather`: the same words, copied
// instead of summed); launched inside CUDA graphs like any kernel.
//
// Every call of the plain sum runs PEER_MAX_BLOCKS blocks, whatever its size, so block b's
// epoch (its count of calls, kept in the rank's own memory) is the same on every rank.
// Receive buffers alternate between two halves by epoch parity: a rank writes into a half
// again two calls later, once it has received every peer's words of the call in between,
// which the peer sends only after its call that read the half has ended.
//
// The `_add_norm` kernels sum two tensors as one (the 26B-A4B dense and expert branches, or a
// row-parallel product and nothing), then run the residual add + norms of the add_norm kernels
// on the sums: one launch where the sum and the add_norm were two (plus the copy that joined
// the two branches; `peer_moe_mix_add_norm` also does the expert mix before them, where the
// mix was one more launch). They serve decode steps of one or two rows, a few thousand words: one
// block of 1024 threads exchanges them and goes straight on to the add + norms (32 blocks, a
// launch-wide counter and a last block measured 0.98-0.99x of that on 26B-A4B at batch 1, 2
// H100s). They keep their own epoch and their own region of the receive buffers, so their
// one-block calls never meet the multi-block calls' words. The one-row dense products with a
// peer tail (`dense_mv_peer_norm`, dense_matvec.cu) take the same epoch and region in turn:
// each block sends its outputs as it stores them, and the last one sums and adds.
#include "common.cuh"
#include "norm_tail.cuh"
#include "peer.cuh"

// Two tensors summed as one vector: a's na elements, then b's (na even for 16-bit types, so
// no word straddles them); n elements in all. One tensor: b = a, na = n.
template <typename T> struct Segments {
    const T* a;
    const T* b;
    T* ya;
    T* yb;
    unsigned int na, n;
    __device__ __forceinline__ const T* src(unsigned int i, unsigned int& at) const {
        at = i < na ? i : i - na;
        return i < na ? a : b;
    }
    __device__ __forceinline__ T* dst(unsigned int i, unsigned int& at) const {
        at = i < na ? i : i - na;
        return i < na ? ya : yb;
    }
};

// Word w of the segments: one f32, or two 16-bit elements (the second 0 past the end).
template <typename T>
__device__ __forceinline__ unsigned int word_of(const Segments<T>& x, unsigned int w) {
    unsigned int at;
    const T* s = x.src(sizeof(T) == 4 ? w : 2 * w, at);
    if (sizeof(T) == 4) return reinterpret_cast<const unsigned int*>(s)[at];
    const unsigned short* h = reinterpret_cast<const unsigned short*>(s);
    const unsigned int lo = h[at];
    const unsigned int hi = 2 * w + 1 < x.n ? h[at + 1] : 0u;
    return lo | (hi << 16);
}

template <typename T>
__device__ __forceinline__ void add_word(float* s, unsigned int word) {
    if (sizeof(T) == 4) {
        s[0] += __uint_as_float(word);
    } else {
        const unsigned short lo = word & 0xffffu, hi = word >> 16;
        s[0] += to_f(*reinterpret_cast<const T*>(&lo));
        s[1] += to_f(*reinterpret_cast<const T*>(&hi));
    }
}

// The block's words of the sum, through the region at word `region` of every receive buffer
// (`cap` words a sender), under the epoch at `epoch_at`.
template <typename T>
__device__ void peer_all_reduce(const PeerArgs a, const Segments<T> x, unsigned int* epoch_at,
                                size_t region, unsigned int cap) {
    pdl_entry();
    const unsigned int words = (unsigned int)(((unsigned long long)x.n * sizeof(T) + 3) / 4);
    const unsigned int per = (words + gridDim.x - 1) / gridDim.x;
    const unsigned int lo = min(words, blockIdx.x * per);
    const unsigned int hi = min(words, lo + per);
    // Every thread reads the block's epoch itself (one broadcast load, in flight together with
    // its first words) rather than after a barrier behind thread 0's load. The block's last
    // store of it, below, follows a barrier every thread reaches after its read.
    const unsigned int epoch = *epoch_at + 1;
    const size_t half = region + (size_t)(epoch & 1u) * a.world * cap;
    for (unsigned int w = lo + threadIdx.x; w < hi; w += blockDim.x) {
        const unsigned long long v = ((unsigned long long)epoch << 32) | word_of(x, w);
        for (unsigned int p = 0; p < a.world; ++p) {
            if (p == a.rank) continue;
            unsigned long long* theirs = reinterpret_cast<unsigned long long*>(a.recv[p]);
            store_word(theirs + half + (size_t)a.rank * cap + w, v);
        }
    }
    const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(a.recv[a.rank]);
    for (unsigned int w = lo + threadIdx.x; w < hi; w += blockDim.x) {
        float s[2] = {0.f, 0.f};
        for (unsigned int r = 0; r < a.world; ++r) {
            unsigned int word;
            if (r == a.rank) {
                word = word_of(x, w);
            } else {
                word = wait_word(mine + half + (size_t)r * cap + w, epoch);
            }
            add_word<T>(s, word);
        }
        unsigned int at;
        if (sizeof(T) == 4) {
            x.dst(w, at)[at] = from_f<T>(s[0]);
        } else {
            T* y = x.dst(2 * w, at);
            y[at] = from_f<T>(s[0]);
            if (2 * w + 1 < x.n) y[at + 1] = from_f<T>(s[1]);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *epoch_at = epoch;
}

// Every rank's x (n elements each, whole 4-byte words) in y, rank order ([world][n]): the
// vocabulary-parallel head's all-gather. A plain call (its blocks, epochs and region): the
// block's words of x go to every peer as a sum's do, and to this rank's part of y; then each
// peer's words are waited for and copied to that peer's part.
template <typename T>
__device__ void peer_all_gather(const PeerArgs a, const T* x, T* y, unsigned int* epoch_at) {
    pdl_entry();
    const unsigned int words = (unsigned int)(((unsigned long long)a.n * sizeof(T)) / 4);
    const unsigned int per = (words + gridDim.x - 1) / gridDim.x;
    const unsigned int lo = min(words, blockIdx.x * per);
    const unsigned int hi = min(words, lo + per);
    const unsigned int epoch = *epoch_at + 1;
    const size_t half = (size_t)(epoch & 1u) * a.world * a.cap;
    const unsigned int* xw = reinterpret_cast<const unsigned int*>(x);
    unsigned int* yw = reinterpret_cast<unsigned int*>(y);
    for (unsigned int w = lo + threadIdx.x; w < hi; w += blockDim.x) {
        const unsigned int word = xw[w];
        const unsigned long long v = ((unsigned long long)epoch << 32) | word;
        for (unsigned int p = 0; p < a.world; ++p) {
            if (p == a.rank) continue;
            unsigned long long* theirs = reinterpret_cast<unsigned long long*>(a.recv[p]);
            store_word(theirs + half + (size_t)a.rank * a.cap + w, v);
        }
        yw[(size_t)a.rank * words + w] = word;
    }
    const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(a.recv[a.rank]);
    for (unsigned int w = lo + threadIdx.x; w < hi; w += blockDim.x) {
        for (unsigned int r = 0; r < a.world; ++r) {
            if (r == a.rank) continue;
            yw[(size_t)r * words + w] = wait_word(mine + half + (size_t)r * a.cap + w, epoch);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *epoch_at = epoch;
}

// The fused kernels: one block sums every word through the fused region, then (the sums
// visible to the whole block after the barrier that ends the sum) runs the residual add + norm
// (AddNormParams as in the add_norm kernels).
template <typename T, int PT, bool TWO>
__device__ void peer_add_norm(const PeerArgs a, const Segments<T> x, unsigned int* epochs,
                              const AddNormParams p, const T* __restrict__ res,
                              const T* __restrict__ w, const T* __restrict__ scalar,
                              const T* __restrict__ w2, T* __restrict__ out, T* __restrict__ out2,
                              const T* __restrict__ w3, T* __restrict__ out3,
                              const T* __restrict__ wa, const T* __restrict__ wb) {
    peer_all_reduce<T>(a, x, epochs + PEER_FUSED_EPOCH, (size_t)2 * a.world * a.cap, a.fcap);
    for (uint32_t r = 0; r < p.rows; ++r)
        add_norm_body<T, ADD_NORM_THREADS, PT, TWO>(p, r, res, x.ya, w, scalar, w2, out, out2,
                                                    w3, out3, x.yb, wa, wb);
}

// The 26B-A4B layer end at one row with the expert mix inside: yb[o] = sum_j mix[j] *
// ye[j, o] over the k picked experts' rows (the order and rounding of moe_mix in moe.cu), then
// the two branches (x, yb) summed over the ranks and the add + norms, as peer_moe_add_norm.
// The mix took a launch of its own before the sum; its rows are read after the dependent-launch
// wait, and the sum reads yb back with plain loads after the barrier that ends the mix.
template <typename T>
__device__ void peer_moe_mix_add_norm(const PeerArgs a, const T* x, const T* ye,
                                      const float* mix, unsigned int k, T* y, T* yb,
                                      unsigned int* epochs, const AddNormParams p,
                                      const T* __restrict__ res, const T* __restrict__ w,
                                      const T* __restrict__ scalar, const T* __restrict__ w2,
                                      T* __restrict__ out, T* __restrict__ out2,
                                      const T* __restrict__ w3, T* __restrict__ out3,
                                      const T* __restrict__ wa, const T* __restrict__ wb) {
    pdl_wait();
    const unsigned int na = a.n / 2;
    for (unsigned int o = threadIdx.x; o < na; o += blockDim.x) {
        float acc = 0.f;
        for (unsigned int j = 0; j < k; ++j) acc = fmaf(mix[j], to_f(ye[(size_t)j * na + o]), acc);
        yb[o] = from_f<T>(acc);
    }
    __syncthreads();
    peer_add_norm<T, MOE_ADD_NORM_PER_THREAD, true>(a, Segments<T>{x, yb, y, yb, na, a.n}, epochs,
                                                    p, res, w, scalar, w2, out, out2, w3, out3,
                                                    wa, wb);
}

#define PEER_KERNEL(TN, T)                                                                      \
    extern "C" __global__ void peer_all_reduce_##TN(const PeerArgs a, const T* __restrict__ x,  \
                                                    T* __restrict__ y, unsigned int* epochs) {  \
        peer_all_reduce<T>(a, Segments<T>{x, x, y, y, a.n, a.n}, epochs + blockIdx.x, 0, a.cap); \
    }                                                                                           \
    extern "C" __global__ void peer_all_gather_##TN(const PeerArgs a, const T* x, T* y,         \
                                                    unsigned int* epochs) {                     \
        peer_all_gather<T>(a, x, y, epochs + blockIdx.x);                                       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS)                              \
        peer_add_norm_##TN(const PeerArgs a, const T* x, T* y, unsigned int* epochs,            \
                           const AddNormParams p, const T* res, const T* w, const T* scalar,    \
                           const T* w2, T* out, T* out2, const T* w3, T* out3) {                \
        peer_add_norm<T, ADD_NORM_PER_THREAD, false>(a, Segments<T>{x, x, y, y, a.n, a.n},      \
                                                     epochs, p, res, w, scalar, w2, out, out2,  \
                                                     w3, out3, w, w);                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS) peer_moe_add_norm_##TN(      \
        const PeerArgs a, const T* x, const T* xb, T* y, T* yb, unsigned int* epochs,           \
        const AddNormParams p, const T* res, const T* w, const T* scalar, const T* w2, T* out,  \
        T* out2, const T* w3, T* out3, const T* wa, const T* wb) {                              \
        const unsigned int na = a.n / 2;                                                        \
        peer_add_norm<T, MOE_ADD_NORM_PER_THREAD, true>(                                        \
            a, Segments<T>{x, xb, y, yb, na, a.n}, epochs, p, res, w, scalar, w2, out, out2, w3, \
            out3, wa, wb);                                                                      \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS) peer_moe_mix_add_norm_##TN(  \
        const PeerArgs a, const T* x, const T* ye, const float* mix, unsigned int k, T* y,      \
        T* yb, unsigned int* epochs, const AddNormParams p, const T* res, const T* w,           \
        const T* scalar, const T* w2, T* out, T* out2, const T* w3, T* out3, const T* wa,       \
        const T* wb) {                                                                          \
        peer_moe_mix_add_norm<T>(a, x, ye, mix, k, y, yb, epochs, p, res, w, scalar, w2, out,   \
                                 out2, w3, out3, wa, wb);                                       \
    }

PEER_KERNEL(f32, float)
PEER_KERNEL(bf16, __nv_bfloat16)
PEER_KERNEL(f16, __half)
