//! Decoding one step ahead (`GenOptions::lookahead`), greedy and with tempered sampling drawn
//! on the device (with and without filters), against the same decoding without it on the same model: the same tokens,
//! with and without a stop token, in f32 and bf16 (bf16 steps replay CUDA graphs fed the
//! previous step's ids on the device); the cache holds the last token too after a stop (which
//! shows that the generation ran ahead), and the next prompt that reuses it continues as a
//! fresh generation. A `BatchSession` decoding ahead, with rows joining, finishing and being
//! cancelled, gives the tokens it gives without it.

use anyhow::Result;
use candle_core::DType;
use candle_gemma::generate::sampling::SamplingOptions;
use candle_gemma::generate::{BatchSession, SeqId};
use candle_gemma::{GenOptions, Model};

use crate::support::{fixture_config as config, gpu};

#[test]
fn lookahead_gives_plain_greedy_tokens_and_caches_the_last_one() -> Result<()> {
    let Some(gpu) = gpu("lookahead") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    for (fixture, dtype, tempered) in ["e2b-hf", "moe-mlx"].into_iter().flat_map(|f| {
        [DType::F32, DType::BF16]
            .into_iter()
            .flat_map(move |d| [None, Some(18), Some(17)].map(|t| (f, d, t)))
    }) {
        // Greedy, or tempered with seed 18 (drawn on the device over the whole row) or 17
        // (drawn on the device under filters).
        let options = |l, m, s| row(l, tempered, m, s);
        let model = Model::random(config(fixture)?, &gpu.dev, dtype, 11)?;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 500).collect();
        let case = format!("{fixture} {dtype:?} tempered {tempered:?}");
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

/// Options of one generation: greedy, or tempered with this seed (temperature 0.8, drawn on the
/// device: odd seeds under top-k 40, top-p 0.9 and min-p 0.02, even ones without filters); a
/// budget; a stop token.
fn row(lookahead: bool, tempered: Option<u64>, max_tokens: usize, stop: Option<u32>) -> GenOptions {
    let filtered = tempered.is_some_and(|s| s % 2 == 1);
    GenOptions {
        max_tokens,
        ignore_eos: true,
        extra_eos: stop.into_iter().collect(),
        lookahead,
        sampling: SamplingOptions {
            temperature: if tempered.is_some() { 0.8 } else { 0.0 },
            top_k: filtered.then_some(40),
            top_p: filtered.then_some(0.9),
            min_p: filtered.then_some(0.02),
            seed: tempered.unwrap_or(0),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Every token each sequence got, by id, and the finished sequences' cached tokens with their
/// caches' lengths.
type BatchRun = (Vec<(SeqId, Vec<u32>)>, Vec<(SeqId, Vec<u32>, Vec<usize>)>);

/// A batch with churn: four rows of different budgets and samplings (greedy, filtered and
/// unfiltered draws side by side), one with a stop token; a prompt that joins in chunks after step 3 and another
/// added at once after step 5; a row cancelled after step 7.
fn churn(model: &Model, lookahead: bool, stop: u32) -> Result<BatchRun> {
    let prompt =
        |p: u32, n: u32| -> Vec<u32> { (0..n).map(|i| (i * 31 + p * 13 + 2) % 500).collect() };
    let mut session = BatchSession::new(model, row(lookahead, None, 8, None));
    session.set_keep_finished(true);
    session.set_prefill_chunk(8);
    session.add_with(&prompt(0, 12), row(lookahead, None, 6, None))?;
    session.add_with(&prompt(1, 9), row(lookahead, Some(3), 14, None))?;
    session.add_with(&prompt(2, 15), row(lookahead, None, 20, Some(stop)))?;
    let cancelled = session.add_with(&prompt(3, 7), row(lookahead, Some(4), 20, None))?;
    let mut tokens: Vec<(SeqId, Vec<u32>)> = Vec::new();
    let mut finished = Vec::new();
    for step in 0..40 {
        if step == 3 {
            session.enqueue(prompt(4, 21), row(lookahead, Some(5), 10, None), None)?;
        }
        if step == 5 {
            session.add_with(&prompt(5, 5), row(lookahead, None, 9, None))?;
        }
        if step == 7 {
            session.cancel(cancelled)?;
        }
        for (id, s) in session.step()? {
            match tokens.iter_mut().find(|t| t.0 == id) {
                Some(t) => t.1.push(s.token),
                None => tokens.push((id, vec![s.token])),
            }
        }
        for f in session.take_finished() {
            finished.push((f.id, f.tokens, f.cache.offsets()));
        }
        if session.is_empty() {
            break;
        }
    }
    tokens.sort_by_key(|t| t.0);
    finished.sort_by_key(|f| f.0);
    Ok((tokens, finished))
}

#[test]
fn batches_decoding_ahead_give_the_same_tokens() -> Result<()> {
    let Some(gpu) = gpu("batch lookahead") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let model = Model::random(config("e2b-hf")?, &gpu.dev, dtype, 12)?;
        // The stop token: the third row's first token from its third on that it had not
        // given before (so that it stops on a step that ran ahead).
        let (plain, _) = churn(&model, false, u32::MAX)?;
        let third = plain.get(2).map(|t| t.1.clone()).unwrap_or_default();
        let fresh = (2..third.len()).find(|&i| !third[..i].contains(&third[i]));
        let stop = fresh.map_or(u32::MAX, |i| third[i]);
        let (plain, plain_done) = churn(&model, false, stop)?;
        let (ahead, ahead_done) = churn(&model, true, stop)?;
        println!("{dtype:?}: {plain:?}");
        if ahead != plain {
            failures.push(format!("{dtype:?}: ahead {ahead:?} against {plain:?}"));
        }
        // Every finished cache holds exactly the tokens it says; the stopped row ran its stop
        // token through the model ahead, and without lookahead it did not.
        for (id, cached, offsets) in plain_done.iter().chain(&ahead_done) {
            if offsets != &[cached.len()] {
                failures.push(format!(
                    "{dtype:?} {id:?}: {offsets:?} for {} tokens",
                    cached.len()
                ));
            }
        }
        let stopped = |done: &[(SeqId, Vec<u32>, Vec<usize>)]| {
            done.iter()
                .find(|f| f.0 == SeqId(2))
                .map(|f| f.1.last() == Some(&stop))
        };
        if stopped(&ahead_done) != Some(true) || stopped(&plain_done) != Some(false) {
            failures.push(format!(
                "{dtype:?}: stop token cached ahead {:?}, plain {:?}",
                stopped(&ahead_done),
                stopped(&plain_done)
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}
