// The residual add + norm that a product's last block computes (`last_block_add_norm`), the
// add_norm kernels' body (`add_norm_body`, also the epilogue of the fused peer sum), and the
// helpers they share: included by dense_matvec.cu (dense products), matvec.cu (packed
// products), layer_ops.cu, reduce.cu and peer_reduce.cu. AddNormParams must match
// `src/kernels/cuda/layer_ops.rs` field for field (#[repr(C)]).
#pragma once

#include <stdint.h>

#include "common.cuh"

// Rounds an f32 to T and back (the rounding an unfused op would apply to its output).
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

// Threads a block of the row-wise norm and softmax kernels.
constexpr int NORM_THREADS = 256;

// Sum over the block (THREADS threads, NORM_THREADS by default); `red` holds THREADS / 32
// floats.
template <int THREADS = 256>
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) s += red[w];
    return s;
}

// The residual add + norm folded into the product that feeds it (`_norm` kernels). Flags as in
// AddNormParams: 1 scalar, 2 next norm, 4 second next norm.
struct MvNormParams {
    uint32_t flags;
    float eps;
};

// Loads bypassing L1: rows other blocks of this launch wrote.
template <typename T>
__device__ __forceinline__ float ld_cg(const T* p) {
    if constexpr (sizeof(T) == 4) {
        return __ldcg(reinterpret_cast<const float*>(p));
    } else {
        const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
        T v;
        memcpy(&v, &u, sizeof(T));
        return to_f(v);
    }
}

// Two packed f16/bf16 elements as f32.
template <typename T>
__device__ __forceinline__ float2 unpack2(const uint32_t u) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u));
    } else {
        __half2 h;
        memcpy(&h, &u, 4);
        return __half22float2(h);
    }
}

// Eight f32 values as eight packed f16/bf16 elements.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
    uint4 r;
    T* pr = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int i = 0; i < 8; ++i) pr[i] = from_f<T>(v[i]);
    return r;
}

// Eight packed f16/bf16 elements as f32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4 u, float (&v)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 f = unpack2<T>(w[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
    }
}

// Whether this block is the launch's last to get here, every other block's stores then visible
// to it (a launch-wide counter, left at zero for the next launch). One thread fences for the
// block, after the barrier (fences are cumulative: they order the block's stores the barrier
// made visible to it); a fence in every thread costs microseconds a launch.
__device__ __forceinline__ bool is_last_block(uint32_t* __restrict__ counter) {
    __shared__ uint32_t is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
        if (is_last) {
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
            *counter = 0u;
        }
    }
    __syncthreads();
    return is_last;
}

