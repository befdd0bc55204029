//! Tensor layouts as the device kernels read them, shared by the CUDA and Metal launchers:
//! the last dimension contiguous, the head and key strides passed to the kernel.

use candle_core::{DType, Tensor};

use crate::kernels::PackedAffine;

/// `t` `[.., heads, keys, last]` with its last dimension contiguous (copied when strided), and
/// its head and key strides (dims 1 and 2) in elements. The layout's start offset is kept.
pub(crate) fn last_dim_contiguous(t: &Tensor) -> candle_core::Result<(Tensor, u64, u64)> {
    let t = if t.stride().last() == Some(&1) {
        t.clone()
    } else {
        t.contiguous()?
    };
    let st = t.stride();
    Ok((t.clone(), st[1] as u64, st[2] as u64))
}

/// [`last_dim_contiguous`] for kernels that copy 16 bytes at a time: copied into a fresh
/// (aligned) buffer unless the start and both strides are whole 16-byte chunks.
#[cfg(feature = "cuda")]
pub(crate) fn last_dim_contiguous_aligned16(t: &Tensor) -> candle_core::Result<(Tensor, u64, u64)> {
    let (t, s1, s2) = last_dim_contiguous(t)?;
    let chunk = (16 / t.dtype().size_in_bytes()).max(1);
    let ok = |x: usize| x.is_multiple_of(chunk);
    if ok(t.layout().start_offset()) && ok(s1 as usize) && ok(s2 as usize) {
        Ok((t, s1, s2))
    } else {
        last_dim_contiguous(&t.force_contiguous()?)
    }
}

/// The scales and biases of packed K or V in `dtype`, with the one (head, key) stride pair the
/// kernels read both with: both made contiguous when their layouts differ.
pub(crate) fn scales_and_biases(
    p: &PackedAffine,
    dtype: DType,
) -> candle_core::Result<(Tensor, Tensor, u64, u64)> {
    let cast = |t: &Tensor| {
        if t.dtype() == dtype {
            Ok(t.clone())
        } else {
            t.to_dtype(dtype)
        }
    };
    let (scales, sh, sk) = last_dim_contiguous(&cast(&p.scales)?)?;
    let (biases, bh, bk) = last_dim_contiguous(&cast(&p.biases)?)?;
    if (sh, sk) == (bh, bk) {
        return Ok((scales, biases, sh, sk));
    }
    let (scales, sh, sk) = last_dim_contiguous(&scales.contiguous()?)?;
    Ok((scales, biases.contiguous()?, sh, sk))
}
