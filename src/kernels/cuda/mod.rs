//! Device kernels for quantized attention and quantized weights: the parameter structs shared by
//! the CUDA and Metal launchers ([`params`], always compiled so both backends and the tests see
//! one layout) and the CUDA launcher (`launch`, `cuda` feature only; kernels in
//! `qkernels.cu`, compiled by `build.rs`) and the fused decoder-layer kernels (`fused`,
//! kernels in `fused.cu`).

pub mod params;

#[cfg(feature = "cuda")]
pub(crate) mod batched;
#[cfg(feature = "cuda")]
pub mod fused;
#[cfg(feature = "cuda")]
pub(crate) mod graph;
#[cfg(feature = "cuda")]
mod kernel_cache;
#[cfg(feature = "cuda")]
pub mod launch;
#[cfg(feature = "cuda")]
pub(crate) mod scratch;

#[cfg(feature = "cuda")]
pub use kernel_cache::launch_stats;
#[cfg(feature = "cuda")]
pub use launch::{attend_packed_cuda, QsdpaPath};
