// CPU stand-ins for the Metal Shading Language features qkernels.metal uses, so the kernels
// compile as C++20 on machines without a Metal compiler (scripts/metal-syntax.sh) and run on CPU
// threads (tests/metal_emulation/emulate.cpp, driven by tests/metal_emulation.rs):
// * one OS thread per Metal thread, one threadgroup at a time; threadgroup arrays are function
//   statics (QK_THREADGROUP), so they are shared by the group that runs;
// * threadgroup_barrier is a barrier over the group's threads, simd_sum a barrier-synchronised
//   sum over the 32 threads of a simdgroup (same value in every lane, as on the GPU);
// * half is IEEE binary16 (_Float16), bfloat the top 16 bits of a float, both rounded to
//   nearest even on conversion as the GPU does; math is the C library's (exp is exact where
//   Metal's fast math is not, so results agree to rounding, not bit for bit).
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#define kernel
#define device
#define constant
#define threadgroup
#define thread
#define QK_THREADGROUP static
// The emulation compiles every kernel, the bf16 ones included (Metal 3.1).
#define __METAL_VERSION__ 310
namespace metal {
typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned long ulong;

struct half {
    _Float16 v;
    half() = default;
    half(float f) : v(static_cast<_Float16>(f)) {}
    operator float() const { return static_cast<float>(v); }
};

struct bfloat {
    uint16_t bits;
    bfloat() = default;
    bfloat(float f) {
        uint32_t x;
        std::memcpy(&x, &f, 4);
        if ((x & 0x7fffffffu) > 0x7f800000u) {
            bits = uint16_t((x >> 16) | 0x40u);  // quiet NaN
        } else {
            bits = uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
        }
    }
    operator float() const {
        const uint32_t x = uint32_t(bits) << 16;
        float f;
        std::memcpy(&f, &x, 4);
        return f;
    }
};

struct uint2 {
    uint x, y;
};
struct uint3 {
    uint x, y, z;
};
enum class mem_flags { mem_threadgroup };

// The calling thread's place in the emulated dispatch (set by the emulator before each group).
struct EmuThread {
    std::barrier<>* group_barrier;
    std::barrier<>* simd_barrier;
    float* simd_values;  // 32 slots of the thread's simdgroup
    uint lane;
};
inline thread_local EmuThread emu_thread{};

inline void threadgroup_barrier(mem_flags) { emu_thread.group_barrier->arrive_and_wait(); }

inline float simd_sum(float x) {
    EmuThread& t = emu_thread;
    t.simd_values[t.lane] = x;
    t.simd_barrier->arrive_and_wait();
    float s = 0.f;
    for (int i = 0; i < 32; ++i) s += t.simd_values[i];
    t.simd_barrier->arrive_and_wait();  // every lane has read before the slots are reused
    return s;
}

// Reinterprets the bits of a value (Metal's `as_type`).
template <typename To, typename From>
inline To as_type(From f) {
    static_assert(sizeof(To) == sizeof(From), "as_type between types of one size");
    To t;
    std::memcpy(&t, &f, sizeof(To));
    return t;
}

using std::clamp;
using std::exp;
using std::fabs;
using std::fma;
using std::max;
using std::min;
using std::rint;
}  // namespace metal
