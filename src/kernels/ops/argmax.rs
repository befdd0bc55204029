//! Token choice on the device, greedy or a tempered draw, so decoding copies one id to the host
//! instead of the logits.

use candle_core::Tensor;

use super::Result;
use crate::generate::sampling::DeviceDraw;

/// Each row's token of f32 logits `[rows, cols]` picked on the device, as u32 `[rows]`: the
/// argmax where `picks[row]` is `None` (greedy decoding, ties to the lowest id), else that
/// tempered draw ([`crate::generate::sampling::Sampler::device_draw`]): over the whole row
/// without filters, from the row's best logits with them. Computed on the device where it has
/// the kernels (CUDA); `None` elsewhere, where the caller reads the logits back and picks on
/// the host. Each way runs once for the rows that take it (a batch whose rows all pick alike
/// runs one).
///
/// # Errors
/// Non-f32 input, a pick count other than the rows, a top-k above
/// [`crate::generate::sampling::DEVICE_TOP_K_MAX`], device errors.
pub(crate) fn pick_rows(x: &Tensor, picks: &[Option<DeviceDraw>]) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return Ok(Some(cuda_pick_rows(x, picks)?));
    }
    let _ = (x, picks);
    Ok(None)
}

#[cfg(feature = "cuda")]
fn cuda_pick_rows(x: &Tensor, picks: &[Option<DeviceDraw>]) -> Result<Tensor> {
    use crate::kernels::cuda::{reduce, top_k};
    let rows = x.dim(0)?;
    if picks.len() != rows {
        return Err(crate::kernels::KernelError::Shape {
            what: "token picks",
            expected: format!("one a row ({rows})"),
            found: vec![picks.len()],
        });
    }
    #[derive(PartialEq, Clone, Copy)]
    enum Way {
        Greedy,
        Whole,
        Filtered,
    }
    let way = |p: &Option<DeviceDraw>| match p {
        None => Way::Greedy,
        Some(d) if d.filter.is_none() => Way::Whole,
        Some(_) => Way::Filtered,
    };
    // Rows picked another way get placeholder parameters; their ids are not kept. A greedy
    // batch needs none.
    let words: Vec<[u32; reduce::DRAW_WORDS]> = if picks.iter().any(Option::is_some) {
        picks
            .iter()
            .map(|p| reduce::draw_words(&p.unwrap_or(PLACEHOLDER)))
            .collect()
    } else {
        Vec::new()
    };
    let mut ids: Option<Tensor> = None;
    for w in [Way::Greedy, Way::Whole, Way::Filtered] {
        if !picks.iter().any(|p| way(p) == w) {
            continue;
        }
        let these = match w {
            Way::Greedy => reduce::argmax_rows(x)?,
            Way::Whole => reduce::draw_rows(x, &words)?,
            Way::Filtered => {
                let k = picks
                    .iter()
                    .filter_map(|p| p.and_then(|d| d.filter).map(|f| f.top_k))
                    .max()
                    .unwrap_or(1);
                let temps: Vec<f32> = picks
                    .iter()
                    .map(|p| p.map_or(1.0, |d| d.temperature))
                    .collect();
                let (values, best) = top_k::top_k_rows(x, &temps, k)?;
                top_k::draw_from_best(&values, &best, &words)?
            }
        };
        ids = Some(match ids {
            None => these,
            Some(before) => {
                let mask: Vec<u8> = picks.iter().map(|p| u8::from(way(p) == w)).collect();
                Tensor::from_vec(mask, rows, x.device())?.where_cond(&these, &before)?
            }
        });
    }
    match ids {
        Some(ids) => Ok(ids),
        None => Ok(Tensor::zeros(0, candle_core::DType::U32, x.device())?),
    }
}

/// Parameters of the rows a way does not pick for (their ids are dropped).
#[cfg(feature = "cuda")]
const PLACEHOLDER: DeviceDraw = DeviceDraw {
    temperature: 1.0,
    key: [0, 0],
    draw: 0,
    filter: None,
};

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
