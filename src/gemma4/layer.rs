//! One decoder layer: attention, the dense MLP (plus the MoE block on 26B-A4B), the per-layer
//! embedding injection (E2B/E4B) and the final `layer_scalar`.

use candle_core::Tensor;

use super::attention::{Attention, KvInput};
use super::mlp::Mlp;
use super::moe::MoeBlock;
use super::norm::RmsNorm;
use super::step::Step;
use super::Linear;
use crate::config::{Config, LayerPlan};
use crate::error::{Error, Result};
use crate::kernels::ops::collective::Collective;
use crate::kernels::ops::norm::{self, ProductAddNorm, TwoBranch};
use crate::kv::KvView;
use crate::weights::WeightStore;

/// The MoE branch and its three extra norms.
#[derive(Debug, Clone)]
struct MoeBranch {
    block: MoeBlock,
    pre_feedforward_layernorm_2: RmsNorm,
    post_feedforward_layernorm_1: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
}

/// The PLE gate of a layer.
#[derive(Debug, Clone)]
struct PleGate {
    per_layer_input_gate: Linear,
    per_layer_projection: Linear,
    post_per_layer_input_norm: RmsNorm,
}

/// What [`DecoderLayer::forward_chained`] returns.
#[derive(Debug)]
pub struct LayerOutput {
    /// The new residual `[B, S, H]`.
    pub x: Tensor,
    /// The next layer's input norm of `x`, when it was asked for.
    pub next_normed: Option<Tensor>,
    /// The cache view of a KV-owning layer.
    pub view: Option<KvView>,
}

/// One Gemma 4 decoder layer.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// What this layer decided at load time.
    pub plan: LayerPlan,
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    moe: Option<MoeBranch>,
    ple: Option<PleGate>,
    /// `[1]`, multiplies the whole residual stream at the end of the layer.
    layer_scalar: Tensor,
    /// Sums the row-parallel products (o_proj, down_proj, the experts) over a tensor-parallel
    /// group; a group of one on a single device.
    collective: Collective,
}

