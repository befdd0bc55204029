//! The product `x · Wᵀ` of activations and a weight matrix, dense or packed.
//!
//! Decode products (few activation rows) of a dense f16/bf16 weight run the crate's
//! matrix-vector kernels on CUDA; packed weights go through [`qmatmul`], which picks its own
//! kernel per device; everything else is candle's matmul.

use candle_core::{Module, Tensor};

use super::Result;
use super::{geglu, norm, tensor_bytes, Norm};
use crate::kernels::qmatmul::qmatmul;
use crate::kernels::PackedAffine;

/// A bias-free weight matrix `[out, in]`: dense, or MLX-quantized and kept packed.
#[derive(Debug, Clone)]
pub enum Weight {
    /// A dense weight.
    Dense(candle_nn::Linear),
    /// A packed affine-quantized weight (the product reads the codes directly).
    Packed(PackedAffine),
}

impl Weight {
    /// Wraps a dense `[out, in]` weight.
    pub fn dense(weight: Tensor) -> Self {
        Weight::Dense(candle_nn::Linear::new(weight, None))
    }

    /// The weight of a dense matrix (`None` when packed).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match self {
            Weight::Dense(l) => Some(l.weight()),
            Weight::Packed(_) => None,
        }
    }

    /// Bytes of resident weight (packed codes, scales and biases for a packed one).
    pub fn resident_bytes(&self) -> usize {
        match self {
            Weight::Dense(l) => tensor_bytes(l.weight()),
            Weight::Packed(p) => p.packed_bytes(),
        }
    }
}

/// `x · Wᵀ` over the last axis of `x`, in `x`'s dtype.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn matmul(x: &Tensor, w: &Weight) -> Result<Tensor> {
    match w {
        Weight::Dense(l) => match dense_decode_product(x, l.weight())? {
            Some(y) => Ok(y),
            None => Ok(l.forward(x)?),
        },
        Weight::Packed(p) => Ok(qmatmul(x, p)?),
    }
}

/// `(gelu_tanh(a) * b) · Wᵀ` for `a`, `b` of one shape: the gated input of the MLP's down
/// projection and of the PLE projection. On CUDA decode with a dense weight the gate is
/// computed inside the product (one launch instead of two, or three with cuBLAS's split-K
/// reduce); elsewhere the gate runs on its own, then [`matmul`].
///
/// # Errors
/// Shape mismatch.
pub(crate) fn matmul_gated(a: &Tensor, b: &Tensor, w: &Weight) -> Result<Tensor> {
    if let Weight::Dense(l) = w {
        if let Some(y) = gated_decode_product(a, b, l.weight())? {
            return Ok(y);
        }
    }
    matmul(&geglu::gelu_mul(a, b)?, w)
}

/// `norm(x) · Wᵀ`: on CUDA decode with a dense weight the norm is computed inside the product
/// (one launch instead of two).
///
/// # Errors
/// Shape mismatch.
pub(crate) fn normed_matmul(x: &Tensor, n: Norm<'_>, w: &Weight) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(wd) = w.dense_weight() {
        if super::fused(x.device())
            && crate::kernels::cuda::dense_matvec::dense_matvec_wanted(
                tensor_bytes(wd),
                super::rows_of(x),
            )
            && n.weight.dtype() == x.dtype()
        {
            if let Some(y) =
                crate::kernels::cuda::dense_matvec::dense_matvec_normed(x, n.weight, n.eps, wd)?
            {
                return Ok(y);
            }
        }
    }
    matmul(&norm::rms_norm(x, n)?, w)
}

/// `x · Tableᵀ` for a dense table `[rows, width]` (a tied embedding used as the head):
/// `[.., width] → [.., rows]`.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn matmul_table(x: &Tensor, table: &Tensor) -> Result<Tensor> {
    match dense_decode_product(x, table)? {
        Some(y) => Ok(y),
        None => Ok(x.broadcast_matmul(&table.t()?)?),
    }
}

/// `x · Wᵀ` through the crate's matrix-vector kernels when `x` has few rows (decode) on CUDA
/// with an f16/bf16 weight: one row with any weight, up to eight with a small one (on large
/// weights cuBLAS is faster there); `None` where the general matmul applies.
fn dense_decode_product(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        if super::fused(x.device())
            && crate::kernels::cuda::dense_matvec::dense_matvec_wanted(
                tensor_bytes(w),
                super::rows_of(x),
            )
        {
            return Ok(crate::kernels::cuda::dense_matvec::dense_matvec(x, w)?);
        }
    }
    let _ = (x, w);
    Ok(None)
}

/// `(gelu_tanh(a) * b) · Wᵀ` in one matrix-vector launch on CUDA decode of one row; `None`
/// elsewhere (the kernel declines more rows: `dense_matvec::folds_into_matvec`).
fn gated_decode_product(a: &Tensor, b: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        if super::fused(a.device()) {
            return Ok(crate::kernels::cuda::dense_matvec::dense_matvec_gated(
                a, b, w,
            )?);
        }
    }
    let _ = (a, b, w);
    Ok(None)
}
