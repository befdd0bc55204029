//! `LaunchPolicy::prefill_chunk` sets how many prompt tokens one forward pass takes at once: a
//! model built under a chunk of 37 reports it, and a 100-token prompt in one `forward` (three
//! chunks, the first two only filling the cache) equals the prompt fed 37 tokens at a time,
//! logits and cache offsets, for every cache kind. Its own test binary, since the policy is
//! the process's.

mod common;

use candle_gemma::{LaunchPolicy, PREFILL_CHUNK};
use common::*;

#[test]
fn the_policy_sets_the_prefill_chunk() {
    const CHUNK: usize = 37;
    let mut policy = LaunchPolicy::default();
    policy.prefill_chunk = CHUNK;
    let model = load_with("e2b-hf", policy);
    assert_eq!(model.prefill_chunk(), CHUNK);
    assert_ne!(CHUNK, PREFILL_CHUNK);
    let prompt: Vec<u32> = (0..100u32).map(|i| (i * 37 + 11) % 500 + 3).collect();
    for (label, cfg) in cache_layouts() {
        let mut whole = model.new_cache(&cfg).expect("cache");
        let mut pieces = model.new_cache(&cfg).expect("cache");
        let got = step(&model, &mut whole, &prompt);
        let mut want = Vec::new();
        for chunk in prompt.chunks(CHUNK) {
            want = step(&model, &mut pieces, chunk);
        }
        assert_eq!(whole.offsets(), pieces.offsets(), "{label}: offsets");
        assert_eq!(got, want, "{label}: last logits");
    }
}
