//! `config.json` (both the multimodal shape with `text_config` and a bare `gemma4_text`) and
//! `generation_config.json`, parsed into a validated [`Config`] whose per-layer [`LayerPlan`]
//! says everything a layer decides once: attention kind, head geometry, MLP width, and whether
//! it computes K/V or reads another layer's.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The attention kind of a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Local attention over the last `sliding_window` keys (the current one included).
    Sliding,
    /// Causal attention over every previous key.
    Full,
}

impl LayerKind {
    fn parse(field: &str, value: &str) -> Result<Self> {
        match value {
            "sliding_attention" => Ok(LayerKind::Sliding),
            "full_attention" => Ok(LayerKind::Full),
            other => Err(Error::Config {
                field: field.to_string(),
                reason: format!(
                    "unknown layer type `{other}` (expected `sliding_attention` or `full_attention`)"
                ),
            }),
        }
    }

    /// The key of this kind in `layer_types` and `rope_parameters`.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::Sliding => "sliding_attention",
            LayerKind::Full => "full_attention",
        }
    }
}

/// Where a layer's keys and values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvSource {
    /// The layer projects its own K/V and owns a cache.
    Own,
    /// A KV-shared layer: it reads the K/V that layer `producer` made in the current step and
    /// owns neither projections nor a cache.
    Shared {
        /// Index of the last non-shared layer of the same kind.
        producer: usize,
    },
}

/// Everything a decoder layer decides at construction time.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    /// Sliding or full attention.
    pub kind: LayerKind,
    /// Head dimension of q/k/v.
    pub head_dim: usize,
    /// Number of KV heads.
    pub kv_heads: usize,
    /// Whether V is projected by its own `v_proj` (false on full layers of k_eq_v models,
    /// where V comes from the raw K projection).
    pub has_v_proj: bool,
    /// Width of the dense MLP (doubled on KV-shared layers with `use_double_wide_mlp`).
    pub intermediate_size: usize,
    /// Own K/V or a producer's.
    pub kv: KvSource,
}

/// Rotary embedding parameters of one layer kind.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    /// Base θ.
    pub theta: f64,
    /// Fraction of the head dimension that rotates (1.0 for `default`).
    pub partial_rotary_factor: f64,
    /// Divides every inverse frequency (1.0 unless the config sets `factor`).
    pub factor: f64,
}

/// The mixture-of-experts block beside the dense MLP (26B-A4B).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Number of experts.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Width of each expert's MLP.
    pub intermediate_size: usize,
}

/// A validated Gemma 4 text configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Query heads (same on every layer).
    pub num_attention_heads: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// W: a sliding layer sees W keys, the current one included.
    pub sliding_window: usize,
    /// Longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// `tanh(x / c) * c` on the logits, if set.
    pub final_logit_softcapping: Option<f64>,
    /// Per-layer-embedding width P (0: no PLE).
    pub hidden_size_per_layer_input: usize,
    /// Rows of the per-layer embedding table.
    pub vocab_size_per_layer_input: usize,
    /// Index of the first KV-shared layer (== number of layers when none share).
    pub first_kv_shared_layer: usize,
    /// The plan of every layer.
    pub layers: Vec<LayerPlan>,
    /// RoPE of sliding layers.
    pub rope_sliding: RopeParams,
    /// RoPE of full layers.
    pub rope_full: RopeParams,
    /// The MoE block, when enabled.
    pub moe: Option<MoeConfig>,
    /// Whether the head is the transposed embedding table.
    pub tie_word_embeddings: bool,
    /// BOS id.
    pub bos_token_id: u32,
    /// PAD id.
    pub pad_token_id: u32,
    /// Every id that ends generation: the text config's, the top level's and
    /// `generation_config.json`'s, merged.
    pub eos_token_ids: Vec<u32>,
    /// The largest quantization group the checkpoint declares (MLX `quantization` or
    /// `quantization_config`, per-module entries included; 128 where the sizes cannot be
    /// read), `None` for a dense checkpoint. A sharded load cuts widths only between groups.
    pub quantization_group: Option<usize>,
    /// The sampling `generation_config.json` recommends, where it sets `do_sample: true`: its
    /// `temperature` (1 where absent, as in transformers), `top_k` (0 or below: off), `top_p`,
    /// `min_p` and `repetition_penalty`, seed 0. `None` (greedy decoding is the
    /// recommendation) where the file is absent or does not sample. Unlike transformers, no
    /// top-k of 50 is assumed where the file sets none. The crate's own defaults stay greedy;
    /// [`crate::generate::SamplingOptions::recommended`] and the `serve` example apply this.
    pub recommended_sampling: Option<crate::generate::SamplingOptions>,
}

