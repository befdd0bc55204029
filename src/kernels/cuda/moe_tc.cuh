// Routed expert products on the tensor cores (included by moe.cu, after GroupedMvParams): a
// block's expert multiplies up to 32 of its pairs at once (four m16n8 tiles of 8 pairs; tiles
// with no pair are skipped), so each weight is read, and for packed experts dequantized, once
// per 32 pairs instead of once per pair or per four on the CUDA cores.
//
// A warp owns 16 output rows and walks the input in chunks; lane (gq, q) holds rows gq and
// gq + 8 and a quarter of each chunk. The mma's k order is a permutation of the chunk's inputs:
// the weight fragments and the activation fragments of a step take the same inputs, which is
// all a dot product needs. A source gives a chunk's weights and turns them into fragments:
//   KC       inputs a chunk (a lane's quarter is KC / 4, in steps of 8)
//   Chunk    what a lane holds of a chunk (its rows' weights)
//   load     the lane's quarter of a chunk of its rows, from input `at` (zeros where `ok` is
//            false: a quarter past the input, read from input 0 so no load leaves the row)
//   frags    step j's A fragments (two mmas: f0 and f1) of the lane's rows
//   bfrags   the matching B fragments from 8 consecutive activations

#pragma once

// Pairs a tensor-core pass takes: four tiles of 8.
constexpr int GTC_TILES = 4;

// MLX-packed 4-bit experts, flattened to [E * out, in], with scales and biases of type T. A
// lane's quarter of a 128-input chunk is 16 bytes of codes a row, inside one scale group.
// `at` is the input a lane's quarter starts at (0 for a lane past the input, whose weights are
// zeroed: it then reads the row's first bytes, never past the row). The codes become T as in
// `qmv_tc4x` (matvec_batch.cu: same fragments, same rounding).
template <typename T> struct PackedTcSource {
    static constexpr int KC = 128;
    const uint32_t* __restrict__ codes;
    const T* __restrict__ scales;
    const T* __restrict__ biases;

    struct Chunk {
        uint4 w[2];
        uint32_t sc[2], bi[2];
    };
    // Per row: the offsets of its codes and of its scales.
    struct Rows {
        uint32_t wo[2], so[2];
    };

    __device__ __forceinline__ Rows rows(const GroupedMvParams& p, const uint32_t (&r)[2]) const {
        Rows o;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            o.wo[m] = r[m] * (p.in_dim / 8);
            o.so[m] = r[m] * (p.in_dim / p.group_size);
        }
        return o;
    }

    __device__ __forceinline__ void load(const GroupedMvParams& p, const Rows& o, int at, bool ok,
                                         Chunk& k) const {
        const int g = at / (int)p.group_size;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const uint4 v = ld_stream4(codes + o.wo[m] + at / 8);
            k.w[m] = ok ? v : zero;
            k.sc[m] = splat(scales[o.so[m] + g]);
            k.bi[m] = splat(biases[o.so[m] + g]);
        }
    }

    static constexpr int STEPS = 4;

    // Step j: word j of each row (see `qt_code_frags`), and the activations that match.
    __device__ __forceinline__ static void frags(const Chunk& k, int j, uint32_t (&f0)[4],
                                                 uint32_t (&f1)[4]) {
        qt_code_frags<T>(k.w[0], k.w[1], j, k.sc[0], k.bi[0], k.sc[1], k.bi[1], f0, f1);
    }

    __device__ __forceinline__ static void bfrags(const uint4 r, uint32_t (&b0)[2],
                                                  uint32_t (&b1)[2]) {
        qt_act_frags(r, b0, b1);
    }
};

// Dense experts [E, out, in] of type T. A lane's quarter of a 128-input chunk is 64 bytes a row
// (four 16-byte loads a row in flight, eight with the next chunk's); `at` as for packed rows.
template <typename T> struct DenseTcSource {
    static constexpr int KC = 128;
    static constexpr int STEPS = 4;
    const T* __restrict__ w;

    struct Chunk {
        uint4 w[2][4];
    };
    struct Rows {
        const T* row[2];
    };

    __device__ __forceinline__ Rows rows(const GroupedMvParams& p, const uint32_t (&r)[2]) const {
        Rows o;
#pragma unroll
        for (int m = 0; m < 2; ++m) o.row[m] = w + (size_t)r[m] * p.in_dim;
        return o;
    }

    __device__ __forceinline__ void load(const GroupedMvParams&, const Rows& o, int at, bool ok,
                                         Chunk& k) const {
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const T* src = o.row[m] + at + 8 * j;
                const uint4 v = ld_stream4(reinterpret_cast<const uint32_t*>(src));
                k.w[m][j] = ok ? v : zero;
            }
    }

    // Step j: 8 weights of each row as the pairs (0, 1), (2, 3) for f0 and (4, 5), (6, 7) for f1.
    __device__ __forceinline__ static void frags(const Chunk& k, int j, uint32_t (&f0)[4],
                                                 uint32_t (&f1)[4]) {
        const uint4 a = k.w[0][j], b = k.w[1][j];
        f0[0] = a.x; f0[1] = b.x; f0[2] = a.y; f0[3] = b.y;
        f1[0] = a.z; f1[1] = b.z; f1[2] = a.w; f1[3] = b.w;
    }

    __device__ __forceinline__ static void bfrags(const uint4 r, uint32_t (&b0)[2],
                                                  uint32_t (&b1)[2]) {
        b0[0] = r.x; b0[1] = r.y;
        b1[0] = r.z; b1[1] = r.w;
    }
};

