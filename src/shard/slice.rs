//! Cutting a loaded weight down to a rank's part ([`TensorSlice`]): dense tensors of any
//! leading shape, and MLX-packed matrices along their packed layout (rows whole; columns at
//! group boundaries, where codes, scales and biases split alike).

use std::ops::Range;

use candle_core::Tensor;

use super::{Axis, TensorSlice};
use crate::error::{Error, Result};
use crate::kernels::PackedAffine;

/// `ranges` of axis `dim` of `t` joined in order.
fn take(t: &Tensor, dim: usize, ranges: &[Range<usize>]) -> Result<Tensor> {
    let parts = ranges
        .iter()
        .map(|r| t.narrow(dim, r.start, r.end - r.start))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, dim)?.contiguous()?)
}

/// Rows of every matrix of a stack held flattened as `[n * full, cols]`.
fn take_rows(t: &Tensor, full: usize, ranges: &[Range<usize>]) -> Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    if full == 0 || rows % full != 0 {
        return Err(Error::Input(format!(
            "{rows} rows are not a stack of matrices of {full} rows"
        )));
    }
    let n = rows / full;
    let kept = take(&t.reshape((n, full, cols))?, 1, ranges)?;
    let local = kept.dim(1)?;
    Ok(kept.reshape((n * local, cols))?)
}

/// A dense weight `[.., out, in]` (a matrix or a stack of them) cut to `s`.
///
/// # Errors
/// A tensor of rank below 2, or whose split axis is not `s.full` long.
pub fn apply_dense(t: &Tensor, s: &TensorSlice) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let n = dims.len();
    let at = match s.axis {
        Axis::Out if n >= 2 => n - 2,
        Axis::In if n >= 1 => n - 1,
        _ => {
            return Err(Error::Input(format!(
                "cannot shard a tensor of shape {dims:?}"
            )))
        }
    };
    if dims[at] != s.full {
        return Err(Error::Input(format!(
            "axis {at} of shape {dims:?} is not the planned {}",
            s.full
        )));
    }
    take(t, at, &s.ranges)
}

/// A packed `[rows, in]` matrix (a stack flattened as `[n * out, in]`) cut to `s`: rows of
/// every matrix, or columns at boundaries of the quantization groups. `None` when a column cut
/// falls inside a group (the caller dequantizes and cuts the dense matrix).
///
/// # Errors
/// A matrix whose split axis does not match `s.full`.
pub fn apply_packed(p: &PackedAffine, s: &TensorSlice) -> Result<Option<PackedAffine>> {
    let (out, inp) = (p.out_dim(), p.in_dim());
    let packed = match s.axis {
        Axis::Out => {
            let rows = |t: &Tensor| take_rows(t, s.full, &s.ranges);
            let local = out / s.full.max(1) * s.len();
            PackedAffine::new(
                rows(&p.codes)?,
                rows(&p.scales)?,
                rows(&p.biases)?,
                local,
                inp,
            )?
        }
        Axis::In => {
            if inp != s.full {
                return Err(Error::Input(format!(
                    "a packed matrix of {inp} inputs is not the planned {}",
                    s.full
                )));
            }
            let (g, bits) = (p.group_size, p.bits.bits());
            if s.ranges.iter().any(|r| r.start % g != 0 || r.end % g != 0) {
                return Ok(None);
            }
            let scaled = |k: usize, d: usize| -> Vec<Range<usize>> {
                s.ranges
                    .iter()
                    .map(|r| r.start * k / d..r.end * k / d)
                    .collect()
            };
            PackedAffine::new(
                take(&p.codes, 1, &scaled(bits, 32))?,
                take(&p.scales, 1, &scaled(1, g))?,
                take(&p.biases, 1, &scaled(1, g))?,
                out,
                s.len(),
            )?
        }
    };
    Ok(Some(if p.is_settled() {
        packed.settled()
    } else {
        packed
    }))
}