impl Config {
    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// RoPE parameters of a layer kind.
    pub fn rope(&self, kind: LayerKind) -> &RopeParams {
        match kind {
            LayerKind::Sliding => &self.rope_sliding,
            LayerKind::Full => &self.rope_full,
        }
    }

    /// Reads `config.json` and, when present, `generation_config.json` from a checkpoint folder.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Json`] for unreadable files, [`Error::Config`] naming the field
    /// that is missing or invalid.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config = read_json(&dir.join("config.json"))?;
        let generation_path = dir.join("generation_config.json");
        let generation = if generation_path.exists() {
            Some(read_json(&generation_path)?)
        } else {
            None
        };
        Self::from_json(&config, generation.as_ref())
    }

    /// Builds a config from parsed `config.json` (either shape) and optional
    /// `generation_config.json` values.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field that is missing or invalid.
    pub fn from_json(config: &Value, generation: Option<&Value>) -> Result<Self> {
        let top = as_object(config, "config.json")?;
        let (text, prefix) = match top.get("text_config") {
            Some(tc) => (as_object(tc, "text_config")?, "text_config."),
            None => (top, ""),
        };
        let f = Fields { obj: text, prefix };

        let hidden_size = f.usize("hidden_size")?;
        let num_layers = f.usize("num_hidden_layers")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let head_dim = f.usize("head_dim")?;
        let kv_heads = f.usize("num_key_value_heads")?;
        let global_head_dim = f.opt_usize("global_head_dim")?;
        let global_kv_heads = f.opt_usize("num_global_key_value_heads")?;
        let k_eq_v = f.opt_bool("attention_k_eq_v")?.unwrap_or(false);
        let intermediate_size = f.usize("intermediate_size")?;
        let double_wide = f.opt_bool("use_double_wide_mlp")?.unwrap_or(false);
        let num_kv_shared = f.opt_usize("num_kv_shared_layers")?.unwrap_or(0);
        if num_kv_shared > num_layers {
            return Err(f.err(
                "num_kv_shared_layers",
                format!("{num_kv_shared} exceeds num_hidden_layers {num_layers}"),
            ));
        }
        let first_shared = num_layers - num_kv_shared;

        let kinds = f.layer_types(num_layers)?;
        let overrides = f.per_layer_config(num_layers)?;

        let mut layers = Vec::with_capacity(num_layers);
        for (i, &kind) in kinds.iter().enumerate() {
            let full = kind == LayerKind::Full;
            let uses_k_eq_v = k_eq_v && full;
            let mut hd = if full {
                global_head_dim.unwrap_or(head_dim)
            } else {
                head_dim
            };
            let mut kvh = match (uses_k_eq_v, global_kv_heads) {
                (true, Some(g)) => g,
                _ => kv_heads,
            };
            if let Some(o) = overrides.get(&i) {
                hd = o.head_dim.unwrap_or(hd);
                kvh = o.kv_heads.unwrap_or(kvh);
            }
            let shared = i >= first_shared;
            let kv = if shared {
                let producer = (0..first_shared)
                    .rev()
                    .find(|&j| kinds[j] == kind)
                    .ok_or_else(|| {
                        f.err(
                            "num_kv_shared_layers",
                            format!(
                                "layer {i} ({}) shares K/V but no earlier non-shared layer has that type",
                                kind.as_str()
                            ),
                        )
                    })?;
                KvSource::Shared { producer }
            } else {
                KvSource::Own
            };
            layers.push(LayerPlan {
                kind,
                head_dim: hd,
                kv_heads: kvh,
                has_v_proj: !uses_k_eq_v,
                intermediate_size: if double_wide && shared && first_shared > 0 {
                    2 * intermediate_size
                } else {
                    intermediate_size
                },
                kv,
            });
        }
        for (i, l) in layers.iter().enumerate() {
            if l.kv_heads == 0 || num_attention_heads % l.kv_heads != 0 {
                return Err(f.err(
                    "num_key_value_heads",
                    format!(
                        "layer {i}: {} query heads are not a multiple of {} KV heads",
                        num_attention_heads, l.kv_heads
                    ),
                ));
            }
            if l.head_dim % 2 != 0 {
                return Err(f.err(
                    "head_dim",
                    format!("layer {i}: head dim {} is odd", l.head_dim),
                ));
            }
        }

        let moe = if f.opt_bool("enable_moe_block")?.unwrap_or(false) {
            Some(MoeConfig {
                num_experts: f.usize("num_experts")?,
                top_k: f.usize("top_k_experts")?,
                intermediate_size: f.usize("moe_intermediate_size")?,
            })
        } else {
            None
        };

        let (rope_sliding, rope_full) = f.rope_parameters()?;
        let hidden_size_per_layer_input = f.opt_usize("hidden_size_per_layer_input")?.unwrap_or(0);
        let vocab_size = f.usize("vocab_size")?;

        let mut eos = Vec::new();
        collect_ids(text.get("eos_token_id"), &mut eos);
        if !prefix.is_empty() {
            collect_ids(top.get("eos_token_id"), &mut eos);
        }
        if let Some(g) = generation {
            collect_ids(g.get("eos_token_id"), &mut eos);
        }
        if eos.is_empty() {
            eos.push(1);
        }

        Ok(Config {
            vocab_size,
            hidden_size,
            num_attention_heads,
            rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            sliding_window: f.usize("sliding_window")?,
            max_position_embeddings: f.usize("max_position_embeddings")?,
            final_logit_softcapping: f.opt_f64("final_logit_softcapping")?,
            hidden_size_per_layer_input,
            vocab_size_per_layer_input: f
                .opt_usize("vocab_size_per_layer_input")?
                .unwrap_or(vocab_size),
            first_kv_shared_layer: first_shared,
            layers,
            rope_sliding,
            rope_full,
            moe,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(true),
            bos_token_id: f.opt_usize("bos_token_id")?.unwrap_or(2) as u32,
            pad_token_id: f.opt_usize("pad_token_id")?.unwrap_or(0) as u32,
            eos_token_ids: eos,
            quantization_group: quantization_group(top).or_else(|| quantization_group(text)),
            recommended_sampling: match generation {
                Some(g) => recommended_sampling(as_object(g, "generation_config.json")?)?,
                None => None,
            },
        })
    }
}

