//! The single-sequence generator. It keeps its cache between calls: a new prompt that shares a
//! prefix with the tokens already cached prefills only the rest (multi-turn chat).

use std::path::Path;
use std::time::Instant;

use super::choose::{accept_device_pick, choose_tokens, device_pick, SamplerRow};
use super::constraint::TokenConstraint;
use super::detok::StreamDecoder;
use super::logprobs::token_logprobs;
use super::lookahead::Lookahead;
use super::sampling::Sampler;
use super::stop::StopStrings;
use super::types::{FinishReason, GenOptions, Output, Stats, StepOutput};
use crate::error::{Error, Result};
use crate::kv::{CacheConfig, CacheMeta, ModelCache, PromptCache};
use crate::model::Model;

/// Generates from one prompt at a time, reusing its cache across calls.
#[derive(Debug)]
pub struct Generator<'m> {
    model: &'m Model,
    options: GenOptions,
    /// The cache and the tokens whose K/V it holds, in order.
    cache: Option<ModelCache>,
    /// The layout `cache` was built with.
    cache_layout: CacheConfig,
    cached_tokens: Vec<u32>,
}

impl<'m> Generator<'m> {
    /// A generator over `model`.
    pub fn new(model: &'m Model, options: GenOptions) -> Self {
        Self {
            model,
            options,
            cache: None,
            cache_layout: CacheConfig::default(),
            cached_tokens: Vec::new(),
        }
    }

    /// The options; changes apply to the next call (a different cache layout starts a new
    /// cache).
    pub fn options_mut(&mut self) -> &mut GenOptions {
        &mut self.options
    }

    /// The current cache, if a generation ran.
    pub fn cache(&self) -> Option<&ModelCache> {
        self.cache.as_ref()
    }

