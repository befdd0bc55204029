//! Generation options, steps, outputs and statistics.

use super::SamplingOptions;

use crate::error::{Error, Result};
use crate::kv::{CacheConfig, CacheMode};

/// Options of one generation. `Default` is greedy, 256 tokens, the default cache layout.
#[derive(Debug, Clone)]
pub struct GenOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How the next token is chosen.
    pub sampling: SamplingOptions,
    /// Generation ends before any of these strings; the string itself is not emitted.
    pub stop_strings: Vec<String>,
    /// Keep going past EOS tokens (benchmarks).
    pub ignore_eos: bool,
    /// Extra ids that end generation, beside the checkpoint's EOS set.
    pub extra_eos: Vec<u32>,
    /// The KV cache layout of this generation.
    pub cache: CacheConfig,
    /// Prefill at most this many prompt tokens per forward (`None`: the whole prompt at once).
    pub prefill_chunk: Option<usize>,
    /// Leave special tokens (`<turn|>`, ...) out of the streamed text.
    pub skip_special_tokens: bool,
    /// Greedy decoding on CUDA runs one step ahead of the host (on by default), and so does
    /// tempered sampling without filters or penalties, which the device draws itself
    /// ([`crate::generate::sampling::Sampler::device_draw`]): each step takes its id from the
    /// previous step's pick on the device, and the host reads the id back while the next step
    /// runs, so the device does not wait for the host between steps. The tokens are the same
    /// either way. With it, a generation that ends on an EOS token or a stop string has also
    /// run that last token through the model, so the cache (and
    /// [`crate::Generator::cached_tokens`], or a [`crate::generate::Finished`]'s tokens) holds
    /// it too. A [`crate::generate::BatchSession`] runs ahead while every live sequence allows it and the
    /// batch stays as it is. Ignored for other sampling, with logprobs, on other devices and
    /// for checkpoints whose per-layer table is smaller than the vocabulary.
    pub lookahead: bool,
    /// Report each generated token's log-probability and those of the `n` most likely tokens
    /// at its step (`Some(n)`, `n` up to [`MAX_TOP_LOGPROBS`]) in [`StepOutput::logprobs`].
    /// They are the model's: the log-softmax of the logits, before temperature, penalties and
    /// filters (vLLM's default). Costs a reduction over each row a step; greedy decoding with
    /// it does not run ahead.
    pub logprobs: Option<usize>,
    /// Hold the output to a JSON schema, a JSON object, a regular expression or a Lark grammar
    /// ([`crate::generate::constraint`]): each step only tokens that can continue a valid
    /// output may be chosen, and the end-of-sequence tokens only once it is complete. Such a
    /// generation does not decode one step ahead.
    pub constraint: Option<super::Constraint>,
}

/// Most alternatives [`GenOptions::logprobs`] reports a token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Default for GenOptions {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            sampling: SamplingOptions::default(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            extra_eos: Vec::new(),
            cache: CacheConfig::default(),
            prefill_chunk: None,
            skip_special_tokens: true,
            lookahead: true,
            logprobs: None,
            constraint: None,
        }
    }
}

impl GenOptions {
    /// Checks every value: a temperature that is NaN, infinite or negative, `top_p` outside
    /// (0, 1], `min_p` outside [0, 1], a repetition penalty that is not a positive finite
    /// number, frequency or presence penalties outside [-2, 2] (OpenAI's range),
    /// `max_tokens == 0`, `prefill_chunk == Some(0)`, `logprobs` above
    /// [`MAX_TOP_LOGPROBS`] and a quantized cache whose group
    /// size is not 32, 64 or 128 are rejected. (The [`Sampler`](super::Sampler) itself stays
    /// lenient and treats such values as "filter off"; this is the check for values that come
    /// from users.) Whether the group size divides the model's head dimension is checked when
    /// the cache is built.
    ///
    /// ```
    /// use candle_gemma::{Error, GenOptions};
    /// let mut o = GenOptions::default();
    /// o.sampling.top_p = Some(2.0);
    /// assert!(matches!(o.validate(), Err(Error::InvalidOption { field: "top_p", .. })));
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidOption`] naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, reason: String| Err(Error::InvalidOption { field, reason });
        let s = &self.sampling;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return bad(
                "temperature",
                format!("must be a finite number >= 0, got {}", s.temperature),
            );
        }
        if let Some(p) = s.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad("top_p", format!("must be in (0, 1], got {p}"));
            }
        }
        if let Some(p) = s.min_p {
            if !(0.0..=1.0).contains(&p) {
                return bad("min_p", format!("must be in [0, 1], got {p}"));
            }
        }
        if let Some(r) = s.repetition_penalty {
            if !(r.is_finite() && r > 0.0) {
                return bad(
                    "repetition_penalty",
                    format!("must be a finite number > 0, got {r}"),
                );
            }
        }
        for (field, p) in [
            ("frequency_penalty", s.frequency_penalty),
            ("presence_penalty", s.presence_penalty),
        ] {
            if let Some(p) = p.filter(|p| !(p.is_finite() && (-2.0..=2.0).contains(p))) {
                return bad(field, format!("must be a number in [-2, 2], got {p}"));
            }
        }
        if let Some((id, b)) = s
            .logit_bias
            .iter()
            .find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b)))
        {
            return bad(
                "logit_bias",
                format!("the bias of token {id} must be in [-100, 100], got {b}"),
            );
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return bad(
                "logprobs",
                format!("at most {MAX_TOP_LOGPROBS} alternatives, got {n}"),
            );
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be at least 1".to_string());
        }
        if self.prefill_chunk == Some(0) {
            return bad("prefill_chunk", "must be at least 1 token".to_string());
        }
        if let CacheMode::Quantized(q) = self.cache.mode {
            if ![32, 64, 128].contains(&q.group_size) {
                return bad(
                    "cache.group_size",
                    format!("must be 32, 64 or 128, got {}", q.group_size),
                );
            }
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token (this id) was generated.
    Eos(u32),
    /// `max_tokens` were generated.
    Length,
    /// A stop string (index into [`GenOptions::stop_strings`]) appeared in the text.
    Stop(usize),
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// The token id.
    pub token: u32,
    /// Text completed by this token (may be empty: a partial UTF-8 character, a special token,
    /// or text held back because it might start a stop string).
    pub text: String,
    /// Set on the last step of the sequence.
    pub finish: Option<FinishReason>,
    /// The token's log-probability and the most likely alternatives, where
    /// [`GenOptions::logprobs`] asks for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// A generated token's log-probability under the model and the most likely tokens at its step
/// ([`GenOptions::logprobs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The log-probability of the token generated.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first (the lowest id
    /// first among equals).
    pub top: Vec<(u32, f32)>,
}

/// Counters and timings of one generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens that went through the model (the rest were reused from the cache).
    pub prefilled_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Seconds spent in prefill.
    pub prefill_secs: f64,
    /// Seconds spent generating after the first token.
    pub decode_secs: f64,
    /// KV cache bytes in use at the end.
    pub kv_bytes: usize,
}

impl Stats {
    /// Prefilled tokens per second.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prefilled_tokens, self.prefill_secs)
    }

    /// Generated tokens per second after the first.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.generated_tokens.saturating_sub(1), self.decode_secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// Generated ids (the EOS token included when one ended the sequence).
    pub tokens: Vec<u32>,
    /// Generated text (empty without a tokenizer).
    pub text: String,
    /// Why it stopped.
    pub finish: FinishReason,
    /// Counters and timings.
    pub stats: Stats,
}
