//! The kernels: their operand types, their error type, and one backend-neutral entry point per
//! operation.
//!
//! Operands: [`QuantBits`] and [`AffineSpec`] (how a tensor is packed), [`PackedAffine`] (one
//! MLX affine-packed tensor, weight or K/V), [`KeyPositions`] (the absolute position of every
//! key) and [`KvView`]/[`KvData`] (the attention operand, dense or packed). Errors are
//! [`KernelError`]s. This module imports nothing from the layers above it (caches, model,
//! generation, weight loading); they build these operands and convert the errors.
//!
//! [`attend`] matches on the [`KvView`] a cache update returned, so dense K/V go to the matmul
//! path (`dense`, any device) and packed K/V to the quantized kernel ([`cpu`], the plain-Rust
//! reference; the CUDA and Metal kernels on their devices). Masks come from key positions, so
//! a ring buffer's unsorted storage and a batch's per-sequence offsets need no special casing.
//! [`qmatmul`] holds the packed matrix products, [`quantize`]/[`dequantize`] the affine
//! packing, `kv_write` the in-place K/V writes of the caches.

pub mod cpu;
pub mod cuda;
mod dense;
mod error;
pub(crate) mod kv_write;
mod layout;
pub mod metal;
mod operand;
pub(crate) mod ops;
pub mod plan;
pub mod policy;
mod positions;
pub mod qmatmul;
mod quant;
#[cfg(test)]
pub(crate) mod testutil;

pub use error::KernelError;
pub(crate) use kv_write::{quantize_kv_into, quantize_kv_into_batch};
pub use operand::{
    check_group_size, AffineSpec, KvData, KvView, PackedAffine, QuantBits, GROUP_SIZES,
};
pub use positions::{KeyPositions, PositionRun};
pub(crate) use quant::dequantize_rows;
pub use quant::{dequantize, quantize};

use candle_core::{Device, Tensor};

/// What one sequence's queries need to know besides the tensors.
#[doc(hidden)]
pub struct QueryPlan {
    /// Absolute position of query 0.
    pub q_offset: usize,
    /// `Some(W)`: a key is visible iff it is one of the W latest positions up to the query's own.
    pub window: Option<usize>,
    /// Multiplier of `q · k` (1.0 for Gemma 4).
    pub scale: f64,
}

/// Whether the key at absolute position `key` is visible to the query at `query`: causal, and
/// for a window `W`, `query - W < key` (W keys including the query's own).
#[inline]
pub fn visible(key: usize, query: usize, window: Option<usize>) -> bool {
    key <= query && window.is_none_or(|w| key.saturating_add(w) > query)
}

/// Attention of `q` over the keys and values of a cache view.
///
/// * `q`: `[batch, n_heads, q_len, head_dim]`, already normed and rotated.
/// * `view`: what the cache update returned; [`KvView::Single`] for `batch == 1`,
///   [`KvView::Batch`] with one view per sequence otherwise.
/// * `q_offsets[b]`: absolute position of query 0 of sequence `b` (the cache offset read
///   *before* the update); query `i` sits at `q_offsets[b] + i`.
/// * `window`: `Some(W)` on sliding layers (key `k` visible to query `q` iff `q - W < k <= q`),
///   `None` on full layers (causal only).
/// * `scale`: multiplier of the scores (Gemma 4 uses 1.0).
///
/// GQA: query head `h` reads KV head `h / (n_heads / kv_heads)`; K/V are never repeated.
/// Scores and softmax are f32; the output is `[batch, n_heads, q_len, head_dim]` in `q`'s dtype.
///
/// Packed K/V run the CPU reference kernel on the CPU, the quantized attention kernels on CUDA
/// (and on Metal when [`policy::LaunchPolicy::metal_kernels`] is on); elsewhere they are
/// dequantized and sent through the dense path.
///
/// # Errors
/// [`KernelError::Shape`] when the batch, heads or head dimension of `q` and the view disagree,
/// or `q_offsets` has the wrong length; candle errors.
pub fn attend(
    q: &Tensor,
    view: &KvView,
    q_offsets: &[usize],
    window: Option<usize>,
    scale: f64,
) -> Result<Tensor, KernelError> {
    let (batch, _, _, _) = q.dims4()?;
    if q_offsets.len() != batch {
        return Err(KernelError::Shape {
            what: "q_offsets",
            expected: format!("one offset per sequence ({batch})"),
            found: vec![q_offsets.len()],
        });
    }
    // A step being captured into a CUDA graph reads its attention parameters from the graph's
    // parameter area (see `cuda::graph`).
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && cuda::graph::recording() {
        let views: Vec<&KvView> = match view {
            KvView::Batch(views) => views.iter().collect(),
            single => vec![single],
        };
        let plans: Vec<QueryPlan> = q_offsets
            .iter()
            .map(|&q_offset| QueryPlan {
                q_offset,
                window,
                scale,
            })
            .collect();
        return cuda::batched::attend_recorded(q, &views, &plans);
    }
    match view {
        KvView::Single { data, positions } => {
            if batch != 1 {
                return Err(KernelError::BatchSize {
                    expected: 1,
                    found: batch,
                });
            }
            let plan = QueryPlan {
                q_offset: q_offsets[0],
                window,
                scale,
            };
            attend_one(q, data, positions, &plan)
        }
        KvView::Batch(views) => {
            if views.len() != batch {
                return Err(KernelError::BatchSize {
                    expected: views.len(),
                    found: batch,
                });
            }
            #[cfg(feature = "cuda")]
            if q.device().is_cuda() {
                if let Some(out) = cuda::batched::attend_batch(q, views, q_offsets, window, scale)?
                {
                    return Ok(out);
                }
            }
            let mut outs = Vec::with_capacity(batch);
            for (b, (v, &off)) in views.iter().zip(q_offsets).enumerate() {
                let qb = q.narrow(0, b, 1)?;
                outs.push(attend(&qb, v, &[off], window, scale)?);
            }
            Ok(Tensor::cat(&outs, 0)?)
        }
    }
}

