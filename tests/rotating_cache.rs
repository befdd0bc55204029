//! The rotating cache on the tiny Gemma 4 fixtures (sliding window 8, prompts of 7, 19 and 33
//! tokens): it reproduces mlx-lm's goldens with prefill chunks smaller, equal to and larger than
//! the window, keeps sliding layers bounded far past the window, and refuses a rollback once
//! the keys it needs were overwritten.

mod common;

use candle_gemma::kv::{CacheError, CacheKind, CacheMode, KvCache, LayerCache};
use candle_gemma::CacheConfig;
use common::*;

const LOGPROB_TOL: f64 = 2e-3;

#[test]
fn rotating_cache_reproduces_the_goldens_with_any_chunking() {
    for name in FIXTURES {
        let model = load(name);
        for (i, case) in golden(name).iter().enumerate() {
            for chunk in [None, Some(3), Some(8), Some(13)] {
                let mut cache = model.new_cache(&CacheConfig::default()).expect("cache");
                let (ids, logits) = run(&model, &mut cache, &case.prompt, case.greedy.len(), chunk);
                let dev = deviation_from_reference(&logits[0], case);
                assert!(
                    dev < LOGPROB_TOL,
                    "{name} case {i} chunk {chunk:?}: first-step log-probs differ by {dev}"
                );
                assert_matches_reference(
                    &format!("{name} case {i} chunk {chunk:?}"),
                    &ids,
                    case,
                    0.01,
                );
            }
        }
    }
}

#[test]
fn sliding_layers_stay_bounded_far_past_the_window() {
    let model = load("e2b-hf");
    let case = &golden("e2b-hf")[2];
    let mut rot = model.new_cache(&CacheConfig::default()).expect("cache");
    let (ids, lr) = run(&model, &mut rot, &case.prompt, 200, Some(5));
    for (l, c) in rot.layers.iter().enumerate() {
        let Some(c) = c else { continue };
        let (kvh, hd) = c.geometry();
        match (c, c.kind()) {
            (LayerCache::Rotating(_), CacheKind::Rotating { window, slots }) => {
                assert_eq!(window, 8);
                assert_eq!(
                    c.memory_bytes(),
                    slots * 2 * kvh * hd * 4,
                    "layer {l}: {slots} slots whatever the length"
                );
            }
            (LayerCache::Simple(_), _) => assert!(
                c.memory_bytes() >= (33 + 199) * 2 * kvh * hd * 4,
                "full layer {l} keeps everything"
            ),
            (_, kind) => panic!("layer {l}: unexpected {kind}"),
        }
    }
    // The same tokens through a simple cache (every key kept, masked to the window).
    let mut all = model
        .new_cache(&CacheConfig {
            mode: CacheMode::Simple,
        })
        .expect("cache");
    let mut ls = vec![step(&model, &mut all, &case.prompt)];
    for &t in &ids[..ids.len() - 1] {
        ls.push(step(&model, &mut all, &[t]));
    }
    let worst = lr
        .iter()
        .zip(&ls)
        .map(|(a, b)| logprob_diff(a, b))
        .fold(0.0, f64::max);
    eprintln!("rotating vs simple over 200 decode steps: max |dlogprob| {worst:.1e}");
    assert!(worst < LOGPROB_TOL, "{worst}");
}

#[test]
fn trim_works_until_the_ring_wraps_then_is_refused_with_a_reason() {
    let model = load("e2b-hf");
    let short = &golden("e2b-hf")[0]; // 7 tokens < window 8: nothing overwritten yet
    let mut cache = model.new_cache(&CacheConfig::default()).expect("cache");
    let (ids, logits) = run(&model, &mut cache, &short.prompt, 2, None);
    cache.trim(1).expect("nothing was overwritten");
    let again = step(&model, &mut cache, &[ids[0]]);
    assert_eq!(again, logits[1], "rolled back exactly");

    let long = &golden("e2b-hf")[2]; // 33 tokens: every ring wrapped
    let mut cache = model.new_cache(&CacheConfig::default()).expect("cache");
    let (ids, logits) = run(&model, &mut cache, &long.prompt, 3, None);
    let before = cache.offsets();
    match cache.trim(2) {
        Err(CacheError::CannotTrim {
            requested: 2,
            available: 1,
            reason,
        }) => {
            assert!(
                reason.contains("layer"),
                "the reason names the layer: {reason}"
            );
        }
        other => panic!("expected CannotTrim, got {other:?}"),
    }
    assert_eq!(cache.offsets(), before, "a refused trim changes nothing");
    // One token can always be rolled back: the ring still holds the W-1 keys the next needs.
    cache.trim(1).expect("one token");
    let again = step(&model, &mut cache, &[ids[1]]);
    assert!(logprob_diff(&again, &logits[2]) < 1e-5);
}
