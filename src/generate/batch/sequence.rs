//! One sequence of a batch: its options, sampler, detokenizer, stop strings and history, and
//! how a chosen token becomes a [`StepOutput`].

use crate::error::Result;
use crate::generate::choose::{device_pick, Chooser};
use crate::generate::constraint::TokenConstraint;
use crate::generate::detok::StreamDecoder;
use crate::generate::sampling::{DeviceDraw, Sampler};
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
    /// The output constraint ([`GenOptions::constraint`]).
    constraint: Option<TokenConstraint>,
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
    /// (seed included), held to `options.constraint`, and stopping after `max_tokens`.
    ///
    /// # Errors
    /// A constraint that cannot run ([`crate::Error::Constraint`]).
    pub fn new(model: &'m Model, id: SeqId, prompt: &[u32], options: GenOptions) -> Result<Self> {
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
        let constraint = options
            .constraint
            .as_ref()
            .map(|c| model.constraint(c))
            .transpose()?;
        Ok(Self {
            id,
            sampler: Sampler::new(options.sampling.clone()),
            constraint,
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
        })
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
    /// asks for no log-probabilities and has no output constraint, and its token is picked on
    /// the device ([`crate::generate::choose::device_pick`]).
    pub fn runs_ahead(&self) -> bool {
        self.options.lookahead
            && self.options.logprobs.is_none()
            && self.constraint.is_none()
            && self.device_pick().is_some()
    }

    /// How the device picks this sequence's next token, where it can
    /// ([`crate::generate::choose::device_pick`]).
    pub fn device_pick(&self) -> Option<Option<DeviceDraw>> {
        device_pick(&self.sampler, &self.history)
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

impl Chooser for Sequence<'_> {
    fn sampler(&self) -> &Sampler {
        &self.sampler
    }
    fn history(&self) -> &[u32] {
        &self.history
    }
    fn parts(&mut self) -> (&mut Sampler, &[u32]) {
        (&mut self.sampler, &self.history)
    }
    fn constraint(&mut self) -> Option<&mut TokenConstraint> {
        self.constraint.as_mut()
    }
}
