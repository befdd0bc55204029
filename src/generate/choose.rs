//! How each row's next token is chosen from a step's logits, for [`crate::Generator`] (one row)
//! and [`crate::generate::BatchSession`] (a row a sequence) alike.
//!
//! Each row goes the cheapest way its sampler allows ([`RowPlan`]), where the device has the
//! kernels (CUDA):
//! - picked on the device, one id copied back: plain greedy decoding (the argmax) and tempered
//!   draws without penalties, over the whole row or from its best logits under the top-k,
//!   top-p and min-p filters ([`Sampler::device_draw`]);
//! - its best logits picked on the device and copied back, the sampler drawing from those: a
//!   top-k with penalties that only lower logits ([`Sampler::best_needed`]), or top-p or min-p
//!   without a top-k, with the row's softmax mass ([`Sampler::nucleus_needed`]);
//! - the whole row copied to the host, that row alone.
//!
//! Every way draws the token [`Sampler::sample`] draws from the whole row. A row under an
//! output constraint ([`super::constraint`]) has the logits of the tokens it does not allow
//! set to -inf first, then goes its sampler's way; the chosen token advances the constraint.

use candle_core::Tensor;

use super::constraint::{bits_to_bytes, TokenConstraint};
use super::sampling::{DeviceDraw, Sampler};
use crate::error::{Error, Result};
use crate::kernels::ops::argmax::pick_rows;
use crate::kernels::ops::candidates::{best_candidates, tempered_mass, MAX_CANDIDATES};

/// A row whose token is chosen: its sampler and the tokens its penalties see.
pub(crate) trait Chooser {
    /// The row's sampler.
    fn sampler(&self) -> &Sampler;
    /// The prompt and the tokens generated so far.
    fn history(&self) -> &[u32];
    /// The sampler, to draw with, and the history.
    fn parts(&mut self) -> (&mut Sampler, &[u32]);
    /// The row's output constraint, where it has one.
    fn constraint(&mut self) -> Option<&mut TokenConstraint> {
        None
    }
}

/// One row's sampler and history, borrowed ([`crate::Generator`]'s single row).
pub(crate) struct SamplerRow<'a> {
    /// The sampler.
    pub sampler: &'a mut Sampler,
    /// The prompt and the tokens generated so far.
    pub history: &'a [u32],
    /// The output constraint, where the generation has one.
    pub constraint: Option<&'a mut TokenConstraint>,
}

impl Chooser for SamplerRow<'_> {
    fn sampler(&self) -> &Sampler {
        self.sampler
    }
    fn history(&self) -> &[u32] {
        self.history
    }
    fn parts(&mut self) -> (&mut Sampler, &[u32]) {
        (self.sampler, self.history)
    }
    fn constraint(&mut self) -> Option<&mut TokenConstraint> {
        self.constraint.as_deref_mut()
    }
}

/// How the device picks a sampler's token without the host, where it can: `Some(None)` for
/// plain greedy decoding (the argmax), `Some(Some(draw))` for a draw
/// ([`Sampler::device_draw`]); `None` where the host takes part (penalties, filters the device
/// does not apply). Such rows may decode one step ahead.
pub(crate) fn device_pick(sampler: &Sampler, history: &[u32]) -> Option<Option<DeviceDraw>> {
    if sampler.is_plain_greedy() {
        return Some(None);
    }
    sampler.device_draw(history).map(Some)
}

/// Takes `token`, picked on the device as [`device_pick`] asked, as the row's choice: a draw
/// advances the sampler's draw count (the next draw gets fresh noise).
pub(crate) fn accept_device_pick(row: &mut impl Chooser, token: u32) {
    let (sampler, history) = row.parts();
    if sampler.device_draw(history).is_some() {
        sampler.accept_device_draw(token);
    }
}

/// How one row's token is chosen (see the module's documentation).
#[derive(Debug, Clone, Copy)]
enum RowPlan {
    /// Picked on the device ([`device_pick`]).
    Device(Option<DeviceDraw>),
    /// The sampler's `k` best logits under temperature `t`, picked on the device.
    Best(usize, f32),
    /// The most candidates the device picks under temperature `t`, and the row's softmax mass,
    /// for top-p or min-p without a top-k (the whole row where the cut lies past them).
    Nucleus(f32),
    /// The whole row, on the host.
    Whole,
}

