//! Per-sequence options in one batch on the tiny fixtures: sequences with different cache
//! layouts (simple, rotating, 8-bit and 4-bit KV) and different sampling, stops and budgets
//! decode together and each gives exactly its single-decode output; joining by chunked prefill
//! gives the same tokens; cancellation and finished caches; option validation names the field.

mod common;

use candle_gemma::generate::{BatchSession, SamplingOptions, SeqId};
use candle_gemma::kv::{CacheMode, QuantSpec};
use candle_gemma::{CacheConfig, Error, FinishReason, GenOptions, Model};
use common::*;

/// Greedy options of one layout, `n` tokens past EOS.
fn greedy(cache: CacheConfig, n: usize) -> GenOptions {
    GenOptions {
        max_tokens: n,
        ignore_eos: true,
        cache,
        ..Default::default()
    }
}

/// Tokens, text and finish of one sequence decoded alone.
fn single(model: &Model, prompt: &[u32], options: &GenOptions) -> (Vec<u32>, String, FinishReason) {
    let out = model
        .generator(options.clone())
        .generate(prompt)
        .expect("single decode");
    (out.tokens, out.text, out.finish)
}

/// Drains a session: tokens, text and finish per id (in id order).
fn drain(
    session: &mut BatchSession<'_>,
    n: usize,
) -> Vec<(Vec<u32>, String, Option<FinishReason>)> {
    let mut got = vec![(Vec::new(), String::new(), None); n];
    let mut steps = 0;
    while !session.is_empty() {
        for (SeqId(id), step) in session.step().expect("step") {
            assert!(got[id].2.is_none(), "sequence {id} stepped after finishing");
            got[id].0.push(step.token);
            got[id].1.push_str(&step.text);
            got[id].2 = step.finish;
        }
        steps += 1;
        assert!(steps < 200, "the batch never drained");
    }
    got
}

#[test]
fn mixed_layouts_in_one_batch_equal_single_decode() {
    for name in ["e2b-hf", "moe-mlx"] {
        let model = load(name);
        let prompts: Vec<Vec<u32>> = golden(name).into_iter().map(|c| c.prompt).collect();
        let mut jobs = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            for (j, (label, cfg)) in cache_layouts().into_iter().enumerate() {
                // Different budgets, so sequences leave at different steps.
                jobs.push((label, p.clone(), greedy(cfg, 6 + (i + j) % 4 * 2)));
            }
        }
        let want: Vec<_> = jobs.iter().map(|(_, p, o)| single(&model, p, o)).collect();
        // A quantized cache quantizes what earlier chunks stored, so chunked prefill is
        // compared with single decode over the same chunks.
        let want_chunked: Vec<_> = jobs
            .iter()
            .map(|(_, p, o)| {
                let o = GenOptions {
                    prefill_chunk: Some(5),
                    ..o.clone()
                };
                single(&model, p, &o)
            })
            .collect();

        // Prefilled at once.
        let mut session = BatchSession::new(&model, GenOptions::default());
        for (_, p, o) in &jobs {
            session.add_with(p, o.clone()).expect("add_with");
        }
        let got = drain(&mut session, jobs.len());
        // Joining by chunked prefill, 5 tokens a chunk.
        let mut session = BatchSession::new(&model, GenOptions::default());
        session.set_prefill_chunk(5);
        for (_, p, o) in &jobs {
            session
                .enqueue(p.clone(), o.clone(), None)
                .expect("enqueue");
        }
        let chunked = drain(&mut session, jobs.len());

        for (k, (label, p, _)) in jobs.iter().enumerate() {
            for (how, g, w) in [
                ("add_with", &got[k], &want[k]),
                ("enqueue", &chunked[k], &want_chunked[k]),
            ] {
                assert_eq!(
                    g.0,
                    w.0,
                    "{name} {how}: {label} sequence of {} prompt tokens differs from single decode",
                    p.len()
                );
                assert_eq!(g.1, w.1, "{name} {how}: {label} text");
                assert_eq!(g.2, Some(w.2), "{name} {how}: {label} finish");
            }
        }
    }
}

