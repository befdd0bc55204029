// What the peer-memory sums share (`peer_reduce.cu`, and the products that send their outputs
// to the peers themselves in `dense_matvec.cu`): the arguments naming every rank's receive
// buffer, the 8-byte stores that carry a 4-byte word with its call's epoch, and the tail of a
// product that sums its outputs over the ranks and then runs the residual add + norm.
// PeerArgs must match `src/kernels/cuda/peer_reduce.rs` field for field (#[repr(C)]).
#pragma once

#include "common.cuh"
#include "norm_tail.cuh"

#define PEER_MAX_RANKS 8
#define PEER_MAX_BLOCKS 32
// The epoch of the fused (sum, then add + norm) calls, after the multi-block calls' epochs.
#define PEER_FUSED_EPOCH PEER_MAX_BLOCKS

struct PeerArgs {
    unsigned long long recv[PEER_MAX_RANKS];  // every rank's receive buffer: the multi-block
                                              // region [2 halves][world senders][cap words],
                                              // then the fused region (fcap words a sender)
    unsigned int rank;
    unsigned int world;
    unsigned int n;     // elements
    unsigned int cap;   // words a sender's slot holds (multi-block region)
    unsigned int fcap;  // words a sender's slot holds (fused region)
    unsigned int pad;
};

__device__ __forceinline__ void store_word(unsigned long long* p, unsigned long long v) {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long load_word(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The word at `at` once it carries `epoch`. A peer that never sends (its rank failed) would
// hold the thread forever: after about half a minute the kernel traps, which fails every later
// call on this device instead.
__device__ __forceinline__ unsigned int wait_word(const unsigned long long* at,
                                                  unsigned int epoch) {
    unsigned long long v = load_word(at);
    const long long start = clock64();
    while ((unsigned int)(v >> 32) != epoch) {
        if (clock64() - start > (1ll << 36)) __trap();
        v = load_word(at);
    }
    return (unsigned int)v;
}

// Word offset of the fused region's half for `epoch` in a receive buffer.
__device__ __forceinline__ size_t fused_half(const PeerArgs& a, unsigned int epoch) {
    return (size_t)2 * a.world * a.cap + (size_t)(epoch & 1u) * a.world * a.fcap;
}

// A 16-bit product's outputs [o0, o1) of each of `rows` rows (o0 and o1 even, rows `dim`
// wide, dim even), which this block has stored to y: sent to every peer's fused region as
// words tagged with `epoch`. Word w of the sum holds elements 2w and 2w + 1 of y.
template <typename T>
__device__ __forceinline__ void peer_send_outputs(const PeerArgs& a, const T* y,
                                                  unsigned int rows, unsigned int dim,
                                                  unsigned int o0, unsigned int o1,
                                                  unsigned int epoch) {
    static_assert(sizeof(T) == 2, "16-bit outputs");
    __syncthreads();  // the block's stores of y, visible to every thread of it
    const unsigned int per_row = (o1 - o0) / 2;
    const size_t half = fused_half(a, epoch);
    for (unsigned int t = threadIdx.x; t < rows * per_row; t += blockDim.x) {
        const unsigned int r = t / per_row;
        const unsigned int w = (r * dim + o0) / 2 + t % per_row;
        const unsigned int word = __ldcg(reinterpret_cast<const unsigned int*>(y) + w);
        const unsigned long long v = ((unsigned long long)epoch << 32) | word;
        for (unsigned int p = 0; p < a.world; ++p) {
            if (p == a.rank) continue;
            unsigned long long* theirs = reinterpret_cast<unsigned long long*>(a.recv[p]);
            store_word(theirs + half + (size_t)a.rank * a.fcap + w, v);
        }
    }
}

// The last block of a product whose blocks sent their outputs (`peer_send_outputs`): once every
// peer's words of this call are in, y becomes the sum over the ranks (rank order, so every
// rank computes the same bits, each rank's part rounded to T as a product's output is), then
// the residual add + norm runs on it and the call's epoch is stored. Returns at once in every
// other block.
template <typename T, int THREADS, typename P>
__device__ __forceinline__ void last_block_peer_add_norm(
    const PeerArgs& a, unsigned int* epoch_at, unsigned int epoch, const P& p,
    const MvNormParams& n, T* y, const T* __restrict__ res, const T* __restrict__ w,
    const T* __restrict__ scalar, const T* __restrict__ w2, const T* __restrict__ w3,
    T* __restrict__ out, T* __restrict__ out2, T* __restrict__ out3,
    uint32_t* __restrict__ counter) {
    static_assert(sizeof(T) == 2, "16-bit outputs");
    if (!is_last_block(counter)) return;
    const unsigned int words = p.rows * p.out_dim / 2;
    const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(a.recv[a.rank]);
    const size_t half = fused_half(a, epoch);
    unsigned int* yw = reinterpret_cast<unsigned int*>(y);
    // PK words a thread a pass, each rank's loads issued together (a pass waits on memory once
    // a rank, not once a word); 26B-A4B's 2816-wide rows take one pass at 256 threads.
    constexpr int PK = 6;
    for (unsigned int i0 = 0; i0 < words; i0 += PK * THREADS) {
        float s[PK][2];
        unsigned int word[PK];
#pragma unroll
        for (int k = 0; k < PK; ++k) s[k][0] = s[k][1] = 0.f;
        for (unsigned int r = 0; r < a.world; ++r) {
            const unsigned long long* from = mine + half + (size_t)r * a.fcap;
            if (r == a.rank) {
#pragma unroll
                for (int k = 0; k < PK; ++k)
                    word[k] = __ldcg(yw + min(i0 + threadIdx.x + k * THREADS, words - 1));
            } else {
                unsigned long long v[PK];
#pragma unroll
                for (int k = 0; k < PK; ++k)
                    v[k] = load_word(from + min(i0 + threadIdx.x + k * THREADS, words - 1));
                // Words not in yet (an earlier call's epoch) are waited for one by one.
#pragma unroll
                for (int k = 0; k < PK; ++k) {
                    const unsigned int i = min(i0 + threadIdx.x + k * THREADS, words - 1);
                    word[k] = (unsigned int)(v[k] >> 32) == epoch ? (unsigned int)v[k]
                                                                   : wait_word(from + i, epoch);
                }
            }
#pragma unroll
            for (int k = 0; k < PK; ++k) {
                const unsigned short lo = word[k] & 0xffffu, hi = word[k] >> 16;
                s[k][0] += to_f(*reinterpret_cast<const T*>(&lo));
                s[k][1] += to_f(*reinterpret_cast<const T*>(&hi));
            }
        }
        // Each thread writes back only its own words (a clamped duplicate is dropped).
#pragma unroll
        for (int k = 0; k < PK; ++k) {
            const unsigned int i = i0 + threadIdx.x + k * THREADS;
            if (i >= words) continue;
            const T lo = from_f<T>(s[k][0]), hi = from_f<T>(s[k][1]);
            yw[i] = (unsigned int)*reinterpret_cast<const unsigned short*>(&lo) |
                    ((unsigned int)*reinterpret_cast<const unsigned short*>(&hi) << 16);
        }
    }
    __syncthreads();
    block_add_norm<T, THREADS>(p, n, y, res, w, scalar, w2, w3, out, out2, out3);
    if (threadIdx.x == 0) *epoch_at = epoch;
}
