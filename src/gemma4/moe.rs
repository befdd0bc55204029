//! The mixture-of-experts block of 26B-A4B: a router picks `top_k` of `num_experts` GeGLU
//! experts per token; the experts run as one matmul per expert over the tokens routed to it.

use candle_core::{DType, Tensor};

use super::norm::RmsNorm;
use super::Linear;
use crate::config::{Config, MoeConfig};
use crate::error::{Error, Result};
use crate::weights::{KeyLayout, WeightStore};

/// Router: `softmax` over the top-k logits of `proj(rms(x) * scale * H^-½)`, times
/// `per_expert_scale` (softmax over the selected logits equals the renormalised full softmax).
#[derive(Debug, Clone)]
struct Router {
    proj: Linear,
    /// `rms_norm` scale: `router.scale * H^-½`, `[H]`.
    norm: RmsNorm,
    /// `[E]` host copy.
    per_expert_scale: Vec<f32>,
    top_k: usize,
}

impl Router {
    /// Routes `x` `[tokens, H]`: for each token, `(expert, weight)` pairs.
    fn route(&self, x: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let logits = self.proj.forward(&self.norm.forward(x)?)?;
        let logits = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        Ok(logits
            .into_iter()
            .map(|row| {
                let mut idx: Vec<usize> = (0..row.len()).collect();
                idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                idx.truncate(self.top_k);
                let max = idx.first().map_or(0.0, |&i| row[i]);
                let exps: Vec<f32> = idx.iter().map(|&i| (row[i] - max).exp()).collect();
                let sum: f32 = exps.iter().sum();
                idx.iter()
                    .zip(exps)
                    .map(|(&e, w)| (e, w / sum * self.per_expert_scale[e]))
                    .collect()
            })
            .collect())
    }
}

/// The expert weights, split into gate, up and down whatever the checkpoint layout.
#[derive(Debug, Clone)]
struct Experts {
    /// `[E, I, H]`
    gate: Tensor,
    /// `[E, I, H]`
    up: Tensor,
    /// `[E, H, I]`
    down: Tensor,
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
        let per_expert_scale = vb
            .tensor(&format!("{p}.router.per_expert_scale"), l, &[e])?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let router = Router {
            proj: Linear::from_loaded(vb.matrix(&format!("{p}.router.proj"), l, &[e, h])?),
            norm: RmsNorm::new((scale * (h as f64).powf(-0.5))?, cfg.rms_norm_eps),
            per_expert_scale,
            top_k: moe.top_k,
        };
        let split = format!("{p}.experts.switch_glu");
        let experts =
            if vb.layout() == KeyLayout::Mlx || vb.contains(&format!("{split}.gate_proj.weight")) {
                Experts {
                    gate: vb
                        .matrix(&format!("{split}.gate_proj"), l, &[e, i, h])?
                        .into_dense(vb.dtype())?,
                    up: vb
                        .matrix(&format!("{split}.up_proj"), l, &[e, i, h])?
                        .into_dense(vb.dtype())?,
                    down: vb
                        .matrix(&format!("{split}.down_proj"), l, &[e, h, i])?
                        .into_dense(vb.dtype())?,
                }
            } else {
                let gate_up = vb
                    .matrix(&format!("{p}.experts.gate_up_proj"), l, &[e, 2 * i, h])?
                    .into_dense(vb.dtype())?;
                Experts {
                    gate: gate_up.narrow(1, 0, i)?.contiguous()?,
                    up: gate_up.narrow(1, i, i)?.contiguous()?,
                    down: vb
                        .matrix(&format!("{p}.experts.down_proj"), l, &[e, h, i])?
                        .into_dense(vb.dtype())?,
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
        let routes = self.router.route(&router_input.reshape((b * s, h))?)?;
        let x = expert_input.reshape((b * s, h))?;
        let n_experts = self.experts.gate.dim(0)?;
        // Group tokens by expert so each expert runs one matmul over its tokens.
        let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); n_experts];
        for (token, picks) in routes.iter().enumerate() {
            for &(e, w) in picks {
                by_expert[e].0.push(token as u32);
                by_expert[e].1.push(w);
            }
        }
        let mut out = Tensor::zeros((b * s, h), x.dtype(), x.device())?;
        for (e, (tokens, weights)) in by_expert.into_iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let idx = Tensor::from_vec(tokens, n, x.device())?;
            let xe = x.index_select(&idx, 0)?;
            let gate = xe.matmul(&self.experts.gate.get(e)?.t()?)?.gelu()?;
            let up = xe.matmul(&self.experts.up.get(e)?.t()?)?;
            let y = (gate * up)?.matmul(&self.experts.down.get(e)?.t()?)?;
            let w = Tensor::from_vec(weights, (n, 1), x.device())?.to_dtype(y.dtype())?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        Ok(out.reshape((b, s, h))?)
    }
}

impl MoeBlock {
    /// Bytes of resident weights (experts are held dense).
    pub fn resident_bytes(&self) -> usize {
        use super::tensor_bytes;
        self.router.proj.resident_bytes()
            + self.router.norm.resident_bytes()
            + tensor_bytes(&self.experts.gate)
            + tensor_bytes(&self.experts.up)
            + tensor_bytes(&self.experts.down)
    }
}