#[test]
fn per_sequence_sampling_stops_and_eos_equal_single_decode() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let lay = cache_layouts();
    let sampled = |seed, cache| GenOptions {
        max_tokens: 10,
        sampling: SamplingOptions {
            temperature: 0.9,
            top_k: Some(40),
            top_p: Some(0.95),
            seed,
            ..Default::default()
        },
        cache,
        ..Default::default()
    };
    // A stop string cut from the greedy text of prompt 0, and that text's third token as an
    // extra EOS.
    let (g_tokens, g_text, _) = single(&model, &prompts[0], &greedy(lay[1].1, 10));
    let stop: String = g_text.chars().skip(3).take(2).collect();
    let mut jobs = vec![
        (prompts[0].clone(), sampled(7, lay[0].1)),
        (prompts[1].clone(), sampled(8, lay[3].1)),
        (prompts[0].clone(), sampled(7, lay[2].1)),
        (
            prompts[2].clone(),
            GenOptions {
                sampling: SamplingOptions {
                    temperature: 0.7,
                    min_p: Some(0.05),
                    repetition_penalty: Some(1.3),
                    seed: 99,
                    ..Default::default()
                },
                ..sampled(0, lay[1].1)
            },
        ),
        (
            prompts[0].clone(),
            GenOptions {
                ignore_eos: false,
                extra_eos: vec![g_tokens[2]],
                ..greedy(lay[1].1, 10)
            },
        ),
        (prompts[1].clone(), greedy(lay[2].1, 3)),
    ];
    let with_stop = !stop.trim().is_empty();
    if with_stop {
        jobs.push((
            prompts[0].clone(),
            GenOptions {
                stop_strings: vec![stop.clone()],
                ..greedy(lay[1].1, 10)
            },
        ));
    }
    // Prefill in chunks of 8 everywhere: `add_with` and the reference follow the options,
    // `enqueue` the session's chunk.
    for (_, o) in jobs.iter_mut() {
        o.prefill_chunk = Some(8);
    }
    let want: Vec<_> = jobs.iter().map(|(p, o)| single(&model, p, o)).collect();
    assert!(
        matches!(want[4].2, FinishReason::Eos(t) if t == g_tokens[2]),
        "the extra EOS ends the reference"
    );
    assert!(with_stop, "greedy text {g_text:?} has a stop string to cut");
    assert_eq!(
        want[6].2,
        FinishReason::Stop(0),
        "the stop string ends the reference"
    );
    let mut session = BatchSession::new(&model, GenOptions::default());
    session.set_prefill_chunk(8);
    for (k, (p, o)) in jobs.iter().enumerate() {
        // Half join prefilled, half by chunks.
        if k % 2 == 0 {
            session.add_with(p, o.clone()).expect("add_with");
        } else {
            session
                .enqueue(p.clone(), o.clone(), None)
                .expect("enqueue");
        }
    }
    let got = drain(&mut session, jobs.len());
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "job {k}: tokens differ from single decode");
        assert_eq!(g.1, w.1, "job {k}: text");
        assert_eq!(g.2, Some(w.2), "job {k}: finish");
    }
}

#[test]
fn cancel_frees_the_cache_and_finished_caches_hold_their_tokens() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let lay = cache_layouts();
    let mut session = BatchSession::new(&model, GenOptions::default());
    session.set_keep_finished(true);
    session.set_prefill_chunk(4);
    let a = session
        .add_with(&prompts[0], greedy(lay[3].1, 30))
        .expect("a");
    let b = session
        .enqueue(prompts[2].clone(), greedy(lay[0].1, 30), None)
        .expect("b");
    let c = session
        .add_with(&prompts[1], greedy(lay[2].1, 4))
        .expect("c");
    for _ in 0..3 {
        session.step().expect("step");
    }
    assert!(session.kv_bytes() > 0);
    assert!(session.cancel(b).expect("cancel b"), "b was joining");
    assert!(session.cancel(a).expect("cancel a"), "a was live");
    assert!(!session.cancel(a).expect("cancel a again"), "a is gone");
    let rest = session.run_to_end().expect("run");
    assert!(rest.iter().all(|(id, _, _)| *id == c), "only c is left");
    assert_eq!(session.kv_bytes(), 0, "every cache freed");

    let finished = session.take_finished();
    assert_eq!(finished.len(), 1, "cancelled sequences leave no cache");
    let f = &finished[0];
    let want = single(&model, &prompts[1], &greedy(lay[2].1, 4)).0;
    assert_eq!(f.id, c);
    assert_eq!(f.tokens[..prompts[1].len()], prompts[1][..]);
    assert_eq!(f.tokens[prompts[1].len()..], want[..want.len() - 1]);
    assert_eq!(f.cache.offsets(), vec![f.tokens.len()]);
}

