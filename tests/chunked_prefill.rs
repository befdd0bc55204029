//! A prompt longer than `PREFILL_CHUNK` in one `forward` (whose earlier chunks only fill the
//! cache: no KV-shared layers, no logits) equals the same prompt fed one chunk at a time through
//! `forward` (every chunk through the whole stack): the same last logits, and the same logits
//! for the steps after it, with every cache kind, on fixtures with and without KV-shared layers.

mod common;

use candle_gemma::PREFILL_CHUNK;
use common::*;

#[test]
fn long_prompt_in_one_forward_equals_chunk_by_chunk() {
    for name in ["e2b-hf", "dense-sharded"] {
        let model = load(name);
        // The CPU's chunk, with no policy set.
        assert_eq!(model.prefill_chunk(), PREFILL_CHUNK, "{name}");
        // Two whole chunks and a few tokens, ids spread over the 512-token vocabulary.
        let prompt: Vec<u32> = (0..2 * PREFILL_CHUNK as u32 + 6)
            .map(|i| (i * 37 + 11) % 500 + 3)
            .collect();
        for (label, cfg) in cache_layouts() {
            let mut whole = model.new_cache(&cfg).expect("cache");
            let mut pieces = model.new_cache(&cfg).expect("cache");
            let mut got = step(&model, &mut whole, &prompt);
            let mut want = Vec::new();
            for chunk in prompt.chunks(PREFILL_CHUNK) {
                want = step(&model, &mut pieces, chunk);
            }
            assert_eq!(whole.offsets(), pieces.offsets(), "{name} {label}: offsets");
            for k in 0..4 {
                assert_eq!(
                    got, want,
                    "{name} {label}: logits {k} steps after the prompt"
                );
                let next = argmax(&want);
                got = step(&model, &mut whole, &[next]);
                want = step(&model, &mut pieces, &[next]);
            }
        }
    }
}
