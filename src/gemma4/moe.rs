//! The mixture-of-experts block of 26B-A4B: a router picks `top_k` of `num_experts` GeGLU
//! experts per token; the experts run as one matmul per expert over the tokens routed to it.
//! MLX-quantized expert stacks stay packed: each expert's product reads its packed rows.

use candle_core::{DType, Tensor};

use super::norm::RmsNorm;
use super::{fused, Linear};
use crate::config::{Config, MoeConfig};
use crate::error::{Error, Result};
use crate::kernels::qmatmul::{qmatmul, PackedWeight};
use crate::weights::{KeyLayout, LoadedMatrix, WeightStore};

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

/// One stack of expert matrices `[E, out, in]`: dense, or MLX-packed and kept packed.
#[derive(Debug, Clone)]
enum ExpertMatrices {
    /// `[E, out, in]` in the model's dtype.
    Dense(Tensor),
    /// `[E * out, in]` packed: expert `e` owns rows `e * out ..`.
    Packed {
        weight: PackedWeight,
        experts: usize,
    },
}

impl ExpertMatrices {
    fn new(loaded: LoadedMatrix, experts: usize) -> Self {
        match loaded {
            LoadedMatrix::Dense(t) => ExpertMatrices::Dense(t),
            LoadedMatrix::Packed(weight) => ExpertMatrices::Packed { weight, experts },
        }
    }

    fn count(&self) -> Result<usize> {
        match self {
            ExpertMatrices::Dense(t) => Ok(t.dim(0)?),
            ExpertMatrices::Packed { experts, .. } => Ok(*experts),
        }
    }

    /// Expert `e`'s product `x · W_eᵀ`: `x` `[n, in]` → `[n, out]`.
    fn product(&self, e: usize, x: &Tensor) -> Result<Tensor> {
        match self {
            ExpertMatrices::Dense(t) => Ok(x.matmul(&t.get(e)?.t()?)?),
            ExpertMatrices::Packed { weight, experts } => {
                let out = weight.out_dim() / experts;
                Ok(qmatmul(x, &weight.narrow_rows(e * out, out)?)?)
            }
        }
    }

    /// The routed products on the device (see `grouped_matvec`).
    #[cfg(feature = "cuda")]
    fn grouped(&self, idx: &Tensor, x: &Tensor, x_per_token: bool) -> Result<Tensor> {
        use crate::kernels::cuda::fused::{grouped_matvec, grouped_qmatvec};
        Ok(match self {
            ExpertMatrices::Dense(t) => grouped_matvec(t, idx, x, x_per_token)?,
            ExpertMatrices::Packed { weight, experts } => {
                grouped_qmatvec(weight, *experts, idx, x, x_per_token)?
            }
        })
    }

    /// The routed products over `gelu_tanh(a) * b`, the gate inside the kernel where it fits.
    #[cfg(feature = "cuda")]
    fn grouped_gated(&self, idx: &Tensor, a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
        use crate::kernels::cuda::fused::{grouped_matvec_gated, grouped_qmatvec_gated};
        Ok(match self {
            ExpertMatrices::Dense(t) => grouped_matvec_gated(t, idx, a, b)?,
            ExpertMatrices::Packed { weight, experts } => {
                grouped_qmatvec_gated(weight, *experts, idx, a, b)?
            }
        })
    }

    fn resident_bytes(&self) -> usize {
        match self {
            ExpertMatrices::Dense(t) => super::tensor_bytes(t),
            ExpertMatrices::Packed { weight, .. } => weight.packed_bytes(),
        }
    }
}

