// Minimal C++ stand-ins for the Metal Shading Language features qkernels.metal uses, so that
// `g++ -fsyntax-only` surfaces syntax and type errors on machines without a Metal compiler
// (scripts/cuda-metal-syntax.sh). Semantics (SIMD reductions, barriers) are not modelled.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#define kernel
#define device
#define constant
#define threadgroup
#define thread
namespace metal {
typedef unsigned int uint;
typedef unsigned long ulong;
struct half {
    float v;
    half() = default;
    half(float f) : v(f) {}
    operator float() const { return v; }
};
struct bfloat {
    float v;
    bfloat() = default;
    bfloat(float f) : v(f) {}
    operator float() const { return v; }
};
struct uint3 {
    uint x, y, z;
};
enum class mem_flags { mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
inline float simd_sum(float x) { return x; }
using std::exp;
using std::fma;
using std::max;
using std::min;
}  // namespace metal