fn plan(row: &impl Chooser) -> RowPlan {
    let (s, history) = (row.sampler(), row.history());
    if let Some(pick) = device_pick(s, history) {
        return RowPlan::Device(pick);
    }
    match (s.best_needed(history), s.nucleus_needed(history)) {
        (Some((k, t)), _) if k <= MAX_CANDIDATES => RowPlan::Best(k, t),
        (_, Some(t)) => RowPlan::Nucleus(t),
        _ => RowPlan::Whole,
    }
}

/// Each row's next token from f32 `logits` `[rows.len(), vocab]`, each row the way its sampler
/// allows (the module's documentation); off CUDA every row is sampled on the host.
///
/// # Errors
/// A row count other than the logits', device errors.
pub(crate) fn choose_tokens<R: Chooser + Send>(
    logits: &Tensor,
    rows: &mut [R],
) -> Result<Vec<u32>> {
    if logits.dim(0)? != rows.len() {
        return Err(Error::Input(format!(
            "{} rows of logits for {} samplers",
            logits.dim(0)?,
            rows.len()
        )));
    }
    let constrained = constrain(logits, rows)?;
    let logits = constrained.as_ref().unwrap_or(logits);
    let plans: Vec<RowPlan> = rows.iter().map(plan).collect();
    let mut chosen: Vec<Option<u32>> = vec![None; rows.len()];
    let device: Vec<Option<DeviceDraw>> = plans
        .iter()
        .filter_map(|p| match p {
            RowPlan::Device(d) => Some(*d),
            _ => None,
        })
        .collect();
    if let Some(&first) = device.first() {
        // Rows chosen another way take the first device row's way; their ids are dropped.
        let picks: Vec<Option<DeviceDraw>> = plans
            .iter()
            .map(|p| match p {
                RowPlan::Device(d) => *d,
                _ => first,
            })
            .collect();
        if let Some(ids) = pick_rows(logits, &picks)? {
            for (i, id) in ids.to_vec1::<u32>()?.into_iter().enumerate() {
                if matches!(plans[i], RowPlan::Device(_)) {
                    accept_device_pick(&mut rows[i], id);
                    chosen[i] = Some(id);
                }
            }
        }
    }
    choose_from_candidates(logits, rows, &plans, &mut chosen)?;
    let rest: Vec<usize> = (0..rows.len()).filter(|&i| chosen[i].is_none()).collect();
    if !rest.is_empty() {
        let host = if rest.len() == rows.len() {
            logits.to_vec2::<f32>()?
        } else {
            let ids: Vec<u32> = rest.iter().map(|&i| i as u32).collect();
            let ids = Tensor::from_vec(ids, rest.len(), logits.device())?;
            logits.index_select(&ids, 0)?.to_vec2::<f32>()?
        };
        let mut left: Vec<&mut R> = rows
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| chosen[*i].is_none())
            .map(|(_, r)| r)
            .collect();
        let tokens = sample_whole_rows(host, &mut left)?;
        for (&i, t) in rest.iter().zip(tokens) {
            chosen[i] = Some(t);
        }
    }
    let chosen: Vec<u32> = chosen.into_iter().map(|t| t.unwrap_or(0)).collect();
    for (row, &token) in rows.iter_mut().zip(&chosen) {
        if let Some(c) = row.constraint() {
            c.accept(token)?;
        }
    }
    Ok(chosen)
}