// One block computes for each row out = (res + rms(y) * w) [* scalar] and the norms of out
// asked for, rounded as the add_norm kernel rounds them (y as other blocks of the launch
// stored it). P: the product's parameters (`rows`, `out_dim`).
template <typename T, int THREADS, typename P>
__device__ __forceinline__ void block_add_norm(
    const P& p, const MvNormParams& n, const T* __restrict__ y,
    const T* __restrict__ res, const T* __restrict__ w, const T* __restrict__ scalar,
    const T* __restrict__ w2, const T* __restrict__ w3, T* __restrict__ out, T* __restrict__ out2,
    T* __restrict__ out3) {
    __shared__ float nred[THREADS / 32];
    const int dim = (int)p.out_dim;
    const float s = (n.flags & 1) ? to_f(scalar[0]) : 1.f;
    // Rows up to 4096 wide whose rows and weights are 16-byte aligned: each thread keeps its
    // elements in registers, reads and writes them 8 at a time and issues each pass's loads
    // together (unconditional, clamped), so the single block pays a handful of memory
    // latencies and few instructions.
    constexpr int PV = 4096 / 8 / THREADS;  // 8-element vectors a thread
    auto al = [](const void* q) { return ((uintptr_t)q & 15) == 0; };
    if constexpr (sizeof(T) == 2 && PV >= 1) {
        const int nv = dim / 8;
        if (dim % 8 == 0 && nv <= PV * THREADS && al(y) && al(res) && al(w) && al(out) &&
            al(w2) && al(w3) && (!(n.flags & 2) || al(out2)) && (!(n.flags & 4) || al(out3))) {
            for (int r = 0; r < (int)p.rows; ++r) {
                const size_t base = (size_t)r * dim;
                // Every load of the row at once: the residual and the norm weights do not wait
                // for the sums (w2 and w3 stand for w when not asked for, so always valid).
                uint4 yv[PV], rv[PV], wv[PV], av[PV], bv[PV];
#pragma unroll
                for (int k = 0; k < PV; ++k) {
                    const int ic = min((int)threadIdx.x + k * THREADS, nv - 1);
                    yv[k] = __ldcg(reinterpret_cast<const uint4*>(y + base) + ic);
                    rv[k] = reinterpret_cast<const uint4*>(res + base)[ic];
                    wv[k] = reinterpret_cast<const uint4*>(w)[ic];
                    av[k] = reinterpret_cast<const uint4*>(w2)[ic];
                    bv[k] = reinterpret_cast<const uint4*>(w3)[ic];
                }
                float v[PV][8];
                float ss = 0.f;
#pragma unroll
                for (int k = 0; k < PV; ++k) {
                    const int i = threadIdx.x + k * THREADS;
                    unpack8<T>(yv[k], v[k]);
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        v[k][j] = i < nv ? v[k][j] : 0.f;
                        ss += v[k][j] * v[k][j];
                    }
                }
                const float inv = rsqrtf(block_sum<THREADS>(ss, nred) / dim + n.eps);
                float ss2 = 0.f;
#pragma unroll
                for (int k = 0; k < PV; ++k) {
                    const bool in = (int)threadIdx.x + k * THREADS < nv;
                    float rf[8], wf[8];
                    unpack8<T>(rv[k], rf);
                    unpack8<T>(wv[k], wf);
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        float o = rnd<T>(rf[j] + rnd<T>(v[k][j] * inv * wf[j]));
                        if (n.flags & 1) o = rnd<T>(o * s);
                        v[k][j] = in ? o : 0.f;
                        ss2 += v[k][j] * v[k][j];
                    }
                }
#pragma unroll
                for (int k = 0; k < PV; ++k) {
                    const int i = threadIdx.x + k * THREADS;
                    if (i < nv) reinterpret_cast<uint4*>(out + base)[i] = pack8<T>(v[k]);
                }
                if (!(n.flags & 2)) continue;
                const float inv2 = rsqrtf(block_sum<THREADS>(ss2, nred) / dim + n.eps);
#pragma unroll
                for (int k = 0; k < PV; ++k) {
                    const int i = threadIdx.x + k * THREADS;
                    if (i >= nv) continue;
                    float af[8], bf[8], o2[8], o3[8];
                    unpack8<T>(av[k], af);
                    unpack8<T>(bv[k], bf);
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        o2[j] = v[k][j] * inv2 * af[j];
                        o3[j] = v[k][j] * inv2 * bf[j];
                    }
                    reinterpret_cast<uint4*>(out2 + base)[i] = pack8<T>(o2);
                    if (n.flags & 4) reinterpret_cast<uint4*>(out3 + base)[i] = pack8<T>(o3);
                }
            }
            return;
        }
    }
    for (int r = 0; r < (int)p.rows; ++r) {
        const size_t base = (size_t)r * dim;
        float ss = 0.f;
        for (int i = threadIdx.x; i < dim; i += THREADS) {
            const float v = ld_cg(y + base + i);
            ss += v * v;
        }
        const float inv = rsqrtf(block_sum<THREADS>(ss, nred) / dim + n.eps);
        float ss2 = 0.f;
        for (int i = threadIdx.x; i < dim; i += THREADS) {
            float o = rnd<T>(to_f(res[base + i]) + rnd<T>(ld_cg(y + base + i) * inv * to_f(w[i])));
            if (n.flags & 1) o = rnd<T>(o * s);
            out[base + i] = from_f<T>(o);
            ss2 += o * o;
        }
        if (!(n.flags & 2)) continue;
        const float inv2 = rsqrtf(block_sum<THREADS>(ss2, nred) / dim + n.eps);
        for (int i = threadIdx.x; i < dim; i += THREADS) {
            const float o = to_f(out[base + i]);  // this thread's own store
            out2[base + i] = from_f<T>(o * inv2 * to_f(w2[i]));
            if (n.flags & 4) out3[base + i] = from_f<T>(o * inv2 * to_f(w3[i]));
        }
    }
}

// After every block has stored its outputs, the last block to finish (a launch-wide counter,
// left at zero for the next launch) runs `block_add_norm`.
template <typename T, int THREADS, typename P>
__device__ __forceinline__ void last_block_add_norm(
    const P& p, const MvNormParams& n, const T* __restrict__ y,
    const T* __restrict__ res, const T* __restrict__ w, const T* __restrict__ scalar,
    const T* __restrict__ w2, const T* __restrict__ w3, T* __restrict__ out, T* __restrict__ out2,
    T* __restrict__ out3, uint32_t* __restrict__ counter) {
    if (!is_last_block(counter)) return;
    block_add_norm<T, THREADS>(p, n, y, res, w, scalar, w2, w3, out, out2, out3);
}

