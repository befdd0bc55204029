//! Sampling from each row's best logits picked on the device: the top-k kernel's candidates
//! against the host sampler's order (ties, NaN, -inf, signed zeros, keys that overflow, greedy
//! rows), sampled generation through the narrowed paths against the same generation reading
//! whole rows (`Generator` and `BatchSession`), tempered draws made on the device (over whole
//! rows, and from the candidates under top-k, top-p and min-p) against the host's draws, top-p and min-p draws from the candidates and the row's softmax mass against
//! whole rows, and token log-probabilities computed on the device against the host's
//! log-softmax.

use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_gemma::generate::sampling::{Sampler, SamplingOptions};
use candle_gemma::generate::BatchSession;
use candle_gemma::kernels::cuda::reduce::{draw_rows, draw_words, DRAW_WORDS};
use candle_gemma::kernels::cuda::top_k::{draw_from_best, key_mass_chunks, top_k_rows, TOP_K_MAX};
use candle_gemma::{GenOptions, Model};

use crate::support::{fixture_config as config, gpu};

/// The host sampler's order: key `logit / t` (the logit plus 0 where `t` is 0), largest first
/// by `total_cmp`, the lowest id first, NaN and -inf logits last.
fn best_by_order(logits: &[f32], t: f32, k: usize) -> Vec<u32> {
    let key = |l: f32| -> Option<f32> {
        (l > f32::NEG_INFINITY).then(|| if t > 0.0 { l / t } else { l + 0.0 })
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(
        |&a, &b| match (key(logits[a as usize]), key(logits[b as usize])) {
            (Some(x), Some(y)) => y.total_cmp(&x).then(a.cmp(&b)),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => a.cmp(&b),
        },
    );
    ids.truncate(k);
    ids
}

/// A row of coarse values (so keys tie), with NaN, -inf, signed zeros and a few huge logits.
fn row(cols: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..cols)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            match s % 97 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => -0.0,
                3 => 0.0,
                4 => 3.0e38,
                v => (v % 40) as f32 * 0.125 - 2.0 + if s.is_multiple_of(5) { 1e-3 } else { 0.0 },
            }
        })
        .collect()
}

