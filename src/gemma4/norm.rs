//! Gemma 4 RMSNorm: `x * (mean(x²) + eps)^-½ * w`, computed in f32. The weight is a plain scale:
//! unlike Gemma 1–3 there is no `1 +` offset. The no-scale variant (used for V and the router)
//! has no weight at all.

use candle_core::{DType, Device, Result, Tensor};

use crate::kernels::ops::Norm;

/// RMSNorm over the last axis, with or without a learned scale.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[dim]` scale; all ones for the no-scale variant.
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// A norm with a learned `[dim]` scale.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            eps: eps as f32,
        }
    }

    /// A norm without a scale (Gemma 4's `v_norm` and the router's input norm).
    ///
    /// # Errors
    /// Allocation failure.
    pub fn no_scale(dim: usize, eps: f64, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self::new(Tensor::ones(dim, dtype, device)?, eps))
    }

    /// Normalises `x` over its last axis.
    ///
    /// # Errors
    /// Last axis not equal to the weight's length.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::kernels::ops::norm::rms_norm(x, self.operand())
    }
}

impl RmsNorm {
    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        f64::from(self.eps)
    }

    /// The norm as the kernels take it.
    pub(crate) fn operand(&self) -> Norm<'_> {
        Norm {
            weight: &self.weight,
            eps: self.eps(),
        }
    }

    /// Bytes of the scale.
    pub fn resident_bytes(&self) -> usize {
        crate::kernels::ops::tensor_bytes(&self.weight)
    }
}
