//! Criterion: one decode step and one prefill of committed fixtures on the CPU in f32 (the
//! fixtures are tiny random-weight Gemma 4 models, so this times the host path of a step: the
//! layer structure, caches and kernel dispatch, not matmul throughput).
//!
//! ```text
//! cargo bench --bench decode
//! ```
//!
//! Names follow `op/device/dtype/shape`: `decode/cpu/f32/e2b-fixture` (a 32-token context,
//! default caches), `decode/cpu/f32-kv-q4/e2b-fixture` (4-bit K/V), `prefill/cpu/f32/...`.

use std::path::PathBuf;
use std::time::Duration;

use candle_gemma::kv::{CacheMode, ModelCache, QuantBits, QuantSpec};
use candle_gemma::{CacheConfig, Model};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

/// Tokens of the prompt that is prefilled, or that a decode step attends to.
const CONTEXT: usize = 32;

fn load(name: &str) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name);
    Model::builder()
        .path(dir)
        .build()
        .unwrap_or_else(|e| panic!("fixture {name} loads: {e}"))
}

/// A fixed prompt of `CONTEXT` ids spread over the vocabulary.
fn prompt(model: &Model) -> Vec<u32> {
    let vocab = model.config().vocab_size as u32;
    (0..CONTEXT as u32)
        .map(|i| (i * 7919 + 3) % vocab)
        .collect()
}

/// A cache holding `prompt`, ready for a decode step.
fn prefilled(model: &Model, config: &CacheConfig, prompt: &[u32]) -> ModelCache {
    let mut cache = model.new_cache(config).expect("cache");
    model
        .forward(&[prompt.to_vec()], &mut cache)
        .expect("prefill");
    cache
}

fn q4() -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits: QuantBits::Four,
            group_size: 32,
            start: 0,
        }),
    }
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode");
    for (fixture, label, config) in [
        ("e2b-hf", "f32", CacheConfig::default()),
        ("e2b-hf", "f32-kv-q4", q4()),
        ("moe-mlx", "f32", CacheConfig::default()),
    ] {
        let model = load(fixture);
        let prompt = prompt(&model);
        let name = fixture.split('-').next().unwrap_or(fixture);
        // Each step runs on a fresh copy of the prefilled cache (built outside the timing), so
        // every sample decodes at the same context length.
        group.bench_function(format!("cpu/{label}/{name}-fixture"), |b| {
            b.iter_batched_ref(
                || prefilled(&model, &config, &prompt),
                |cache| model.forward(&[vec![prompt[0]]], cache).expect("step"),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

fn prefill(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefill");
    for fixture in ["e2b-hf", "moe-mlx"] {
        let model = load(fixture);
        let prompt = prompt(&model);
        let name = fixture.split('-').next().unwrap_or(fixture);
        let config = CacheConfig::default();
        group.bench_function(format!("cpu/f32/{name}-fixture-{CONTEXT}tok"), |b| {
            b.iter(|| {
                let mut cache = model.new_cache(&config).expect("cache");
                model
                    .forward(std::slice::from_ref(&prompt), &mut cache)
                    .expect("prefill")
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = decode, prefill
}
criterion_main!(benches);
