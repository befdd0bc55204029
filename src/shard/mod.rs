//! The tensor-parallel sharding plan: which rows or columns of every weight each rank of a
//! group of `world` GPUs holds, and the rank-local config its layers are built from. Pure
//! arithmetic over the [`Config`] and the weights' logical names, no backend: the loader
//! (`weights::WeightStore::with_shard`) applies it ([`mod@slice`]) and the layers add one
//! all-reduce after each row-parallel product (`kernels::ops::collective`).
//!
//! | weight | split | how |
//! |---|---|---|
//! | `self_attn.q_proj` | column-parallel | rows of the rank's query heads |
//! | `self_attn.k_proj`, `v_proj` | column-parallel | rows of the rank's KV heads: split where `world` divides the KV heads, else each rank takes the one KV head its query heads read (E2B/E4B: one KV head, on every rank) |
//! | `self_attn.o_proj` | row-parallel, all-reduce | columns of the rank's query heads |
//! | `mlp.gate_proj`, `up_proj` | column-parallel | rows of the rank's part of the width |
//! | `mlp.down_proj` | row-parallel, all-reduce | columns of that part |
//! | MoE `gate_up_proj` / `switch_glu.{gate,up}_proj` | by tensor, column-parallel | every expert's rows of the rank's part of the expert width |
//! | MoE `down_proj` | by tensor, row-parallel, all-reduce (joined with the dense MLP's) | every expert's columns of that part |
//! | embeddings, `lm_head`, PLE tables and gates, router, norms | replicated | whole on every rank |
//! | tied head | vocabulary-parallel, all-gather | each rank's logits of its rows of the (replicated) table (`TextModel::set_collective`) |
//!
//! Experts are split by tensor (each rank holds a slice of every expert), not by expert: every
//! rank then runs the same `top_k` experts at a fraction of the width, so the work is even
//! whichever experts the router picks (split by expert, the rank holding most of a token's
//! picks sets the step time), and the expert kernels run unchanged.
//!
//! The embedding table is replicated, not vocab-parallel: a lookup then needs no collective,
//! at the cost of the table's memory on every rank. The tied head reading the same table is
//! split by vocabulary rows (where the group divides the vocabulary): each rank reads only its
//! rows per step, and one all-gather of the logits joins them.
//!
//! Widths are split at multiples of 128 elements where the width allows (smaller powers of two
//! otherwise): MLX packs each row's inputs in groups of 32, 64 or 128, so a column split on such
//! a boundary keeps a packed matrix packed ([`slice::apply_packed`]); a split off a group
//! boundary is dequantized on load.

pub mod slice;

use std::ops::Range;

use crate::config::Config;
use crate::error::{Error, Result};

/// Which axis of a `[.., out, in]` matrix a rank holds part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// Rows (outputs): a column-parallel product.
    Out,
    /// Columns (inputs): a row-parallel product, summed across ranks afterwards.
    In,
}

/// The part of one weight a rank holds: along `axis`, the `ranges` (joined in order) of an axis
/// of length `full`. A stack `[n, out, in]` (MoE experts) takes the same ranges of every matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlice {
    /// The split axis.
    pub axis: Axis,
    /// The axis's length in the checkpoint (per matrix of a stack).
    pub full: usize,
    /// The parts kept, in order.
    pub ranges: Vec<Range<usize>>,
}

impl TensorSlice {
    /// The axis's length on this rank.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }

    /// Whether the rank holds nothing of the weight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The checkpoint's shape of a weight the rank asks for as `local` (`[.., out, in]`).
    ///
    /// # Errors
    /// [`Error::Shape`] when `local` does not have this slice's length on its axis.
    pub fn full_shape(&self, name: &str, local: &[usize]) -> Result<Vec<usize>> {
        let n = local.len();
        let at = match self.axis {
            Axis::Out if n >= 2 => n - 2,
            Axis::In if n >= 1 => n - 1,
            _ => usize::MAX,
        };
        if at == usize::MAX || local[at] != self.len() {
            return Err(Error::Shape {
                tensor: name.to_string(),
                expected: vec![self.len()],
                found: local.to_vec(),
            });
        }
        let mut full = local.to_vec();
        full[at] = self.full;
        Ok(full)
    }
}

