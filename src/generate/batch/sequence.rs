//! One sequence of a batch: its options, sampler, detokenizer, stop strings and history, and
//! how a chosen token becomes a [`StepOutput`].

use crate::error::Result;
use crate::generate::detok::StreamDecoder;
use crate::generate::sampling::Sampler;
use crate::generate::stop::StopStrings;
use crate::generate::types::{FinishReason, GenOptions, StepOutput, TokenLogprobs};
use crate::model::Model;

use super::SeqId;

/// A sequence's next token and, where its options ask, its log-probabilities.
#[derive(Debug)]
pub(super) struct Picked {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// The per-sequence state of a [`super::BatchSession`].
#[derive(Debug)]
pub(super) struct Sequence<'m> {
    pub id: SeqId,
    /// The options this sequence was added with (its own sampling, stops, cache layout).
    pub options: GenOptions,
    sampler: Sampler,
    decoder: Option<StreamDecoder<'m>>,
    stops: StopStrings,
    /// Prompt, then every generated token.
    pub history: Vec<u32>,
    /// Tokens of the prompt.
    pub prompt_len: usize,
    /// The token sampled last, fed at the next step (unless `last_forwarded`).
    pub last: u32,
    /// Whether a step ahead already ran `last` through the model (decoding one step ahead).
    pub last_forwarded: bool,
    generated: usize,
    max_tokens: usize,
    eos: Vec<u32>,
}

impl<'m> Sequence<'m> {
    /// A sequence about to generate after `prompt`, sampling with `options.sampling` as given
    /// (seed included) and stopping after `max_tokens`.
    pub fn new(model: &'m Model, id: SeqId, prompt: &[u32], options: GenOptions) -> Self {
        let mut eos = if options.ignore_eos {
            Vec::new()
        } else {
            model.config().eos_token_ids.clone()
        };
        eos.extend(&options.extra_eos);
        // The last token generated is never fed: a prompt of `p` tokens leaves room for
        // `max_position_embeddings + 1 - p` of them before the context is full.
        let room = (model.config().max_position_embeddings + 1)
            .saturating_sub(prompt.len())
            .max(1);
        Self {
            id,
            sampler: Sampler::new(options.sampling.clone()),
            decoder: model
                .tokenizer()
                .map(|t| StreamDecoder::new(t, options.skip_special_tokens)),
            stops: StopStrings::new(options.stop_strings.iter().cloned()),
            history: prompt.to_vec(),
            prompt_len: prompt.len(),
            last: 0,
            last_forwarded: false,
            generated: 0,
            max_tokens: options.max_tokens.min(room),
            eos,
            options,
        }
    }

    /// Whether the next token is a plain argmax of the logits, which may then be taken where
    /// the logits live.
    pub fn is_plain_greedy(&self) -> bool {
        self.sampler.is_plain_greedy()
    }

    /// Chooses the next token from `logits` (`[vocab]`).
    pub fn choose(&mut self, logits: &[f32]) -> u32 {
        self.sampler.sample(logits, &self.history)
    }

    /// How many of its row's best logits the sampler needs, and the temperature that ranks
    /// them ([`crate::generate::sampling::Sampler::best_needed`]); `None`: the whole row.
    pub fn best_needed(&self) -> Option<(usize, f32)> {
        self.sampler.best_needed(&self.history)
    }

    /// The draw a device may make over this sequence's whole row
    /// ([`crate::generate::sampling::Sampler::device_draw`]); `None`: another way.
    pub fn device_draw(&self) -> Option<crate::generate::sampling::DeviceDraw> {
        self.sampler.device_draw(&self.history)
    }

    /// Takes the token a device drew as [`Sequence::device_draw`] asked.
    pub fn accept_device_draw(&mut self, token: u32) -> u32 {
        self.sampler.accept_device_draw(token);
        token
    }

    /// The temperature ranking the best logits its top-p or min-p filter without a top-k needs
    /// ([`crate::generate::sampling::Sampler::nucleus_needed`]); `None`: another way.
    pub fn nucleus_needed(&self) -> Option<f32> {
        self.sampler.nucleus_needed(&self.history)
    }

    /// Draws from its row's best pairs and softmax mass where the filters' cut lies among them
    /// ([`crate::generate::sampling::Sampler::sample_from_nucleus`]); `None`: read the row.
    pub fn choose_from_nucleus(
        &mut self,
        best: &[(u32, f32)],
        mass: f64,
        row_len: usize,
    ) -> Option<u32> {
        self.sampler.sample_from_nucleus(best, mass, row_len)
    }

    /// Chooses the next token from its row's best `(id, logit)` pairs
    /// ([`crate::generate::sampling::Sampler::sample_from_best`]).
    pub fn choose_from_best(&mut self, best: &[(u32, f32)]) -> u32 {
        self.sampler.sample_from_best(best, &self.history)
    }

    /// Records `token` (the one [`Picked`] names) as the next one and turns it into a step
    /// (text, finish, its log-probabilities where asked).
    pub fn emit(&mut self, picked: Picked) -> Result<StepOutput> {
        let Picked { token, logprobs } = picked;
        self.history.push(token);
        self.last = token;
        self.last_forwarded = false;
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
            logprobs,
        })
    }

    /// Whether this sequence may decode one step ahead of the host: its options allow it, it
    /// asks for no log-probabilities, and its token is picked on the device (plain greedy
    /// decoding, or a draw the device makes).
    pub fn runs_ahead(&self) -> bool {
        self.options.lookahead
            && self.options.logprobs.is_none()
            && (self.is_plain_greedy() || self.sampler.device_draw(&self.history).is_some())
    }

    /// Whether the sequence wants another token after the next one (its budget allows two
    /// more): only then may a step ahead run the next one through the model.
    pub fn wants_more_after_next(&self) -> bool {
        self.generated + 1 < self.max_tokens
    }

    /// The tokens whose K/V the sequence's cache holds: the prompt and every generated token
    /// but the last (which was sampled, never fed), unless a step ahead fed that one too.
    pub fn cached_tokens(&self) -> &[u32] {
        let held = if self.generated > 0 && !self.last_forwarded {
            self.history.len() - 1
        } else {
            self.history.len()
        };
        &self.history[..held]
    }
}
