//! Each row's best logits picked on the device for the host samplers: a sampled step copies
//! `k` (id, logit) pairs a row to the host instead of the whole vocabulary (a megabyte a row at
//! Gemma 4's 262,144 tokens), and the sampler works on those alone
//! ([`crate::generate::sampling::Sampler::sample_from_best`]); a top-p or min-p filter without
//! a top-k also needs the row's softmax mass ([`tempered_mass`],
//! [`crate::generate::sampling::Sampler::sample_from_nucleus`]).

use candle_core::Tensor;

use super::Result;

/// Most candidates a row the device picks; samplers that keep more read the whole row.
#[cfg(feature = "cuda")]
pub(crate) const MAX_CANDIDATES: usize = crate::kernels::cuda::top_k::TOP_K_MAX;
/// Most candidates a row the device picks (no device picks them without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub(crate) const MAX_CANDIDATES: usize = 1024;

/// One row's best `(id, logit)` pairs, best first.
pub(crate) type Candidates = Vec<(u32, f32)>;

/// For each row of f32 `logits` `[rows, vocab]`, its `min(k, vocab)` best `(id, logit)` pairs
/// in [`crate::generate::sampling::Sampler`]'s order: the key `logit / temps[row]` largest
/// first (the logit itself where the temperature is not above 0: a greedy row, zeros of either
/// sign equal), the lowest id first among equal keys, NaN and -inf logits last. Computed where
/// the logits live when that is a CUDA device; `None` elsewhere (the caller then reads the
/// rows).
///
/// # Errors
/// Non-f32 logits, `k` of 0 or above [`MAX_CANDIDATES`], a temperature count other than the
/// rows, device errors.
pub(crate) fn best_candidates(
    logits: &Tensor,
    temps: &[f32],
    k: usize,
) -> Result<Option<Vec<Candidates>>> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let (values, ids) = crate::kernels::cuda::top_k::top_k_rows(logits, temps, k)?;
        let values = values.to_vec2::<f32>()?;
        let ids = ids.to_vec2::<u32>()?;
        return Ok(Some(
            ids.into_iter()
                .zip(values)
                .map(|(i, v)| i.into_iter().zip(v).collect())
                .collect(),
        ));
    }
    let _ = (logits, temps, k);
    Ok(None)
}

/// For each row of f32 `logits` `[rows, vocab]`, its softmax mass under the sampler's key
/// `logit / temps[row]`: the sum over the row's logits (NaN and -inf left out) of
/// `exp((key - max_key) as f64)`, the f32 difference then the f64 exponential, as
/// [`crate::generate::sampling::Sampler`] sums them (in another order). Computed where the
/// logits live when that is a CUDA device; `None` elsewhere.
///
/// # Errors
/// Non-f32 logits, a temperature count other than the rows or one not above 0, device errors.
pub(crate) fn tempered_mass(logits: &Tensor, temps: &[f32]) -> Result<Option<Vec<f64>>> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let sums = crate::kernels::cuda::top_k::key_mass_chunks(logits, temps)?;
        return Ok(Some(
            sums.to_vec2::<f64>()?
                .iter()
                .map(|row| row.iter().sum())
                .collect(),
        ));
    }
    let _ = (logits, temps);
    Ok(None)
}