impl DecoderLayer {
    /// Loads `layers.{layer}.*`.
    ///
    /// # Errors
    /// Missing or misshapen tensors, named with the layer.
    pub fn new(cfg: &Config, layer: usize, vb: &WeightStore) -> Result<Self> {
        let h = cfg.hidden_size;
        let p = format!("layers.{layer}");
        let l = Some(layer);
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm::new(
                vb.tensor(&format!("{p}.{name}.weight"), l, &[dim])?,
                cfg.rms_norm_eps,
            ))
        };
        let plan = cfg.layers[layer].clone();
        let moe = match &cfg.moe {
            None => None,
            Some(m) => Some(MoeBranch {
                block: MoeBlock::new(cfg, m, layer, vb)?,
                pre_feedforward_layernorm_2: norm("pre_feedforward_layernorm_2", h)?,
                post_feedforward_layernorm_1: norm("post_feedforward_layernorm_1", h)?,
                post_feedforward_layernorm_2: norm("post_feedforward_layernorm_2", h)?,
            }),
        };
        let pw = cfg.hidden_size_per_layer_input;
        let ple = if pw > 0 {
            Some(PleGate {
                per_layer_input_gate: Linear::from_loaded(vb.matrix(
                    &format!("{p}.per_layer_input_gate"),
                    l,
                    &[pw, h],
                )?),
                per_layer_projection: Linear::from_loaded(vb.matrix(
                    &format!("{p}.per_layer_projection"),
                    l,
                    &[h, pw],
                )?),
                post_per_layer_input_norm: norm("post_per_layer_input_norm", h)?,
            })
        } else {
            None
        };
        Ok(Self {
            self_attn: Attention::new(cfg, layer, vb)?,
            mlp: Mlp::new(&format!("{p}.mlp"), layer, h, plan.intermediate_size, vb)?,
            input_layernorm: norm("input_layernorm", h)?,
            post_attention_layernorm: norm("post_attention_layernorm", h)?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm", h)?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm", h)?,
            moe,
            ple,
            layer_scalar: vb.tensor(&format!("{p}.layer_scalar"), l, &[1])?,
            plan,
            collective: Collective::default(),
        })
    }

    /// Makes this layer one rank of a tensor-parallel group: its row-parallel products are
    /// summed over `collective`'s group.
    pub(crate) fn set_collective(&mut self, collective: Collective) {
        self.collective = collective;
    }

    /// The norm applied to the residual before attention.
    pub fn input_norm(&self) -> &RmsNorm {
        &self.input_layernorm
    }

    /// One layer of the stack: `x` `[B, S, H]`, `ple` this layer's `[B, S, P]` slice when the
    /// model has PLE; returns the new residual and, for a KV-owning layer, its cache view.
    /// `input_normed` is this layer's input norm of `x`
    /// when the previous layer already computed it, and `next_norm` the next layer's input norm,
    /// which is then computed in this layer's last residual add (one pass instead of two).
    ///
    /// # Errors
    /// Cache and shape errors.
    pub fn forward_chained(
        &self,
        x: &Tensor,
        input_normed: Option<&Tensor>,
        step: &Step,
        ple: Option<&Tensor>,
        kv: KvInput<'_>,
        next_norm: Option<&RmsNorm>,
    ) -> Result<LayerOutput> {
        let normed_in = match input_normed {
            Some(n) => n.clone(),
            None => self.input_layernorm.forward(x)?,
        };
        // The output projection, the residual add and the feed-forward input norms are one
        // launch on CUDA decode (see `kernels::ops::norm::product_add_norm`).
        let (attn, view) = self.self_attn.attend(&normed_in, step, kv)?;
        let o_proj = self.self_attn.o_proj();
        // The layer scalar multiplies the whole residual at the end of the layer: fold it into
        // the last residual add.
        let ple = self.ple.as_ref().zip(ple);
        let scalar = if ple.is_none() {
            Some(&self.layer_scalar)
        } else {
            None
        };
        // On 26B-A4B both feed-forward inputs are norms of the same residual, computed in the
        // same pass; its two branch outputs meet in the layer's last residual add.
        let (x, normed, normed_2) = norm::product_reduce_add_norm(
            o_proj.weight(),
            &attn,
            None,
            &ProductAddNorm {
                res: x,
                norm: self.post_attention_layernorm.operand(),
                scalar: None,
                next: Some(self.pre_feedforward_layernorm.operand()),
                next2: self
                    .moe
                    .as_ref()
                    .map(|m| m.pre_feedforward_layernorm_2.operand()),
            },
            &self.collective,
        )?;
        let normed = normed.ok_or_else(|| Error::Input("add_norm returned no norm".into()))?;
        if let Some(m) = &self.moe {
            let normed_2 =
                normed_2.ok_or_else(|| Error::Input("add_norm returned no norm".into()))?;
            let dense = self.mlp.forward(&normed)?;
            // Both branches are row-parallel partial sums: one all-reduce for the two.
            if ple.is_none() {
                // A rank of several leaves one token's expert mix to the sum's launch.
                let rows = if self.collective.world() > 1 {
                    m.block.forward_rows(&x, &normed_2)?
                } else {
                    None
                };
                let experts = match rows {
                    Some(r) => TwoBranch::Rows(r),
                    None => TwoBranch::Sum(m.block.forward(&x, &normed_2)?),
                };
                let (x, next_normed) = norm::reduce_add_two_branch_norm(
                    &x,
                    (&dense, m.post_feedforward_layernorm_1.operand()),
                    (&experts, m.post_feedforward_layernorm_2.operand()),
                    self.post_feedforward_layernorm.operand(),
                    scalar,
                    next_norm.map(RmsNorm::operand),
                    &self.collective,
                )?;
                return Ok(LayerOutput {
                    x,
                    next_normed,
                    view,
                });
            }
            let experts = m.block.forward(&x, &normed_2)?;
            let (dense, experts) = self.collective.sum_pair(&dense, &experts)?;
            let ff = (m.post_feedforward_layernorm_1.forward(&dense)?
                + m.post_feedforward_layernorm_2.forward(&experts)?)?;
            let (x, _) = norm::add_norm(
                &x,
                &ff,
                self.post_feedforward_layernorm.operand(),
                None,
                None,
            )?;
            return self.finish_ple(x, ple, next_norm, view);
        }
        let (input, up) = self.mlp.down_input(&normed)?;
        let (x, next_normed, _) = norm::product_reduce_add_norm(
            self.mlp.down_proj().weight(),
            &input,
            up.as_ref(),
            &ProductAddNorm {
                res: &x,
                norm: self.post_feedforward_layernorm.operand(),
                scalar,
                next: if ple.is_none() {
                    next_norm.map(RmsNorm::operand)
                } else {
                    None
                },
                next2: None,
            },
            &self.collective,
        )?;
        if ple.is_none() {
            return Ok(LayerOutput {
                x,
                next_normed,
                view,
            });
        }
        self.finish_ple(x, ple, next_norm, view)
    }

    /// The PLE gate after the feed-forward residual add `x`, with the layer scalar and the next
    /// layer's input norm folded into its residual add.
    fn finish_ple(
        &self,
        x: Tensor,
        ple: Option<(&PleGate, &Tensor)>,
        next_norm: Option<&RmsNorm>,
        view: Option<KvView>,
    ) -> Result<LayerOutput> {
        let Some((g, ple)) = ple else {
            return Err(Error::Input(
                "finish_ple called for a layer without a PLE gate".into(),
            ));
        };
        let (x, next_normed, _) = norm::product_add_norm(
            g.per_layer_projection.weight(),
            &g.per_layer_input_gate.forward(&x)?,
            Some(ple),
            &ProductAddNorm {
                res: &x,
                norm: g.post_per_layer_input_norm.operand(),
                scalar: Some(&self.layer_scalar),
                next: next_norm.map(RmsNorm::operand),
                next2: None,
            },
        )?;
        Ok(LayerOutput {
            x,
            next_normed,
            view,
        })
    }
}

impl DecoderLayer {
    /// Bytes of resident weights.
    pub fn resident_bytes(&self) -> usize {
        let norms = [
            &self.input_layernorm,
            &self.post_attention_layernorm,
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ]
        .iter()
        .map(|n| n.resident_bytes())
        .sum::<usize>();
        let moe = self.moe.as_ref().map_or(0, |m| {
            m.block.resident_bytes()
                + m.pre_feedforward_layernorm_2.resident_bytes()
                + m.post_feedforward_layernorm_1.resident_bytes()
                + m.post_feedforward_layernorm_2.resident_bytes()
        });
        let ple = self.ple.as_ref().map_or(0, |g| {
            g.per_layer_input_gate.resident_bytes()
                + g.per_layer_projection.resident_bytes()
                + g.post_per_layer_input_norm.resident_bytes()
        });
        self.self_attn.resident_bytes()
            + self.mlp.resident_bytes()
            + norms
            + moe
            + ple
            + crate::kernels::ops::tensor_bytes(&self.layer_scalar)
    }
}
