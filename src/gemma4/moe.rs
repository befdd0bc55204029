//! The mixture-of-experts block of 26B-A4B: a router picks `top_k` of `num_experts` GeGLU
//! experts per token; the experts run as one matmul per expert over the tokens routed to it.

use candle_core::{DType, Tensor};

use super::norm::RmsNorm;
use super::{fused, Linear};
use crate::config::{Config, MoeConfig};
use crate::error::{Error, Result};
use crate::weights::{KeyLayout, WeightStore};

/// Above this many tokens a CUDA forward groups the picks by expert and runs the experts as
/// batched tensor-core matmuls; up to it, the grouped matrix-vector kernel reads each expert
/// once.
/// `CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS` overrides it (0 sends every forward through the
/// sorted path, which is how the GPU token check covers that path on the short fixture
/// prompts).
#[cfg(feature = "cuda")]
fn grouped_max_tokens() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(64)
    })
}

/// Router: `softmax` over the top-k logits of `proj(rms(x) * scale * H^-½)`, times
/// `per_expert_scale` (softmax over the selected logits equals the renormalised full softmax).
#[derive(Debug, Clone)]
struct Router {
    proj: Linear,
    /// `rms_norm` scale: `router.scale * H^-½`, `[H]`.
    norm: RmsNorm,
    /// `[E]` host copy.
    per_expert_scale: Vec<f32>,
    /// `[E]` f32 on the model's device (for routing without a host round trip).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    per_expert_scale_dev: Tensor,
    top_k: usize,
}

