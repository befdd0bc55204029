//! Chunked prefill of joining sequences: which joiners go through the model together in one
//! step, and the forward that advances them by one chunk each.
//!
//! The rule: the oldest joiner's next chunk has `L = min(remaining, chunk)` tokens; every later
//! joiner whose next chunk has exactly `L` tokens too joins that forward, up to
//! `max(1, chunk / L)` sequences, so one step prefills at most `max(chunk, L)` tokens. A
//! sequence's chunk boundaries are therefore fixed (multiples of `chunk` from the start of what
//! it prefills), whoever it shares a step with.

use candle_core::Tensor;

use super::mixed;
use super::sequence::Sequence;
use crate::error::{Error, Result};
use crate::kv::ModelCache;
use crate::model::Model;

/// A sequence being prefilled chunk by chunk.
#[derive(Debug)]
pub(super) struct Joiner<'m> {
    pub seq: Sequence<'m>,
    /// Prompt tokens whose K/V the cache holds.
    pub done: usize,
    /// Its own single-sequence cache (`None` only while a forward borrows it).
    pub cache: Option<ModelCache>,
}

impl Joiner<'_> {
    fn next_chunk(&self, chunk: usize) -> usize {
        (self.seq.prompt_len - self.done).min(chunk)
    }

    /// The next `len` prompt tokens.
    fn piece(&self, len: usize) -> Vec<u32> {
        self.seq.history[self.done..self.done + len].to_vec()
    }

    /// Whether every prompt token went through the model.
    pub fn complete(&self) -> bool {
        self.done >= self.seq.prompt_len
    }
}

/// The joiners (indices into `joiners`, oldest first) to prefill together this step, and their
/// chunk length. Empty when `joiners` is.
pub(super) fn pick_group(joiners: &[Joiner<'_>], chunk: usize) -> (Vec<usize>, usize) {
    let Some(first) = joiners.first() else {
        return (Vec::new(), 0);
    };
    let len = first.next_chunk(chunk);
    let most = (chunk / len.max(1)).max(1);
    let group = joiners
        .iter()
        .enumerate()
        .filter(|(_, j)| j.next_chunk(chunk) == len)
        .map(|(i, _)| i)
        .take(most)
        .collect();
    (group, len)
}

/// Advances each joiner of `group` by `len` prompt tokens in one forward and returns the logits
/// of their last positions, `[group.len(), vocab]`.
///
/// # Errors
/// Model or cache errors; the caches of the group's joiners are then in an unknown state and
/// the caller drops them.
pub(super) fn prefill_group(
    model: &Model,
    joiners: &mut [Joiner<'_>],
    group: &[usize],
    len: usize,
) -> Result<Tensor> {
    let rows: Vec<Vec<u32>> = group.iter().map(|&i| joiners[i].piece(len)).collect();
    let missing = || Error::Input("a joining sequence lost its cache".to_string());
    let logits = if let [only] = group {
        let cache = joiners[*only].cache.as_mut().ok_or_else(missing)?;
        model.forward(&rows, cache)?
    } else {
        let mut batch = None;
        for &i in group {
            let cache = joiners[i].cache.take().ok_or_else(missing)?;
            mixed::push(&mut batch, cache)?;
        }
        let mut batch = batch.ok_or_else(missing)?;
        let out = model.forward(&rows, &mut batch);
        for (&i, cache) in group.iter().zip(mixed::split(batch)?) {
            joiners[i].cache = Some(cache);
        }
        out?
    };
    for &i in group {
        joiners[i].done += len;
    }
    Ok(logits)
}
