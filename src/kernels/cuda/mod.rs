//! CUDA kernels and their launchers (`cuda` feature only; the launch plan they share with Metal
//! is [`crate::kernels::plan`]).
//!
//! One file per concept, each with its `.cu` source (compiled to a fatbin by `build.rs` and
//! loaded by `kernel_cache`):
//!
//! | module | kernels |
//! |---|---|
//! | `attention` | fused attention over packed or dense K/V: planning, one-sequence and batched launches (`attention.cu`, `attention_tc.cu`); flash attention for prefill (`prefill_attention.cu`) |
//! | `matvec`, `matvec_plan` | the packed-weight matrix-vector products and their kernel choice (`matvec.cu`) |
//! | `dense_matvec` | dense-weight decode products, gated and normed forms (`dense_matvec.cu`) |
//! | `norm_tail` | the residual add + norm folded into a product's last block |
//! | `layer_ops` | residual add + RMS norm, GeGLU, q/k/v norm + RoPE + layout (`layer_ops.cu`) |
//! | `kv_write` | writing new K/V into cache slots, dense or quantized |
//! | `grouped_gemm` | row blocks of one matrix, each times its own weight, as one cuBLAS grouped product (MoE prefill) |
//! | `moe` | router top-k, grouped expert products, the weighted mix, the row gather (`moe.cu`) |
//! | `reduce` | masked softmax, row argmax, each row's tempered draw (`reduce.cu`) |
//! | `top_k` | each row's k best logits for sampling (`top_k.cu`) |
//! | `quantize` | affine quantization and dequantization (`quantize.cu`) |
//! | `nccl` | the NCCL all-reduce of tensor-parallel groups (`nccl` feature) |
//! | `peer_reduce` | the one-shot all-reduce over peer memory, alone or with the add + norms after it (`nccl` feature) |
//! | `pool` | the device memory pool and event tracking |
//! | `scratch`, `graph` | per-thread scratch buffers; CUDA graph capture of decode steps |
//! | `diagnostics` | bench helpers: copy bandwidth reference, GPU spin, host-cost probe (`diagnostics.cu`) |

#[cfg(feature = "cuda")]
pub mod attention;
#[cfg(feature = "cuda")]
pub mod dense_matvec;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod diagnostics;
#[cfg(feature = "cuda")]
pub(crate) mod graph;
#[cfg(feature = "cuda")]
pub mod grouped_gemm;
#[cfg(feature = "cuda")]
mod kernel_cache;
#[cfg(feature = "cuda")]
pub mod kv_write;
#[cfg(feature = "cuda")]
pub mod layer_ops;
#[cfg(feature = "cuda")]
pub mod matvec;
#[cfg(feature = "cuda")]
mod matvec_plan;
#[cfg(feature = "cuda")]
pub mod moe;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
#[cfg(feature = "cuda")]
pub mod norm_tail;
/// The one-shot all-reduce over peer memory (tensor parallelism, `nccl` feature).
#[cfg(feature = "nccl")]
pub(crate) mod peer_reduce;
#[cfg(feature = "cuda")]
pub mod pool;
#[cfg(feature = "cuda")]
pub mod quantize;
#[cfg(feature = "cuda")]
pub mod reduce;
#[cfg(feature = "cuda")]
pub(crate) mod scratch;
#[cfg(feature = "cuda")]
pub mod top_k;

#[cfg(feature = "cuda")]
pub(crate) use attention::batched;
#[cfg(feature = "cuda")]
pub use attention::launch::{attend_packed_cuda, QsdpaPath};
#[cfg(feature = "cuda")]
pub use attention::prefill::{attend_prefill_cuda, PREFILL_HEAD_DIMS};
