//! Metal host side of the quantized kernels (`feature = "metal"`).
//!
//! The kernels live in `qkernels.metal` (same parameter structs as CUDA, see
//! [`super::cuda::params`]). Until the Metal launch is wired and run on a Mac, these entry points
//! take the correct but unfused route: dequantize on the device, then candle's dense ops.

use candle_core::Tensor;

use super::qmatmul::PackedWeight;
use super::{dense, dequantize, QueryPlan};
use crate::kv::{CacheError, PackedKv};

/// MSL source of the quantized kernels, compiled at run time by the Metal device.
pub const SOURCE: &str = include_str!("qkernels.metal");

/// Quantized attention of one sequence on a Metal device (shapes as
/// [`crate::kernels::attend`]).
pub(crate) fn attend_packed(
    q: &Tensor,
    k: &PackedKv,
    v: &PackedKv,
    positions: &[usize],
    plan: &QueryPlan,
) -> Result<Tensor, CacheError> {
    let (kd, vd) = (dequantize(k)?, dequantize(v)?);
    dense::attend_dense(q, &kd, &vd, positions, plan)
}

/// `x` `[rows, in]` · `Wᵀ` on a Metal device.
pub(crate) fn qmatmul(x: &Tensor, w: &PackedWeight) -> crate::Result<Tensor> {
    let dense = w.dequantize(x.dtype())?;
    Ok(x.matmul(&dense.t()?)?)
}
