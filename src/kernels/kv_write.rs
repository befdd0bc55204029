//! Writing new K/V rows into a cache's storage: the backend-neutral entry points a cache calls.
//!
//! A cache first reserves its next slots (views into its storage), then asks one of these to
//! fill them; `Ok(false)` means nothing was written, and the cache falls back to its plain
//! candle path (a copy, or [`super::quantize`] and a copy). Only CUDA writes in place: on
//! every other device, and without the `cuda` feature, these return `Ok(false)` at once.

use candle_core::{Device, Tensor};

use super::{KernelError, QuantBits};

/// Whether new K/V rows on `device` can be written straight into reserved slots, so reserving
/// them is worth it.
pub(crate) fn writes_in_place(device: &Device) -> bool {
    cfg!(feature = "cuda") && device.is_cuda()
}

/// Whether this thread is capturing a CUDA graph (never without the `cuda` feature): cache
/// writes must then go to reserved slots, whose addresses each replay rewrites; a copy into
/// storage would be replayed at the address it had at capture.
pub(crate) fn capturing_graph() -> bool {
    #[cfg(feature = "cuda")]
    {
        super::cuda::graph::recording()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Copies token rows `src` (`[1, heads, n, width]`, any head and token strides) into `dst`
/// (the same shape, a view into a cache's storage) in one CUDA launch. `Ok(false)`, writing
/// nothing, off CUDA, while a graph records, or when the rows are not whole 16-byte units.
///
/// # Errors
/// Candle/CUDA errors.
pub(crate) fn copy_token_rows(dst: &Tensor, src: &Tensor) -> Result<bool, KernelError> {
    #[cfg(feature = "cuda")]
    if src.device().is_cuda() {
        return Ok(super::cuda::kv_write::copy_token_rows(dst, src)?);
    }
    let _ = (dst, src);
    Ok(false)
}

/// Copies sequence `b` of `k`, `v` (`[batch, kv_heads, n, head_dim]`) into `dst[b]`, each
/// sequence's reserved dense slots (`[1, kv_heads, n, head_dim]` views), in one CUDA launch
/// for up to 16 sequences. `Ok(false)`, writing nothing, off CUDA or when a destination is not
/// laid out as the kernel writes it.
///
/// # Errors
/// Candle/CUDA errors.
pub(crate) fn scatter_kv_batch(
    k: &Tensor,
    v: &Tensor,
    dst: &[(Tensor, Tensor)],
) -> Result<bool, KernelError> {
    #[cfg(feature = "cuda")]
    if k.device().is_cuda() {
        return Ok(super::cuda::kv_write::kv_scatter_batch(k, v, dst)?);
    }
    let _ = (k, v, dst);
    Ok(false)
}

/// Quantizes new K and V rows (`[1, kv_heads, n, head_dim]`, as [`super::quantize`] would)
/// straight into a packed cache's reserved slots `dst` (codes, scales, biases of K, then of V),
/// in one CUDA launch. Returns `Ok(false)`, writing nothing, off CUDA or when `dst` is not laid
/// out as the kernel writes it; the caller then quantizes and copies.
///
/// # Errors
/// Candle/CUDA errors.
pub(crate) fn quantize_kv_into(
    k: &Tensor,
    v: &Tensor,
    bits: QuantBits,
    group_size: usize,
    dst: &[Tensor],
) -> Result<bool, KernelError> {
    #[cfg(feature = "cuda")]
    if k.device().is_cuda() {
        return Ok(super::cuda::kv_write::quantize_kv_into(
            k, v, bits, group_size, dst,
        )?);
    }
    let _ = (k, v, bits, group_size, dst);
    Ok(false)
}

/// [`quantize_kv_into`] for a batch: sequence `b` of `k`, `v` (`[batch, kv_heads, n,
/// head_dim]`) into `dst[b]`, each sequence's own slots, in one CUDA launch for up to 16
/// sequences. Returns `Ok(false)`, writing nothing, off CUDA or when any sequence's slots are
/// not laid out as the kernel writes them.
///
/// # Errors
/// Candle/CUDA errors.
pub(crate) fn quantize_kv_into_batch(
    k: &Tensor,
    v: &Tensor,
    bits: QuantBits,
    group_size: usize,
    dst: &[Vec<Tensor>],
) -> Result<bool, KernelError> {
    #[cfg(feature = "cuda")]
    if k.device().is_cuda() {
        return Ok(super::cuda::kv_write::quantize_kv_into_batch(
            k, v, bits, group_size, dst,
        )?);
    }
    let _ = (k, v, bits, group_size, dst);
    Ok(false)
}
