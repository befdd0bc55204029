//! Log-probabilities of generated tokens ([`super::GenOptions::logprobs`]): the log-softmax of
//! each row of logits, read back as the chosen token's value and the most likely tokens'.
//! The row's normalizer and the chosen logits are reduced where the logits live; the most
//! likely tokens are picked there too on CUDA, so a step copies a few numbers a row.

use candle_core::{DType, Tensor};

use super::TokenLogprobs;
use crate::error::Result;

/// For each row of f32 `logits` `[rows, vocab]`: the log-probability of `chosen[row]` and the
/// `top` most likely tokens' (most likely first, the lowest id first among equals, NaN and
/// -inf logits last).
///
/// # Errors
/// A chosen id outside the vocabulary, `chosen` of another length than the rows, device
/// errors.
pub(crate) fn token_logprobs(
    logits: &Tensor,
    chosen: &[u32],
    top: usize,
) -> Result<Vec<TokenLogprobs>> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if chosen.len() != rows || chosen.iter().any(|&c| c as usize >= vocab) {
        return Err(crate::Error::Input(format!(
            "logprobs of ids {chosen:?} in {rows} rows of {vocab} logits"
        )));
    }
    let max = logits.max_keepdim(1)?;
    let norm = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + &max)?;
    let ids = Tensor::from_slice(chosen, (rows, 1), logits.device())?;
    let picked = logits.gather(&ids, 1)?;
    let both = Tensor::cat(&[&picked, &norm], 1)?.to_vec2::<f32>()?;
    let best = if top == 0 {
        vec![Vec::new(); rows]
    } else {
        best_logits(&logits, top)?
    };
    Ok(both
        .into_iter()
        .zip(best)
        .map(|(pn, best)| {
            let (value, norm) = (
                pn.first().copied().unwrap_or(f32::NAN),
                pn.get(1).copied().unwrap_or(f32::NAN),
            );
            TokenLogprobs {
                logprob: value - norm,
                top: best.into_iter().map(|(id, v)| (id, v - norm)).collect(),
            }
        })
        .collect())
}

/// Each row's `k` largest logits under the sampler's greedy order, as `(id, logit)`.
fn best_logits(logits: &Tensor, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
    let rows = logits.dim(0)?;
    if let Some(best) =
        crate::kernels::ops::candidates::best_candidates(logits, &vec![0.0; rows], k)?
    {
        return Ok(best);
    }
    Ok(logits
        .to_vec2::<f32>()?
        .into_iter()
        .map(|row| {
            let key = |v: f32| (v > f32::NEG_INFINITY).then_some(v + 0.0);
            let mut ids: Vec<u32> = (0..row.len() as u32).collect();
            let order = |a: &u32, b: &u32| match (key(row[*a as usize]), key(row[*b as usize])) {
                (Some(x), Some(y)) => y.total_cmp(&x).then(a.cmp(b)),
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => a.cmp(b),
            };
            if k < ids.len() {
                ids.select_nth_unstable_by(k - 1, order);
                ids.truncate(k);
            }
            ids.sort_unstable_by(order);
            ids.into_iter().map(|i| (i, row[i as usize])).collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn logprobs_are_the_log_softmax_of_the_row() {
        let rows = [
            vec![1.0f32, 3.0, 3.0, -2.0, f32::NEG_INFINITY],
            vec![0.5, 0.25, 0.0, -0.0, 7.0],
        ];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (2, 5), &Device::Cpu).expect("tensor");
        let got = token_logprobs(&logits, &[0, 4], 3).expect("logprobs");
        for (row, (lp, chosen)) in rows.iter().zip(got.iter().zip([0usize, 4])) {
            let norm = row.iter().map(|&v| f64::from(v).exp()).sum::<f64>().ln();
            let want = |i: usize| (f64::from(row[i]) - norm) as f32;
            assert!((lp.logprob - want(chosen)).abs() < 1e-5, "{lp:?}");
            let total: f64 = row.iter().map(|&v| (f64::from(v) - norm).exp()).sum();
            assert!((total - 1.0).abs() < 1e-9);
            for (id, v) in &lp.top {
                assert!((v - want(*id as usize)).abs() < 1e-5, "{lp:?}");
            }
        }
        // Ties: the lowest id first; zeros of either sign equal.
        let ids = |i: usize| got[i].top.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(0), vec![1, 2, 0]);
        assert_eq!(ids(1), vec![4, 0, 1]);
        assert!(
            token_logprobs(&logits, &[0, 5], 1).is_err(),
            "an id past the vocabulary"
        );
        assert!(
            token_logprobs(&logits, &[0], 1).is_err(),
            "one id for two rows"
        );
    }
}