/// The sampling of `generation_config.json`'s fields (see [`Config::recommended_sampling`]).
fn recommended_sampling(
    g: &Map<String, Value>,
) -> Result<Option<crate::generate::SamplingOptions>> {
    let f = Fields {
        obj: g,
        prefix: "generation_config.",
    };
    if f.opt_bool("do_sample")? != Some(true) {
        return Ok(None);
    }
    let top_k = match f.present("top_k") {
        None => None,
        Some(v) => match v.as_i64() {
            Some(k) if k > 0 => Some(k as usize),
            Some(_) => None,
            None => return Err(f.err("top_k", format!("expected an integer, found {v}"))),
        },
    };
    let num = |name: &str| -> Result<Option<f32>> { Ok(f.opt_f64(name)?.map(|x| x as f32)) };
    Ok(Some(crate::generate::SamplingOptions {
        temperature: num("temperature")?.unwrap_or(1.0),
        top_k,
        top_p: num("top_p")?,
        min_p: num("min_p")?,
        repetition_penalty: num("repetition_penalty")?,
        frequency_penalty: None,
        presence_penalty: None,
        logit_bias: Vec::new(),
        seed: 0,
    }))
}

/// The largest `group_size` of an object's `quantization` (or `quantization_config`) entry and
/// its per-module entries; 128 when the entry names none.
fn quantization_group(obj: &Map<String, Value>) -> Option<usize> {
    let q = ["quantization", "quantization_config"]
        .iter()
        .find_map(|k| obj.get(*k))?;
    let group = |e: &Value| e.get("group_size").and_then(Value::as_u64);
    let per_module = q
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, e)| group(e));
    let largest = group(q).into_iter().chain(per_module).max();
    Some(largest.map_or(128, |g| g as usize))
}

