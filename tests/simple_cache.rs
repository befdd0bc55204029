//! The simple (dense, growing) cache on the tiny Gemma 4 fixtures: it reproduces mlx-lm's
//! goldens, agrees with the rotating cache, prefills in chunks, rolls back exactly, and grows
//! its storage in amortised steps.

mod common;

use candle_gemma::kv::{CacheMode, LayerCache};
use candle_gemma::CacheConfig;
use common::*;

fn simple() -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Simple,
    }
}

/// First-step log-probs vs the goldens (README: an f32 port stays below 2e-3).
const LOGPROB_TOL: f64 = 2e-3;

#[test]
fn simple_cache_reproduces_the_goldens() {
    for name in FIXTURES {
        let model = load(name);
        for (i, case) in golden(name).iter().enumerate() {
            let mut cache = model.new_cache(&simple()).expect("cache");
            let (ids, logits) = run(&model, &mut cache, &case.prompt, case.greedy.len(), None);
            let dev = deviation_from_reference(&logits[0], case);
            assert!(
                dev < LOGPROB_TOL,
                "{name} case {i}: first-step log-probs differ by {dev}"
            );
            assert_matches_reference(&format!("{name} case {i} (simple cache)"), &ids, case, 0.01);
        }
    }
}

#[test]
fn simple_and_rotating_caches_agree_far_past_the_window() {
    // Both are dense; the rotating one holds W keys, the simple one all, masked to W.
    for name in FIXTURES {
        let model = load(name);
        let case = &golden(name)[2];
        let mut a = model.new_cache(&simple()).expect("cache");
        let (ids, la) = run(&model, &mut a, &case.prompt, 40, None);
        // Teacher-forced on the same ids, so a near-tie cannot make the runs diverge.
        let mut b = model.new_cache(&CacheConfig::default()).expect("cache");
        let mut lb = vec![step(&model, &mut b, &case.prompt)];
        for &t in &ids[..ids.len() - 1] {
            lb.push(step(&model, &mut b, &[t]));
        }
        let worst = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| logprob_diff(x, y))
            .fold(0.0, f64::max);
        eprintln!(
            "{name}: simple vs rotating over {} steps: max |dlogprob| {worst:.1e}",
            la.len()
        );
        assert!(worst < LOGPROB_TOL, "{name}: {worst}");
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    for name in ["e2b-hf", "moe-mlx"] {
        let model = load(name);
        let case = &golden(name)[2]; // 33 tokens
        let mut one = model.new_cache(&simple()).expect("cache");
        let want = step(&model, &mut one, &case.prompt);
        for chunk in [1, 3, 8, 13] {
            let mut cache = model.new_cache(&simple()).expect("cache");
            let (_, got) = run(&model, &mut cache, &case.prompt, 1, Some(chunk));
            let d = logprob_diff(&got[0], &want);
            assert!(d < LOGPROB_TOL, "{name} chunk {chunk}: {d}");
            assert_eq!(cache.offsets(), vec![case.prompt.len()]);
        }
    }
}

#[test]
fn trim_rolls_back_exactly() {
    let model = load("e4b-text");
    let case = &golden("e4b-text")[1];
    let mut cache = model.new_cache(&simple()).expect("cache");
    let (ids, logits) = run(&model, &mut cache, &case.prompt, 10, None);
    let before = cache.offsets()[0];
    // Roll back the 9 decoded tokens (the 10th was chosen but never fed), then decode again.
    cache
        .trim(9)
        .expect("a simple cache trims anything it holds");
    assert_eq!(cache.offsets(), vec![case.prompt.len()]);
    let mut again = Vec::new();
    let mut next = ids[0];
    for _ in 0..9 {
        let l = step(&model, &mut cache, &[next]);
        next = argmax(&l);
        again.push(l);
    }
    assert_eq!(cache.offsets()[0], before);
    assert_eq!(
        &again[..],
        &logits[1..],
        "the rollback restores the exact state"
    );
    assert!(
        cache.trim(before + 1).is_err(),
        "cannot trim more than held"
    );
}

#[test]
fn storage_grows_in_amortised_steps() {
    let model = load("e4b-text");
    let case = &golden("e4b-text")[0];
    let mut cache = model.new_cache(&simple()).expect("cache");
    let per_token: usize = cache
        .layers
        .iter()
        .flatten()
        .map(|c| {
            let (kvh, hd) = c.geometry();
            2 * kvh * hd * 4
        })
        .sum();
    run(&model, &mut cache, &case.prompt, 30, None);
    // The first allocation holds 256 tokens; writes go in place until it is full.
    assert_eq!(cache.memory_bytes(), 256 * per_token);
    let mut last = argmax(&step(&model, &mut cache, &[5]));
    while cache.offsets()[0] < 300 {
        last = argmax(&step(&model, &mut cache, &[last]));
    }
    assert_eq!(
        cache.memory_bytes(),
        512 * per_token,
        "capacity doubled once"
    );
    assert!(cache
        .layers
        .iter()
        .flatten()
        .all(|c| matches!(c, LayerCache::Simple(_))));
}

#[test]
fn prompts_longer_than_one_prefill_chunk_equal_pieces() {
    // The model splits prompts longer than PREFILL_CHUNK itself; feeding the same prompt in
    // uneven pieces by hand must give the same last logits and offsets.
    let model = load("e2b-hf");
    let vocab = model.config().vocab_size as u32;
    let n = candle_gemma::PREFILL_CHUNK + 77;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 3) % vocab).collect();
    let mut whole = model.new_cache(&simple()).expect("cache");
    let want = step(&model, &mut whole, &prompt);
    let mut pieces = model.new_cache(&simple()).expect("cache");
    let mut got = Vec::new();
    for piece in prompt.chunks(300) {
        got = step(&model, &mut pieces, piece);
    }
    assert_eq!(whole.offsets(), vec![n]);
    assert_eq!(pieces.offsets(), vec![n]);
    let d = logprob_diff(&got, &want);
    assert!(d < LOGPROB_TOL, "{d}");
}
