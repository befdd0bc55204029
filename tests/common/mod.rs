//! Shared helpers of the integration tests: fixture paths, goldens recorded from mlx-lm, the
//! comparison rule (exact ids up to the first step whose reference top-2 margin is small), and
//! the tensor closeness check ([`close`]).
#![allow(dead_code)]

pub mod close;
pub mod packed;

use std::path::PathBuf;

use candle_gemma::kernels::policy::LaunchPolicy;
use candle_gemma::kv::{CacheMode, ModelCache, QuantBits, QuantSpec};
use candle_gemma::{CacheConfig, GenOptions, Model};
use serde_json::Value;

/// Max |Δ log-prob| the goldens tolerate on the first step in f32 (a different summation
/// order in the matmuls moves log-probs by ~1e-5; a missing architectural detail moves them
/// by > 0.1).
pub const LOGPROB_TOL: f64 = 2e-3;

/// Every fixture folder with a golden.
pub const FIXTURES: &[&str] = &[
    "e2b-hf",
    "e4b-text",
    "moe-mlx",
    "dense-sharded",
    "e2b-q4",
    "e2b-q8",
    "moe-q4",
];

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

pub fn load(name: &str) -> Model {
    Model::builder()
        .path(fixture(name))
        .build()
        .unwrap_or_else(|e| panic!("fixture {name} loads: {e}"))
}

/// Fixture `name` built with `policy` in force.
pub fn load_with(name: &str, policy: LaunchPolicy) -> Model {
    Model::builder()
        .path(fixture(name))
        .launch_policy(policy)
        .build()
        .unwrap_or_else(|e| panic!("fixture {name} loads: {e}"))
}

/// One recorded prompt of a golden file.
pub struct Case {
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    pub margins: Vec<f64>,
    pub first_logprobs: Vec<f64>,
}

pub fn golden(name: &str) -> Vec<Case> {
    let path = fixture(name).join("golden.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("golden readable"))
        .expect("golden parses");
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .expect("list")
            .iter()
            .map(|i| i.as_u64().expect("id") as u32)
            .collect()
    };
    let floats = |x: &Value| -> Vec<f64> {
        x.as_array()
            .expect("list")
            .iter()
            .map(|i| i.as_f64().expect("float"))
            .collect()
    };
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt_ids"]),
            greedy: ids(&c["greedy_ids"]),
            margins: floats(&c["margins"]),
            first_logprobs: floats(&c["first_logprobs"]),
        })
        .collect()
}

/// Steps that must match exactly: those before the first step whose reference top-2 margin is
/// below `min_margin` (after that, a near-tie may legitimately flip).
pub fn comparable_steps(margins: &[f64], min_margin: f64) -> usize {
    margins
        .iter()
        .position(|&m| m < min_margin)
        .unwrap_or(margins.len())
}

/// Greedy generation of `n` tokens, EOS ignored, with a cache layout.
pub fn greedy(
    model: &Model,
    prompt: &[u32],
    n: usize,
    cache: CacheConfig,
    chunk: Option<usize>,
) -> Vec<u32> {
    let mut g = model.generator(GenOptions {
        max_tokens: n,
        ignore_eos: true,
        cache,
        prefill_chunk: chunk,
        ..Default::default()
    });
    g.generate(prompt).expect("generation runs").tokens
}

/// Greedy ids of a golden case: its prompt, as many tokens as were recorded, the default cache.
pub fn greedy_case(model: &Model, case: &Case) -> Vec<u32> {
    greedy(
        model,
        &case.prompt,
        case.greedy.len(),
        CacheConfig::default(),
        None,
    )
}

/// Asserts `got` equals the reference up to its first near-tie (margin < `min_margin`).
pub fn assert_matches_reference(label: &str, got: &[u32], case: &Case, min_margin: f64) {
    let n = comparable_steps(&case.margins, min_margin).min(got.len());
    assert_eq!(
        &got[..n],
        &case.greedy[..n],
        "{label}: ids differ within the first {n} steps (reference margins {:?})",
        &case.margins[..n]
    );
}

/// log-softmax of logits.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits.iter().map(|&x| x as f64 - max - sum.ln()).collect()
}

/// A scratch copy of a fixture folder, removed on drop.
pub struct Scratch {
    pub dir: PathBuf,
}

