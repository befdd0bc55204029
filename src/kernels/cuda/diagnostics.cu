// Bench helpers, not used by the model: an SM copy kernel (the bandwidth reference) and a
// kernel that keeps the stream busy.

#include <stdint.h>

#include "common.cuh"

// Device-to-device copy through the SMs (16-byte loads and stores, grid-stride): the
// bandwidth reference of the benches, the access pattern of a bandwidth-bound kernel.
extern "C" __global__ void copy_u4(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                   uint64_t n) {
    pdl_entry();
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// One thread that returns `ns` nanoseconds after it starts (device clock): work a benchmark
// enqueues behind it then runs back to back, timed on the GPU without the host's enqueue time.
extern "C" __global__ void gpu_spin(const unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
