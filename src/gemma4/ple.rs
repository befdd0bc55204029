//! Per-layer embeddings (E2B/E4B): a second, per-layer token embedding plus a projection of the
//! scaled main embedding, combined once per forward and sliced into one `[B, S, P]` input per
//! decoder layer.

use candle_core::{DType, Tensor};

use super::norm::RmsNorm;
use super::{Embedding, Linear};
use crate::config::Config;
use crate::error::Result;
use crate::weights::WeightStore;

/// The PLE tables and projection of the model.
#[derive(Debug, Clone)]
pub struct PerLayerEmbeddings {
    /// `[V_ple, L * P]`
    embed_tokens_per_layer: Embedding,
    /// `H -> L * P`
    per_layer_model_projection: Linear,
    /// RMSNorm over each `[P]` slice.
    per_layer_projection_norm: RmsNorm,
    layers: usize,
    width: usize,
    hidden: usize,
}

/// Multiplies by a scale rounded to the activation dtype first, as the references do (an f32
/// run uses the f32 scale, a bf16 run the bf16-rounded one).
///
/// The factor goes through f32 (the references' scalar), is rounded to the dtype here, and one
/// `affine` multiplies by it. Rounding here keeps the product the same on every backend:
/// candle's CPU `affine` rounds its factor to the tensor's dtype itself, its Metal `affine`
/// multiplies by the f32 factor as given. With the factor already in the dtype, both compute
/// the exact product of two dtype values (it fits an f32) rounded once to the dtype.
pub(crate) fn scale_in_dtype(x: &Tensor, scale: f64) -> Result<Tensor> {
    Ok(x.affine(factor_in_dtype(scale, x.dtype()), 0.0)?)
}

/// `scale` through f32, rounded to `dtype` (to nearest, ties to even).
fn factor_in_dtype(scale: f64, dtype: DType) -> f64 {
    let factor = scale as f32;
    match dtype {
        DType::BF16 => half::bf16::from_f32(factor).to_f64(),
        DType::F16 => half::f16::from_f32(factor).to_f64(),
        _ => f64::from(factor),
    }
}

impl PerLayerEmbeddings {
    /// Loads the PLE weights; `None` when the config has `hidden_size_per_layer_input == 0`.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(cfg: &Config, vb: &WeightStore) -> Result<Option<Self>> {
        let p = cfg.hidden_size_per_layer_input;
        if p == 0 {
            return Ok(None);
        }
        let l = cfg.num_layers();
        Ok(Some(Self {
            embed_tokens_per_layer: Embedding::from_loaded(vb.matrix(
                "embed_tokens_per_layer",
                None,
                &[cfg.vocab_size_per_layer_input, l * p],
            )?),
            per_layer_model_projection: Linear::from_loaded(vb.matrix(
                "per_layer_model_projection",
                None,
                &[l * p, cfg.hidden_size],
            )?),
            per_layer_projection_norm: RmsNorm::new(
                vb.tensor("per_layer_projection_norm.weight", None, &[p])?,
                cfg.rms_norm_eps,
            ),
            layers: l,
            width: p,
            hidden: cfg.hidden_size,
        }))
    }

    /// `ids` `[B, S]` (u32) and the scaled embedding `h0` `[B, S, H]` → `[B, S, L, P]`, for ids the caller has checked against the PLE table
    /// (packed tables then gather without reading the ids back to the host).
    ///
    /// # Errors
    /// Shape mismatch.
    pub(crate) fn forward_checked_ids(&self, ids: &Tensor, h0: &Tensor) -> Result<Tensor> {
        self.forward_with(ids, h0, true)
    }

    fn forward_with(&self, ids: &Tensor, h0: &Tensor, ids_checked: bool) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let (l, p) = (self.layers, self.width);
        let flat = ids.flatten_all()?;
        let tokens = if ids_checked {
            self.embed_tokens_per_layer
                .lookup_checked_ids(&flat, h0.dtype())?
        } else {
            self.embed_tokens_per_layer.lookup(&flat, h0.dtype())?
        }
        .reshape((b, s, l, p))?;
        let tokens = scale_in_dtype(&tokens, (p as f64).sqrt())?;
        let ctx = self.per_layer_model_projection.forward(h0)?;
        let ctx = scale_in_dtype(&ctx, (self.hidden as f64).powf(-0.5))?.reshape((b, s, l, p))?;
        let ctx = self.per_layer_projection_norm.forward(&ctx)?;
        scale_in_dtype(&(ctx + tokens)?, 0.5f64.sqrt())
    }
}

/// The `[B, S, P]` slice of layer `layer`.
///
/// # Errors
/// Index out of range.
pub fn layer_slice(ple: &Tensor, layer: usize) -> Result<Tensor> {
    Ok(ple.narrow(2, layer, 1)?.squeeze(2)?)
}

impl PerLayerEmbeddings {
    /// Bytes of resident weights.
    pub fn resident_bytes(&self) -> usize {
        self.embed_tokens_per_layer.resident_bytes()
            + self.per_layer_model_projection.resident_bytes()
            + self.per_layer_projection_norm.resident_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn scaling_equals_a_product_with_the_scale_rounded_to_the_dtype() -> Result<()> {
        let x = Tensor::randn(0f32, 3.0, (4, 257), &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = x.to_dtype(dtype)?;
            for scale in [1536f64.sqrt(), 2560f64.powf(-0.5), 0.5f64.sqrt(), 16.0] {
                let s = Tensor::new(&[scale as f32], &Device::Cpu)?.to_dtype(dtype)?;
                let want = x.broadcast_mul(&s)?.to_dtype(DType::F32)?;
                let got = scale_in_dtype(&x, scale)?.to_dtype(DType::F32)?;
                assert_eq!(
                    got.to_vec2::<f32>()?,
                    want.to_vec2::<f32>()?,
                    "{dtype:?} {scale}"
                );
                // An `affine` that multiplies in f32 by the factor as given (candle's Metal
                // kernel) gives the same values.
                let f32_affine = x
                    .to_dtype(DType::F32)?
                    .affine(factor_in_dtype(scale, dtype), 0.0)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?;
                assert_eq!(
                    f32_affine.to_vec2::<f32>()?,
                    want.to_vec2::<f32>()?,
                    "{dtype:?} {scale}: f32 multiply"
                );
            }
        }
        Ok(())
    }
}
