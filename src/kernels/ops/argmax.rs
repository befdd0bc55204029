//! Greedy token choice on the device, so decoding copies one id to the host instead of the
//! logits.

use candle_core::Tensor;

use super::Result;

/// Index of the largest value of each row of f32 `[rows, cols]` (ties: lowest index), as u32
/// `[rows]`, computed on the device where it has a kernel for it (CUDA); `None` elsewhere,
/// where the caller reads the logits back and picks on the host.
///
/// # Errors
/// Non-f32 input, device errors.
pub(crate) fn argmax_rows(x: &Tensor) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return Ok(Some(crate::kernels::cuda::reduce::argmax_rows(x)?));
    }
    let _ = x;
    Ok(None)
}