#[test]
fn top_k_rows_follow_the_samplers_order() -> Result<()> {
    let Some(gpu) = gpu("top_k_rows") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    let temps = [1.0f32, 0.0, 0.7, 1e-30, 2.5];
    for cols in [1, 700, 5000, 262_144] {
        let rows: Vec<Vec<f32>> = (0..temps.len() as u64)
            .map(|r| row(cols, r * 31 + cols as u64))
            .collect();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (rows.len(), cols), &gpu.dev)?;
        for k in [1, 64, 1000, TOP_K_MAX] {
            let (values, ids) = top_k_rows(&logits, &temps, k)?;
            let (values, ids) = (values.to_vec2::<f32>()?, ids.to_vec2::<u32>()?);
            for (r, (row, t)) in rows.iter().zip(temps).enumerate() {
                let want = best_by_order(row, t, k);
                let got_values_match = ids[r]
                    .iter()
                    .zip(&values[r])
                    .all(|(&i, &v)| row[i as usize].to_bits() == v.to_bits());
                if ids[r] != want || !got_values_match {
                    let at = ids[r].iter().zip(&want).position(|(a, b)| a != b);
                    failures.push(format!(
                        "cols {cols} k {k} t {t}: first difference at {at:?} of {} (values match: {got_values_match})",
                        want.len()
                    ));
                }
            }
            println!("top_k_rows cols {cols} k {k}: checked {} rows", rows.len());
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

/// Sampled generation options; a top-k at least the vocabulary (512) keeps every token, so
/// `top_k` 512 and 5000 (above the device's limit: whole rows read) draw alike. At 512 a
/// sampler with penalties draws on the host from candidates picked on the device (k plus the
/// tokens the penalties touch: at most 1,024), one without draws on the device.
fn sampled(top_k: usize, seed: u64) -> GenOptions {
    GenOptions {
        max_tokens: 20,
        ignore_eos: true,
        sampling: SamplingOptions {
            temperature: 1.0,
            top_k: Some(top_k),
            top_p: Some(0.9),
            // Odd seeds add penalties that lower logits: the device then picks k plus the
            // touched tokens, and the host penalizes those.
            repetition_penalty: (seed % 2 == 1).then_some(1.3),
            frequency_penalty: (seed % 2 == 1).then_some(0.4),
            presence_penalty: (seed % 2 == 1).then_some(0.6),
            seed,
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn sampling_from_device_picked_candidates_draws_what_whole_rows_draw() -> Result<()> {
    let Some(gpu) = gpu("sampling from candidates") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let model = Model::random(config("e2b-hf")?, &gpu.dev, dtype, 5)?;
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|p| (0..12 + p).map(|i| (i * 29 + p * 7 + 3) % 500).collect())
            .collect();
        for (p, prompt) in prompts.iter().enumerate() {
            let seed = 40 + p as u64;
            let narrowed = model.generator(sampled(512, seed)).generate(prompt)?.tokens;
            let whole = model
                .generator(sampled(5000, seed))
                .generate(prompt)?
                .tokens;
            println!("{dtype:?} prompt {p}: {narrowed:?}");
            if narrowed != whole {
                failures.push(format!(
                    "{dtype:?} generator {p}: {narrowed:?} vs {whole:?}"
                ));
            }
        }
        // A batch of the three: sampled with penalties, greedy with a repetition penalty (its
        // row is picked among the candidates too), sampled without.
        let batch = |top_k: usize| -> Result<Vec<Vec<u32>>> {
            let mut session = BatchSession::new(&model, sampled(top_k, 0));
            for (p, prompt) in prompts.iter().enumerate() {
                let mut o = sampled(top_k, [41, 0, 42][p]);
                if p == 1 {
                    o.sampling = SamplingOptions {
                        repetition_penalty: Some(1.2),
                        ..SamplingOptions::default()
                    };
                }
                session.add_with(prompt, o)?;
            }
            Ok(session
                .run_to_end()?
                .into_iter()
                .map(|(_, t, _)| t)
                .collect())
        };
        let (narrowed, whole) = (batch(512)?, batch(5000)?);
        if narrowed != whole {
            failures.push(format!("{dtype:?} batch: {narrowed:?} vs {whole:?}"));
        }
        if narrowed.iter().all(|t| t.len() != 20) {
            failures.push(format!("{dtype:?} batch: lengths {narrowed:?}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

#[test]
fn draws_on_the_device_equal_the_hosts() -> Result<()> {
    let Some(gpu) = gpu("draw_rows") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    let temps = [1.0f32, 0.7, 1e-30, 2.5, 0.05];
    for cols in [1, 700, 5000, 262_144] {
        let rows: Vec<Vec<f32>> = (0..temps.len() as u64)
            .map(|r| row(cols, r * 17 + cols as u64))
            .collect();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (rows.len(), cols), &gpu.dev)?;
        let opts = |r: usize| SamplingOptions {
            temperature: temps[r],
            seed: 1000 + r as u64,
            ..Default::default()
        };
        let mut host: Vec<Sampler> = (0..rows.len()).map(|r| Sampler::new(opts(r))).collect();
        let mut device = host.clone();
        for step in 0..12 {
            let params: Vec<[u32; DRAW_WORDS]> = device
                .iter()
                .map(|s| draw_words(&s.device_draw(&[]).expect("a plain tempered sampler")))
                .collect();
            let ids = draw_rows(&logits, &params)?.to_vec1::<u32>()?;
            for (r, id) in ids.into_iter().enumerate() {
                device[r].accept_device_draw(id);
                let want = host[r].sample(&rows[r], &[]);
                if want != id {
                    failures.push(format!(
                        "cols {cols} t {} step {step}: {id} vs {want}",
                        temps[r]
                    ));
                }
            }
        }
        println!(
            "draw_rows cols {cols}: checked {} rows x 12 draws",
            rows.len()
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

/// The filters of the draws from candidates: (top-k, top-p, min-p).
const FILTERS: [(usize, Option<f32>, Option<f32>); 6] = [
    (1, None, None),
    (64, Some(0.95), None),
    (64, None, Some(0.05)),
    (1000, Some(0.5), Some(0.2)),
    (TOP_K_MAX, Some(0.99), None),
    (40, Some(0.9), Some(0.01)),
];

#[test]
fn filtered_draws_on_the_device_equal_the_hosts() -> Result<()> {
    let Some(gpu) = gpu("draw_from_best") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    let temps = [1.0f32, 0.7, 2.5, 0.05];
    for cols in [1, 700, 5000, 262_144] {
        // Coarse rows (flat: top-p cuts late) and the same scaled by 6 (peaked: it cuts early);
        // each row takes another filter, so one launch mixes top-k sizes.
        let rows: Vec<Vec<f32>> = (0..2 * temps.len())
            .map(|r| {
                let scale = if r % 2 == 0 { 1.0 } else { 6.0 };
                row(cols, r as u64 * 13 + cols as u64)
                    .into_iter()
                    .map(|v| v * scale)
                    .collect()
            })
            .collect();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (rows.len(), cols), &gpu.dev)?;
        let opts = |r: usize| {
            let (top_k, top_p, min_p) = FILTERS[r % FILTERS.len()];
            SamplingOptions {
                temperature: temps[r / 2],
                top_k: Some(top_k),
                top_p,
                min_p,
                seed: 2000 + r as u64,
                ..Default::default()
            }
        };
        let mut host: Vec<Sampler> = (0..rows.len()).map(|r| Sampler::new(opts(r))).collect();
        let mut device = host.clone();
        for step in 0..12 {
            let draws: Vec<_> = device
                .iter()
                .map(|s| s.device_draw(&[]).expect("a filtered tempered sampler"))
                .collect();
            let k = draws.iter().filter_map(|d| d.filter).map(|f| f.top_k).max();
            let temps: Vec<f32> = draws.iter().map(|d| d.temperature).collect();
            let (values, ids) = top_k_rows(&logits, &temps, k.unwrap_or(1))?;
            let params: Vec<[u32; DRAW_WORDS]> = draws.iter().map(draw_words).collect();
            let got = draw_from_best(&values, &ids, &params)?.to_vec1::<u32>()?;
            for (r, id) in got.into_iter().enumerate() {
                device[r].accept_device_draw(id);
                let want = host[r].sample(&rows[r], &[]);
                if want != id {
                    failures.push(format!(
                        "cols {cols} row {r} ({:?}) step {step}: {id} vs {want}",
                        opts(r)
                    ));
                }
            }
        }
        println!(
            "draw_from_best cols {cols}: checked {} rows x 12 draws",
            rows.len()
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

/// Temperature-only sampling (drawn on the device over the whole row), a top-k of the whole
/// vocabulary (512: drawn on the device from its candidates) and one above the device's limit
/// (whole rows on the host) keep every token, so they draw alike.
fn tempered(top_k: Option<usize>, seed: u64) -> GenOptions {
    GenOptions {
        max_tokens: 20,
        ignore_eos: true,
        sampling: SamplingOptions {
            temperature: 0.9,
            top_k,
            seed,
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn tempered_sampling_on_the_device_draws_what_the_host_draws() -> Result<()> {
    let Some(gpu) = gpu("tempered draws") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    let ways = [None, Some(512), Some(5000)];
    for dtype in [DType::F32, DType::BF16] {
        let model = Model::random(config("e2b-hf")?, &gpu.dev, dtype, 6)?;
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|p| (0..10 + p).map(|i| (i * 37 + p * 11 + 5) % 500).collect())
            .collect();
        for (p, prompt) in prompts.iter().enumerate() {
            let runs: Vec<Vec<u32>> = ways
                .iter()
                .map(|&k| {
                    Ok(model
                        .generator(tempered(k, 70 + p as u64))
                        .generate(prompt)?
                        .tokens)
                })
                .collect::<Result<_>>()?;
            println!("{dtype:?} prompt {p}: {:?}", runs[0]);
            if runs[0] != runs[1] || runs[0] != runs[2] || runs[0].len() != 20 {
                failures.push(format!("{dtype:?} generator {p}: {runs:?}"));
            }
        }
        // One batch whose rows take the three ways at once (a draw over the whole row, one from
        // the candidates, a whole row copied alone), against batches whose rows all take one
        // way.
        let batch = |ks: [Option<usize>; 3]| -> Result<Vec<Vec<u32>>> {
            let mut session = BatchSession::new(&model, tempered(None, 0));
            for (p, prompt) in prompts.iter().enumerate() {
                session.add_with(prompt, tempered(ks[p], 80 + p as u64))?;
            }
            Ok(session
                .run_to_end()?
                .into_iter()
                .map(|(_, t, _)| t)
                .collect())
        };
        let mixed = batch(ways)?;
        for k in ways {
            let same = batch([k; 3])?;
            if same != mixed {
                failures.push(format!(
                    "{dtype:?} batch {k:?}: {same:?} vs mixed {mixed:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

#[test]
fn nucleus_draws_from_device_candidates_and_mass_equal_the_hosts() -> Result<()> {
    let Some(gpu) = gpu("nucleus draws") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    let (mut narrowed, mut fallbacks) = (0, 0);
    let temps = [1.0f32, 0.7, 0.25, 2.0];
    for cols in [1, 700, 5000, 262_144] {
        // Rows of `row`'s coarse values, some sharpened (a low temperature) so that the
        // filters cut inside the candidates, some flat so that they cut past them.
        let rows: Vec<Vec<f32>> = (0..temps.len() as u64)
            .map(|r| {
                row(cols, r * 7 + cols as u64)
                    .into_iter()
                    .map(|v| if v.abs() < 1e30 { v * 4.0 } else { v })
                    .collect()
            })
            .collect();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let logits = Tensor::from_vec(flat, (rows.len(), cols), &gpu.dev)?;
        let sums = key_mass_chunks(&logits, &temps)?.to_vec2::<f64>()?;
        let (values, ids) = top_k_rows(&logits, &temps, TOP_K_MAX)?;
        let (values, ids) = (values.to_vec2::<f32>()?, ids.to_vec2::<u32>()?);
        for (r, row) in rows.iter().enumerate() {
            let t = temps[r];
            let mass: f64 = sums[r].iter().sum();
            let mut keys: Vec<f32> = row
                .iter()
                .filter(|l| **l > f32::NEG_INFINITY)
                .map(|l| l / t)
                .collect();
            keys.sort_by(|a, b| b.total_cmp(a));
            let host: f64 = keys.iter().map(|&k| ((k - keys[0]) as f64).exp()).sum();
            if (mass - host).abs() > 1e-12 * host.abs() {
                failures.push(format!("cols {cols} t {t}: mass {mass} against {host}"));
            }
            let best: Vec<(u32, f32)> = ids[r]
                .iter()
                .copied()
                .zip(values[r].iter().copied())
                .collect();
            for (c, (top_p, min_p)) in [
                (Some(0.9), None),
                (None, Some(0.1)),
                (Some(0.6), Some(0.02)),
            ]
            .into_iter()
            .enumerate()
            {
                let o = SamplingOptions {
                    temperature: t,
                    top_p,
                    min_p,
                    seed: 90 + c as u64,
                    ..Default::default()
                };
                let (mut host, mut device) = (Sampler::new(o.clone()), Sampler::new(o));
                for draw in 0..6 {
                    let want = host.sample(row, &[]);
                    let got = match device.sample_from_nucleus(&best, mass, cols) {
                        Some(id) => {
                            narrowed += 1;
                            id
                        }
                        None => {
                            fallbacks += 1;
                            device.sample(row, &[])
                        }
                    };
                    if want != got {
                        failures.push(format!(
                            "cols {cols} t {t} filters {c} draw {draw}: {got} vs {want}"
                        ));
                    }
                }
            }
        }
        println!(
            "nucleus cols {cols}: {narrowed} drawn from candidates, {fallbacks} whole rows so far"
        );
    }
    assert!(narrowed > 0 && fallbacks > 0, "{narrowed} / {fallbacks}");
    assert!(failures.is_empty(), "{failures:#?}");
    // Through `Generator` and `BatchSession`: top-p alone (candidates and mass: the fixture's
    // 512 tokens are fewer than the candidates) against a top-k of 5000, which keeps every
    // token and reads whole rows.
    let model = Model::random(config("e2b-hf")?, &gpu.dev, DType::BF16, 8)?;
    let nucleus = |top_k: Option<usize>, seed: u64| GenOptions {
        max_tokens: 16,
        ignore_eos: true,
        sampling: SamplingOptions {
            temperature: 0.5,
            top_k,
            top_p: Some(0.8),
            min_p: Some(0.01),
            seed,
            ..Default::default()
        },
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..11).map(|i| (i * 41 + 9) % 500).collect();
    let narrowed = model.generator(nucleus(None, 3)).generate(&prompt)?.tokens;
    let whole = model
        .generator(nucleus(Some(5000), 3))
        .generate(&prompt)?
        .tokens;
    assert_eq!(narrowed, whole, "generator");
    let batch = |top_k: Option<usize>| -> Result<Vec<Vec<u32>>> {
        let mut session = BatchSession::new(&model, nucleus(top_k, 0));
        for p in 0..3u64 {
            session.add_with(&prompt[p as usize..], nucleus(top_k, 30 + p))?;
        }
        Ok(session
            .run_to_end()?
            .into_iter()
            .map(|(_, t, _)| t)
            .collect())
    };
    assert_eq!(batch(None)?, batch(Some(5000))?, "batch");
    Ok(())
}

#[test]
fn logprobs_on_the_device_equal_the_log_softmax_on_the_host() -> Result<()> {
    let Some(gpu) = gpu("logprobs") else {
        return Ok(());
    };
    let model = Model::random(config("e2b-hf")?, &gpu.dev, DType::F32, 5)?;
    let prompt: Vec<u32> = (0..16).map(|i| (i * 31 + 7) % 500).collect();
    let options = GenOptions {
        max_tokens: 1,
        ignore_eos: true,
        logprobs: Some(4),
        ..Default::default()
    };
    let out = model.generator(options).stream(&prompt)?.next();
    let step = out.ok_or_else(|| anyhow::anyhow!("no step"))??;
    let lp = step
        .logprobs
        .ok_or_else(|| anyhow::anyhow!("no logprobs"))?;
    let mut cache = model.new_cache(&Default::default())?;
    let logits = model
        .forward(&[prompt], &mut cache)?
        .squeeze(0)?
        .to_vec1::<f32>()?;
    let norm = logits.iter().map(|&v| f64::from(v).exp()).sum::<f64>().ln();
    let want = |i: u32| f64::from(logits[i as usize]) - norm;
    let order = best_by_order(&logits, 0.0, 4);
    println!("logprobs: {lp:?}");
    assert!((f64::from(lp.logprob) - want(step.token)).abs() < 1e-4);
    assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), order);
    for (id, v) in &lp.top {
        assert!((f64::from(*v) - want(*id)).abs() < 1e-4, "{id}: {v}");
    }
    Ok(())
}
