//! Gemma 4 attention. A layer that owns K/V projects, norms and rotates them and appends them to
//! its cache; a KV-shared layer owns no k/v projections and reads its producer's view of the
//! current step. Scores are not scaled (scale 1.0): q_norm and k_norm take that role.

use candle_core::Tensor;

use super::norm::RmsNorm;
use super::step::Step;
use super::Linear;
use crate::config::{Config, KvSource, LayerKind, LayerPlan};
use crate::error::{Error, Result};
use crate::kernels::ops::qkv::{self, QkvInput, QkvOutput};
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

/// The norms a KV-owning layer applies to its new K and V.
#[derive(Debug, Clone)]
struct KvNorms {
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

/// The input projections. KV-shared layers own only q; KV-owning layers also own k, and v unless
/// V is the raw K projection (full layers of k_eq_v models).
#[derive(Debug, Clone)]
enum InProj {
    /// q, k and v stacked row-wise into one `[q; k; v]` weight (dense, or packed alike): one
    /// product per step (CUDA).
    /// The widths of the three parts (0 for an absent one).
    Stacked { weight: Linear, widths: [usize; 3] },
    /// One product per part (off CUDA, or parts that cannot stack: dense beside packed, or
    /// packed at different bit widths or group sizes).
    Split {
        q: Linear,
        k: Option<Linear>,
        v: Option<Linear>,
    },
}

/// The raw (pre-norm) q, k and v of one step.
type RawQkv = (Tensor, Option<Tensor>, Option<Tensor>);

impl InProj {
    fn forward(&self, x: &Tensor) -> Result<RawQkv> {
        match self {
            InProj::Stacked { weight, widths } => {
                let y = weight.forward(x)?;
                let part = |start: usize, w: usize| -> Result<Option<Tensor>> {
                    Ok(if w == 0 {
                        None
                    } else {
                        Some(y.narrow(2, start, w)?)
                    })
                };
                let [wq, wk, wv] = *widths;
                let q = y.narrow(2, 0, wq)?;
                Ok((q, part(wq, wk)?, part(wq + wk, wv)?))
            }
            InProj::Split { q, k, v } => Ok((
                q.forward(x)?,
                k.as_ref().map(|k| k.forward(x)).transpose()?,
                v.as_ref().map(|v| v.forward(x)).transpose()?,
            )),
        }
    }

