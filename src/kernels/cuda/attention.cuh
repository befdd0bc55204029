// Shared device code of the fused attention kernels (`attention.cu`, CUDA cores, and
// `attention_tc.cu`, tensor cores): the launch parameters, K/V element decoding, key positions,
// the key split, and the entry of the batched kernels.
//
// QsdpaParams must match `QsdpaParams` in `src/kernels/plan.rs` field for field (#[repr(C)]).

#pragma once

#include <stdint.h>

#include "common.cuh"
#include "packed.cuh"

#include <type_traits>

struct QsdpaParams {
    // Element strides of K/V codes and scales/biases along heads and keys (last axis is dense).
    uint64_t k_codes_sh, k_codes_sk, k_sc_sh, k_sc_sk;
    uint64_t v_codes_sh, v_codes_sk, v_sc_sh, v_sc_sk;
    uint32_t n_heads, kv_heads, q_len, head_dim;
    uint32_t keys, group_size, window, q_offset;
    // Key positions: mode 0: base + j; mode 1: two runs (j < split: base + j, else base2 + j - split);
    // mode 2: read positions[j].
    uint32_t pos_mode, pos_base, pos_split, pos_base2;
    uint32_t n_split, keys_per_split;
    float scale;
    uint32_t long_splits;  // splits 0 .. long_splits - 1 take QS_SPLIT_STEP keys more
};

// One sequence of a batched attention launch (`qsdpa_batch_*`): its parameters and the device
// addresses of its K/V words, scales, biases and position table (queries and outputs are one
// [batch, n_heads, q_len, head_dim] tensor each, partials one buffer with n_split_max splits a
// sequence). Must match `QsdpaSeq` in `src/kernels/cuda/attention/batched.rs`.
struct QsdpaSeq {
    QsdpaParams p;
    uint64_t kc, ks, kb, vc, vs, vb, pos, pad_;
};

// Element i of a lane's slice of dense K/V (BITS = 16: f16/bf16 bit patterns, 32: f32).
template <typename T, int BITS>
__device__ __forceinline__ float dense_of(const uint32_t* w, int i, int shift) {
    if constexpr (BITS == 32) {
        return __uint_as_float(w[i]);
    } else {
        const int bit = i * 16 + shift;
        const uint32_t h = (w[bit >> 5] >> (bit & 31)) & 0xffffu;
        if constexpr (sizeof(T) == 2 && std::is_same<T, __half>::value) {
            return __half2float(__ushort_as_half((unsigned short)h));
        } else {
            return __uint_as_float(h << 16);
        }
    }
}

// A K/V element: packed code (BITS 4/8, before scale and bias) or dense value (BITS 16/32).
template <typename T, int BITS, int NW>
__device__ __forceinline__ float kv_elem(const uint32_t* w, int i, int shift) {
    if constexpr (BITS >= 16) {
        return dense_of<T, BITS>(w, i, shift);
    } else {
        return code_of<BITS, NW>(w, i, shift);
    }
}

// Position of key j under the position fields (pos_mode, pos_base, pos_split, pos_base2) of a
// launch's parameters (QsdpaParams, PrefillParams).
template <typename P>
__device__ __forceinline__ uint32_t key_pos(const P& p, const uint32_t* pos, int j) {
    if (p.pos_mode == 0) return p.pos_base + (uint32_t)j;
    if (p.pos_mode == 1)
        return (uint32_t)j < p.pos_split ? p.pos_base + (uint32_t)j
                                          : p.pos_base2 + ((uint32_t)j - p.pos_split);
    return pos[j];
}

// Keys [x, y) of key split `split`: keys_per_split each, the first long_splits one step more
// (`KeySplit` in plan.rs).
constexpr int QS_SPLIT_STEP = 16;
__device__ __forceinline__ int2 split_range(const QsdpaParams& p, int split) {
    const int first =
        split * (int)p.keys_per_split + min(split, (int)p.long_splits) * QS_SPLIT_STEP;
    const int len = (int)p.keys_per_split + (split < (int)p.long_splits ? QS_SPLIT_STEP : 0);
    return make_int2(first, min((int)p.keys, first + len));
}

// Most key splits the combine kernel merges (host: QSDPA_MAX_SPLIT).
constexpr int QS_MAX_SPLIT = 1024;

// Entry of the batch kernels: the block's sequence (grid z = sequence x split) from its
// descriptor, with its slices of the queries, outputs and partials, handed to `body` (a kernel
// body taking the single-sequence kernel's arguments and the split).
template <typename T, int HD, typename Body>
__device__ __forceinline__ void qsdpa_batch_entry(const QsdpaSeq* seqs, uint32_t n_split_max,
                                                  const T* q, T* out, float* part_ml,
                                                  float* part_acc, Body body) {
    const uint32_t seq = blockIdx.z / n_split_max, split = blockIdx.z % n_split_max;
    const QsdpaSeq& s = seqs[seq];
    const QsdpaParams p = s.p;
    if (split >= p.n_split) return;
    const size_t qn = (size_t)p.n_heads * p.q_len * HD;
    const size_t pr = (size_t)n_split_max * p.n_heads * p.q_len;
    body(p, q + seq * qn, reinterpret_cast<const uint32_t*>(s.kc),
         reinterpret_cast<const T*>(s.ks), reinterpret_cast<const T*>(s.kb),
         reinterpret_cast<const uint32_t*>(s.vc), reinterpret_cast<const T*>(s.vs),
         reinterpret_cast<const T*>(s.vb), reinterpret_cast<const uint32_t*>(s.pos),
         out + seq * qn, part_ml + seq * pr * 2, part_acc + seq * pr * HD, (int)split);
}
