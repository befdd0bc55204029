// Helpers shared by every kernel file: element conversions, the 8-wide activation
// load, the streaming weight load, the m16n8k16 tensor-core product, the (value, index) warp
// reduction of the argmax kernels, and the softmaxes' base-2 exponential.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// 2^x, approximate, subnormal results flushed to zero: one MUFU.EX2, without __expf's subnormal
// fix-ups (softmaxes scale their exponents by LOG2E instead).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

// 8 consecutive elements as f32 (16-byte aligned for f16/bf16, 32 bytes for f32).
template <typename T> __device__ __forceinline__ void load_x8(const T* p, float* v);
template <> __device__ __forceinline__ void load_x8<float>(const float* p, float* v) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <> __device__ __forceinline__ void load_x8<__half>(const __half* p, float* v) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&a);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        v[2 * i] = f.x; v[2 * i + 1] = f.y;
    }
}
template <> __device__ __forceinline__ void load_x8<__nv_bfloat16>(const __nv_bfloat16* p, float* v) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// Keeps the larger of (bv, bi) and (v, i); ties go to the lower index.
template <typename I>
__device__ __forceinline__ void argmax_step(float& bv, I& bi, float v, I i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// Warp-wide (value, index) argmax: every lane ends with the warp's best pair.
template <typename I>
__device__ __forceinline__ void warp_argmax(float& bv, I& bi) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const I oi = __shfl_xor_sync(0xffffffffu, bi, off);
        argmax_step(bv, bi, ov, oi);
    }
}

// The two halves of `pdl_entry`. Kernels that load data no earlier kernel writes (settled
// weights) may issue those loads before the wait.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// First statement of every kernel: with programmatic dependent launch (kernel_cache.rs) the
// blocks may be scheduled while the previous kernel on the stream still runs; wait for it to
// finish and its writes to be visible, then let the next kernel's blocks be scheduled. Without
// such a launch both return at once.
__device__ __forceinline__ void pdl_entry() {
    pdl_wait();
    pdl_trigger();
}

// Streaming 16-byte load that does not allocate in L1 (keeps the small activation there).
__device__ __forceinline__ uint4 ld_stream4(const uint32_t* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// A 16-byte load of data an earlier kernel may still be writing, for kernels that issue loads
// before their `pdl_wait`: a coherent load in volatile asm stays after the wait. Reads of
// `const __restrict__` pointers compile to the read-only path (LDG.CONSTANT), which nvcc and
// ptxas treat as unchanging for the whole launch and moved above the wait (seen in the SASS
// of the early `qmv_row4` kernels: stale activations under load).
__device__ __forceinline__ uint4 ld_after_wait4(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p)
                 : "memory");
    return r;
}

// c += A (16x16) * B (16x8), f32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, const uint32_t* b) {
    if constexpr (std::is_same<T, __half>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// Epilogue of the block-split tensor-core matvecs: each warp holds MT m16n8 accumulator tiles
// (flat, 4 floats a tile) over its share of the input; they are summed over the block's WARPS
// warps through `red` and the first MT warps write one tile each. Tile t covers output rows
// tile0 + 16 t ..; its C fragment is (row gq, cols 2q, 2q + 1) and (row gq + 8, same cols),
// the columns being activation rows (`rows` of them, y is [rows, out_dim]).
template <typename T, int MT, int WARPS>
__device__ __forceinline__ void store_mma_tiles(const float* acc, float (*red)[32][4 * MT],
                                                int tile0, int last, int rows, int out_dim,
                                                T* __restrict__ y) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, q = lane & 3;
#pragma unroll
    for (int i = 0; i < 4 * MT; ++i) red[warp][lane][i] = acc[i];
    __syncthreads();
    if (warp >= MT) return;
    const int t = warp;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i] += red[w][lane][4 * t + i];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = tile0 + 16 * t + gq + (i >= 2 ? 8 : 0);
        const int col = 2 * q + (i & 1);
        if (row <= last && col < rows) y[(size_t)col * out_dim + row] = from_f<T>(s[i]);
    }
}