// The row reader `grouped_mv_body` takes for the tensor-core kernels: 16 output rows a warp.
template <typename T, typename Src> struct TcRows {
    static constexpr int R = 16;
    static constexpr bool TC = true;
    Src src;

    // y rows of the block's n pairs (pair i is mine[i]; its activations at xs + i * in_dim when
    // GATED, else at x's row of the pair) for output rows o0 .. o0 + 16 of expert e.
    template <bool GATED>
    __device__ __forceinline__ void run(const GroupedMvParams& p, uint32_t e, int o0, uint32_t n,
                                        const uint32_t* mine, const T* __restrict__ x,
                                        const T* xs, T* __restrict__ y) const {
        constexpr int KC = Src::KC, QW = KC / 4;  // inputs a chunk, and a lane's share
        const int lane = threadIdx.x & 31, gq = lane >> 2, q = lane & 3;
        const int in_dim = (int)p.in_dim;
        const int chunks = (in_dim + KC - 1) / KC;
        const int last = (int)p.out_dim - 1;
        // Rows past the end repeat the last one (their sums are not stored).
        const uint32_t r[2] = {e * p.out_dim + (uint32_t)min(o0 + gq, last),
                               e * p.out_dim + (uint32_t)min(o0 + gq + 8, last)};
        const typename Src::Rows rows = src.rows(p, r);
        // Where the lane's quarter of chunk c starts, and whether it is inside the input.
        auto quarter = [&](int c, int& at) {
            at = c * KC + QW * q;
            const bool ok = at < in_dim;
            if (!ok) at = 0;
            return ok;
        };
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        for (uint32_t i0 = 0; i0 < n; i0 += 8 * GTC_TILES) {
            const int tiles = min(GTC_TILES, (int)((n - i0 + 7) / 8));  // uniform in the warp
            // Pair 8 nt + gq of this pass: the activation row this lane feeds to tile nt.
            const T* xr[GTC_TILES];
            bool xok[GTC_TILES];
#pragma unroll
            for (int nt = 0; nt < GTC_TILES; ++nt) {
                const uint32_t i = i0 + 8 * nt + gq;
                xok[nt] = i < n;
                const uint32_t ii = xok[nt] ? i : i0;
                size_t row = ii;
                if constexpr (!GATED) row = p.x_per_token ? mine[ii] / p.top_k : mine[ii];
                xr[nt] = (GATED ? xs : x) + row * in_dim;
            }
            float acc[GTC_TILES][4];
#pragma unroll
            for (int nt = 0; nt < GTC_TILES; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
            typename Src::Chunk k;
            int at;
            bool ok = quarter(0, at);
            src.load(p, rows, at, ok, k);
            for (int c = 0; c < chunks; ++c) {
                int next_at;
                const bool next_ok = quarter(min(c + 1, chunks - 1), next_at);
                typename Src::Chunk next;
                src.load(p, rows, next_at, next_ok, next);
#pragma unroll
                for (int j = 0; j < Src::STEPS; ++j) {
                    uint32_t f0[4], f1[4];
                    Src::frags(k, j, f0, f1);
#pragma unroll
                    for (int nt = 0; nt < GTC_TILES; ++nt) {
                        if (nt >= tiles) break;
                        const uint4 xv = *reinterpret_cast<const uint4*>(xr[nt] + at + 8 * j);
                        uint32_t b0[2], b1[2];
                        Src::bfrags(ok && xok[nt] ? xv : zero, b0, b1);
                        mma_16816<T>(acc[nt], f0, b0);
                        mma_16816<T>(acc[nt], f1, b1);
                    }
                }
                k = next;
                at = next_at;
                ok = next_ok;
            }
            // C fragment i of tile nt: output row gq (+ 8 for i >= 2), pair 2 q + (i & 1).
#pragma unroll
            for (int nt = 0; nt < GTC_TILES; ++nt) {
                if (nt >= tiles) break;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int out = o0 + gq + (i >= 2 ? 8 : 0);
                    const uint32_t pi = i0 + 8 * nt + 2 * q + (i & 1);
                    if (out <= last && pi < n)
                        y[(size_t)mine[pi] * p.out_dim + out] = from_f<T>(acc[nt][i]);
                }
            }
        }
    }
};