/// The finest cut of a dense (unquantized) checkpoint's widths: even parts where a width
/// splits into multiples of 32 (26B-A4B's experts, 704 wide, in two halves of 352), which the
/// dense kernels take at full speed.
pub const DENSE_CUT_UNIT: usize = 32;

/// The finest cut that keeps every quantization group of `group` columns whole (`None`: a
/// dense checkpoint, [`DENSE_CUT_UNIT`]).
pub fn cut_unit(group: Option<usize>) -> usize {
    group.map_or(DENSE_CUT_UNIT, |g| g.max(1))
}

/// `len` elements in `world` contiguous parts, cut at multiples of the largest unit of 128, 64,
/// ..., 1 that gives every part at least one unit; the parts are as even as those cuts allow.
pub fn partition(len: usize, world: usize) -> Vec<Range<usize>> {
    partition_in(len, world, 128)
}

/// [`partition`], but equal parts where `len` splits into `world` equal multiples of a unit of
/// 128, 64, ... no finer than `finest` (a checkpoint's quantization group, [`cut_unit`]).
pub fn partition_in(len: usize, world: usize, finest: usize) -> Vec<Range<usize>> {
    let world = world.max(1);
    let even = [128, 64, 32, 16, 8, 4, 2, 1]
        .into_iter()
        .filter(|&u| u >= finest.max(1))
        .any(|u| len > 0 && len.is_multiple_of(u * world));
    if even {
        let part = len / world;
        return (0..world).map(|r| r * part..(r + 1) * part).collect();
    }
    let unit = [128, 64, 32, 16, 8, 4, 2, 1]
        .into_iter()
        .find(|&u| len >= u * world)
        .unwrap_or(1);
    let units = len.div_ceil(unit);
    let cut = |r: usize| ((r * units + world / 2) / world * unit).min(len);
    (0..world).map(|r| cut(r)..cut(r + 1)).collect()
}

/// The heads of one attention layer a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadSplit {
    /// Query heads (contiguous).
    pub q: Range<usize>,
    /// KV heads the query heads read (contiguous; shared with other ranks when the KV heads
    /// are fewer than the ranks).
    pub kv: Range<usize>,
}

/// One rank's share of every weight of a checkpoint.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    rank: usize,
    world: usize,
    /// Per layer: its heads and head dimension.
    heads: Vec<(HeadSplit, usize)>,
    /// Per layer: the dense MLP's width part.
    mlp: Vec<Range<usize>>,
    /// The MoE experts' width part and full width.
    moe: Option<(Range<usize>, usize)>,
    /// Per layer: the full MLP width.
    mlp_full: Vec<usize>,
    /// Per layer: the checkpoint's KV heads.
    kv_full: Vec<usize>,
}

impl ShardPlan {
    /// The plan of `rank` of `world` for `config`, with widths cut at multiples of 128
    /// ([`partition`]), which keeps every quantization group whole.
    ///
    /// # Errors
    /// [`Error::Config`] when `rank >= world`, when `world` does not divide the query heads, or
    /// when a layer's KV heads neither divide by `world` nor divide it.
    pub fn new(config: &Config, rank: usize, world: usize) -> Result<Self> {
        Self::with_cut_unit(config, rank, world, 128)
    }