/// `logits` with each constrained row's disallowed tokens at -inf; `None` where no row has a
/// constraint. Each constrained row writes its mask, a bit a token, into its row of the
/// batch's mask, on up to [`SAMPLING_THREADS`] threads (a fraction of a millisecond each at
/// 262,144 tokens). CUDA takes the bits as they are (`mask_by_bits`: 1 MB for 32 rows at
/// Gemma's vocabulary, not the 8 MB of a byte a token); other devices a byte mask made from
/// them.
fn constrain<R: Chooser + Send>(logits: &Tensor, rows: &mut [R]) -> Result<Option<Tensor>> {
    if !rows.iter_mut().any(|r| r.constraint().is_some()) {
        return Ok(None);
    }
    let (n, vocab) = logits.dims2()?;
    let words = vocab.div_ceil(32);
    let mut bits = vec![u32::MAX; n * words];
    let mut work: Vec<(&mut TokenConstraint, &mut [u32])> = rows
        .iter_mut()
        .zip(bits.chunks_mut(words.max(1)))
        .filter_map(|(r, m)| r.constraint().map(|c| (c, m)))
        .collect();
    let threads = work.len().min(cores()).clamp(1, SAMPLING_THREADS);
    let chunk = work.len().div_ceil(threads);
    let results: Vec<Result<()>> = if threads == 1 {
        work.iter_mut()
            .map(|(c, m)| c.allowed_bits_into(m))
            .collect()
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = work
                .chunks_mut(chunk)
                .map(|part| {
                    scope.spawn(move || {
                        part.iter_mut()
                            .map(|(c, m)| c.allowed_bits_into(m))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| {
                    h.join().unwrap_or_else(|_| {
                        vec![Err(Error::Candle(candle_core::Error::Msg(
                            "a thread computing token masks panicked".to_string(),
                        )))]
                    })
                })
                .collect()
        })
    };
    results.into_iter().collect::<Result<()>>()?;
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let bits = Tensor::from_vec(bits, (n, words), logits.device())?;
        return Ok(Some(crate::kernels::cuda::reduce::mask_by_bits(
            logits, &bits,
        )?));
    }
    let mut mask = vec![0u8; n * vocab];
    for (row, w) in mask.chunks_mut(vocab.max(1)).zip(bits.chunks(words.max(1))) {
        bits_to_bytes(w, row);
    }
    let mask = Tensor::from_vec(mask, (n, vocab), logits.device())?;
    let blocked = Tensor::new(f32::NEG_INFINITY, logits.device())?.broadcast_as((n, vocab))?;
    Ok(Some(mask.where_cond(logits, &blocked)?))
}

/// The rows planned [`RowPlan::Best`] and [`RowPlan::Nucleus`], drawn from their best logits
/// picked on the device (and the row's mass); a nucleus row whose cut lies past them is left
/// unchosen, as is every row where the device has no kernel for it.
fn choose_from_candidates<R: Chooser>(
    logits: &Tensor,
    rows: &mut [R],
    plans: &[RowPlan],
    chosen: &mut [Option<u32>],
) -> Result<()> {
    let best = plans.iter().filter_map(|p| match p {
        RowPlan::Best(k, _) => Some(*k),
        RowPlan::Nucleus(_) => Some(MAX_CANDIDATES),
        _ => None,
    });
    let Some(k) = best.max() else {
        return Ok(());
    };
    // Rows drawn another way rank by any positive temperature; their candidates are unused.
    let temps: Vec<f32> = plans
        .iter()
        .map(|p| match p {
            RowPlan::Best(_, t) | RowPlan::Nucleus(t) => *t,
            _ => 0.0,
        })
        .collect();
    let masses = if plans.iter().any(|p| matches!(p, RowPlan::Nucleus(_))) {
        let positive: Vec<f32> = temps
            .iter()
            .map(|&t| if t > 0.0 { t } else { 1.0 })
            .collect();
        tempered_mass(logits, &positive)?
    } else {
        None
    };
    let row_len = logits.dim(1)?;
    let Some(candidates) = best_candidates(logits, &temps, k)? else {
        return Ok(());
    };
    for (i, best) in candidates.iter().enumerate() {
        let (sampler, history) = rows[i].parts();
        chosen[i] = match (&plans[i], &masses) {
            (RowPlan::Best(..), _) => Some(sampler.sample_from_best(best, history)),
            (RowPlan::Nucleus(_), Some(m)) => sampler.sample_from_nucleus(best, m[i], row_len),
            _ => chosen[i],
        };
    }
    Ok(())
}

/// Most threads that sample whole rows, or compute constrained rows' masks, of one step.
const SAMPLING_THREADS: usize = 16;