/// The expert weights, gate and up stacked whatever the checkpoint layout.
#[derive(Debug, Clone)]
struct Experts {
    /// `[E, 2I, H]`: gate rows, then up rows.
    gate_up: ExpertMatrices,
    /// `[E, H, I]`
    down: ExpertMatrices,
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
        let load = |name: &str, shape: [usize; 3]| -> Result<ExpertMatrices> {
            Ok(ExpertMatrices::new(vb.matrix(name, l, &shape)?, e))
        };
        let experts =
            if vb.layout() == KeyLayout::Mlx || vb.contains(&format!("{split}.gate_proj.weight")) {
                let (gate, up) = (format!("{split}.gate_proj"), format!("{split}.up_proj"));
                Experts {
                    gate_up: ExpertMatrices::new(vb.matrix_pair(&gate, &up, l, [e, i, h])?, e),
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
        if crate::kernels::fused_enabled(x.device()) {
            return Ok(self
                .forward_on_device(&router_input, &x)?
                .reshape((b, s, h))?);
        }
        let routes = self.router.route(&router_input)?;
        let n_experts = self.experts.gate_up.count()?;
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
            let gu = self.experts.gate_up.product(e, &xe)?;
            let hidden = fused::gelu_mul(&gu.narrow(1, 0, width)?, &gu.narrow(1, width, width)?)?;
            let y = self.experts.down.product(e, &hidden)?;
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
        use crate::kernels::cuda::fused::{moe_mix, moe_route, GROUPED_MAX_PAIRS};
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
            let gu = self
                .experts
                .gate_up
                .grouped(&idx, &x.narrow(0, start, n)?, true)?;
            let (gate, up) = (gu.narrow(1, 0, width)?, gu.narrow(1, width, width)?);
            // The gate inside the down product where its rows fit the kernel's shared memory.
            let y = match self.experts.down.grouped_gated(&idx, &gate, &up)? {
                Some(y) => y,
                None => {
                    let hidden = fused::gelu_mul(&gate, &up)?;
                    self.experts.down.grouped(&idx, &hidden, false)?
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
    /// routing per layer). Dense experts: one `[experts, longest group, hidden]` block padded
    /// with row 0, and both expert products as one batched tensor-core matmul each (padding
    /// rows are computed and dropped). Packed experts: one product per picked expert over its
    /// rows (each dequantizes that expert for the GEMM).
    #[cfg(feature = "cuda")]
    fn forward_sorted(&self, x: &Tensor, idx: &Tensor, mix: &Tensor) -> Result<Tensor> {
        use crate::kernels::cuda::fused::moe_mix;
        let (_, k) = idx.dims2()?;
        let picks = idx.flatten_all()?.to_vec1::<u32>()?;
        let n_experts = self.experts.gate_up.count()?;
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
        let dev = x.device();
        let h = x.dim(1)?;
        let width = self.experts.width;
        let gelu_halves = |gu: &Tensor, dim: usize| -> Result<Tensor> {
            fused::gelu_mul(&gu.narrow(dim, 0, width)?, &gu.narrow(dim, width, width)?)
        };
        let u32s = |v: Vec<u32>| -> Result<Tensor> {
            let n = v.len();
            Ok(Tensor::from_vec(v, n, dev)?)
        };
        // Output rows in some slot order, and the slot of each pair for the way back.
        let mut slot_of = vec![0u32; picks.len()];
        let stacked = match (&self.experts.gate_up, &self.experts.down) {
            (ExpertMatrices::Dense(gate_up), ExpertMatrices::Dense(down)) => {
                let longest = groups.iter().map(Vec::len).max().unwrap_or(0).max(1);
                // Row of each padded slot (token of the pair, or 0 for padding).
                let mut rows = vec![0u32; n_experts * longest];
                for (e, g) in groups.iter().enumerate() {
                    for (i, &p) in g.iter().enumerate() {
                        rows[e * longest + i] = p / k as u32;
                        slot_of[p as usize] = (e * longest + i) as u32;
                    }
                }
                let n_slots = rows.len();
                let x_pad = x
                    .index_select(&u32s(rows)?, 0)?
                    .reshape((n_experts, longest, h))?;
                let gu = x_pad.matmul(&gate_up.transpose(1, 2)?)?; // [E, L, 2I]
                let y_pad = gelu_halves(&gu, 2)?.matmul(&down.transpose(1, 2)?)?; // [E, L, H]
                y_pad.reshape((n_slots, h))?
            }
            _ => {
                let mut ys = Vec::new();
                let mut slot = 0u32;
                for (e, g) in groups.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
                    let rows: Vec<u32> = g.iter().map(|&p| p / k as u32).collect();
                    let xe = x.index_select(&u32s(rows)?, 0)?;
                    let gu = self.experts.gate_up.product(e, &xe)?;
                    ys.push(self.experts.down.product(e, &gelu_halves(&gu, 1)?)?);
                    for &p in g {
                        slot_of[p as usize] = slot;
                        slot += 1;
                    }
                }
                Tensor::cat(&ys, 0)?
            }
        };
        let y = stacked.index_select(&u32s(slot_of)?, 0)?;
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
    /// Bytes of resident weights (packed experts at their packed size).
    pub fn resident_bytes(&self) -> usize {
        self.router.proj.resident_bytes()
            + self.router.norm.resident_bytes()
            + self.experts.gate_up.resident_bytes()
            + self.experts.down.resident_bytes()
    }
}