// The residual add + norm runs one row per block at decode: more threads, shorter serial loops.
constexpr int ADD_NORM_THREADS = 1024;
// Widest row of the residual add + norm: its elements stay in registers (host: ADD_NORM_MAX_WIDTH).
constexpr int ADD_NORM_PER_THREAD = 8;

struct AddNormParams {
    uint32_t rows, dim;
    float eps;
    // 1: multiply the sum by scalar[0]; 2: also write norm2(out) * w2 to out2; 4: also
    // norm2(out) * w3 to out3 (with 2).
    uint32_t flags;
};

// Widest row of the two-branch residual add + norm (moe_add_norm): it keeps more values per
// element in registers, so fewer elements a thread.
constexpr int MOE_ADD_NORM_PER_THREAD = 4;

// out = (res + rms(y) * w) [* scalar]; out2 = rms(out) * w2 [; out3 = rms(out) * w3], for row
// `row` of at most PT * THREADS elements (the add_norm kernels: one block a row), kept in registers: every load but w3's is
// issued before the first reduction, so the kernel waits on memory once. With TWO the branch is
// itself y = rms(a) * wa + rms(b) * wb (the 26B-A4B dense and expert outputs, each with its own
// post-norm), every step rounded to T as the unfused ops round it.
template <typename T, int THREADS, int PT, bool TWO>
__device__ __forceinline__ void add_norm_body(const AddNormParams p, const uint32_t row,
                                              const T* __restrict__ res,
                                              const T* __restrict__ y, const T* __restrict__ w,
                                              const T* __restrict__ scalar,
                                              const T* __restrict__ w2, T* __restrict__ out,
                                              T* __restrict__ out2, const T* __restrict__ w3,
                                              T* __restrict__ out3, const T* __restrict__ b,
                                              const T* __restrict__ wa,
                                              const T* __restrict__ wb) {
    __shared__ float red[THREADS / 32];
    const size_t base = (size_t)row * p.dim;
    float yv[PT], rv[PT], wv[PT], w2v[PT];
    float bv[TWO ? PT : 1], wav[TWO ? PT : 1], wbv[TWO ? PT : 1];
    const float s = (p.flags & 1) ? to_f(scalar[0]) : 1.f;
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int i = threadIdx.x + k * THREADS;
        const bool in = i < (int)p.dim;
        yv[k] = in ? ld_cg(y + base + i) : 0.f;
        rv[k] = in ? to_f(res[base + i]) : 0.f;
        wv[k] = in ? to_f(w[i]) : 0.f;
        w2v[k] = in && (p.flags & 2) ? to_f(w2[i]) : 0.f;
        if constexpr (TWO) {
            bv[k] = in ? ld_cg(b + base + i) : 0.f;
            wav[k] = in ? to_f(wa[i]) : 0.f;
            wbv[k] = in ? to_f(wb[i]) : 0.f;
        }
    }
    if constexpr (TWO) {
        float sa = 0.f, sb = 0.f;
#pragma unroll
        for (int k = 0; k < PT; ++k) {
            sa += yv[k] * yv[k];
            sb += bv[k] * bv[k];
        }
        const float ia = rsqrtf(block_sum<THREADS>(sa, red) / p.dim + p.eps);
        const float ib = rsqrtf(block_sum<THREADS>(sb, red) / p.dim + p.eps);
#pragma unroll
        for (int k = 0; k < PT; ++k)
            yv[k] = rnd<T>(rnd<T>(yv[k] * ia * wav[k]) + rnd<T>(bv[k] * ib * wbv[k]));
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < PT; ++k) ss += yv[k] * yv[k];
    const float inv = rsqrtf(block_sum<THREADS>(ss, red) / p.dim + p.eps);
    float ss2 = 0.f;
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int i = threadIdx.x + k * THREADS;
        if (i >= (int)p.dim) continue;
        const float normed = rnd<T>(yv[k] * inv * wv[k]);
        float o = rnd<T>(rv[k] + normed);
        if (p.flags & 1) o = rnd<T>(o * s);
        out[base + i] = from_f<T>(o);
        yv[k] = o;
        ss2 += o * o;
    }
    if (!(p.flags & 2)) return;
    const float inv2 = rsqrtf(block_sum<THREADS>(ss2, red) / p.dim + p.eps);
#pragma unroll
    for (int k = 0; k < PT; ++k) {
        const int i = threadIdx.x + k * THREADS;
        if (i >= (int)p.dim) continue;
        out2[base + i] = from_f<T>(yv[k] * inv2 * w2v[k]);
        if (p.flags & 4) out3[base + i] = from_f<T>(yv[k] * inv2 * to_f(w3[i]));
    }
}
