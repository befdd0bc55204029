//! Prompt caches on the tiny Gemma 4 fixtures: a cache saved to disk (or deep-copied in memory)
//! and restored continues exactly as if never interrupted, for every cache kind including
//! wrapped rings and quantized rings; a restore into another configuration is refused, naming
//! what differs; prefix reuse rolls back exactly or refuses.

mod common;

use candle_core::{DType, Device};
use candle_gemma::kv::{
    CacheError, CacheMeta, CacheMode, ModelCache, PromptCache, QuantBits, QuantSpec,
};
use candle_gemma::{CacheConfig, Model};
use common::*;

fn modes() -> Vec<(&'static str, CacheConfig)> {
    let q = |bits, start| CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 32,
            start,
        }),
    };
    vec![
        (
            "simple",
            CacheConfig {
                mode: CacheMode::Simple,
            },
        ),
        ("rotating", CacheConfig::default()),
        ("8-bit", q(QuantBits::Eight, 0)),
        ("4-bit from 40", q(QuantBits::Four, 40)),
    ]
}

fn meta(model: &Model, cfg: &CacheConfig) -> CacheMeta {
    CacheMeta::new(
        cfg,
        &model.text_model().cache_specs(),
        model.dtype(),
        model.fingerprint(),
    )
    .expect("meta")
}

fn temp(label: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "candle-gemma-prompt-{}-{label}.safetensors",
        std::process::id()
    ))
}

#[test]
fn saved_and_restored_caches_continue_exactly() {
    for name in ["e2b-hf", "e4b-text"] {
        let model = load(name);
        let prompt = &golden(name)[2].prompt; // 33 tokens: every ring has wrapped
        for (label, cfg) in modes() {
            // Uninterrupted: the prompt, then 16 greedy tokens.
            let mut whole = model.new_cache(&cfg).expect("cache");
            let (ids, logits) = run(&model, &mut whole, prompt, 16, None);

            // Interrupted after 5 decoded tokens: save, load, go on with the same ids.
            let mut cache = model.new_cache(&cfg).expect("cache");
            step(&model, &mut cache, prompt);
            for &t in &ids[..5] {
                step(&model, &mut cache, &[t]);
            }
            let tokens: Vec<u32> = prompt.iter().chain(&ids[..5]).copied().collect();
            let path = temp(&format!("{name}-{}", label.replace(' ', "-")));
            PromptCache::new(tokens.clone(), cache, meta(&model, &cfg))
                .save(&path)
                .expect("save");
            let restored = PromptCache::load(&path, &Device::Cpu).expect("load");
            let _ = std::fs::remove_file(&path);
            assert_eq!(restored.tokens, tokens);
            restored
                .restore_check(&meta(&model, &cfg))
                .expect("same configuration");
            let mut cache = restored.cache;
            assert_eq!(cache.offsets(), vec![tokens.len()]);
            for i in 5..15 {
                let got = step(&model, &mut cache, &[ids[i]]);
                // Same storage layout (a ring slot holds position p at p % slots) and the same
                // packed codes: bit-identical.
                assert_eq!(got, logits[i + 1], "{name} {label}: step {i} after restore");
            }
        }
    }
}

#[test]
fn in_memory_copies_branch_independently() {
    let model = load("e2b-hf");
    let prompt = &golden("e2b-hf")[1].prompt;
    for (label, cfg) in modes() {
        let mut base = model.new_cache(&cfg).expect("cache");
        let first = argmax(&step(&model, &mut base, prompt));
        let pc = PromptCache::new(prompt.clone(), base, meta(&model, &cfg));
        // Two continuations from one cached prompt.
        let mut a = pc.deep_clone().expect("copy").cache;
        let mut b = pc.deep_clone().expect("copy").cache;
        let la = step(&model, &mut a, &[first]);
        let lb = step(&model, &mut b, &[(first + 1) % 512]);
        step(&model, &mut b, &[7]);
        // The original is untouched by either.
        let mut c = pc.cache;
        assert_eq!(c.offsets(), vec![prompt.len()]);
        assert_eq!(step(&model, &mut c, &[first]), la, "{label}");
        assert_ne!(la, lb);
    }
}

