// A stricter stand-in for <metal_stdlib> (scripts/metal-strict.sh): Metal's address spaces as
// distinct clang address spaces, so that a pointer or reference passed across them (a
// threadgroup array into a `device` parameter, a `constant` struct into a `device` one) is a
// compile error, as it is for Apple's compiler. `half` and `bfloat` are clang's builtin
// `_Float16` and `__bf16`, as they are builtins in Metal. Nothing runs against this header:
// the emulation (shim.h) runs the kernels.
#pragma once
// No system headers: the check needs only the compiler (the libclang wheel has no C library).
#define INFINITY __builtin_inff()
#define kernel
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#define QK_THREADGROUP static threadgroup
// Metal 3.1 (macOS 14, with `bfloat`) unless the check asks for an older version.
#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif
namespace metal {
typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned long ulong;
typedef _Float16 half;
#if __METAL_VERSION__ >= 310
typedef __bf16 bfloat;  // Metal 3.1+ only, as on Apple's compiler
#endif
struct uint2 {
    uint x, y;
};
struct uint3 {
    uint x, y, z;
};
enum class mem_flags { mem_threadgroup };
void threadgroup_barrier(mem_flags);
float simd_sum(float);
inline float exp(float x) { return __builtin_expf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
inline float rint(float x) { return __builtin_rintf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
template <typename T>
T max(T a, T b) { return a > b ? a : b; }
template <typename T>
T min(T a, T b) { return a < b ? a : b; }
template <typename To, typename From>
To as_type(From f) { return __builtin_bit_cast(To, f); }
template <typename T>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
}  // namespace metal