/// The machine's hardware threads, read once.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Each row's token from its whole logits, on up to [`SAMPLING_THREADS`] threads (a tempered
/// draw with filters sorts its pool: milliseconds a row at 262,144 tokens).
fn sample_whole_rows<R: Chooser + Send>(
    host: Vec<Vec<f32>>,
    rows: &mut [&mut R],
) -> Result<Vec<u32>> {
    let threads = rows.len().min(cores()).clamp(1, SAMPLING_THREADS);
    let sample = |r: &mut &mut R, logits: &Vec<f32>| {
        let (sampler, history) = r.parts();
        sampler.sample(logits, history)
    };
    if threads == 1 {
        return Ok(rows
            .iter_mut()
            .zip(&host)
            .map(|(r, l)| sample(r, l))
            .collect());
    }
    let chunk = rows.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .chunks_mut(chunk)
            .zip(host.chunks(chunk))
            .map(|(rs, ls)| {
                scope.spawn(move || {
                    rs.iter_mut()
                        .zip(ls)
                        .map(|(r, l)| sample(r, l))
                        .collect::<Vec<u32>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(host.len());
        for h in handles {
            out.extend(h.join().map_err(|_| {
                Error::Candle(candle_core::Error::Msg(
                    "a thread sampling a batch's rows panicked".to_string(),
                ))
            })?);
        }
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::sampling::{DrawFilter, SamplingOptions, DEVICE_TOP_K_MAX};

    fn plan_of(o: SamplingOptions, history: &[u32]) -> RowPlan {
        let mut sampler = Sampler::new(o);
        plan(&SamplerRow {
            sampler: &mut sampler,
            history,
            constraint: None,
        })
    }

    fn tempered(t: f32) -> SamplingOptions {
        SamplingOptions {
            temperature: t,
            seed: 3,
            ..Default::default()
        }
    }

    #[test]
    fn each_sampler_takes_the_cheapest_way_it_allows() {
        assert!(matches!(
            plan_of(SamplingOptions::default(), &[]),
            RowPlan::Device(None)
        ));
        assert!(matches!(
            plan_of(tempered(0.7), &[]),
            RowPlan::Device(Some(d)) if d.filter.is_none() && d.temperature == 0.7
        ));
        let recommended = SamplingOptions {
            top_k: Some(64),
            top_p: Some(0.95),
            ..tempered(1.0)
        };
        assert!(matches!(
            plan_of(recommended, &[]),
            RowPlan::Device(Some(d)) if d.filter == Some(DrawFilter { top_k: 64, top_p: Some(0.95), min_p: None })
        ));
        // Penalties that only lower logits: the k best plus the touched tokens, on the host.
        let penalized = SamplingOptions {
            top_k: Some(8),
            repetition_penalty: Some(1.3),
            ..tempered(1.0)
        };
        assert!(matches!(plan_of(penalized, &[5, 6, 5]), RowPlan::Best(10, t) if t == 1.0));
        // Greedy with a penalty: the best one plus the touched tokens.
        let greedy_penalized = SamplingOptions {
            repetition_penalty: Some(1.3),
            ..Default::default()
        };
        assert!(matches!(
            plan_of(greedy_penalized, &[5]),
            RowPlan::Best(2, t) if t == 0.0
        ));
        let nucleus = SamplingOptions {
            top_p: Some(0.9),
            ..tempered(0.5)
        };
        assert!(matches!(plan_of(nucleus, &[]), RowPlan::Nucleus(t) if t == 0.5));
        // More candidates than the device picks, or a penalty that can raise logits: whole rows.
        let wide = SamplingOptions {
            top_k: Some(DEVICE_TOP_K_MAX + 1),
            ..tempered(1.0)
        };
        assert!(matches!(plan_of(wide, &[]), RowPlan::Whole));
        let raised = SamplingOptions {
            top_k: Some(8),
            logit_bias: vec![(3, 5.0)],
            ..tempered(1.0)
        };
        assert!(matches!(plan_of(raised, &[]), RowPlan::Whole));
    }

    #[test]
    fn on_the_cpu_each_row_draws_what_its_sampler_draws_from_the_whole_row() -> Result<()> {
        let vocab = 300;
        let logits: Vec<f32> = (0..2 * vocab)
            .map(|i| ((i * 7919) % 97) as f32 * 0.1 - 4.0)
            .collect();
        let t = Tensor::from_vec(logits.clone(), (2, vocab), &candle_core::Device::Cpu)?;
        let options = [
            SamplingOptions::default(),
            SamplingOptions {
                top_k: Some(64),
                top_p: Some(0.95),
                ..tempered(1.0)
            },
        ];
        let (mut a, mut b) = (
            Sampler::new(options[0].clone()),
            Sampler::new(options[1].clone()),
        );
        let history = [1u32, 2];
        let mut rows = [
            SamplerRow {
                sampler: &mut a,
                history: &history,
                constraint: None,
            },
            SamplerRow {
                sampler: &mut b,
                history: &history,
                constraint: None,
            },
        ];
        let got = choose_tokens(&t, &mut rows)?;
        let want: Vec<u32> = options
            .iter()
            .zip(logits.chunks(vocab))
            .map(|(o, row)| Sampler::new(o.clone()).sample(row, &history))
            .collect();
        assert_eq!(got, want);
        // A row count other than the logits' is an error, not a panic.
        assert!(choose_tokens(&t, &mut rows[..1]).is_err());
        Ok(())
    }
}
