//! The mixture-of-experts block of 26B-A4B: a router picks `top_k` of `num_experts` GeGLU
//! experts per token, and the picked experts' outputs are summed with the routing weights (see
//! `kernels::ops::moe`). MLX-quantized expert stacks stay packed.

use candle_core::{DType, Tensor};

use super::norm::RmsNorm;
use super::Linear;
use crate::config::{Config, MoeConfig};
use crate::error::{Error, Result};
use crate::kernels::ops;
use crate::kernels::ops::moe::{ExpertWeights, Experts as ExpertsOperand, Router as RouterOperand};
use crate::weights::{KeyLayout, LoadedMatrix, WeightStore};

/// Router: `softmax` over the top-k logits of `proj(rms(x) * scale * H^-½)`, times
/// `per_expert_scale`.
#[derive(Debug, Clone)]
struct Router {
    proj: Linear,
    /// `rms_norm` scale: `router.scale * H^-½`, `[H]`.
    norm: RmsNorm,
    /// `[E]` host copy.
    per_expert_scale: Vec<f32>,
    /// `[E]` f32 on the model's device (for routing without a host round trip).
    per_expert_scale_dev: Tensor,
    top_k: usize,
}

/// A stack of expert matrices as loaded: dense `[E, out, in]`, or packed `[E * out, in]`.
fn expert_weights(loaded: LoadedMatrix, experts: usize) -> ExpertWeights {
    match loaded {
        LoadedMatrix::Dense(t) => ExpertWeights::Dense(t),
        LoadedMatrix::Packed(weight) => ExpertWeights::Packed { weight, experts },
    }
}

/// The expert weights, gate and up stacked whatever the checkpoint layout.
#[derive(Debug, Clone)]
struct Experts {
    /// `[E, 2I, H]`: gate rows, then up rows.
    gate_up: ExpertWeights,
    /// `[E, H, I]`
    down: ExpertWeights,
    /// `I`.
    width: usize,
}

/// Router plus experts of one layer.
#[derive(Debug, Clone)]
pub struct MoeBlock {
    router: Router,
    experts: Experts,
}

impl MoeBlock {
    /// Loads `layers.{layer}.router.*` and `layers.{layer}.experts.*` (HF's fused
    /// `gate_up_proj` or MLX's split `switch_glu`).
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(cfg: &Config, moe: &MoeConfig, layer: usize, vb: &WeightStore) -> Result<Self> {
        let (h, e, i) = (cfg.hidden_size, moe.num_experts, moe.intermediate_size);
        let l = Some(layer);
        let p = format!("layers.{layer}");
        let scale = vb.tensor(&format!("{p}.router.scale"), l, &[h])?;
        let per_expert_scale_dev = vb
            .tensor(&format!("{p}.router.per_expert_scale"), l, &[e])?
            .to_dtype(DType::F32)?;
        let router = Router {
            proj: Linear::from_loaded(vb.matrix(&format!("{p}.router.proj"), l, &[e, h])?),
            norm: RmsNorm::new((scale * (h as f64).powf(-0.5))?, cfg.rms_norm_eps),
            per_expert_scale: per_expert_scale_dev.to_vec1::<f32>()?,
            per_expert_scale_dev,
            top_k: moe.top_k,
        };
        let split = format!("{p}.experts.switch_glu");
        let load = |name: &str, shape: [usize; 3]| -> Result<ExpertWeights> {
            Ok(expert_weights(vb.matrix(name, l, &shape)?, e))
        };
        let experts =
            if vb.layout() == KeyLayout::Mlx || vb.contains(&format!("{split}.gate_proj.weight")) {
                let (gate, up) = (format!("{split}.gate_proj"), format!("{split}.up_proj"));
                Experts {
                    gate_up: expert_weights(vb.matrix_pair(&gate, &up, l, [e, i, h])?, e),
                    down: load(&format!("{split}.down_proj"), [e, h, i])?,
                    width: i,
                }
            } else {
                Experts {
                    gate_up: load(&format!("{p}.experts.gate_up_proj"), [e, 2 * i, h])?,
                    down: load(&format!("{p}.experts.down_proj"), [e, h, i])?,
                    width: i,
                }
            };
        if moe.top_k == 0 || moe.top_k > e {
            return Err(Error::Config {
                field: "top_k_experts".to_string(),
                reason: format!("{} is not in 1..={e}", moe.top_k),
            });
        }
        Ok(Self { router, experts })
    }

    /// `router_input` is the un-normed residual, `expert_input` the `pre_feedforward_layernorm_2`
    /// output, both `[B, S, H]`; returns the weighted expert sum `[B, S, H]`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward(&self, router_input: &Tensor, expert_input: &Tensor) -> Result<Tensor> {
        let (b, s, h) = expert_input.dims3()?;
        let x = expert_input.reshape((b * s, h))?;
        let router_input = router_input.reshape((b * s, h))?;
        let (router, experts) = (self.router_operand(), self.experts_operand());
        Ok(ops::moe::moe(&router_input, &x, &router, &experts)?.reshape((b, s, h))?)
    }

    /// [`MoeBlock::forward`] of one token, stopped before the weighted sum of the picked
    /// experts' rows (`ops::moe::moe_rows`); `None` where that form is not made (the caller
    /// runs [`MoeBlock::forward`]).
    ///
    /// # Errors
    /// Shape mismatch.
    pub(crate) fn forward_rows(
        &self,
        router_input: &Tensor,
        expert_input: &Tensor,
    ) -> Result<Option<ops::moe::ExpertRows>> {
        let (b, s, h) = expert_input.dims3()?;
        if b * s != 1 {
            return Ok(None);
        }
        let x = expert_input.reshape((1, h))?;
        let router_input = router_input.reshape((1, h))?;
        Ok(ops::moe::moe_rows(
            &router_input,
            &x,
            &self.router_operand(),
            &self.experts_operand(),
        )?)
    }

    fn router_operand(&self) -> RouterOperand<'_> {
        let r = &self.router;
        RouterOperand {
            proj: r.proj.weight(),
            norm: r.norm.operand(),
            per_expert_scale: &r.per_expert_scale,
            per_expert_scale_dev: &r.per_expert_scale_dev,
            top_k: r.top_k,
        }
    }

    fn experts_operand(&self) -> ExpertsOperand<'_> {
        ExpertsOperand {
            gate_up: &self.experts.gate_up,
            down: &self.experts.down,
            width: self.experts.width,
        }
    }
}

impl MoeBlock {
    /// Bytes of resident weights (packed experts at their packed size).
    pub fn resident_bytes(&self) -> usize {
        self.router.proj.resident_bytes()
            + self.router.norm.resident_bytes()
            + self.experts.gate_up.resident_bytes()
            + self.experts.down.resident_bytes()
    }
}
