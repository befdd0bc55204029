//! Gemma 4 attention. A layer that owns K/V projects, norms and rotates them and appends them to
//! its cache; a KV-shared layer owns no k/v projections and reads its producer's view of the
//! current step. Scores are not scaled (scale 1.0): q_norm and k_norm take that role.

use candle_core::Tensor;

use super::norm::RmsNorm;
use super::rope::{self, Rope};
use super::step::Step;
use super::Linear;
use crate::config::{Config, KvSource, LayerKind, LayerPlan};
use crate::error::{Error, Result};
use crate::kv::{KvCache, KvView, LayerCache};
use crate::weights::WeightStore;

/// Where this forward's K/V come from.
#[derive(Debug)]
pub enum KvInput<'a> {
    /// The layer's own cache: new K/V are appended to it.
    Own(&'a mut LayerCache),
    /// The producer's view of this step (KV-shared layers).
    Shared(&'a KvView),
}

/// The projections a KV-owning layer holds.
#[derive(Debug, Clone)]
struct KvProjections {
    k_proj: Linear,
    /// `None` on full layers of k_eq_v models: V is the raw K projection.
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

/// Self-attention of one decoder layer.
#[derive(Debug, Clone)]
pub struct Attention {
    q_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    /// `None` on KV-shared layers, which read their producer's K/V.
    kv: Option<KvProjections>,
    kind: LayerKind,
    n_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    rope: Rope,
}

impl Attention {
    /// Loads the attention of `layer` (`layers.{layer}.self_attn.*`). KV-shared layers load no
    /// k/v/k_norm, whether or not the checkpoint ships them.
    ///
    /// # Errors
    /// Missing or misshapen tensors, named with the layer.
    pub fn new(cfg: &Config, layer: usize, vb: &WeightStore) -> Result<Self> {
        let plan: &LayerPlan = &cfg.layers[layer];
        let (h, nh, hd, kvh) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            plan.head_dim,
            plan.kv_heads,
        );
        let p = format!("layers.{layer}.self_attn");
        let l = Some(layer);
        let lin = |name: &str, out: usize, inp: usize| -> Result<Linear> {
            Ok(Linear::from_loaded(vb.matrix(
                &format!("{p}.{name}"),
                l,
                &[out, inp],
            )?))
        };
        let norm = |name: &str| -> Result<RmsNorm> {
            Ok(RmsNorm::new(
                vb.tensor(&format!("{p}.{name}.weight"), l, &[hd])?,
                cfg.rms_norm_eps,
            ))
        };
        let kv = match plan.kv {
            KvSource::Shared { .. } => None,
            KvSource::Own => Some(KvProjections {
                k_proj: lin("k_proj", kvh * hd, h)?,
                v_proj: if plan.has_v_proj {
                    Some(lin("v_proj", kvh * hd, h)?)
                } else {
                    None
                },
                k_norm: norm("k_norm")?,
                v_norm: RmsNorm::no_scale(hd, cfg.rms_norm_eps, vb.dtype(), vb.device())?,
            }),
        };
        Ok(Self {
            q_proj: lin("q_proj", nh * hd, h)?,
            o_proj: lin("o_proj", h, nh * hd)?,
            q_norm: norm("q_norm")?,
            kv,
            kind: plan.kind,
            n_heads: nh,
            kv_heads: kvh,
            head_dim: hd,
            window: match plan.kind {
                LayerKind::Sliding => Some(cfg.sliding_window),
                LayerKind::Full => None,
            },
            rope: Rope::new(cfg.rope(plan.kind), hd),
        })
    }

    /// The rotary table of this layer's kind and head dim.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Attends `x` `[batch, seq, hidden]` and returns `[batch, seq, hidden]` plus, for a
    /// KV-owning layer, the view its cache returned (KV-shared layers get it from here).
    ///
    /// # Errors
    /// Cache errors, shape errors.
    pub fn forward(
        &self,
        x: &Tensor,
        step: &Step,
        kv: KvInput<'_>,
    ) -> Result<(Tensor, Option<KvView>)> {
        let (b, s, _) = x.dims3()?;
        let (cos, sin) = step.rope(self.kind);
        let heads =
            |t: Tensor, n: usize| -> Result<Tensor> { Ok(t.reshape((b, s, n, self.head_dim))?) };
        let q = heads(self.q_proj.forward(x)?, self.n_heads)?;
        let q = self.q_norm.forward(&q)?.transpose(1, 2)?;
        let q = rope::apply(&q, cos, sin)?;

        let mut produced = None;
        let view: &KvView = match (kv, &self.kv) {
            (KvInput::Own(cache), Some(p)) => {
                let k_raw = heads(p.k_proj.forward(x)?, self.kv_heads)?;
                let v_raw = match &p.v_proj {
                    Some(v_proj) => heads(v_proj.forward(x)?, self.kv_heads)?,
                    None => k_raw.clone(),
                };
                let k = p.k_norm.forward(&k_raw)?.transpose(1, 2)?;
                let k = rope::apply(&k, cos, sin)?;
                let v = p.v_norm.forward(&v_raw)?.transpose(1, 2)?.contiguous()?;
                &*produced.insert(cache.update(&k, &v)?)
            }
            (KvInput::Shared(view), None) => view,
            (KvInput::Own(_), None) => return Err(Error::Input(
                "a KV-shared layer was handed a cache to write; it only reads its producer's K/V"
                    .to_string(),
            )),
            (KvInput::Shared(_), Some(_)) => {
                return Err(Error::Input(
                    "a KV-owning layer was handed another layer's K/V instead of its cache"
                        .to_string(),
                ))
            }
        };
        let out = crate::kernels::attend(&q, view, &step.offsets, self.window, 1.0)?;
        let out = out
            .transpose(1, 2)?
            .reshape((b, s, self.n_heads * self.head_dim))?;
        Ok((self.o_proj.forward(&out)?, produced))
    }
}

impl Attention {
    /// Bytes of resident weights.
    pub fn resident_bytes(&self) -> usize {
        let kv = self.kv.as_ref().map_or(0, |p| {
            p.k_proj.resident_bytes()
                + p.v_proj.as_ref().map_or(0, Linear::resident_bytes)
                + p.k_norm.resident_bytes()
        });
        self.q_proj.resident_bytes()
            + self.o_proj.resident_bytes()
            + self.q_norm.resident_bytes()
            + kv
    }
}
