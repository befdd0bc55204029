// Shared-memory staging for the packed matvec kernels: async 16-byte global -> shared copies
// (cp.async, bypassing L1; committed and waited per warp) and a thread's code words read back
// from shared memory.
#pragma once
#include <stdint.h>

// Async 16-byte global -> shared copies (bypassing L1), committed and waited per warp.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// A thread's TW consecutive code words from shared memory (16-byte aligned for TW >= 4).
template <int TW> __device__ __forceinline__ void lds_codes(const uint32_t* p, uint32_t* w) {
    if constexpr (TW >= 4) {
#pragma unroll
        for (int c = 0; c < TW / 4; ++c) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[c];
            w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
        }
    } else if constexpr (TW == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = *p;
    }
}
