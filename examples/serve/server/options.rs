//! Request knobs shared by every generation route (sampling, limits, stop strings, EOS handling,
//! KV layout) and their translation into the library's [`GenOptions`], with validation.
//!
//! Each bad value is a 400 whose `param` names the field and whose `code` is
//! `invalid_<field>` (`invalid_temperature`, `invalid_top_p`, `invalid_kv_bits`, ...).
//! `kv_bits` is 4 or 8 (a quantized cache of that width) or `null` (a dense cache); absent, the
//! server's `--kv-bits` default applies. `kv_group_size` is 32, 64 or 128 and must divide the
//! model's head dimensions.

use candle_gemma::generate::{GenOptions, SamplingOptions, MAX_TOP_LOGPROBS};
use candle_gemma::kv::{CacheMode, QuantBits, QuantSpec};
use candle_gemma::CacheConfig;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use super::error::ApiError;
use super::unimplemented::Unimplemented;

/// The server's defaults for what a request leaves out.
#[derive(Debug, Clone)]
pub struct Defaults {
    /// KV bits when a request does not say (`None`: a dense cache).
    pub kv_bits: Option<QuantBits>,
    /// Group size of quantized KV when a request does not say.
    pub kv_group_size: usize,
    /// The dense layout: rotating sliding-window layers (`false`: every layer keeps all).
    pub rotating: bool,
    /// `max_tokens` when a request does not say (clipped to the context).
    pub max_tokens: usize,
    /// Head dimensions of the model's KV layers (group sizes must divide them).
    pub head_dims: Vec<usize>,
    /// The model's recommended sampling (`generation_config.json`), which fills the sampling
    /// fields a request omits; `None`: OpenAI's defaults (temperature 1, no filters).
    pub sampling: Option<SamplingOptions>,
    /// The model's vocabulary size (`logit_bias` ids must be below it).
    pub vocab_size: usize,
}

/// Head dimensions of the model's KV-owning layers.
pub fn head_dims(model: &candle_gemma::Model) -> Vec<usize> {
    let mut dims: Vec<usize> = model
        .text_model()
        .cache_specs()
        .into_iter()
        .flatten()
        .map(|s| s.head_dim)
        .collect();
    dims.sort_unstable();
    dims.dedup();
    dims
}

