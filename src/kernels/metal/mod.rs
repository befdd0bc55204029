//! Metal side of the quantized kernels.
//!
//! The kernels live in `qkernels.metal` (same parameter structs as CUDA, see
//! [`super::plan`]); `plan` turns a call into the parameters, grids and buffer layout of their
//! launch, `route` decides which implementation each entry point takes, and `launch` (`metal`
//! feature) compiles the source once per device and dispatches the plans. `q4_1` maps exact
//! MLX 4-bit matrices onto candle's `Q4_1` blocks, whose Metal kernels have run on Macs for
//! years; the crate's own kernels take the rest (8-bit and inexact 4-bit products, row
//! gathers, K/V quantization, attention over packed K/V, and the MoE routing, grouping and
//! routed expert products that `ops::moe` chains). They are on by default
//! ([`super::policy::LaunchPolicy::metal_kernels`]); off, these entry points dequantize on
//! the host (correct, but a copy through the host per call). The kernels and plans are checked
//! on every `cargo test` by running them on CPU threads through `shim.h`
//! (`tests/metal_emulation*.rs`); they have not run on a Mac.

#[cfg(feature = "metal")]
#[doc(hidden)]
pub mod launch;
#[doc(hidden)]
pub mod plan;
pub mod q4_1;
pub mod route;

#[cfg(feature = "metal")]
use candle_core::Tensor;

#[cfg(feature = "metal")]
use super::{dense, dequantize, QueryPlan};
#[cfg(feature = "metal")]
use crate::kernels::{KernelError, KeyPositions, PackedAffine};
#[cfg(feature = "metal")]
use route::{Family, Route};

/// MSL source of the quantized kernels, compiled at run time by the Metal device.
pub const SOURCE: &str = include_str!("qkernels.metal");

/// Whether the Metal kernels are launched ([`super::policy::LaunchPolicy::metal_kernels`]).
#[cfg(feature = "metal")]
pub(crate) fn kernels_on() -> bool {
    super::policy::current().metal_kernels
}

/// Quantized attention of one sequence on a Metal device (shapes as
/// [`crate::kernels::attend`]): the fused kernel for up to `plan::MAX_FUSED_Q_LEN` (16) queries
/// when the kernels are on; longer queries (prefill) dequantize K/V with the dequantize kernel
/// on the device and attend densely. With the kernels off, K/V are dequantized on the host.
#[cfg(feature = "metal")]
pub(crate) fn attend_packed(
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, KernelError> {
    match route::packed_attention(q.dim(2)?, q.dtype(), kernels_on()) {
        Route::Kernel(Family::Qsdpa) => launch::attend_packed(q, k, v, positions, plan),
        _ => {
            // Prefill: the dequantize kernel on the device (with the kernels on), then dense.
            let (kd, vd) = (dequantize(k)?, dequantize(v)?);
            dense::attend_dense(q, &kd, &vd, &positions.to_vec(), plan)
        }
    }
}

/// A packed tensor of any rank (a weight, or K/V `[1, kv_heads, keys, ..]` viewed in a cache,
/// possibly strided) dequantized by the dequantize kernel to its dense shape in `dtype`;
/// `None` when the kernels are off or no kernel takes the dtypes.
#[cfg(feature = "metal")]
pub(crate) fn dequantize_on_device(
    p: &PackedAffine,
    dtype: candle_core::DType,
) -> Result<Option<Tensor>, KernelError> {
    if !kernels_on() {
        return Ok(None);
    }
    if let Some(q) = p.q4_1.as_ref().filter(|_| !p.mlx_resident()) {
        return q.dequantize_on_device(dtype);
    }
    let dims = p.dims();
    let rows = p.out_dim();
    let flat = |t: &Tensor| -> Result<Tensor, KernelError> {
        let last = t.dims().last().copied().unwrap_or(0);
        Ok(t.contiguous()?.reshape((rows, last))?)
    };
    let matrix = PackedAffine::from_parts(
        flat(&p.codes)?,
        flat(&p.scales)?,
        flat(&p.biases)?,
        p.spec(),
    );
    Ok(launch::dequantize_rows(&matrix, None, dtype)?
        .map(|d| d.reshape(dims))
        .transpose()?)
}

/// `x` `[rows, in]` · `Wᵀ` on a Metal device (a weight without an exact `Q4_1` form): the
/// matvec kernel for up to 8 rows when the kernels are on, else a dense product with the
/// weight dequantized by the dequantize kernel on the device. With the kernels off, the weight
/// is dequantized on the host.
#[cfg(feature = "metal")]
pub(crate) fn qmatmul(x: &Tensor, w: &PackedAffine) -> Result<Tensor, KernelError> {
    let rows = x.dim(0)?;
    if route::product(rows, x.dtype(), format_of(w), kernels_on()) == Route::Kernel(Family::Qmatvec)
    {
        if let Some(y) = launch::qmatvec(x, w)? {
            return Ok(y);
        }
    }
    // `PackedAffine::dequantize` runs the dequantize kernel when the kernels are on
    // (`dequant_q41` for a matrix held only as `Q4_1` blocks).
    let dense = w.dequantize(x.dtype())?;
    Ok(x.matmul(&dense.t()?)?)
}

/// How the routes see a packed weight.
#[cfg(feature = "metal")]
pub(crate) fn format_of(w: &PackedAffine) -> route::WeightFormat {
    route::WeightFormat {
        bits: w.bits,
        q4_1: w.q4_1.is_some(),
        scale_dtype: w.scales.dtype(),
        in_dim: w.in_dim(),
    }
}

/// Rows `ids` (`[..]` `u32` on the device, checked against the table) of a packed table,
/// `[n, in]` in `dtype`, gathered by the dequantize kernel's row selection; `None` when the
/// kernels are off or no kernel takes the dtypes.
#[cfg(feature = "metal")]
pub(crate) fn qembedding(
    ids: &Tensor,
    w: &PackedAffine,
    dtype: candle_core::DType,
) -> Result<Option<Tensor>, KernelError> {
    match route::gather(dtype, format_of(w), kernels_on()) {
        Route::Kernel(Family::Dequant) => launch::dequantize_rows(w, Some(ids), dtype),
        _ => Ok(None),
    }
}

/// `x` `[.., dim]` quantized by the quantize kernel on the device (the K/V written into a
/// quantized cache); `None` when the kernels are off or no kernel takes the dtype.
#[cfg(feature = "metal")]
pub(crate) fn quantize(
    x: &Tensor,
    bits: crate::kernels::QuantBits,
    group_size: usize,
) -> Result<Option<PackedAffine>, KernelError> {
    match route::kv_quantize(x.dtype(), kernels_on()) {
        Route::Kernel(Family::Quant) => launch::quantize(x, bits, group_size),
        _ => Ok(None),
    }
}