    fn resident_bytes(&self) -> usize {
        match self {
            InProj::Stacked { weight, .. } => weight.resident_bytes(),
            InProj::Split { q, k, v } => {
                q.resident_bytes()
                    + k.as_ref().map_or(0, Linear::resident_bytes)
                    + v.as_ref().map_or(0, Linear::resident_bytes)
            }
        }
    }
}

/// Self-attention of one decoder layer.
#[derive(Debug, Clone)]
pub struct Attention {
    proj: InProj,
    o_proj: Linear,
    q_norm: RmsNorm,
    /// `None` on KV-shared layers, which read their producer's K/V.
    kv: Option<KvNorms>,
    kind: LayerKind,
    n_heads: usize,
    head_dim: usize,
    window: Option<usize>,
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
            KvSource::Own => Some(KvNorms {
                k_norm: norm("k_norm")?,
                v_norm: RmsNorm::no_scale(hd, cfg.rms_norm_eps, vb.dtype(), vb.device())?,
            }),
        };
        let (k_width, v_width) = match plan.kv {
            KvSource::Shared { .. } => (0, 0),
            KvSource::Own => (kvh * hd, if plan.has_v_proj { kvh * hd } else { 0 }),
        };
        let parts: Vec<(String, usize)> = [
            ("q_proj", nh * hd),
            ("k_proj", k_width),
            ("v_proj", v_width),
        ]
        .into_iter()
        .filter(|&(_, width)| width > 0)
        .map(|(name, width)| (format!("{p}.{name}"), width))
        .collect();
        // Stacked on CUDA, where one product instead of three saves launches; elsewhere the
        // products stay separate, summing exactly as the references' separate products do.
        let stacked = if vb.device().is_cuda() {
            vb.matrix_rows(&parts, l, h)?
        } else {
            None
        };
        let part = |name: &str, width: usize| -> Result<Option<Linear>> {
            (width > 0).then(|| lin(name, width, h)).transpose()
        };
        let proj = match stacked {
            Some(weight) => InProj::Stacked {
                weight: Linear::from_loaded(weight),
                widths: [nh * hd, k_width, v_width],
            },
            None => InProj::Split {
                q: lin("q_proj", nh * hd, h)?,
                k: part("k_proj", k_width)?,
                v: part("v_proj", v_width)?,
            },
        };
        Ok(Self {
            proj,
            o_proj: lin("o_proj", h, nh * hd)?,
            q_norm: norm("q_norm")?,
            kv,
            kind: plan.kind,
            n_heads: nh,
            head_dim: hd,
            window: match plan.kind {
                LayerKind::Sliding => Some(cfg.sliding_window),
                LayerKind::Full => None,
            },
        })
    }

    /// The output projection.
    pub fn o_proj(&self) -> &Linear {
        &self.o_proj
    }

    /// Attention without the output projection: `[batch, seq, n_heads * head_dim]`
    /// (the caller may fold the projection into what follows it).
    ///
    /// # Errors
    /// Cache errors, shape errors.
    pub fn attend(
        &self,
        x: &Tensor,
        step: &Step,
        kv: KvInput<'_>,
    ) -> Result<(Tensor, Option<KvView>)> {
        let (b, s, _) = x.dims3()?;
        let (cos, sin) = step.rope(self.kind);
        let (q_raw, k_raw, v_raw) = self.proj.forward(x)?;
        let prep =
            |with_kv: Option<&KvNorms>, kv_dst: Option<(&Tensor, &Tensor)>| -> Result<QkvOutput> {
                let k = match (with_kv, &k_raw) {
                    (Some(n), Some(k)) => Some((k, n.k_norm.operand())),
                    _ => None,
                };
                // V is the raw K projection when the layer has no v_proj.
                let v = match (with_kv, v_raw.as_ref().or(k_raw.as_ref())) {
                    (Some(n), Some(v)) => Some((v, n.v_norm.operand())),
                    _ => None,
                };
                Ok(qkv::qkv_prep(&QkvInput {
                    q: &q_raw,
                    k,
                    v,
                    q_norm: self.q_norm.operand(),
                    cos,
                    sin,
                    head_dim: self.head_dim,
                    kv_dst,
                })?)
            };

        let mut produced = None;
        let (q, view): (Tensor, &KvView) = match (kv, &self.kv) {
            (KvInput::Own(cache), Some(norms)) => {
                // The kernel writes K and V straight into the cache's next slots where it can
                // (no separate copy into the cache).
                let slots = if qkv::writes_kv_in_place(&q_raw, self.q_norm.operand()) {
                    cache.reserve_slots(s, x.device())?
                } else {
                    None
                };
                let view = match slots {
                    Some((kd, vd)) => {
                        let q = prep(Some(norms), Some((&kd, &vd)))?.0;
                        (q, cache.commit_slots(s)?)
                    }
                    None => {
                        let (q, kv) = prep(Some(norms), None)?;
                        let (k, v) = kv.ok_or_else(|| {
                            Error::Input("a KV-owning layer produced no K/V".to_string())
                        })?;
                        (q, cache.update(&k, &v)?)
                    }
                };
                (view.0, &*produced.insert(view.1))
            }
            (KvInput::Shared(view), None) => (prep(None, None)?.0, view),
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
        Ok((out, produced))
    }
}

impl Attention {
    /// Bytes of resident weights.
    pub fn resident_bytes(&self) -> usize {
        let norms = self.kv.as_ref().map_or(0, |n| n.k_norm.resident_bytes());
        self.proj.resident_bytes()
            + self.o_proj.resident_bytes()
            + self.q_norm.resident_bytes()
            + norms
    }
}