/// One sequence: `q` `[1, n_heads, q_len, head_dim]`.
fn attend_one(
    q: &Tensor,
    data: &KvData,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, KernelError> {
    let (_, n_heads, _, head_dim) = q.dims4()?;
    check_view(n_heads, head_dim, data, positions)?;
    match data {
        KvData::Dense { k, v } => {
            #[cfg(feature = "cuda")]
            if q.device().is_cuda()
                && q.dim(2)? <= cuda::attention::launch::FUSED_MAX_Q_LEN
                && k.dtype() == q.dtype()
                && v.dtype() == q.dtype()
                && plan::QSDPA_HEAD_DIMS.contains(&head_dim)
            {
                return cuda::attention::launch::attend_dense_fused(q, k, v, positions, plan);
            }
            #[cfg(feature = "cuda")]
            if q.device().is_cuda() && flash_prefill(q, k, v) {
                return cuda::attention::prefill::attend_prefill(q, k, v, positions, plan);
            }
            dense::attend_dense(q, k, v, &positions.to_vec(), plan)
        }
        KvData::Packed { k, v } => match q.device() {
            Device::Cpu => cpu::attend_packed(q, k, v, &positions.to_vec(), plan),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => cuda::attention::launch::attend_packed(
                q,
                k,
                v,
                positions,
                plan,
                cuda::QsdpaPath::Auto,
            ),
            #[cfg(feature = "metal")]
            Device::Metal(_) => metal::attend_packed(q, k, v, positions, plan),
            _ => {
                let (kd, vd) = (dequantize(k)?, dequantize(v)?);
                dense::attend_dense(q, &kd, &vd, &positions.to_vec(), plan)
            }
        },
    }
}

/// Whether a query block over dense K/V on CUDA takes the flash prefill kernel: longer than the
/// fused decode kernel's blocks, a dtype and head dimension it is built for, and
/// [`policy::LaunchPolicy::flash_prefill`] on.
#[cfg(feature = "cuda")]
pub(crate) fn flash_prefill(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    q.dim(2)
        .is_ok_and(|n| n > cuda::attention::launch::FUSED_MAX_Q_LEN)
        && policy::current().flash_prefill
        && cuda::attention::prefill::supports(q, k, v)
}

/// Checks one sequence's view against queries of `n_heads` heads of `head_dim`: K/V
/// `[1, kv_heads dividing n_heads, positions.len(), head_dim]`, and for packed K/V a group
/// size dividing the head dimension with scales/biases of the matching shape.
pub(crate) fn check_view(
    n_heads: usize,
    head_dim: usize,
    data: &KvData,
    positions: &KeyPositions,
) -> Result<(), KernelError> {
    let (k_dims, v_dims) = match data {
        KvData::Dense { k, v } => (k.dims().to_vec(), v.dims().to_vec()),
        KvData::Packed { k, v } => (k.dims(), v.dims()),
    };
    let ok = k_dims.len() == 4
        && k_dims == v_dims
        && k_dims[0] == 1
        && k_dims[1] > 0
        && n_heads.is_multiple_of(k_dims[1])
        && k_dims[2] == positions.len()
        && k_dims[3] == head_dim;
    if !ok {
        return Err(KernelError::Shape {
            what: "view K/V",
            expected: format!(
                "[1, kv_heads dividing {n_heads}, {} keys, {head_dim}] for K and V",
                positions.len()
            ),
            found: k_dims,
        });
    }
    if let KvData::Packed { k, v } = data {
        for p in [k, v] {
            if p.group_size == 0 || !head_dim.is_multiple_of(p.group_size) {
                return Err(KernelError::BadGroupSize {
                    group_size: p.group_size,
                    dim: head_dim,
                });
            }
            let groups = [1, k_dims[1], k_dims[2], head_dim / p.group_size];
            if p.scales.dims() != groups || p.biases.dims() != groups {
                return Err(KernelError::Shape {
                    what: "packed scales/biases",
                    expected: format!("{groups:?}"),
                    found: p.scales.dims().to_vec(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