impl Scratch {
    pub fn copy_of(name: &str, label: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "candle-gemma-{label}-{}-{}",
            std::process::id(),
            name
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        for entry in std::fs::read_dir(fixture(name)).expect("fixture dir") {
            let entry = entry.expect("entry");
            std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
        }
        Self { dir }
    }

    /// Rewrites `file` (a safetensors file of the copy) through `edit`.
    pub fn edit_tensors(
        &self,
        file: &str,
        edit: impl FnOnce(&mut std::collections::HashMap<String, candle_core::Tensor>),
    ) {
        let path = self.dir.join(file);
        let mut tensors =
            candle_core::safetensors::load(&path, &candle_core::Device::Cpu).expect("load");
        edit(&mut tensors);
        candle_core::safetensors::save(&tensors, &path).expect("save");
    }

    /// Rewrites config.json through `edit`.
    pub fn edit_config(&self, edit: impl FnOnce(&mut Value)) {
        let path = self.dir.join("config.json");
        let mut v: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        edit(&mut v);
        std::fs::write(&path, serde_json::to_string_pretty(&v).expect("ser")).expect("write");
    }

    pub fn build(&self) -> candle_gemma::Result<Model> {
        Model::builder().path(&self.dir).build()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Max |Δ log-prob| between first-step logits and the reference's first-step log-probs.
pub fn deviation_from_reference(logits: &[f32], case: &Case) -> f64 {
    log_softmax(logits)
        .iter()
        .zip(&case.first_logprobs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// Max |Δ log-prob| between the model's first step on a golden prompt and the reference.
pub fn first_step_deviation(model: &Model, case: &Case) -> f64 {
    let mut cache = model.new_cache(&CacheConfig::default()).expect("cache");
    deviation_from_reference(&step(model, &mut cache, &case.prompt), case)
}

/// Greedy decoding through `Model::forward`: prefill in chunks, then `n` single tokens.
/// Returns the generated ids and the logits that chose each of them.
pub fn run(
    model: &Model,
    cache: &mut ModelCache,
    prompt: &[u32],
    n: usize,
    chunk: Option<usize>,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = Vec::new();
    for piece in prompt.chunks(chunk.unwrap_or(prompt.len()).max(1)) {
        logits = step(model, cache, piece);
    }
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for i in 0..n {
        let next = argmax(&logits);
        ids.push(next);
        all.push(std::mem::take(&mut logits));
        if i + 1 < n {
            logits = step(model, cache, &[next]);
        }
    }
    (ids, all)
}

/// One forward of one sequence; the logits of its last position.
pub fn step(model: &Model, cache: &mut ModelCache, tokens: &[u32]) -> Vec<f32> {
    model
        .forward(&[tokens.to_vec()], cache)
        .expect("forward")
        .squeeze(0)
        .expect("squeeze")
        .to_vec1()
        .expect("logits")
}

pub fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// Max |Δ log-prob| between two logit vectors.
pub fn logprob_diff(a: &[f32], b: &[f32]) -> f64 {
    log_softmax(a)
        .iter()
        .zip(log_softmax(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// A quantized K/V layout of `bits` with groups of 32, packed from the first token.
pub fn quantized(bits: QuantBits) -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 32,
            start: 0,
        }),
    }
}

/// Every K/V layout a sequence can pick, labelled: simple, rotating, 8-bit and 4-bit.
pub fn cache_layouts() -> Vec<(&'static str, CacheConfig)> {
    vec![
        (
            "simple",
            CacheConfig {
                mode: CacheMode::Simple,
            },
        ),
        ("rotating", CacheConfig::default()),
        ("8-bit", quantized(QuantBits::Eight)),
        ("4-bit", quantized(QuantBits::Four)),
    ]
}

/// A JSON schema whose values are all bounded (a random-weight model's output under it ends
/// within a short budget), without free whitespace: the constrained-decoding tests' schema.
pub fn bounded_schema() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99}
        },
        "required": ["color", "count"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false}
    })
}

/// Whether `text` is a JSON object valid under [`bounded_schema`].
pub fn fits_bounded_schema(text: &str) -> bool {
    serde_json::from_str::<Value>(text).is_ok_and(|v| {
        v.as_object().is_some_and(|o| o.len() == 2)
            && matches!(v["color"].as_str(), Some("red" | "green" | "blue"))
            && v["count"].as_u64().is_some_and(|n| n <= 99)
    })
}
