// One-shot all-reduce over the GPUs of one process, through peer memory (NVLink). Each rank
// writes its part straight into every peer's receive buffer, one 4-byte word at a time
// packed with the call's epoch into one 8-byte store (which lands whole), so the receiver
// needs no separate flag: it polls its own memory until every word carries this call's
// epoch, then sums every rank's words in rank order (so every rank computes the same bits).
// Used for the small sums of decode steps, where NCCL's latency is most of the cost; launched
// inside CUDA graphs like any kernel.
//
// Every call runs PEER_MAX_BLOCKS blocks, whatever its size, so block b's epoch (its count of
// calls, kept in the rank's own memory) is the same on every rank and in every block.
// Receive buffers alternate between two halves by epoch parity: a rank writes into a half
// again two calls later, once it has received every peer's words of the call in between,
// which the peer sends only after its call that read the half has ended.
#include "common.cuh"

#define PEER_MAX_RANKS 8
#define PEER_MAX_BLOCKS 32

struct PeerArgs {
    unsigned long long recv[PEER_MAX_RANKS];  // every rank's receive buffer:
                                              // [2 halves][world senders][cap words] u64
    unsigned int rank;
    unsigned int world;
    unsigned int n;    // elements
    unsigned int cap;  // words a sender's slot holds
};

__device__ __forceinline__ void store_word(unsigned long long* p, unsigned long long v) {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long load_word(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Word w of x: one f32, or two 16-bit elements (the second 0 past the end).
template <typename T>
__device__ __forceinline__ unsigned int word_of(const T* x, unsigned int w, unsigned int n) {
    if (sizeof(T) == 4) return reinterpret_cast<const unsigned int*>(x)[w];
    const unsigned short* h = reinterpret_cast<const unsigned short*>(x);
    const unsigned int lo = h[2 * w];
    const unsigned int hi = 2 * w + 1 < n ? h[2 * w + 1] : 0u;
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

template <typename T>
__device__ void peer_all_reduce(const PeerArgs a, const T* __restrict__ x, T* __restrict__ y,
                                unsigned int* epochs) {
    pdl_entry();
    const unsigned int words = (unsigned int)(((unsigned long long)a.n * sizeof(T) + 3) / 4);
    const unsigned int per = (words + gridDim.x - 1) / gridDim.x;
    const unsigned int lo = min(words, blockIdx.x * per);
    const unsigned int hi = min(words, lo + per);
    __shared__ unsigned int epoch_s;
    if (threadIdx.x == 0) epoch_s = epochs[blockIdx.x] + 1;
    __syncthreads();
    const unsigned int epoch = epoch_s;
    const size_t half = (size_t)(epoch & 1u) * a.world * a.cap;
    for (unsigned int w = lo + threadIdx.x; w < hi; w += blockDim.x) {
        const unsigned long long v = ((unsigned long long)epoch << 32) | word_of(x, w, a.n);
        for (unsigned int p = 0; p < a.world; ++p) {
            if (p == a.rank) continue;
            unsigned long long* theirs = reinterpret_cast<unsigned long long*>(a.recv[p]);
            store_word(theirs + half + (size_t)a.rank * a.cap + w, v);
        }
    }
    const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(a.recv[a.rank]);
    for (unsigned int w = lo + threadIdx.x; w < hi; w += blockDim.x) {
        float s[2] = {0.f, 0.f};
        for (unsigned int r = 0; r < a.world; ++r) {
            unsigned int word;
            if (r == a.rank) {
                word = word_of(x, w, a.n);
            } else {
                const unsigned long long* at = mine + half + (size_t)r * a.cap + w;
                unsigned long long v = load_word(at);
                // A peer that never sends (its rank failed) would hold this thread forever:
                // after about half a minute the kernel traps, which fails every later call on
                // this device instead.
                const long long start = clock64();
                while ((unsigned int)(v >> 32) != epoch) {
                    if (clock64() - start > (1ll << 36)) __trap();
                    v = load_word(at);
                }
                word = (unsigned int)v;
            }
            add_word<T>(s, word);
        }
        if (sizeof(T) == 4) {
            y[w] = from_f<T>(s[0]);
        } else {
            y[2 * w] = from_f<T>(s[0]);
            if (2 * w + 1 < a.n) y[2 * w + 1] = from_f<T>(s[1]);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}

#define PEER_KERNEL(NAME, T)                                                                    \
    extern "C" __global__ void NAME(const PeerArgs a, const T* __restrict__ x,                  \
                                    T* __restrict__ y, unsigned int* epochs) {                  \
        peer_all_reduce<T>(a, x, y, epochs);                                                    \
    }

PEER_KERNEL(peer_all_reduce_f32, float)
PEER_KERNEL(peer_all_reduce_bf16, __nv_bfloat16)
PEER_KERNEL(peer_all_reduce_f16, __half)
