//! Generation options, steps, outputs and statistics.

use super::SamplingOptions;

use crate::kv::CacheConfig;

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
}

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
        }
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