#[test]
fn restore_into_another_configuration_is_refused_naming_the_difference() {
    let model = load("e2b-hf");
    let q = |bits, group_size, start| CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size,
            start,
        }),
    };
    let mut cache = model.new_cache(&q(QuantBits::Four, 32, 0)).expect("cache");
    step(&model, &mut cache, &[2, 200, 300]);
    let path = temp("mismatch");
    PromptCache::new(
        vec![2, 200, 300],
        cache,
        meta(&model, &q(QuantBits::Four, 32, 0)),
    )
    .save(&path)
    .expect("save");
    let saved = PromptCache::load(&path, &Device::Cpu).expect("load");
    let _ = std::fs::remove_file(&path);
    let field = |expected: CacheMeta| match saved.restore_check(&expected) {
        Err(CacheError::Mismatch { field, .. }) => field,
        other => panic!("expected a mismatch, got {other:?}"),
    };
    assert_eq!(
        field(meta(&model, &q(QuantBits::Eight, 32, 0))),
        "bits of layer 0"
    );
    assert_eq!(
        field(meta(&model, &q(QuantBits::Four, 32, 16))),
        "start of layer 0"
    );
    assert_eq!(
        field(meta(&model, &CacheConfig::default())),
        "kind of layer 0"
    );
    let specs = model.text_model().cache_specs();
    let other_model = CacheMeta::new(
        &q(QuantBits::Four, 32, 0),
        &specs,
        model.dtype(),
        "another checkpoint",
    )
    .expect("meta");
    assert_eq!(field(other_model), "fingerprint");
    let bf16 = CacheMeta::new(
        &q(QuantBits::Four, 32, 0),
        &specs,
        DType::BF16,
        model.fingerprint(),
    )
    .expect("meta");
    assert_eq!(field(bf16), "dtype");
    // Another model with the same fingerprint but another layer plan is caught too.
    let other = load("e4b-text");
    let e4b = CacheMeta::new(
        &q(QuantBits::Four, 32, 0),
        &other.text_model().cache_specs(),
        model.dtype(),
        model.fingerprint(),
    )
    .expect("meta");
    assert_eq!(field(e4b), "layer count");
    assert!(saved
        .restore_check(&meta(&model, &q(QuantBits::Four, 32, 0)))
        .is_ok());
}

#[test]
fn prefix_reuse_rolls_back_exactly_or_refuses() {
    let model = load("e4b-text");
    let cached = &golden("e4b-text")[1].prompt; // 19 tokens
    let mut new_prompt = cached[..12].to_vec();
    new_prompt.extend([300, 301, 302, 303, 304]);
    let simple = CacheConfig {
        mode: CacheMode::Simple,
    };

    // A simple cache rolls back to the common prefix; feeding the rest equals a fresh prefill.
    let mut cache = model.new_cache(&simple).expect("cache");
    step(&model, &mut cache, cached);
    let pc = PromptCache::new(cached.clone(), cache, meta(&model, &simple));
    assert_eq!(pc.common_prefix(&new_prompt), 12);
    let (mut cache, n) = pc
        .reuse(&meta(&model, &simple), &new_prompt)
        .expect("reuse");
    assert_eq!(n, 12);
    let got = step(&model, &mut cache, &new_prompt[n..]);
    let mut fresh = model.new_cache(&simple).expect("cache");
    let want = step(&model, &mut fresh, &new_prompt);
    assert!(
        logprob_diff(&got, &want) < 2e-3,
        "prefix reuse vs fresh prefill"
    );

    // A wrapped ring no longer holds the keys position 12 needs: refused, never silently wrong.
    let rotating = CacheConfig::default();
    let mut cache = model.new_cache(&rotating).expect("cache");
    step(&model, &mut cache, cached);
    let pc = PromptCache::new(cached.clone(), cache, meta(&model, &rotating));
    assert!(matches!(
        pc.reuse(&meta(&model, &rotating), &new_prompt),
        Err(CacheError::CannotTrim { .. })
    ));

    // Reusing into another configuration is refused before anything else.
    let mut cache = model.new_cache(&simple).expect("cache");
    step(&model, &mut cache, cached);
    let pc = PromptCache::new(cached.clone(), cache, meta(&model, &simple));
    assert!(matches!(
        pc.reuse(&meta(&model, &rotating), &new_prompt),
        Err(CacheError::Mismatch { .. })
    ));
}

#[test]
fn batches_and_bad_files_are_typed_errors() {
    let model = load("e2b-hf");
    let cfg = CacheConfig::default();
    let mut one = model.new_cache(&cfg).expect("cache");
    step(&model, &mut one, &[2, 200]);
    let batch = ModelCache::batch(vec![one]).expect("batch");
    let pc = PromptCache::new(vec![2, 200], batch, meta(&model, &cfg));
    assert!(matches!(
        pc.save(temp("batch")),
        Err(CacheError::Batched { .. })
    ));

    let path = temp("garbage");
    std::fs::write(&path, b"definitely not safetensors").expect("write");
    assert!(matches!(
        PromptCache::load(&path, &Device::Cpu),
        Err(CacheError::Format { .. })
    ));
    // A model checkpoint is safetensors but not a prompt cache.
    assert!(matches!(
        PromptCache::load(fixture("e2b-hf").join("model.safetensors"), &Device::Cpu),
        Err(CacheError::Format { .. })
    ));
    let _ = std::fs::remove_file(&path);
    assert!(matches!(
        PromptCache::load(temp("missing"), &Device::Cpu),
        Err(CacheError::Io { .. })
    ));
}
