//! Token choice on the device, greedy or a tempered draw, so decoding copies one id to the host
//! instead of the logits.

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

/// One tempered draw of each row of f32 logits `[rows, cols]` as `draws` asks (one a row,
/// [`crate::generate::sampling::Sampler::device_draw`]), as u32 `[rows]`, computed on the
/// device where it has a kernel for it (CUDA); `None` elsewhere, where the caller reads the
/// logits back and draws on the host.
///
/// # Errors
/// Non-f32 input, a draw count other than the rows, device errors.
pub(crate) fn draw_rows(
    x: &Tensor,
    draws: &[crate::generate::sampling::DeviceDraw],
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let words: Vec<[u32; crate::kernels::cuda::reduce::DRAW_WORDS]> = draws
            .iter()
            .map(|d| {
                [
                    d.temperature.to_bits(),
                    d.key[0],
                    d.key[1],
                    d.draw as u32,
                    (d.draw >> 32) as u32,
                ]
            })
            .collect();
        return Ok(Some(crate::kernels::cuda::reduce::draw_rows(x, &words)?));
    }
    let _ = (x, draws);
    Ok(None)
}

/// Copies of greedy ids to the host that wait only for themselves: a step enqueued after the
/// copy keeps the device busy while the host waits for the ids (decoding one step ahead).
#[derive(Debug)]
pub(crate) struct IdReadback {
    #[cfg(feature = "cuda")]
    slots: crate::kernels::cuda::reduce::IdSlots,
    #[cfg(not(feature = "cuda"))]
    never: Never,
}

/// No value: nothing is read back ahead without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
enum Never {}

/// One copy of [`IdReadback::start`] in flight.
#[derive(Debug)]
pub(crate) struct PendingIds {
    #[cfg(feature = "cuda")]
    copy: crate::kernels::cuda::reduce::IdCopy,
    #[cfg(not(feature = "cuda"))]
    never: Never,
}

impl IdReadback {
    /// Readbacks from `device`; `None` where the ids cannot be read back without waiting for
    /// everything queued (every device but CUDA, or the `cuda` feature not built).
    pub(crate) fn new(device: &candle_core::Device) -> Option<Self> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            return Some(Self {
                slots: Default::default(),
            });
        }
        let _ = device;
        None
    }

    /// Starts copying u32 `ids` (on the readback's device) to the host.
    ///
    /// # Errors
    /// Another dtype or device, device errors.
    pub(crate) fn start(&mut self, ids: &Tensor) -> Result<PendingIds> {
        #[cfg(feature = "cuda")]
        return Ok(PendingIds {
            copy: self.slots.start(ids)?,
        });
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ids;
            match self.never {}
        }
    }

    /// Waits for `pending`'s copy (and what was queued before it) and returns its ids.
    ///
    /// # Errors
    /// Device errors.
    pub(crate) fn finish(&mut self, pending: PendingIds) -> Result<Vec<u32>> {
        #[cfg(feature = "cuda")]
        return Ok(self.slots.finish(pending.copy)?);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = self;
            match pending.never {}
        }
    }
}