#[test]
fn invalid_options_name_the_field() {
    let model = load("e2b-hf");
    let prompt = golden("e2b-hf").remove(0).prompt;
    let with = |f: &dyn Fn(&mut GenOptions)| {
        let mut o = GenOptions::default();
        f(&mut o);
        o
    };
    let cases: Vec<(&str, GenOptions)> = vec![
        ("temperature", with(&|o| o.sampling.temperature = f32::NAN)),
        ("temperature", with(&|o| o.sampling.temperature = -0.5)),
        (
            "temperature",
            with(&|o| o.sampling.temperature = f32::INFINITY),
        ),
        ("top_p", with(&|o| o.sampling.top_p = Some(2.0))),
        ("top_p", with(&|o| o.sampling.top_p = Some(0.0))),
        ("top_p", with(&|o| o.sampling.top_p = Some(f32::NAN))),
        ("min_p", with(&|o| o.sampling.min_p = Some(-0.1))),
        ("min_p", with(&|o| o.sampling.min_p = Some(1.5))),
        (
            "repetition_penalty",
            with(&|o| o.sampling.repetition_penalty = Some(0.0)),
        ),
        (
            "repetition_penalty",
            with(&|o| o.sampling.repetition_penalty = Some(f32::NAN)),
        ),
        (
            "logit_bias",
            with(&|o| o.sampling.logit_bias = vec![(3, 1.0), (4, 100.5)]),
        ),
        (
            "logit_bias",
            with(&|o| o.sampling.logit_bias = vec![(3, f32::NAN)]),
        ),
        ("max_tokens", with(&|o| o.max_tokens = 0)),
        ("prefill_chunk", with(&|o| o.prefill_chunk = Some(0))),
        (
            "cache.group_size",
            with(&|o| {
                o.cache.mode = CacheMode::Quantized(QuantSpec {
                    group_size: 48,
                    ..Default::default()
                })
            }),
        ),
    ];
    let named = |r: Result<_, Error>, field: &str, how: &str| match r {
        Err(Error::InvalidOption { field: f, reason }) => {
            assert_eq!(f, field, "{how}: wrong field ({reason})");
            assert!(
                Error::InvalidOption { field: f, reason }
                    .to_string()
                    .contains(field),
                "{how}: the message names the field"
            );
        }
        other => panic!("{how}: {field} accepted or wrong error: {other:?}"),
    };
    for (field, o) in cases {
        named(o.validate(), field, "validate");
        named(
            model.generator(o.clone()).generate(&prompt).map(|_| ()),
            field,
            "generator",
        );
        let mut session = BatchSession::new(&model, GenOptions::default());
        named(
            session.add_with(&prompt, o.clone()).map(|_| ()),
            field,
            "add_with",
        );
        named(
            session.enqueue(prompt.clone(), o, None).map(|_| ()),
            field,
            "enqueue",
        );
        assert!(session.is_empty(), "nothing joined");
    }
    // Edge values that are fine.
    let ok = GenOptions {
        sampling: SamplingOptions {
            temperature: 0.0,
            top_p: Some(1.0),
            min_p: Some(0.0),
            repetition_penalty: Some(1.0),
            logit_bias: vec![(0, -100.0), (1, 100.0)],
            ..Default::default()
        },
        max_tokens: 1,
        ..Default::default()
    };
    ok.validate().expect("edge values are valid");
}

