//! Continuous batching: sequences of different lengths decode together, each with its own
//! [`GenOptions`] (sampling and seed, token budget, stop strings, EOS handling and cache layout:
//! dense, rotating, 8-bit and 4-bit sequences share one decode step). New sequences join
//! between steps and finished ones leave.
//!
//! A sequence joins in one of two ways:
//! - [`BatchSession::add_with`] prefills its prompt at once, alone, and adds it to the batch;
//! - [`BatchSession::enqueue`] prefills it inside later [`BatchSession::step`] calls, one chunk
//!   per step (see `prefill.rs` for which joiners share a chunk), so running sequences keep
//!   getting a token every step while a long prompt joins.
//!
//! Every sequence keeps its own cache inside the batched cache, so batched greedy decode gives
//! each sequence exactly its single-decode tokens, whatever its neighbours' layouts. On CUDA a
//! batch whose tokens are all picked on the device decodes one step ahead of the host
//! (`ahead.rs`).

mod ahead;
mod mixed;
mod prefill;
mod sequence;

use std::time::Instant;

use candle_core::Tensor;

use super::logprobs::token_logprobs;
use super::types::{GenOptions, StepOutput};
use crate::error::{Error, Result};
use crate::generate::choose::choose_tokens;
use crate::kv::ModelCache;
use crate::model::Model;
use prefill::Joiner;
use sequence::{Picked, Sequence};

/// Identifies a sequence of a [`BatchSession`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub usize);

/// A finished sequence and its cache, handed back by [`BatchSession::take_finished`] (for a
/// prefix store) when the session keeps finished caches.
#[derive(Debug)]
pub struct Finished {
    /// The sequence.
    pub id: SeqId,
    /// The tokens whose K/V `cache` holds: the prompt and every generated token but the last
    /// (the last too where a step ahead ran it through the model: see
    /// [`GenOptions::lookahead`]).
    pub tokens: Vec<u32>,
    /// Its single-sequence cache.
    pub cache: ModelCache,
    /// The options it ran with (its cache layout among them).
    pub options: GenOptions,
}

/// Several sequences decoding as one batch.
#[derive(Debug)]
pub struct BatchSession<'m> {
    model: &'m Model,
    /// The options of [`BatchSession::add`] and [`BatchSession::add_with_max_tokens`].
    options: GenOptions,
    /// Batched cache, one entry per live sequence, in `live` order.
    cache: Option<ModelCache>,
    live: Vec<Sequence<'m>>,
    /// Sequences being prefilled by [`BatchSession::enqueue`], oldest first.
    joining: Vec<Joiner<'m>>,
    /// Steps produced at join time (the first token comes from the prefill logits).
    pending: Vec<(SeqId, StepOutput)>,
    finished: Vec<Finished>,
    failed: Vec<(SeqId, Error)>,
    keep_finished: bool,
    /// Most prompt tokens a joining sequence prefills per step.
    prefill_chunk: usize,
    next_id: usize,
    /// Copies of ids picked on the device (decoding one step ahead), made at first use.
    readback: Option<crate::kernels::ops::argmax::IdReadback>,
    /// Tokens picked on the device and not handed out yet (decoding one step ahead).
    ahead: Option<ahead::Ahead>,
    /// Seconds spent in batched decode forwards.
    pub decode_secs: f64,
    /// Seconds spent prefilling joining prompts.
    pub prefill_secs: f64,
}

impl<'m> BatchSession<'m> {
    /// An empty batch. `options` serve [`BatchSession::add`] and
    /// [`BatchSession::add_with_max_tokens`] (each such sequence gets its own sampler, seeded
    /// with `options.sampling.seed + id`); [`BatchSession::add_with`] and
    /// [`BatchSession::enqueue`] take each sequence's own options. Joining prompts prefill
    /// `options.prefill_chunk` tokens per step ([`crate::PREFILL_CHUNK`] when `None`).
    pub fn new(model: &'m Model, options: GenOptions) -> Self {
        let prefill_chunk = options.prefill_chunk.unwrap_or(crate::PREFILL_CHUNK).max(1);
        Self {
            model,
            options,
            cache: None,
            live: Vec::new(),
            joining: Vec::new(),
            pending: Vec::new(),
            finished: Vec::new(),
            failed: Vec::new(),
            keep_finished: false,
            prefill_chunk,
            next_id: 0,
            readback: None,
            ahead: None,
            decode_secs: 0.0,
            prefill_secs: 0.0,
        }
    }