    /// The tokens whose K/V the cache holds.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached_tokens
    }

    /// Forgets the cache.
    pub fn reset(&mut self) {
        self.cache = None;
        self.cached_tokens.clear();
    }

    /// What a prompt cache made by this generator records about it.
    ///
    /// # Errors
    /// Invalid cache options.
    pub fn cache_meta(&self) -> Result<CacheMeta> {
        Ok(CacheMeta::new(
            &self.options.cache,
            &self.model.text_model().cache_specs(),
            self.model.dtype(),
            self.model.fingerprint(),
        )?)
    }

    /// Writes the cache and its tokens to `path` (one safetensors file).
    ///
    /// # Errors
    /// No generation ran yet, or the file cannot be written.
    pub fn save_prompt_cache(&self, path: &Path) -> Result<()> {
        let cache = self
            .cache
            .as_ref()
            .ok_or_else(|| Error::Input("nothing to save: no generation ran yet".to_string()))?;
        let pc = PromptCache {
            tokens: self.cached_tokens.clone(),
            cache: cache.deep_clone()?,
            meta: self.cache_meta()?,
        };
        Ok(pc.save(path)?)
    }

    /// Restores a cache saved by [`Generator::save_prompt_cache`]; the next prompt reuses its
    /// longest common prefix.
    ///
    /// # Errors
    /// A file made with another cache layout, bit width, group size, dtype or checkpoint
    /// ([`crate::kv::CacheError::Mismatch`] naming what differs), or an unreadable file.
    pub fn load_prompt_cache(&mut self, path: &Path) -> Result<()> {
        let pc = PromptCache::load(path, self.model.device())?;
        pc.restore_check(&self.cache_meta()?)?;
        self.cached_tokens = pc.tokens;
        self.cache = Some(pc.cache);
        self.cache_layout = self.options.cache;
        Ok(())
    }

    /// Generates to the end and returns the whole output.
    ///
    /// # Errors
    /// Invalid options, invalid prompt ids, a prompt longer than the context, cache errors.
    pub fn generate(&mut self, prompt: &[u32]) -> Result<Output> {
        let mut stream = self.stream(prompt)?;
        let mut tokens = Vec::new();
        let mut text = String::new();
        let mut finish = FinishReason::Length;
        for step in stream.by_ref() {
            let step = step?;
            tokens.push(step.token);
            text.push_str(&step.text);
            if let Some(f) = step.finish {
                finish = f;
            }
        }
        Ok(Output {
            tokens,
            text,
            finish,
            stats: stream.stats(),
        })
    }

    /// Prefills `prompt` (reusing the cached prefix) and returns an iterator over the generated
    /// tokens, each handed out as soon as it is made.
    ///
    /// # Errors
    /// Invalid options ([`GenOptions::validate`]), an empty prompt, invalid ids, a prompt
    /// longer than the context, cache errors, a constraint that cannot run
    /// ([`Error::Constraint`]).
    pub fn stream(&mut self, prompt: &[u32]) -> Result<Stream<'_, 'm>> {
        self.options.validate()?;
        if prompt.is_empty() {
            return Err(Error::Input("the prompt is empty".to_string()));
        }
        // Before the prefill: a constraint that does not compile costs no forward pass.
        let constraint = self
            .options
            .constraint
            .as_ref()
            .map(|c| self.model.constraint(c))
            .transpose()?;
        let started = Instant::now();
        let reused = self.reuse_prefix(prompt)?;
        let mut cache = match self.cache.take() {
            Some(c) => c,
            None => {
                self.cache_layout = self.options.cache;
                self.model.new_cache(&self.options.cache)?
            }
        };
        let rest = &prompt[reused..];
        let chunk = self.options.prefill_chunk.unwrap_or(rest.len()).max(1);
        let mut logits = None;
        for piece in rest.chunks(chunk) {
            let out = self.model.forward(&[piece.to_vec()], &mut cache);
            match out {
                Ok(l) => logits = Some(l.squeeze(0)?),
                Err(e) => {
                    self.cached_tokens.clear();
                    return Err(e);
                }
            }
        }
        self.cache = Some(cache);
        self.cached_tokens = prompt.to_vec();
        let stats = Stats {
            prompt_tokens: prompt.len(),
            prefilled_tokens: rest.len(),
            prefill_secs: started.elapsed().as_secs_f64(),
            ..Stats::default()
        };
        let model = self.model;
        let options = self.options.clone();
        let mut eos = if options.ignore_eos {
            Vec::new()
        } else {
            model.config().eos_token_ids.clone()
        };
        eos.extend(&options.extra_eos);
        let sampler = Sampler::new(options.sampling.clone());
        let lookahead = match (&logits, device_pick(&sampler, prompt)) {
            (Some(l), Some(draw))
                if options.lookahead && options.logprobs.is_none() && constraint.is_none() =>
            {
                Lookahead::start(model, l, options.max_tokens, draw)?
            }
            _ => None,
        };
        Ok(Stream {
            lookahead,
            constraint,
            logprobs: options.logprobs,
            sampler,
            decoder: model
                .tokenizer()
                .map(|t| StreamDecoder::new(t, options.skip_special_tokens)),
            stops: StopStrings::new(options.stop_strings.iter().cloned()),
            history: prompt.to_vec(),
            logits: match logits {
                Some(l) => l,
                None => candle_core::Tensor::zeros(
                    0,
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )?,
            },
            eos,
            max_tokens: options.max_tokens,
            generated: 0,
            done: options.max_tokens == 0,
            stats,
            decode_started: None,
            generator: self,
        })
    }

    /// The model and the cache of the generation under way.
    fn model_and_cache(&mut self) -> Result<(&'m Model, &mut ModelCache)> {
        let cache = self.cache.as_mut().ok_or_else(|| {
            Error::Input("the generator's cache was reset mid-stream".to_string())
        })?;
        Ok((self.model, cache))
    }

    /// Keeps the longest cached prefix of `prompt` (at least one prompt token is always left to
    /// prefill, so there are logits to sample from). Returns how many tokens are reused.
    fn reuse_prefix(&mut self, prompt: &[u32]) -> Result<usize> {
        let Some(cache) = self.cache.as_mut() else {
            return Ok(0);
        };
        if self.cache_layout != self.options.cache || cache.batch_size() != 1 {
            self.reset();
            return Ok(0);
        }
        let common = self
            .cached_tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        let drop = cache
            .offsets()
            .first()
            .copied()
            .unwrap_or(0)
            .saturating_sub(common);
        if common == 0 || cache.trim(drop).is_err() {
            // A ring buffer that wrapped cannot roll back: start over rather than attend to
            // keys of another prompt.
            self.reset();
            return Ok(0);
        }
        self.cached_tokens.truncate(common);
        Ok(common)
    }
}

