//! The GeGLU gate `gelu_tanh(a) * b`, alone or inside the gate/up product that feeds it.

use candle_core::Tensor;

use super::Result;
use super::Weight;

/// `gelu_tanh(a) * b` for `a`, `b` of one shape (`[.., width]`; rows may be strided).
///
/// # Errors
/// Shape mismatch.
pub(crate) fn gelu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::fused(a.device()) {
        return Ok(crate::kernels::cuda::layer_ops::gelu_mul(a, b)?);
    }
    // candle's `gelu` is the tanh approximation (`gelu_pytorch_tanh`).
    Ok((a.gelu()? * b)?)
}

/// `gelu_tanh(x · Gᵀ) * (x · Uᵀ)` in one launch, for `gate_up` the stacked `[G; U]` weight
/// `[2 * width, in]`: CUDA decode with a dense weight runs the gate inside the product. `None`
/// where no kernel serves; the caller then computes the two products and the gate apart.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn geglu_matvec(x: &Tensor, gate_up: &Weight) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(w) = gate_up.dense_weight() {
        if super::fused(x.device()) {
            return Ok(crate::kernels::cuda::dense_matvec::dense_matvec_geglu(
                x, w,
            )?);
        }
    }
    let _ = (x, gate_up);
    Ok(None)
}
