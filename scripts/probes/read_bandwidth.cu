// How fast one kernel can read N bytes on this GPU (buffers rotated so that L2 keeps nothing),
// as a share of a 1 GiB device copy measured in the same process: a plain grid-stride read
// (4 or 8 blocks of 256 threads a multiprocessor, U 16-byte loads a thread in flight) and a
// persistent reader that streams each block's range into shared memory with bulk async copies
// (cp.async.bulk, mbarriers; sm_90), each with and without programmatic dependent launch. The
// sizes are the 31B q_proj's packed bytes (4-bit, group 64) and multiples. A ceiling for the
// matvec kernels, not part of the crate. Build here, run on the GPU machine:
//
//   source ../shared/cuda/toolkit.sh && nvcc -O3 -std=c++17 -arch=sm_90 \
//       -o .device/read_bandwidth scripts/probes/read_bandwidth.cu
//   (device) .device/read_bandwidth
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("err %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__device__ __forceinline__ void pdl() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ uint4 ldnc(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
template <int U>
__global__ void read_ldg(const uint4* __restrict__ src, size_t n16, uint32_t* out) {
  pdl();
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ldnc(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) { uint4 v = ldnc(src + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x12345678u) out[0] = acc;
}
// Contiguous range per warp variant: each warp reads a contiguous slice, U loads in flight.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" :: "r"(smem_u32(b)), "r"(parity) : "memory");
}
// Persistent TMA-bulk reader: each block a contiguous byte range, STAGES chunks of CH bytes in flight.
template <int STAGES, int CH>
__global__ void read_tma(const char* __restrict__ src, size_t nbytes, uint32_t* out) {
  extern __shared__ __align__(128) char sm[];
  __shared__ uint64_t bar[STAGES];
  const size_t per = ((nbytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  const size_t b0 = blockIdx.x * per, b1 = min(nbytes, b0 + per);
  const int nch = b1 > b0 ? (int)((b1 - b0 + CH - 1) / CH) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(&bar[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl();
  if (threadIdx.x == 0)
    for (int c = 0; c < STAGES && c < nch; ++c) {
      const size_t off = b0 + (size_t)c * CH; const uint32_t len = (uint32_t)min((size_t)CH, b1 - off);
      mbar_expect(&bar[c], len); bulk_g2s(sm + c * CH, src + off, len, &bar[c]);
    }
  uint32_t acc = 0;
  for (int c = 0; c < nch; ++c) {
    const int s = c % STAGES;
    mbar_wait(&bar[s], (c / STAGES) & 1);
    const size_t off = b0 + (size_t)c * CH; const int len = (int)min((size_t)CH, b1 - off);
    for (int i = threadIdx.x * 16; i < len; i += blockDim.x * 16) { uint4 v = *(const uint4*)(sm + s * CH + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    __syncthreads();
    if (threadIdx.x == 0 && c + STAGES < nch) {
      const size_t o2 = b0 + (size_t)(c + STAGES) * CH; const uint32_t l2 = (uint32_t)min((size_t)CH, b1 - o2);
      mbar_expect(&bar[s], l2); bulk_g2s(sm + s * CH, src + o2, l2, &bar[s]);
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

template <typename F>
float timeit(F launch, int iters, cudaStream_t st) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < 20; ++i) launch(i);
  CK(cudaEventRecord(a, st));
  for (int i = 0; i < iters; ++i) launch(i);
  CK(cudaEventRecord(b, st)); CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b)); CK(cudaGetLastError());
  return ms * 1000.f / iters;
}
template <typename K, typename... A>
void launch_pdl(K k, dim3 g, dim3 bl, size_t sm, cudaStream_t st, bool pdl, A... args) {
  cudaLaunchConfig_t cfg = {}; cfg.gridDim = g; cfg.blockDim = bl; cfg.dynamicSmemBytes = sm; cfg.stream = st;
  cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at; cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, k, args...));
}
int main(int argc, char** argv) {
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t big = 1ull << 30; char *s0, *s1; CK(cudaMalloc(&s0, big)); CK(cudaMalloc(&s1, big));
  CK(cudaMemset(s0, 1, big)); uint32_t* out; CK(cudaMalloc(&out, 4));
  float us = timeit([&](int) { CK(cudaMemcpyAsync(s1, s0, big, cudaMemcpyDeviceToDevice, st)); }, 20, st);
  const double copy = 2.0 * big / (us * 1e-6) / 1e9;
  printf("copy 1GiB: %.1f us %.1f GB/s\n", us, copy);
  const size_t sizes[] = {24772608, 24772608 * 2, 24772608 * 4, 62000000};
  for (size_t nb : sizes) {
    const int R = (int)(800000000 / nb); // rotate through ~800 MB
    auto src = [&](int i) { return s0 + (size_t)(i % R) * nb; };
    us = timeit([&](int i) { CK(cudaMemcpyAsync(s1, src(i), nb / 2, cudaMemcpyDeviceToDevice, st)); }, 200, st);
    printf("%zu same-size copy: %.2f us frac %.3f\n", nb, us, nb / (us * 1e-6) / 1e9 / copy);
    for (int pdl = 0; pdl < 2; ++pdl) {
      for (int bpsm : {4, 8}) for (int U : {4, 8}) {
        auto k = U == 4 ? read_ldg<4> : read_ldg<8>;
        us = timeit([&](int i) { launch_pdl(k, dim3(sms * bpsm), dim3(256), 0, st, pdl, (const uint4*)src(i), nb / 16, out); }, 200, st);
        printf("%zu ldg pdl=%d bpsm=%d U=%d: %.2f us frac %.3f\n", nb, pdl, bpsm, U, us, nb / (us * 1e-6) / 1e9 / copy);
      }
      {
        auto k = read_tma<12, 16384>; size_t smb = 12 * 16384; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smb));
        us = timeit([&](int i) { launch_pdl(k, dim3(sms), dim3(256), smb, st, pdl, (const char*)src(i), nb, out); }, 200, st);
        printf("%zu tma 1x12x16K pdl=%d: %.2f us frac %.3f\n", nb, pdl, us, nb / (us * 1e-6) / 1e9 / copy);
      }
      {
        auto k = read_tma<6, 16384>; size_t smb = 6 * 16384; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smb));
        us = timeit([&](int i) { launch_pdl(k, dim3(sms * 2), dim3(256), smb, st, pdl, (const char*)src(i), nb, out); }, 200, st);
        printf("%zu tma 2x6x16K pdl=%d: %.2f us frac %.3f\n", nb, pdl, us, nb / (us * 1e-6) / 1e9 / copy);
      }
      {
        auto k = read_tma<24, 8192>; size_t smb = 24 * 8192; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smb));
        us = timeit([&](int i) { launch_pdl(k, dim3(sms), dim3(256), smb, st, pdl, (const char*)src(i), nb, out); }, 200, st);
        printf("%zu tma 1x24x8K pdl=%d: %.2f us frac %.3f\n", nb, pdl, us, nb / (us * 1e-6) / 1e9 / copy);
      }
    }
  }
  return 0;
}