/// Sampling and limit fields, under the names OpenAI and vLLM use.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Knobs {
    /// Most tokens to generate (OpenAI's older name).
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Most tokens to generate (OpenAI's newer name; wins over `max_tokens`).
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// Softmax temperature; 0 is greedy. Default: the model's recommended temperature, else 1.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus filter, in (0, 1].
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Keep the `k` most likely tokens (vLLM: -1 or 0 turns it off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Min-p filter, in [0, 1].
    #[serde(default)]
    pub min_p: Option<f64>,
    /// HF-style repetition penalty, > 0.
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// OpenAI's frequency penalty, in [-2, 2].
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    /// OpenAI's presence penalty, in [-2, 2].
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    /// OpenAI's logit bias: token ids (as strings) to biases in [-100, 100].
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop strings: one string or a list.
    #[serde(default)]
    pub stop: Option<StopField>,
    /// Keep generating past EOS (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Return the generated token ids.
    #[serde(default)]
    pub return_token_ids: bool,
    /// KV cache bits: 4, 8 or `null` (dense); absent: the server default.
    #[serde(default, deserialize_with = "present")]
    pub kv_bits: Option<Value>,
    /// Group size of a quantized KV cache.
    #[serde(default)]
    pub kv_group_size: Option<i64>,
    /// Number of choices, 1 to [`MAX_CHOICES`].
    #[serde(default)]
    pub n: Option<i64>,
    /// Log-probabilities: `true`/`false` (chat, with `top_logprobs` alternatives) or the
    /// number of alternatives (completions). At most [`MAX_TOP_LOGPROBS`].
    #[serde(default)]
    pub logprobs: Option<Value>,
    /// Alternatives a token's log-probabilities list (chat; needs `logprobs: true`).
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Structured output: `{"type": "text" | "json_object" | "json_schema", ..}`
    /// ([`super::structured`]).
    #[serde(default)]
    pub response_format: Option<Value>,
    /// vLLM's schema constraint (a JSON schema object).
    #[serde(default)]
    pub guided_json: Option<Value>,
    /// vLLM's pattern constraint (a regular expression the whole answer matches).
    #[serde(default)]
    pub guided_regex: Option<Value>,
    /// Fields that would change the answer but are not implemented (refused unless default).
    #[serde(flatten)]
    pub unimplemented: Unimplemented,
}

/// `stop` as OpenAI takes it.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// Keeps an explicit `null` apart from an absent field (`Some(Value::Null)` against `None`).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// Most choices (`n`) a request may ask for.
pub const MAX_CHOICES: usize = 16;

impl Knobs {
    /// The choices asked for (`n`, 1 when absent), after [`Knobs::to_options`] checked it.
    pub fn choices(&self) -> usize {
        self.n
            .map_or(1, |n| n.clamp(1, MAX_CHOICES as i64) as usize)
    }

    /// Checks every field and builds the options for a prompt of `prompt_len` tokens in a
    /// context of `context` tokens.
    ///
    /// # Errors
    /// A 400 naming the first bad field.
    pub fn to_options(
        &self,
        defaults: &Defaults,
        prompt_len: usize,
        context: usize,
    ) -> Result<GenOptions, ApiError> {
        if let Some(n) = self.n {
            if !(1..=MAX_CHOICES as i64).contains(&n) {
                return Err(ApiError::invalid(
                    "n",
                    format!("n must be in [1, {MAX_CHOICES}], got {n}"),
                ));
            }
        }
        self.unimplemented.check(self.choices())?;
        let room = context.saturating_sub(prompt_len).max(1);
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            None => defaults.max_tokens.min(room),
            Some(m) if m < 1 => {
                let param = if self.max_completion_tokens.is_some() {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                return Err(ApiError::invalid(
                    param,
                    format!("{param} must be at least 1, got {m}"),
                ));
            }
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX).min(room),
        };
        // Omitted sampling fields take the model's recommended values (vLLM does the same).
        let model = defaults.sampling.as_ref();
        let temperature = self
            .temperature
            .or(model.map(|m| f64::from(m.temperature)))
            .unwrap_or(1.0);
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be a number >= 0, got {temperature}"),
            ));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(
                    "top_p",
                    format!("top_p must be in (0, 1], got {p}"),
                ));
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(ApiError::invalid(
                    "min_p",
                    format!("min_p must be in [0, 1], got {p}"),
                ));
            }
        }
        if let Some(r) = self.repetition_penalty {
            if !(r.is_finite() && r > 0.0) {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    format!("repetition_penalty must be a number > 0, got {r}"),
                ));
            }
        }
        for (field, p) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if let Some(p) = p.filter(|p| !(-2.0..=2.0).contains(p)) {
                return Err(ApiError::invalid(
                    field,
                    format!("{field} must be a number in [-2, 2], got {p}"),
                ));
            }
        }
        let top_k = match self.top_k {
            None => model.and_then(|m| m.top_k),
            Some(-1) | Some(0) => None,
            Some(k) if k > 0 => Some(k as usize),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1, 0 (off) or positive, got {k}"),
                ))
            }
        };
        let logprobs = self.logprobs()?;
        let stop_strings = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        if stop_strings.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        Ok(GenOptions {
            max_tokens,
            sampling: SamplingOptions {
                temperature: temperature as f32,
                top_k,
                top_p: self.top_p.map(|p| p as f32).or(model.and_then(|m| m.top_p)),
                min_p: self.min_p.map(|p| p as f32).or(model.and_then(|m| m.min_p)),
                repetition_penalty: self
                    .repetition_penalty
                    .map(|r| r as f32)
                    .or(model.and_then(|m| m.repetition_penalty)),
                frequency_penalty: self.frequency_penalty.map(|p| p as f32),
                presence_penalty: self.presence_penalty.map(|p| p as f32),
                logit_bias: self.logit_bias(defaults.vocab_size)?,
                seed,
            },
            stop_strings,
            ignore_eos: self.ignore_eos,
            cache: self.cache(defaults)?,
            logprobs,
            constraint: super::structured::constraint(
                self.response_format.as_ref(),
                self.guided_json.as_ref(),
                self.guided_regex.as_ref(),
            )?,
            ..GenOptions::default()
        })
    }

    /// `logit_bias` as `(id, bias)` pairs: each key a token id below `vocab`, each bias in
    /// [-100, 100].
    fn logit_bias(&self, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(key, &bias)| {
                let id = key
                    .trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|&id| (id as usize) < vocab)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "logit_bias",
                            format!("{key:?} is not a token id below the vocabulary size {vocab}"),
                        )
                    })?;
                if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
                    return Err(ApiError::invalid(
                        "logit_bias",
                        format!("the bias of token {id} must be in [-100, 100], got {bias}"),
                    ));
                }
                Ok((id, bias as f32))
            })
            .collect()
    }

    /// `logprobs` and `top_logprobs` as [`GenOptions::logprobs`].
    fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let count = |field: &str, n: i64| -> Result<usize, ApiError> {
            usize::try_from(n)
                .ok()
                .filter(|&n| n <= MAX_TOP_LOGPROBS)
                .ok_or_else(|| {
                    ApiError::invalid(
                        field,
                        format!("{field} must be an integer in 0..={MAX_TOP_LOGPROBS}, got {n}"),
                    )
                })
        };
        let top = self
            .top_logprobs
            .map(|n| count("top_logprobs", n))
            .transpose()?;
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => match top {
                Some(_) => Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                )),
                None => Ok(None),
            },
            Some(Value::Bool(true)) => Ok(Some(top.unwrap_or(0))),
            Some(v) => match v.as_i64() {
                Some(n) => count("logprobs", n).map(Some),
                None => Err(ApiError::invalid(
                    "logprobs",
                    format!("logprobs must be a boolean or an integer, got {v}"),
                )),
            },
        }
    }

    /// The KV layout the request asks for.
    fn cache(&self, defaults: &Defaults) -> Result<CacheConfig, ApiError> {
        let bits = match &self.kv_bits {
            None => defaults.kv_bits,
            Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(4) => Some(QuantBits::Four),
                Some(8) => Some(QuantBits::Eight),
                _ => {
                    return Err(ApiError::invalid(
                        "kv_bits",
                        format!("kv_bits must be 4, 8 or null, got {v}"),
                    ))
                }
            },
        };
        let group_size = match self.kv_group_size {
            None => defaults.kv_group_size,
            Some(g) if [32, 64, 128].contains(&g) => g as usize,
            Some(g) => {
                return Err(ApiError::invalid(
                    "kv_group_size",
                    format!("kv_group_size must be 32, 64 or 128, got {g}"),
                ))
            }
        };
        let mode = match bits {
            None if defaults.rotating => CacheMode::Rotating,
            None => CacheMode::Simple,
            Some(bits) => {
                if let Some(d) = defaults.head_dims.iter().find(|&&d| d % group_size != 0) {
                    return Err(ApiError::invalid(
                        "kv_group_size",
                        format!(
                            "kv_group_size {group_size} does not divide the head dimension {d}"
                        ),
                    ));
                }
                CacheMode::Quantized(QuantSpec {
                    bits,
                    group_size,
                    start: 0,
                })
            }
        };
        Ok(CacheConfig { mode })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Defaults {
        Defaults {
            kv_bits: None,
            kv_group_size: 32,
            rotating: true,
            max_tokens: 16,
            head_dims: vec![32, 64],
            sampling: None,
            vocab_size: 512,
        }
    }

    #[test]
    fn logit_bias_takes_token_ids_and_bounded_biases() {
        let d = defaults();
        let opts = |v: Value| knobs(v).to_options(&d, 4, 64);
        let bias = |v: Value| opts(v).expect("valid").sampling.logit_bias;
        assert_eq!(bias(serde_json::json!({})), vec![]);
        let mut got = bias(serde_json::json!({"logit_bias": {"7": -100, "300": 2.5}}));
        got.sort_by_key(|b| b.0);
        assert_eq!(got, vec![(7, -100.0), (300, 2.5)]);
        for bad in [
            serde_json::json!({"logit_bias": {"512": 1}}),
            serde_json::json!({"logit_bias": {"abc": 1}}),
            serde_json::json!({"logit_bias": {"-1": 1}}),
            serde_json::json!({"logit_bias": {"5": 101}}),
        ] {
            let err = opts(bad.clone()).expect_err("rejected");
            assert_eq!(err.param.as_deref(), Some("logit_bias"), "{bad}");
        }
    }

    #[test]
    fn logprobs_fields_chat_and_completion_forms() {
        let d = defaults();
        let opts = |v: Value| knobs(v).to_options(&d, 4, 64);
        let lp = |v: Value| opts(v).expect("valid").logprobs;
        assert_eq!(lp(serde_json::json!({})), None);
        assert_eq!(lp(serde_json::json!({"logprobs": false})), None);
        assert_eq!(lp(serde_json::json!({"logprobs": true})), Some(0));
        assert_eq!(
            lp(serde_json::json!({"logprobs": true, "top_logprobs": 5})),
            Some(5)
        );
        assert_eq!(lp(serde_json::json!({"logprobs": 3})), Some(3));
        let code = |v: Value| opts(v).unwrap_err().code;
        assert_eq!(
            code(serde_json::json!({"top_logprobs": 2})).as_deref(),
            Some("invalid_top_logprobs")
        );
        assert_eq!(
            code(serde_json::json!({"logprobs": true, "top_logprobs": 21})).as_deref(),
            Some("invalid_top_logprobs")
        );
        assert_eq!(
            code(serde_json::json!({"logprobs": -1})).as_deref(),
            Some("invalid_logprobs")
        );
        let penalty = |v: Value| {
            let o = knobs(v).to_options(&d, 4, 64).expect("valid").sampling;
            (o.frequency_penalty, o.presence_penalty)
        };
        let both = serde_json::json!({"frequency_penalty": 0.5, "presence_penalty": -1.0});
        assert_eq!(penalty(both), (Some(0.5), Some(-1.0)));
        let high = serde_json::json!({"presence_penalty": 2.5});
        assert_eq!(code(high).as_deref(), Some("invalid_presence_penalty"));
        assert_eq!(
            code(serde_json::json!({"logprobs": "yes"})).as_deref(),
            Some("invalid_logprobs")
        );
    }

    #[test]
    fn omitted_sampling_fields_take_the_models_recommendation() {
        let d = Defaults {
            sampling: Some(SamplingOptions {
                temperature: 0.7,
                top_k: Some(64),
                top_p: Some(0.95),
                ..SamplingOptions::default()
            }),
            ..defaults()
        };
        let o = knobs(serde_json::json!({}))
            .to_options(&d, 4, 64)
            .expect("valid");
        assert_eq!(
            (o.sampling.temperature, o.sampling.top_k, o.sampling.top_p),
            (0.7, Some(64), Some(0.95))
        );
        let set = serde_json::json!({"temperature": 0.2, "top_k": -1, "top_p": 1.0});
        let o = knobs(set).to_options(&d, 4, 64).expect("valid");
        assert_eq!(
            (o.sampling.temperature, o.sampling.top_k, o.sampling.top_p),
            (0.2, None, Some(1.0))
        );
        let openai = knobs(serde_json::json!({})).to_options(&defaults(), 4, 64);
        let o = openai.expect("valid");
        assert_eq!((o.sampling.temperature, o.sampling.top_k), (1.0, None));
    }

    fn knobs(v: Value) -> Knobs {
        serde_json::from_value(v).expect("knobs parse")
    }

    #[test]
    fn kv_bits_absent_null_and_values() {
        let d = defaults();
        let dense = knobs(serde_json::json!({"kv_bits": null}));
        assert_eq!(dense.kv_bits, Some(Value::Null));
        assert!(knobs(serde_json::json!({})).kv_bits.is_none());
        let bad = knobs(serde_json::json!({"kv_bits": 5})).to_options(&d, 4, 64);
        assert_eq!(bad.unwrap_err().code.as_deref(), Some("invalid_kv_bits"));
    }
}
