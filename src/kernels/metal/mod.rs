//! Metal side of the quantized kernels.
//!
//! The kernels live in `qkernels.metal` (same parameter structs as CUDA, see
//! [`super::plan`]); `plan` turns a call into the parameters, grids and buffer layout
//! of their launch, and `launch` (`metal` feature) compiles the source once per device and
//! dispatches those plans. The launches have not run on a Mac, so they are opt-in
//! ([`super::policy::LaunchPolicy::metal_kernels`]); otherwise these entry points dequantize
//! on the device and use candle's dense ops (correct, but a transient dense copy of K/V or of
//! the weight per call). The kernels and plans themselves are checked on every `cargo test` by
//! running them on CPU threads through `shim.h` (`tests/metal_emulation.rs`).

#[cfg(feature = "metal")]
#[doc(hidden)]
pub mod launch;
#[doc(hidden)]
pub mod plan;

#[cfg(feature = "metal")]
use candle_core::Tensor;

#[cfg(feature = "metal")]
use super::{dense, dequantize, QueryPlan};
#[cfg(feature = "metal")]
use crate::kernels::{KernelError, KeyPositions, PackedAffine};

/// MSL source of the quantized kernels, compiled at run time by the Metal device.
pub const SOURCE: &str = include_str!("qkernels.metal");

/// Whether the Metal kernels are launched ([`super::policy::LaunchPolicy::metal_kernels`]).
#[cfg(feature = "metal")]
fn kernels_on() -> bool {
    super::policy::current().metal_kernels
}

/// Quantized attention of one sequence on a Metal device (shapes as
/// [`crate::kernels::attend`]): the fused kernel for up to `plan::MAX_FUSED_Q_LEN` (16) queries
/// when the kernels are on, else dequantize and attend densely.
#[cfg(feature = "metal")]
pub(crate) fn attend_packed(
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, KernelError> {
    if kernels_on() && q.dim(2)? <= plan::MAX_FUSED_Q_LEN {
        return launch::attend_packed(q, k, v, positions, plan);
    }
    let (kd, vd) = (dequantize(k)?, dequantize(v)?);
    dense::attend_dense(q, &kd, &vd, &positions.to_vec(), plan)
}

/// `x` `[rows, in]` · `Wᵀ` on a Metal device: the matvec kernel for up to 8 rows when the
/// kernels are on, else a dense product with the weight dequantized (by the Metal dequantize
/// kernel when the kernels are on).
#[cfg(feature = "metal")]
pub(crate) fn qmatmul(x: &Tensor, w: &PackedAffine) -> Result<Tensor, KernelError> {
    if kernels_on() {
        if let Some(y) = launch::qmatvec(x, w)? {
            return Ok(y);
        }
        if let Some(dense) = launch::dequantize_weight(w, x.dtype())? {
            return Ok(x.matmul(&dense.t()?)?);
        }
    }
    let dense = w.dequantize(x.dtype())?;
    Ok(x.matmul(&dense.t()?)?)
}
