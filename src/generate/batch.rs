//! Continuous batching: sequences of different lengths decode together, each with its own
//! positions, sampler and stop conditions; new sequences join between steps and finished ones
//! leave. A joining prompt is prefilled alone (in a single-sequence cache of the same layout)
//! and then added to the batch, so batched greedy decode gives exactly single decode's tokens.

use std::time::Instant;

use super::detok::StreamDecoder;
use super::sampling::Sampler;
use super::stop::StopStrings;
use super::types::{FinishReason, GenOptions, StepOutput};
use crate::error::{Error, Result};
use crate::kv::ModelCache;
use crate::model::Model;

/// Identifies a sequence of a [`BatchSession`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub usize);

#[derive(Debug)]
struct Sequence<'m> {
    id: SeqId,
    sampler: Sampler,
    decoder: Option<StreamDecoder<'m>>,
    stops: StopStrings,
    history: Vec<u32>,
    /// The token sampled last, fed at the next step.
    last: u32,
    generated: usize,
    max_tokens: usize,
    eos: Vec<u32>,
}

/// Several sequences decoding as one batch.
#[derive(Debug)]
pub struct BatchSession<'m> {
    model: &'m Model,
    options: GenOptions,
    /// Batched cache, one entry per live sequence, in `live` order.
    cache: Option<ModelCache>,
    live: Vec<Sequence<'m>>,
    /// Steps produced at join time (the first token comes from the prefill logits).
    pending: Vec<(SeqId, StepOutput)>,
    next_id: usize,
    /// Seconds spent in batched decode forwards.
    pub decode_secs: f64,
    /// Seconds spent prefilling joining prompts.
    pub prefill_secs: f64,
}

impl<'m> BatchSession<'m> {
    /// An empty batch; every sequence uses `options` (each gets its own sampler, seeded with
    /// `options.sampling.seed + id`).
    pub fn new(model: &'m Model, options: GenOptions) -> Self {
        Self {
            model,
            options,
            cache: None,
            live: Vec::new(),
            pending: Vec::new(),
            next_id: 0,
            decode_secs: 0.0,
            prefill_secs: 0.0,
        }
    }

    /// Live sequences.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no sequence is live and no step is pending.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty() && self.pending.is_empty()
    }

    /// KV bytes of the batch cache.
    pub fn kv_bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.memory_bytes())
    }

    /// Prefills `prompt` alone, samples its first token, and adds it to the batch.
    ///
    /// # Errors
    /// Invalid prompt, cache errors.
    pub fn add(&mut self, prompt: &[u32]) -> Result<SeqId> {
        self.add_with_max_tokens(prompt, self.options.max_tokens)
    }

    /// As [`BatchSession::add`], with this sequence's own token budget (sequences of one batch
    /// share the cache layout and sampling options, not their lengths).
    ///
    /// # Errors
    /// Invalid prompt, cache errors.
    pub fn add_with_max_tokens(&mut self, prompt: &[u32], max_tokens: usize) -> Result<SeqId> {
        if prompt.is_empty() {
            return Err(Error::Input("the prompt is empty".to_string()));
        }
        let started = Instant::now();
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let mut single = self.model.new_cache(&self.options.cache)?;
        let chunk = self.options.prefill_chunk.unwrap_or(prompt.len()).max(1);
        let mut logits = Vec::new();
        for piece in prompt.chunks(chunk) {
            logits = self
                .model
                .forward(&[piece.to_vec()], &mut single)?
                .squeeze(0)?
                .to_vec1::<f32>()?;
        }
        let mut sampling = self.options.sampling.clone();
        sampling.seed = sampling.seed.wrapping_add(id.0 as u64);
        let mut eos = if self.options.ignore_eos {
            Vec::new()
        } else {
            self.model.config().eos_token_ids.clone()
        };
        eos.extend(&self.options.extra_eos);
        let mut seq = Sequence {
            id,
            sampler: Sampler::new(sampling),
            decoder: self
                .model
                .tokenizer()
                .map(|t| StreamDecoder::new(t, self.options.skip_special_tokens)),
            stops: StopStrings::new(self.options.stop_strings.iter().cloned()),
            history: prompt.to_vec(),
            last: 0,
            generated: 0,
            max_tokens,
            eos,
        };
        self.prefill_secs += started.elapsed().as_secs_f64();
        if seq.max_tokens == 0 {
            return Ok(id);
        }
        let step = seq.emit(&logits)?;
        let finished = step.finish.is_some();
        self.pending.push((id, step));
        if !finished {
            match self.cache.as_mut() {
                Some(c) => c.push_sequence(single)?,
                None => self.cache = Some(ModelCache::batch(vec![single])?),
            }
            self.live.push(seq);
        }
        Ok(id)
    }

    /// Advances every live sequence by one token and returns the new steps (plus the first
    /// steps of sequences that joined since the last call). Finished sequences leave the batch.
    ///
    /// # Errors
    /// Cache or model errors.
    pub fn step(&mut self) -> Result<Vec<(SeqId, StepOutput)>> {
        let mut out = std::mem::take(&mut self.pending);
        if self.live.is_empty() {
            return Ok(out);
        }
        let started = Instant::now();
        let cache = self
            .cache
            .as_mut()
            .ok_or_else(|| Error::Input("live sequences without a batch cache".to_string()))?;
        let batch: Vec<Vec<u32>> = self.live.iter().map(|s| vec![s.last]).collect();
        let logits = self.model.forward(&batch, cache)?.to_vec2::<f32>()?;
        let mut finished = Vec::new();
        for (i, (seq, row)) in self.live.iter_mut().zip(logits).enumerate() {
            let step = seq.emit(&row)?;
            if step.finish.is_some() {
                finished.push(i);
            }
            out.push((seq.id, step));
        }
        for &i in finished.iter().rev() {
            self.live.remove(i);
            cache.remove_sequence(i)?;
        }
        if self.live.is_empty() {
            self.cache = None;
        }
        self.decode_secs += started.elapsed().as_secs_f64();
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
}

impl Sequence<'_> {
    /// Samples the next token from `logits` and turns it into a step.
    fn emit(&mut self, logits: &[f32]) -> Result<StepOutput> {
        let token = self.sampler.sample(logits, &self.history);
        self.history.push(token);
        self.last = token;
        self.generated += 1;
        let mut finish = self
            .eos
            .contains(&token)
            .then_some(FinishReason::Eos(token));
        let mut text = String::new();
        if let Some(d) = self.decoder.as_mut() {
            let piece = d.push(token)?.unwrap_or_default();
            let o = self.stops.push(&piece);
            text = o.text;
            if let (None, Some(i)) = (finish, o.matched) {
                finish = Some(FinishReason::Stop(i));
            }
        }
        if finish.is_none() && self.generated >= self.max_tokens {
            finish = Some(FinishReason::Length);
        }
        if matches!(
            finish,
            Some(FinishReason::Eos(_)) | Some(FinishReason::Length)
        ) {
            if let Some(d) = self.decoder.as_mut() {
                let tail = d.finish()?.unwrap_or_default();
                text.push_str(&self.stops.push(&tail).text);
            }
            text.push_str(&self.stops.finish());
        }
        Ok(StepOutput {
            token,
            text,
            finish,
        })
    }
}
