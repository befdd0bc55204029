// The GeGLU gate, gelu_tanh(a) * b, as the layer, dense-product and expert kernels compute it
// (rounded to T where the unfused candle ops round).

#pragma once

#include "common.cuh"
#include "norm_tail.cuh"

__device__ __forceinline__ float gelu_tanh(const float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// gelu_tanh(a) * b on eight packed elements, rounded as gelu_mul rounds.
template <typename T>
__device__ __forceinline__ uint4 gate8(const uint4 a, const uint4 b) {
    const T* pa = reinterpret_cast<const T*>(&a);
    const T* pb = reinterpret_cast<const T*>(&b);
    uint4 r;
    T* pr = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int i = 0; i < 8; ++i) pr[i] = from_f<T>(rnd<T>(gelu_tanh(to_f(pa[i]))) * to_f(pb[i]));
    return r;
}
