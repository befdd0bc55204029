//! Decoding one step ahead (`GenOptions::lookahead`), greedy and with tempered sampling drawn
//! on the device, against the same decoding without it on the same model: the same tokens,
//! with and without a stop token, in f32 and bf16 (bf16 steps replay CUDA graphs fed the
//! previous step's ids on the device); the cache holds the last token too after a stop (which
//! shows that the generation ran ahead), and the next prompt that reuses it continues as a
//! fresh generation.

use anyhow::Result;
use candle_core::DType;
use candle_gemma::generate::sampling::SamplingOptions;
use candle_gemma::{GenOptions, Model};

use crate::support::{fixture_config as config, gpu};

/// Greedy decoding, or tempered sampling (temperature 0.8, no filters: drawn on the device).
fn options(lookahead: bool, max_tokens: usize, stop: Option<u32>, tempered: bool) -> GenOptions {
    GenOptions {
        max_tokens,
        ignore_eos: true,
        extra_eos: stop.into_iter().collect(),
        lookahead,
        sampling: SamplingOptions {
            temperature: if tempered { 0.8 } else { 0.0 },
            seed: 17,
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn lookahead_gives_plain_greedy_tokens_and_caches_the_last_one() -> Result<()> {
    let Some(gpu) = gpu("lookahead") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    for (fixture, dtype, tempered) in ["e2b-hf", "moe-mlx"].into_iter().flat_map(|f| {
        [DType::F32, DType::BF16]
            .into_iter()
            .flat_map(move |d| [false, true].map(|t| (f, d, t)))
    }) {
        let options = |l, m, s| options(l, m, s, tempered);
        let model = Model::random(config(fixture)?, &gpu.dev, dtype, 11)?;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
        let case = format!("{fixture} {dtype:?} tempered {tempered}");
        let plain = model
            .generator(options(false, 24, None))
            .generate(&prompt)?;
        let mut ahead_gen = model.generator(options(true, 24, None));
        let ahead = ahead_gen.generate(&prompt)?;
        println!("{case}: plain {:?}", plain.tokens);
        if ahead.tokens != plain.tokens {
            failures.push(format!("{case}: lookahead {:?}", ahead.tokens));
        }
        // Ended by length: the last token is not run through the model.
        if ahead_gen.cached_tokens().len() != prompt.len() + 23 {
            failures.push(format!(
                "{case}: {} cached after 24 tokens",
                ahead_gen.cached_tokens().len()
            ));
        }
        // A stop token at index 6.
        let stop = plain.tokens[6];
        let at = plain.tokens.iter().position(|&t| t == stop).unwrap_or(6);
        let mut plain_gen = model.generator(options(false, 24, Some(stop)));
        let plain = plain_gen.generate(&prompt)?;
        let mut ahead_gen = model.generator(options(true, 24, Some(stop)));
        let ahead = ahead_gen.generate(&prompt)?;
        if plain.tokens.len() != at + 1 || ahead.tokens != plain.tokens {
            failures.push(format!(
                "{case}: stop {stop}: plain {:?} ahead {:?}",
                plain.tokens, ahead.tokens
            ));
            continue;
        }
        let mut want = prompt.clone();
        want.extend(&ahead.tokens);
        if ahead_gen.cached_tokens() != want.as_slice()
            || plain_gen.cached_tokens() != &want[..want.len() - 1]
        {
            failures.push(format!(
                "{case}: cached {} (lookahead) and {} (plain), want {} and {}",
                ahead_gen.cached_tokens().len(),
                plain_gen.cached_tokens().len(),
                want.len(),
                want.len() - 1
            ));
        }
        // The next turn reuses the cache, the stop token's K/V included.
        if dtype == DType::F32 {
            want.extend([7, 8, 9]);
            let next = ahead_gen.generate(&want)?;
            let fresh = model
                .generator(options(false, 24, Some(stop)))
                .generate(&want)?;
            if next.tokens != fresh.tokens || next.stats.prefilled_tokens != 3 {
                failures.push(format!(
                    "{case}: next turn {:?} (prefilled {}), fresh {:?}",
                    next.tokens, next.stats.prefilled_tokens, fresh.tokens
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}