#[test]
fn joiners_with_equal_chunks_share_a_step_and_longer_ones_follow_chunk_by_chunk() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let lay = cache_layouts();
    let jobs = [
        (prompts[0].clone(), lay[3].1), // 7 tokens, 4-bit
        (prompts[0].clone(), lay[0].1), // 7 tokens, simple
        (prompts[1].clone(), lay[2].1), // 19 tokens, 8-bit: chunks of 16 and 3
    ];
    let mut session = BatchSession::new(&model, GenOptions::default());
    session.set_prefill_chunk(16);
    for (p, cfg) in &jobs {
        session
            .enqueue(p.clone(), greedy(*cfg, 5), None)
            .expect("enqueue");
    }
    let mut first_step = [None; 3];
    let mut got = vec![Vec::new(); 3];
    let mut step = 0;
    while !session.is_empty() {
        step += 1;
        for (SeqId(id), s) in session.step().expect("step") {
            first_step[id].get_or_insert(step);
            got[id].push(s.token);
        }
    }
    assert_eq!(
        first_step,
        [Some(1), Some(1), Some(3)],
        "both 7-token prompts prefill in step 1; the 19-token one in steps 2 and 3"
    );
    for (k, (p, cfg)) in jobs.iter().enumerate() {
        let o = GenOptions {
            prefill_chunk: Some(16),
            ..greedy(*cfg, 5)
        };
        assert_eq!(
            got[k],
            single(&model, p, &o).0,
            "job {k} equals single decode"
        );
    }
}

#[test]
fn logprobs_are_the_models_log_softmax_in_single_and_batched_decode() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let options = |seed, top| GenOptions {
        max_tokens: 5,
        ignore_eos: true,
        logprobs: Some(top),
        sampling: SamplingOptions {
            temperature: 0.8,
            top_k: Some(30),
            seed,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut single_runs = Vec::new();
    for (i, prompt) in prompts.iter().enumerate().take(3) {
        let mut generator = model.generator(options(i as u64, 3));
        let steps: Vec<_> = generator
            .stream(prompt)
            .expect("stream")
            .collect::<candle_gemma::Result<Vec<_>>>()
            .expect("steps");
        // The first token's log-probability, from the prompt's logits on the host.
        let mut cache = model.new_cache(&CacheConfig::default()).expect("cache");
        let host = log_softmax(&step(&model, &mut cache, prompt));
        let first = steps[0].logprobs.as_ref().expect("logprobs asked");
        let want = host[steps[0].token as usize];
        assert!(
            (f64::from(first.logprob) - want).abs() < 1e-4,
            "{first:?} vs {want}"
        );
        for s in &steps {
            let lp = s.logprobs.as_ref().expect("every step");
            assert_eq!(lp.top.len(), 3);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
            assert!(
                lp.logprob <= lp.top[0].1 + 1e-6 && lp.logprob <= 0.0,
                "{lp:?}"
            );
            // A top-30 draw is among the 30 best; when it is among the 3 best, the values agree.
            if let Some(t) = lp.top.iter().find(|t| t.0 == s.token) {
                assert!((t.1 - lp.logprob).abs() < 1e-6, "{lp:?}");
            }
        }
        single_runs.push(steps);
    }
    // The same sequences batched, one without logprobs.
    let mut session = BatchSession::new(&model, options(0, 3));
    for (i, prompt) in prompts.iter().enumerate().take(3) {
        let mut o = options(i as u64, 3);
        if i == 1 {
            o.logprobs = None;
        }
        session.add_with(prompt, o).expect("add");
    }
    let mut batched: Vec<Vec<candle_gemma::StepOutput>> = vec![Vec::new(); 3];
    while !session.is_empty() {
        for (id, step) in session.step().expect("step") {
            batched[id.0].push(step);
        }
    }
    for (i, (b, s)) in batched.iter().zip(&single_runs).enumerate() {
        let tokens = |x: &[candle_gemma::StepOutput]| x.iter().map(|t| t.token).collect::<Vec<_>>();
        assert_eq!(tokens(b), tokens(s), "sequence {i}");
        for (bs, ss) in b.iter().zip(s) {
            match (&bs.logprobs, i) {
                (None, 1) => {}
                (Some(lp), _) if i != 1 => {
                    let want = ss.logprobs.as_ref().expect("single");
                    assert!(
                        (lp.logprob - want.logprob).abs() < 1e-4,
                        "{lp:?} vs {want:?}"
                    );
                    let ids = |l: &candle_gemma::generate::TokenLogprobs| {
                        l.top.iter().map(|t| t.0).collect::<Vec<_>>()
                    };
                    assert_eq!(ids(lp), ids(want));
                }
                other => panic!("sequence {i}: logprobs {other:?}"),
            }
        }
    }
    let mut bad = options(0, 3);
    bad.logprobs = Some(21);
    assert!(matches!(
        bad.validate(),
        Err(Error::InvalidOption {
            field: "logprobs",
            ..
        })
    ));
}