    /// Sets how many prompt tokens joining sequences prefill per step (at least 1).
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// Whether finished sequences hand their cache to [`BatchSession::take_finished`] (off by
    /// default: a finished sequence's cache is freed at once). When on, the caller must take
    /// them, or they stay in memory.
    pub fn set_keep_finished(&mut self, keep: bool) {
        self.keep_finished = keep;
    }

    /// Live (decoding) sequences.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Sequences still being prefilled by [`BatchSession::enqueue`].
    pub fn joining(&self) -> usize {
        self.joining.len()
    }

    /// Whether no sequence is live or joining and no step is pending.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty() && self.joining.is_empty() && self.pending.is_empty()
    }

    /// KV bytes of the batch cache and of the joining sequences' caches.
    pub fn kv_bytes(&self) -> usize {
        let joining: usize = self
            .joining
            .iter()
            .filter_map(|j| j.cache.as_ref())
            .map(ModelCache::memory_bytes)
            .sum();
        self.cache.as_ref().map_or(0, |c| c.memory_bytes()) + joining
    }

    /// Prefills `prompt` alone, samples its first token, and adds it to the batch, with the
    /// session's options.
    ///
    /// # Errors
    /// Invalid options or prompt, cache errors.
    pub fn add(&mut self, prompt: &[u32]) -> Result<SeqId> {
        self.add_with_max_tokens(prompt, self.options.max_tokens)
    }

    /// As [`BatchSession::add`], with this sequence's own token budget. A budget of 0 adds
    /// nothing and returns an id that never produces a step.
    ///
    /// # Errors
    /// Invalid options or prompt, cache errors.
    pub fn add_with_max_tokens(&mut self, prompt: &[u32], max_tokens: usize) -> Result<SeqId> {
        let mut options = self.options.clone();
        options.max_tokens = max_tokens;
        options.sampling.seed = options.sampling.seed.wrapping_add(self.next_id as u64);
        if max_tokens == 0 {
            check_prompt(self.model, prompt)?;
            return Ok(self.new_id());
        }
        self.add_with(prompt, options)
    }

    /// Prefills `prompt` alone (in chunks of `options.prefill_chunk`), samples its first token,
    /// and adds it to the batch with its own `options`: sampling (the seed as given), token
    /// budget, stops, EOS handling and cache layout.
    ///
    /// # Errors
    /// [`Error::InvalidOption`]; an empty prompt, ids outside the vocabulary, a prompt longer
    /// than the context; cache errors.
    pub fn add_with(&mut self, prompt: &[u32], options: GenOptions) -> Result<SeqId> {
        options.validate()?;
        check_prompt(self.model, prompt)?;
        let started = Instant::now();
        let mut single = self.model.new_cache(&options.cache)?;
        let chunk = options.prefill_chunk.unwrap_or(prompt.len()).max(1);
        let mut logits = None;
        for piece in prompt.chunks(chunk) {
            logits = Some(self.model.forward(&[piece.to_vec()], &mut single)?);
        }
        let id = self.new_id();
        let mut seq = Sequence::new(self.model, id, prompt, options)?;
        self.prefill_secs += started.elapsed().as_secs_f64();
        let logits = logits.ok_or_else(|| Error::Input("the prompt is empty".to_string()))?;
        let token = pick_tokens(&logits, std::slice::from_mut(&mut seq))?
            .pop()
            .ok_or_else(|| Error::Input("no token picked".to_string()))?;
        self.join(seq, single, token)?;
        Ok(id)
    }

    /// Queues `prompt` with its own `options`; it is prefilled chunk by chunk inside later
    /// [`BatchSession::step`] calls and decodes with the batch from the step after its last
    /// chunk (its first token comes with that last chunk's step). `prefix`, a single-sequence
    /// cache of the same layout already holding the first `n < prompt.len()` prompt tokens
    /// (from a prefix store), is used as the sequence's cache: only the rest is prefilled.
    ///
    /// # Errors
    /// As [`BatchSession::add_with`]; [`Error::Input`] when `prefix` does not hold exactly `n`
    /// tokens of one sequence or `n >= prompt.len()`.
    pub fn enqueue(
        &mut self,
        prompt: Vec<u32>,
        options: GenOptions,
        prefix: Option<(ModelCache, usize)>,
    ) -> Result<SeqId> {
        options.validate()?;
        check_prompt(self.model, &prompt)?;
        let (cache, done) = match prefix {
            Some((cache, n)) => {
                if cache.is_batched() || cache.offsets() != [n] || n >= prompt.len() {
                    return Err(Error::Input(format!(
                        "a prefix cache must hold the first n < {} prompt tokens of one \
                         sequence; it holds {:?} for n = {n}",
                        prompt.len(),
                        cache.offsets()
                    )));
                }
                (cache, n)
            }
            None => (self.model.new_cache(&options.cache)?, 0),
        };
        let id = self.new_id();
        self.joining.push(Joiner {
            seq: Sequence::new(self.model, id, &prompt, options)?,
            done,
            cache: Some(cache),
        });
        Ok(id)
    }

    /// Removes sequence `id` (live, joining, or with a pending step) and frees its cache.
    /// Returns whether it was found.
    ///
    /// # Errors
    /// Cache errors while taking the sequence out of the batch.
    pub fn cancel(&mut self, id: SeqId) -> Result<bool> {
        let had_pending = self.pending.iter().any(|(s, _)| *s == id);
        self.pending.retain(|(s, _)| *s != id);
        if let Some(i) = self.joining.iter().position(|j| j.seq.id == id) {
            self.joining.remove(i);
            return Ok(true);
        }
        if let Some(i) = self.live.iter().position(|s| s.id == id) {
            self.live.remove(i);
            if let Some(cache) = self.cache.as_mut() {
                cache.remove_sequence(i)?;
            }
            if self.live.is_empty() {
                self.cache = None;
            }
            return Ok(true);
        }
        Ok(had_pending)
    }

    /// Finished sequences with their caches (only while [`BatchSession::set_keep_finished`]
    /// is on), in the order they finished.
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Joining sequences whose prefill failed (they left the session), with the error.
    pub fn take_failed(&mut self) -> Vec<(SeqId, Error)> {
        std::mem::take(&mut self.failed)
    }

    /// Advances every live sequence by one token and prefills at most one chunk of the joining
    /// ones (a sequence whose last chunk ran gets its first token in this step and decodes from
    /// the next). Returns the new steps (plus those of sequences added since the last call).
    /// Finished sequences leave the batch.
    ///
    /// # Errors
    /// Cache or model errors of the batched decode (a failing prefill chunk only drops its
    /// joiners: see [`BatchSession::take_failed`]).
    pub fn step(&mut self) -> Result<Vec<(SeqId, StepOutput)>> {
        self.step_with(&mut |_: &[u32], _: &GenOptions, _: &ModelCache| {})
    }

    /// As [`BatchSession::step`], calling `on_prefilled(prompt, options, cache)` for every
    /// joining sequence whose prompt this step completes, with its single-sequence cache
    /// holding exactly the prompt's K/V, before the sequence enters the batch: the one point
    /// where that state exists alone (a prefix store keeps a checkpoint of it there; the
    /// sequence's decode then moves its sliding-window rings past the prompt).
    ///
    /// # Errors
    /// As [`BatchSession::step`].
    pub fn step_with(
        &mut self,
        on_prefilled: &mut dyn FnMut(&[u32], &GenOptions, &ModelCache),
    ) -> Result<Vec<(SeqId, StepOutput)>> {
        let mut out = std::mem::take(&mut self.pending);
        if !self.live.is_empty() {
            self.decode(&mut out)?;
        }
        if !self.joining.is_empty() {
            self.prefill_chunk_step(&mut out, on_prefilled)?;
        }
        Ok(out)
    }

    /// Runs until every sequence has finished; returns each sequence's tokens by id.
    ///
    /// # Errors
    /// As [`BatchSession::step`].
    pub fn run_to_end(&mut self) -> Result<Vec<(SeqId, Vec<u32>, String)>> {
        let mut results: Vec<(SeqId, Vec<u32>, String)> = Vec::new();
        while !self.is_empty() {
            for (id, step) in self.step()? {
                match results.iter_mut().find(|r| r.0 == id) {
                    Some(r) => {
                        r.1.push(step.token);
                        r.2.push_str(&step.text);
                    }
                    None => results.push((id, vec![step.token], step.text)),
                }
            }
        }
        results.sort_by_key(|r| r.0);
        Ok(results)
    }

    fn new_id(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        id
    }

    /// One prefill chunk for the joining sequences that share it; those whose prompt is then
    /// complete sample their first token and join the batch.
    fn prefill_chunk_step(
        &mut self,
        out: &mut Vec<(SeqId, StepOutput)>,
        on_prefilled: &mut dyn FnMut(&[u32], &GenOptions, &ModelCache),
    ) -> Result<()> {
        let started = Instant::now();
        let (group, len) = prefill::pick_group(&self.joining, self.prefill_chunk);
        let logits = match prefill::prefill_group(self.model, &mut self.joining, &group, len) {
            Ok(l) => l,
            Err(e) => {
                for &i in group.iter().rev() {
                    let j = self.joining.remove(i);
                    let err = if i == group[0] {
                        e.to_string()
                    } else {
                        format!("prefill failed with its chunk group: {e}")
                    };
                    self.failed.push((j.seq.id, Error::Input(err)));
                }
                self.prefill_secs += started.elapsed().as_secs_f64();
                return Ok(());
            }
        };
        // Joiners whose prompt is complete leave `joining` (in their order) with their row.
        let mut complete = Vec::new();
        for (row, &i) in group.iter().enumerate().rev() {
            if self.joining[i].complete() {
                complete.push((row, self.joining.remove(i)));
            }
        }
        for (row, mut j) in complete.into_iter().rev() {
            let row_logits = logits.narrow(0, row, 1)?;
            let token = pick_tokens(&row_logits, std::slice::from_mut(&mut j.seq))?
                .pop()
                .ok_or_else(|| Error::Input("no token picked".to_string()))?;
            let cache = j
                .cache
                .take()
                .ok_or_else(|| Error::Input("a joining sequence lost its cache".to_string()))?;
            on_prefilled(&j.seq.history[..j.seq.prompt_len], &j.seq.options, &cache);
            self.join(j.seq, cache, token)?;
            // `join` queued the first step; it belongs to this step's output.
            out.append(&mut self.pending);
        }
        self.prefill_secs += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Emits a prefilled sequence's first token (a pending step) and adds it to the batch, or
    /// retires it when that token already ends it.
    fn join(&mut self, mut seq: Sequence<'m>, cache: ModelCache, token: Picked) -> Result<()> {
        let step = seq.emit(token)?;
        let finished = step.finish.is_some();
        self.pending.push((seq.id, step));
        if finished {
            self.retire(seq, cache);
        } else {
            mixed::push(&mut self.cache, cache)?;
            self.live.push(seq);
        }
        Ok(())
    }

    /// A finished sequence leaves: its cache is kept for [`BatchSession::take_finished`] or
    /// dropped.
    fn retire(&mut self, seq: Sequence<'m>, cache: ModelCache) {
        if self.keep_finished {
            self.finished.push(Finished {
                id: seq.id,
                tokens: seq.cached_tokens().to_vec(),
                cache,
                options: seq.options,
            });
        }
    }
}