/// The tokens of one generation, produced lazily. Dropping it early leaves the cache holding
/// the prompt and every token generated so far.
#[derive(Debug)]
pub struct Stream<'g, 'm> {
    generator: &'g mut Generator<'m>,
    sampler: Sampler,
    decoder: Option<StreamDecoder<'m>>,
    stops: StopStrings,
    history: Vec<u32>,
    /// Logits of the next token, `[vocab]` f32 where the model left them.
    logits: candle_core::Tensor,
    eos: Vec<u32>,
    max_tokens: usize,
    generated: usize,
    done: bool,
    stats: Stats,
    decode_started: Option<Instant>,
    /// Greedy decoding one step ahead ([`GenOptions::lookahead`]), where it applies.
    lookahead: Option<Lookahead>,
    /// The output constraint ([`GenOptions::constraint`]).
    constraint: Option<TokenConstraint>,
    /// Alternatives reported with each token's log-probability ([`GenOptions::logprobs`]).
    logprobs: Option<usize>,
}

impl Stream<'_, '_> {
    /// Counters and timings so far.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.generated_tokens = self.generated;
        s.decode_secs = self
            .decode_started
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        s.kv_bytes = self
            .generator
            .cache
            .as_ref()
            .map_or(0, |c| c.memory_bytes());
        s
    }

    /// The next token from the current logits, chosen as the sampler allows
    /// ([`crate::generate::choose`]: on the device where it can, one id copied back; from the
    /// row's best logits picked there; or from the whole row copied to the host).
    fn pick(&mut self) -> Result<u32> {
        let rows = self.logits.unsqueeze(0)?;
        let mut row = [SamplerRow {
            sampler: &mut self.sampler,
            history: &self.history,
            constraint: self.constraint.as_mut(),
        }];
        let ids = choose_tokens(&rows, &mut row)?;
        ids.first()
            .copied()
            .ok_or_else(|| Error::Input("no token was chosen".to_string()))
    }

    fn next_step(&mut self) -> Result<Option<StepOutput>> {
        if self.done {
            return Ok(None);
        }
        let (token, forwarded) = match self.lookahead.as_mut() {
            Some(ahead) => {
                let (model, cache) = self.generator.model_and_cache()?;
                let next = ahead.next(model, cache)?;
                let mut row = SamplerRow {
                    sampler: &mut self.sampler,
                    history: &self.history,
                    constraint: None,
                };
                accept_device_pick(&mut row, next.token);
                (next.token, next.forwarded)
            }
            None => (self.pick()?, false),
        };
        // Lookahead (which keeps no logits) is off whenever logprobs are asked for.
        let logprobs = match self.logprobs {
            Some(n) if self.lookahead.is_none() => {
                token_logprobs(&self.logits.unsqueeze(0)?, &[token], n)?.pop()
            }
            _ => None,
        };
        if forwarded {
            self.generator.cached_tokens.push(token);
        }
        self.history.push(token);
        self.generated += 1;
        if self.decode_started.is_none() {
            self.decode_started = Some(Instant::now());
        }
        let mut finish = None;
        if self.eos.contains(&token) {
            finish = Some(FinishReason::Eos(token));
        }
        let mut text = String::new();
        if let Some(d) = self.decoder.as_mut() {
            let mut piece = d.push(token)?.unwrap_or_default();
            if finish.is_some() || self.generated >= self.max_tokens {
                piece.push_str(&d.finish()?.unwrap_or_default());
            }
            let out = self.stops.push(&piece);
            text = out.text;
            if let (None, Some(i)) = (finish, out.matched) {
                finish = Some(FinishReason::Stop(i));
            }
        }
        if finish.is_none() && self.generated >= self.max_tokens {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() && !matches!(finish, Some(FinishReason::Stop(_))) {
            text.push_str(&self.stops.finish());
        }
        if finish.is_some() {
            self.done = true;
        } else if !forwarded {
            let (model, cache) = self.generator.model_and_cache()?;
            let logits = model.forward(&[vec![token]], cache)?;
            self.generator.cached_tokens.push(token);
            self.logits = logits.squeeze(0)?;
        }
        Ok(Some(StepOutput {
            token,
            text,
            finish,
            logprobs,
        }))
    }
}

impl Iterator for Stream<'_, '_> {
    type Item = Result<StepOutput>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.next_step() {
            Ok(Some(s)) => Some(Ok(s)),
            Ok(None) => None,
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}