    /// [`ShardPlan::new`], but widths that split evenly at a unit no finer than `finest`
    /// ([`cut_unit`]) are split evenly ([`partition_in`]).
    ///
    /// # Errors
    /// As [`ShardPlan::new`].
    pub fn with_cut_unit(
        config: &Config,
        rank: usize,
        world: usize,
        finest: usize,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::Config {
                field: "devices".to_string(),
                reason: format!("rank {rank} of a group of {world}"),
            });
        }
        let nh = config.num_attention_heads;
        if !nh.is_multiple_of(world) {
            return Err(Error::Config {
                field: "num_attention_heads".to_string(),
                reason: format!("{nh} query heads do not split over {world} devices"),
            });
        }
        let per = nh / world;
        let q = rank * per..(rank + 1) * per;
        let heads = config
            .layers
            .iter()
            .enumerate()
            .map(|(l, plan)| {
                let kvh = plan.kv_heads;
                let kv = if kvh % world == 0 {
                    rank * kvh / world..(rank + 1) * kvh / world
                } else if kvh > 0 && world.is_multiple_of(kvh) {
                    // world / kvh ranks share each KV head; their query heads all read it.
                    let h = rank / (world / kvh);
                    h..h + 1
                } else {
                    return Err(Error::Config {
                        field: format!("layers.{l}.num_key_value_heads"),
                        reason: format!("{kvh} KV heads do not split over {world} devices"),
                    });
                };
                Ok((HeadSplit { q: q.clone(), kv }, plan.head_dim))
            })
            .collect::<Result<Vec<_>>>()?;
        let mlp_full: Vec<usize> = config.layers.iter().map(|p| p.intermediate_size).collect();
        let mlp = mlp_full
            .iter()
            .map(|&w| partition_in(w, world, finest)[rank].clone())
            .collect();
        let moe = config.moe.as_ref().map(|m| {
            (
                partition_in(m.intermediate_size, world, finest)[rank].clone(),
                m.intermediate_size,
            )
        });
        let plan = Self {
            rank,
            world,
            heads,
            mlp,
            moe,
            mlp_full,
            kv_full: config.layers.iter().map(|p| p.kv_heads).collect(),
        };
        if let Some(l) = plan.mlp.iter().position(|r| r.is_empty()) {
            return Err(Error::Config {
                field: format!("layers.{l}.intermediate_size"),
                reason: format!("too narrow to split over {world} devices"),
            });
        }
        Ok(plan)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The heads layer `layer` holds.
    pub fn heads(&self, layer: usize) -> Option<&HeadSplit> {
        self.heads.get(layer).map(|(h, _)| h)
    }

    /// The config of this rank's layers: its query heads, KV heads and widths.
    pub fn local_config(&self, config: &Config) -> Config {
        let mut c = config.clone();
        c.num_attention_heads = config.num_attention_heads / self.world;
        for (l, plan) in c.layers.iter_mut().enumerate() {
            plan.kv_heads = self.heads[l].0.kv.len();
            plan.intermediate_size = self.mlp[l].len();
        }
        if let (Some(m), Some((r, _))) = (c.moe.as_mut(), &self.moe) {
            m.intermediate_size = r.len();
        }
        c
    }

    /// The part of the weight `module` (a logical name as the layers load it, without
    /// `.weight`) this rank holds; `None` for a replicated weight.
    pub fn slice(&self, module: &str) -> Option<TensorSlice> {
        let rest = module.strip_prefix("layers.")?;
        let (layer, name) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (heads, hd) = self.heads.get(layer)?;
        let rows = |r: &Range<usize>, unit: usize, full: usize| TensorSlice {
            axis: Axis::Out,
            full,
            ranges: std::iter::once(r.start * unit..r.end * unit).collect(),
        };
        let cols = |r: &Range<usize>, full: usize| TensorSlice {
            axis: Axis::In,
            full,
            ranges: vec![r.clone()],
        };
        let nh = heads.q.len() * self.world;
        let kv_full = |l: usize| self.kv_heads_full(l);
        match name {
            "self_attn.q_proj" => Some(rows(&heads.q, *hd, nh * hd)),
            "self_attn.k_proj" | "self_attn.v_proj" => {
                Some(rows(&heads.kv, *hd, kv_full(layer) * hd))
            }
            "self_attn.o_proj" => Some(cols(&(heads.q.start * hd..heads.q.end * hd), nh * hd)),
            "mlp.gate_proj" | "mlp.up_proj" => {
                Some(rows(&self.mlp[layer], 1, self.mlp_full[layer]))
            }
            "mlp.down_proj" => Some(cols(&self.mlp[layer], self.mlp_full[layer])),
            "experts.gate_up_proj" => {
                let (r, i) = self.moe.clone()?;
                Some(TensorSlice {
                    axis: Axis::Out,
                    full: 2 * i,
                    ranges: vec![r.clone(), i + r.start..i + r.end],
                })
            }
            "experts.switch_glu.gate_proj" | "experts.switch_glu.up_proj" => {
                let (r, i) = self.moe.clone()?;
                Some(rows(&r, 1, i))
            }
            "experts.down_proj" | "experts.switch_glu.down_proj" => {
                let (r, i) = self.moe.clone()?;
                Some(cols(&r, i))
            }
            _ => None,
        }
    }

    /// KV heads of `layer` in the checkpoint.
    fn kv_heads_full(&self, layer: usize) -> usize {
        self.kv_full[layer]
    }
}

#[cfg(test)]
mod tests;