/// Checks a prompt before any forward: not empty, every id inside the vocabulary, not longer
/// than the context.
fn check_prompt(model: &Model, prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::Input("the prompt is empty".to_string()));
    }
    let vocab_size = model.config().vocab_size;
    if let Some((position, &id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab_size)
    {
        return Err(Error::TokenOutOfVocab {
            id,
            position,
            vocab_size,
        });
    }
    let max = model.config().max_position_embeddings;
    if prompt.len() > max {
        return Err(Error::ContextTooLong {
            length: prompt.len(),
            max,
        });
    }
    Ok(())
}

/// The next token of each sequence from `logits` (`[seqs.len(), vocab]`), each row chosen as
/// its sampler allows ([`crate::generate::choose`]: on the device where it can, that row
/// alone copied to the host where not). Sequences whose options ask for log-probabilities get
/// them with their token.
fn pick_tokens(logits: &Tensor, seqs: &mut [Sequence<'_>]) -> Result<Vec<Picked>> {
    let tokens = choose_tokens(logits, seqs)?;
    let Some(top) = seqs.iter().filter_map(|s| s.options.logprobs).max() else {
        return Ok(tokens
            .into_iter()
            .map(|token| Picked {
                token,
                logprobs: None,
            })
            .collect());
    };
    let lps = token_logprobs(logits, &tokens, top)?;
    Ok(seqs
        .iter()
        .zip(tokens.into_iter().zip(lps))
        .map(|(s, (token, mut lp))| Picked {
            token,
            logprobs: s.options.logprobs.map(|n| {
                lp.top.truncate(n);
                lp
            }),
        })
        .collect())
}
