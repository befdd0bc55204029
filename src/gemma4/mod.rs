//! The Gemma 4 text decoder: one model type for E2B, E4B, 26B-A4B and 31B. Each layer decides
//! its shape once, from its [`crate::config::LayerPlan`]; forwards only match on that decision.

pub mod attention;
pub mod layer;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod ple;
pub mod rope;
pub mod step;

pub use attention::{Attention, KvInput};
pub use layer::DecoderLayer;
pub use model::TextModel;
pub use step::Step;

use candle_core::{Module, Tensor};

/// A bias-free linear layer over a `[out, in]` weight (dequantized on load when the checkpoint
/// stored it quantized).
#[derive(Debug, Clone)]
pub struct Linear {
    inner: candle_nn::Linear,
}

impl Linear {
    /// Wraps a `[out, in]` weight.
    pub fn new(weight: Tensor) -> Self {
        Self {
            inner: candle_nn::Linear::new(weight, None),
        }
    }

    /// The `[out, in]` weight.
    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }

    /// `x · Wᵀ` over the last axis of `x`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.inner.forward(x)
    }
}