/// Reads and parses a JSON file.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn as_object<'a>(v: &'a Value, field: &str) -> Result<&'a Map<String, Value>> {
    v.as_object().ok_or_else(|| Error::Config {
        field: field.to_string(),
        reason: "expected a JSON object".to_string(),
    })
}

fn collect_ids(v: Option<&Value>, out: &mut Vec<u32>) {
    let mut push = |x: &Value| {
        if let Some(id) = x.as_u64() {
            let id = id as u32;
            if !out.contains(&id) {
                out.push(id);
            }
        }
    };
    match v {
        Some(Value::Array(items)) => items.iter().for_each(&mut push),
        Some(x) => push(x),
        None => {}
    }
}

#[derive(Default)]
struct LayerOverride {
    head_dim: Option<usize>,
    kv_heads: Option<usize>,
}

/// Typed access to the fields of one JSON object, with errors naming the dotted field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn err(&self, field: &str, reason: String) -> Error {
        Error::Config {
            field: format!("{}{field}", self.prefix),
            reason,
        }
    }

    fn present(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn usize(&self, name: &str) -> Result<usize> {
        self.opt_usize(name)?
            .ok_or_else(|| self.err(name, "required field is missing".to_string()))
    }

    fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        match self.present(name) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                self.err(name, format!("expected a non-negative integer, found {v}"))
            }),
        }
    }

    fn opt_f64(&self, name: &str) -> Result<Option<f64>> {
        match self.present(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("expected a number, found {v}"))),
        }
    }

    fn opt_bool(&self, name: &str) -> Result<Option<bool>> {
        match self.present(name) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(name, format!("expected a boolean, found {v}"))),
        }
    }

    fn layer_types(&self, num_layers: usize) -> Result<Vec<LayerKind>> {
        let list = self
            .present("layer_types")
            .ok_or_else(|| self.err("layer_types", "required field is missing".to_string()))?
            .as_array()
            .ok_or_else(|| self.err("layer_types", "expected a list of strings".to_string()))?;
        if list.len() != num_layers {
            return Err(self.err(
                "layer_types",
                format!(
                    "has {} entries, num_hidden_layers is {num_layers}",
                    list.len()
                ),
            ));
        }
        list.iter()
            .enumerate()
            .map(|(i, v)| {
                let field = format!("{}layer_types[{i}]", self.prefix);
                let s = v.as_str().ok_or_else(|| Error::Config {
                    field: field.clone(),
                    reason: format!("expected a string, found {v}"),
                })?;
                LayerKind::parse(&field, s)
            })
            .collect()
    }

    fn per_layer_config(&self, num_layers: usize) -> Result<BTreeMap<usize, LayerOverride>> {
        let mut out = BTreeMap::new();
        let Some(v) = self.present("per_layer_config") else {
            return Ok(out);
        };
        let obj = v
            .as_object()
            .ok_or_else(|| self.err("per_layer_config", "expected an object".to_string()))?;
        for (key, entry) in obj {
            let field = format!("per_layer_config.{key}");
            let layer: usize = key
                .parse()
                .ok()
                .filter(|&l| l < num_layers)
                .ok_or_else(|| {
                    self.err(
                        &field,
                        format!("`{key}` is not a layer index below {num_layers}"),
                    )
                })?;
            let entry = entry
                .as_object()
                .ok_or_else(|| self.err(&field, "expected an object".to_string()))?;
            let sub = Fields {
                obj: entry,
                prefix: "",
            };
            let wrap = |e: Error| match e {
                Error::Config { field: f, reason } => self.err(&format!("{field}.{f}"), reason),
                other => other,
            };
            out.insert(
                layer,
                LayerOverride {
                    head_dim: sub.opt_usize("head_dim").map_err(wrap)?,
                    kv_heads: sub.opt_usize("num_key_value_heads").map_err(wrap)?,
                },
            );
        }
        Ok(out)
    }

    fn rope_parameters(&self) -> Result<(RopeParams, RopeParams)> {
        let defaults = (
            RopeParams {
                theta: 10_000.0,
                partial_rotary_factor: 1.0,
                factor: 1.0,
            },
            RopeParams {
                theta: 1_000_000.0,
                partial_rotary_factor: 0.25,
                factor: 1.0,
            },
        );
        let Some(v) = self.present("rope_parameters") else {
            return Err(self.err("rope_parameters", "required field is missing".to_string()));
        };
        let obj = v
            .as_object()
            .ok_or_else(|| self.err("rope_parameters", "expected an object".to_string()))?;
        let parse = |kind: LayerKind, default: RopeParams| -> Result<RopeParams> {
            let Some(entry) = obj.get(kind.as_str()) else {
                return Ok(default);
            };
            let field = format!("rope_parameters.{}", kind.as_str());
            let entry = entry
                .as_object()
                .ok_or_else(|| self.err(&field, "expected an object".to_string()))?;
            let num = |name: &str, d: f64| -> Result<f64> {
                match entry.get(name).filter(|v| !v.is_null()) {
                    None => Ok(d),
                    Some(x) => x.as_f64().ok_or_else(|| {
                        self.err(
                            &format!("{field}.{name}"),
                            format!("expected a number, found {x}"),
                        )
                    }),
                }
            };
            let rope_type = entry
                .get("rope_type")
                .and_then(Value::as_str)
                .unwrap_or("default");
            let prf_default = if rope_type == "proportional" {
                default.partial_rotary_factor
            } else {
                1.0
            };
            match rope_type {
                "default" | "proportional" => {}
                other => {
                    return Err(self.err(
                        &format!("{field}.rope_type"),
                        format!(
                        "unsupported rope type `{other}` (expected `default` or `proportional`)"
                    ),
                    ))
                }
            }
            Ok(RopeParams {
                theta: num("rope_theta", default.theta)?,
                partial_rotary_factor: num("partial_rotary_factor", prf_default)?,
                factor: num("factor", 1.0)?,
            })
        };
        Ok((
            parse(LayerKind::Sliding, defaults.0.clone())?,
            parse(LayerKind::Full, defaults.1.clone())?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared_config(name: &str) -> Config {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/real-configs");
        let cfg = read_json(&dir.join(name)).expect("config readable");
        let gen = read_json(&dir.join("generation_config.json")).expect("generation config");
        Config::from_json(&cfg, Some(&gen)).expect("config parses")
    }

    #[test]
    fn the_largest_declared_quantization_group_bounds_the_cut() {
        let fixture = |name: &str| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures")
                .join(name);
            Config::from_dir(&dir)
                .expect("fixture config")
                .quantization_group
        };
        // Group 32 overall, 64 for the per-layer table.
        assert_eq!(fixture("e2b-q4"), Some(64));
        assert_eq!(fixture("e2b-q8"), Some(64));
        assert_eq!(fixture("moe-q4"), Some(64));
        assert_eq!(fixture("moe-mlx"), None);
        assert_eq!(fixture("e2b-hf"), None);
    }

    #[test]
    fn real_configs_give_the_right_layer_plan() {
        let e2b = shared_config("e2b-config.json");
        assert_eq!(e2b.first_kv_shared_layer, 15);
        assert_eq!(e2b.layers[4].head_dim, 512);
        assert_eq!(e2b.layers[3].head_dim, 256);
        assert_eq!(e2b.layers[14].kv_heads, 1);
        assert_eq!(e2b.layers[14].intermediate_size, 6144);
        assert_eq!(e2b.layers[15].intermediate_size, 12288);
        assert_eq!(e2b.layers[19].kv, KvSource::Shared { producer: 14 });
        assert_eq!(e2b.layers[20].kv, KvSource::Shared { producer: 13 });
        assert_eq!(e2b.eos_token_ids, vec![1, 106, 50]);
        let sampling = e2b.recommended_sampling.expect("Gemma 4 samples");
        assert_eq!(
            (sampling.temperature, sampling.top_k, sampling.top_p),
            (1.0, Some(64), Some(0.95))
        );
        assert_eq!((sampling.min_p, sampling.repetition_penalty), (None, None));

        let e4b = shared_config("e4b-config.json");
        assert_eq!(e4b.first_kv_shared_layer, 24);
        assert_eq!(e4b.layers[41].kv, KvSource::Shared { producer: 23 });
        assert_eq!(e4b.layers[24].kv, KvSource::Shared { producer: 22 });
        assert_eq!(e4b.layers[5].kv_heads, 2);
        assert!(e4b.layers.iter().all(|l| l.intermediate_size == 10240));

        let moe = shared_config("26b-a4b-config.json");
        assert!(moe.layers.iter().all(|l| l.kv == KvSource::Own));
        assert_eq!(moe.layers[5].kv_heads, 2);
        assert!(!moe.layers[5].has_v_proj);
        assert_eq!(moe.layers[0].kv_heads, 8);
        assert!(moe.layers[0].has_v_proj);
        let m = moe.moe.as_ref().expect("moe");
        assert_eq!((m.num_experts, m.top_k, m.intermediate_size), (128, 8, 704));

        let d31 = shared_config("31b-config.json");
        assert_eq!(d31.num_layers(), 60);
        assert_eq!(d31.layers[59].kv_heads, 4);
        assert_eq!(d31.layers[59].head_dim, 512);
        assert_eq!(d31.layers[0].kv_heads, 16);
        assert_eq!(d31.sliding_window, 1024);
        assert_eq!(d31.hidden_size_per_layer_input, 0);
        assert!((d31.rope_full.partial_rotary_factor - 0.25).abs() < 1e-12);
    }

    #[test]
    fn unknown_layer_type_is_named() {
        let mut v = read_json(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/real-configs/31b-config.json"),
        )
        .expect("readable");
        v["text_config"]["layer_types"][3] = Value::from("chunked_attention");
        let err = Config::from_json(&v, None).expect_err("must fail");
        let msg = err.to_string();
        assert!(
            msg.contains("text_config.layer_types[3]") && msg.contains("chunked_attention"),
            "{msg}"
        );
    }

    #[test]
    fn generation_configs_that_do_not_sample_recommend_greedy_decoding() {
        let cfg = read_json(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/real-configs/e2b-config.json"),
        )
        .expect("config readable");
        let with = |gen: serde_json::Value| Config::from_json(&cfg, Some(&gen));
        let greedy = with(serde_json::json!({"do_sample": false, "temperature": 0.7, "top_k": 5}));
        assert_eq!(greedy.expect("parses").recommended_sampling, None);
        assert_eq!(
            with(serde_json::json!({"top_k": 5}))
                .expect("parses")
                .recommended_sampling,
            None
        );
        let off = with(serde_json::json!({"do_sample": true, "top_k": -1})).expect("parses");
        let off = off.recommended_sampling.expect("samples");
        assert_eq!((off.temperature, off.top_k), (1.0, None));
        match with(serde_json::json!({"do_sample": true, "top_p": "high"})) {
            Err(Error::Config { field, .. }) => assert_eq!(field, "generation_config.top_p"),
            other => panic!("expected a config error naming top_p, got {other:?}"),
        }
    }
}