impl Router {
    /// Routes `x` `[tokens, H]`: for each token, `(expert, weight)` pairs.
    fn route(&self, x: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let logits = fused::normed_product(&self.proj, x, &self.norm)?;
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

/// The expert weights, gate and up stacked whatever the checkpoint layout.
#[derive(Debug, Clone)]
struct Experts {
    /// `[E, 2I, H]`: gate rows, then up rows.
    gate_up: Tensor,
    /// `[E, H, I]`
    down: Tensor,
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
        let dense = |name: &str, shape: &[usize]| -> Result<Tensor> {
            vb.matrix(name, l, shape)?.into_dense(vb.dtype())
        };
        let experts =
            if vb.layout() == KeyLayout::Mlx || vb.contains(&format!("{split}.gate_proj.weight")) {
                let gate = dense(&format!("{split}.gate_proj"), &[e, i, h])?;
                let up = dense(&format!("{split}.up_proj"), &[e, i, h])?;
                Experts {
                    gate_up: Tensor::cat(&[gate, up], 1)?,
                    down: dense(&format!("{split}.down_proj"), &[e, h, i])?,
                    width: i,
                }
            } else {
                Experts {
                    gate_up: dense(&format!("{p}.experts.gate_up_proj"), &[e, 2 * i, h])?,
                    down: dense(&format!("{p}.experts.down_proj"), &[e, h, i])?,
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
        if crate::kernels::fused_enabled(x.device()) {
            return Ok(self
                .forward_on_device(&router_input, &x)?
                .reshape((b, s, h))?);
        }
        let routes = self.router.route(&router_input)?;
        let n_experts = self.experts.gate_up.dim(0)?;
        // Group tokens by expert so each expert runs one matmul over its tokens.
        let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); n_experts];
        for (token, picks) in routes.iter().enumerate() {
            for &(e, w) in picks {
                by_expert[e].0.push(token as u32);
                by_expert[e].1.push(w);
            }
        }
        let width = self.experts.width;
        let mut out = Tensor::zeros((b * s, h), x.dtype(), x.device())?;
        for (e, (tokens, weights)) in by_expert.into_iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let idx = Tensor::from_vec(tokens, n, x.device())?;
            let xe = x.index_select(&idx, 0)?;
            let gu = xe.matmul(&self.experts.gate_up.get(e)?.t()?)?;
            let hidden = fused::gelu_mul(&gu.narrow(1, 0, width)?, &gu.narrow(1, width, width)?)?;
            let y = hidden.matmul(&self.experts.down.get(e)?.t()?)?;
            let w = Tensor::from_vec(weights, (n, 1), x.device())?.to_dtype(y.dtype())?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        Ok(out.reshape((b, s, h))?)
    }

    /// Routing and experts without a host round trip (CUDA): top-k on the device, then the
    /// routed expert products grouped by expert, so each picked expert's rows are read once per
    /// call. Long inputs run in slices of at most `GROUPED_MAX_PAIRS / top_k` tokens.
    #[cfg(feature = "cuda")]
    fn forward_on_device(&self, router_input: &Tensor, x: &Tensor) -> Result<Tensor> {
        use crate::kernels::cuda::fused::{
            grouped_matvec, grouped_matvec_gated, moe_mix, moe_route, GROUPED_MAX_PAIRS,
        };
        let r = &self.router;
        let logits = fused::normed_product(&r.proj, router_input, &r.norm)?;
        let tokens = logits.dim(0)?;
        if tokens > grouped_max_tokens() {
            let (idx, mix) = moe_route(&logits, &r.per_expert_scale_dev, r.top_k)?;
            return self.forward_sorted(x, &idx, &mix);
        }
        let slice = (GROUPED_MAX_PAIRS / r.top_k).max(1);
        let width = self.experts.width;
        let mut outs = Vec::with_capacity(tokens.div_ceil(slice));
        for start in (0..tokens).step_by(slice) {
            let n = slice.min(tokens - start);
            let (idx, mix) = moe_route(
                &logits.narrow(0, start, n)?,
                &r.per_expert_scale_dev,
                r.top_k,
            )?;
            let gu = grouped_matvec(&self.experts.gate_up, &idx, &x.narrow(0, start, n)?, true)?;
            let (gate, up) = (gu.narrow(1, 0, width)?, gu.narrow(1, width, width)?);
            // The gate inside the down product where its rows fit the kernel's shared memory.
            let y = match grouped_matvec_gated(&self.experts.down, &idx, &gate, &up)? {
                Some(y) => y,
                None => {
                    let hidden = fused::gelu_mul(&gate, &up)?;
                    grouped_matvec(&self.experts.down, &idx, &hidden, false)?
                }
            };
            outs.push(moe_mix(&y, &mix)?);
        }
        Ok(if outs.len() == 1 {
            outs.remove(0)
        } else {
            Tensor::cat(&outs, 0)?
        })
    }

    /// Many tokens (prefill): the picks are grouped by expert on the host (one copy of the
    /// routing per layer) into a `[experts, longest group, hidden]` block padded with row 0,
    /// and both expert products run as one batched tensor-core matmul each (padding rows are
    /// computed and dropped).
    #[cfg(feature = "cuda")]
    fn forward_sorted(&self, x: &Tensor, idx: &Tensor, mix: &Tensor) -> Result<Tensor> {
        use crate::kernels::cuda::fused::moe_mix;
        let (_, k) = idx.dims2()?;
        let picks = idx.flatten_all()?.to_vec1::<u32>()?;
        let n_experts = self.experts.gate_up.dim(0)?;
        let mut groups: Vec<Vec<u32>> = vec![Vec::new(); n_experts];
        for (p, &e) in picks.iter().enumerate() {
            let e = e as usize;
            if e >= n_experts {
                return Err(Error::Input(format!(
                    "router picked expert {e} of {n_experts}"
                )));
            }
            groups[e].push(p as u32);
        }
        let longest = groups.iter().map(Vec::len).max().unwrap_or(0).max(1);
        // Row of each padded slot (token of the pair, or 0 for padding), and the slot of each
        // pair for the way back.
        let mut rows = vec![0u32; n_experts * longest];
        let mut slot_of = vec![0u32; picks.len()];
        for (e, g) in groups.iter().enumerate() {
            for (i, &p) in g.iter().enumerate() {
                rows[e * longest + i] = p / k as u32;
                slot_of[p as usize] = (e * longest + i) as u32;
            }
        }
        let dev = x.device();
        let h = x.dim(1)?;
        let n_slots = rows.len();
        let x_pad = x
            .index_select(&Tensor::from_vec(rows, n_slots, dev)?, 0)?
            .reshape((n_experts, longest, h))?;
        let width = self.experts.width;
        let gu = x_pad.matmul(&self.experts.gate_up.transpose(1, 2)?)?; // [E, L, 2I]
        let hidden = fused::gelu_mul(&gu.narrow(2, 0, width)?, &gu.narrow(2, width, width)?)?;
        let y_pad = hidden.matmul(&self.experts.down.transpose(1, 2)?)?; // [E, L, H]
        let n = slot_of.len();
        let y = y_pad
            .reshape((n_slots, h))?
            .index_select(&Tensor::from_vec(slot_of, n, dev)?, 0)?;
        Ok(moe_mix(&y, mix)?)
    }

    #[cfg(not(feature = "cuda"))]
    fn forward_on_device(&self, _router_input: &Tensor, _x: &Tensor) -> Result<Tensor> {
        Err(Error::Input(
            "device-side routing needs the `cuda` feature".to_string(),
        ))
    }
}

impl MoeBlock {
    /// Bytes of resident weights (experts are held dense).
    pub fn resident_bytes(&self) -> usize {
        use super::tensor_bytes;
        self.router.proj.resident_bytes()
            + self.router.norm.resident_bytes()
            + tensor_bytes(&self.experts.gate_up)
            + tensor_bytes(&self.experts.down)
    }
}
