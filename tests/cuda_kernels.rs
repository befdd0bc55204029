//! The CUDA kernels against the CPU references, on random inputs, one table of cases per
//! kernel family:
//!
//! * `attention`: quantized attention (fused and dequantize-then-dense paths, and the
//!   dispatcher) over head dims, bits, group sizes, GQA, decode/prefill, causal and sliding
//!   masks, key-position encodings and query dtypes; dense attention through the dispatcher;
//!   settled-key marks (bit-identical); batched attention against each sequence alone.
//! * `prefill`: the flash prefill attention kernel over dense K/V, against the CPU in f32.
//! * `caches`: K/V quantization and quantized/dense cache updates, bit-exact against the CPU.
//! * `layer_ops`: the fused decoder-layer kernels (add + norm, GeGLU, q/k/v prep, argmax)
//!   against the candle op chains they replace.
//! * `grouped_gemm`: row blocks each times its own weight in one cuBLAS grouped product.
//! * `moe`: expert routing and the grouped expert products, dense and packed.
//! * `qmatmul`: the packed matmul (matvec and GEMM paths) and embedding lookup.
//! * `lookahead`: greedy generation one step ahead against plain greedy generation.
//! * `constrained`: constrained decoding on the device (masked logits, then the usual picks)
//!   against the CPU, and beside unconstrained rows of a batch decoding ahead.
//! * `sampling`: each row's best logits picked on the device against the host sampler's order,
//!   and sampled generation from them against generation reading whole rows.
//! * `dense_matvec`: the tensor-core dense matvec family and the packed product with the
//!   residual add + norm folded in.
//!
//! Every case prints one line (`--nocapture` shows them); a test fails naming each case that
//! missed its tolerance.
//!
//! # Running on a GPU machine
//!
//! Build here (nvcc, no GPU needed):
//!
//! ```text
//! cargo test --release --features cuda --test cuda_kernels --no-run
//! ```
//!
//! Cargo prints the binary, `target/release/deps/cuda_kernels-<hash>` (under
//! `$CARGO_TARGET_DIR` when set). Carry it to the GPU machine and run it there, with the CUDA
//! libraries on `LD_LIBRARY_PATH`:
//!
//! ```text
//! CUDA_KERNELS_REQUIRE_GPU=1 ./cuda_kernels-<hash> --test-threads=1
//! ```
//!
//! Without a CUDA device the tests print a note and pass, so that `cargo test --features cuda`
//! on a CPU-only machine succeeds; `CUDA_KERNELS_REQUIRE_GPU=1` makes a missing device a
//! failure. The tests take the one device in turn, whatever `--test-threads` says.

mod common;

#[path = "cuda_kernels/attention.rs"]
mod attention;
#[path = "cuda_kernels/caches.rs"]
mod caches;
#[path = "cuda_kernels/constrained.rs"]
mod constrained;
#[path = "cuda_kernels/dense_matvec.rs"]
mod dense_matvec;
#[path = "cuda_kernels/grouped_gemm.rs"]
mod grouped_gemm;
#[path = "cuda_kernels/layer_ops.rs"]
mod layer_ops;
#[path = "cuda_kernels/lookahead.rs"]
mod lookahead;
#[path = "cuda_kernels/moe.rs"]
mod moe;
#[path = "cuda_kernels/prefill.rs"]
mod prefill;
#[path = "cuda_kernels/qmatmul.rs"]
mod qmatmul;
#[path = "cuda_kernels/sampling.rs"]
mod sampling;
#[path = "cuda_kernels/support.rs"]
mod support;
