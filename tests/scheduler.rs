//! The serving scheduler and engine on the tiny fixtures: chunked prefill interleaved with
//! decode, the KV budget, cancellation, the queue bound, and concurrent requests with mixed KV
//! layouts through the engine, each equal to the same request decoded alone.

mod common;

use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use candle_gemma::kv::{CacheMode, QuantBits};
use candle_gemma::serve::{
    kv_bytes_for, Engine, Event, RequestId, Scheduler, SchedulerConfig, SubmitError, Usage,
};
use candle_gemma::{CacheConfig, FinishReason, GenOptions, Model};
use common::*;

fn greedy(cache: CacheConfig, n: usize) -> GenOptions {
    GenOptions {
        max_tokens: n,
        ignore_eos: true,
        cache,
        ..Default::default()
    }
}

/// The request decoded alone, its prompt prefilled in the scheduler's chunks (a quantized
/// cache quantizes what earlier chunks stored, so the chunking is part of the request).
fn alone(model: &Model, prompt: &[u32], options: &GenOptions, chunk: usize) -> Vec<u32> {
    let options = GenOptions {
        prefill_chunk: Some(chunk),
        ..options.clone()
    };
    model
        .generator(options)
        .generate(prompt)
        .expect("single decode")
        .tokens
}

/// A request's events, gathered.
#[derive(Debug, Default, Clone)]
struct Seen {
    started: Option<(usize, usize)>,
    tokens: Vec<u32>,
    done: Option<(FinishReason, Usage)>,
    failed: Option<String>,
}

fn record(seen: &mut HashMap<RequestId, Seen>, id: RequestId, event: Event) {
    let s = seen.entry(id).or_default();
    match event {
        Event::Started {
            prompt_tokens,
            cached_tokens,
        } => s.started = Some((prompt_tokens, cached_tokens)),
        Event::Token(step) => s.tokens.push(step.token),
        Event::Done { finish, usage } => s.done = Some((finish, usage)),
        Event::Failed(e) => s.failed = Some(e.to_string()),
    }
}

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_batch: 8,
        kv_budget_bytes: 1 << 30,
        prefill_chunk: 4,
        max_queue: 64,
        prefix_cache_bytes: 0,
    }
}

#[test]
fn a_joining_prompt_costs_running_streams_one_chunk_per_step() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let long: Vec<u32> = prompts.iter().flatten().copied().collect(); // 59 tokens
    let mut s = Scheduler::new(&model, config()).expect("scheduler");
    let opts = [
        greedy(CacheConfig::default(), 40),
        greedy(quantized(QuantBits::Four), 40),
        greedy(quantized(QuantBits::Eight), 6),
    ];
    let a = s.submit(prompts[0].clone(), opts[0].clone()).expect("a");
    let b = s.submit(prompts[1].clone(), opts[1].clone()).expect("b");
    let mut seen = HashMap::new();
    while seen.len() < 2 || seen.values().any(|x: &Seen| x.tokens.is_empty()) {
        for (id, e) in s.step() {
            record(&mut seen, id, e);
        }
    }
    let c = s.submit(long.clone(), opts[2].clone()).expect("long");
    let mut steps = 0;
    loop {
        let before: Vec<usize> = [a, b].iter().map(|id| seen[id].tokens.len()).collect();
        for (id, e) in s.step() {
            record(&mut seen, id, e);
        }
        steps += 1;
        for (k, id) in [a, b].iter().enumerate() {
            assert_eq!(
                seen[id].tokens.len(),
                before[k] + 1,
                "step {steps}: a running stream got exactly one token while the long prompt joins"
            );
        }
        if seen.get(&c).is_some_and(|x| !x.tokens.is_empty()) {
            break;
        }
        assert!(steps < 40, "the long prompt never joined");
    }
    assert_eq!(
        steps,
        long.len().div_ceil(4),
        "one chunk of 4 tokens per step"
    );
    while !s.is_idle() {
        for (id, e) in s.step() {
            record(&mut seen, id, e);
        }
    }
    for (id, (p, o)) in [a, b, c].iter().zip([
        (&prompts[0], &opts[0]),
        (&prompts[1], &opts[1]),
        (&long, &opts[2]),
    ]) {
        assert_eq!(
            seen[id].tokens,
            alone(&model, p, o, 4),
            "{id:?} equals decode alone"
        );
        let (finish, usage) = seen[id].done.expect("done");
        assert_eq!(finish, FinishReason::Length);
        assert_eq!(usage.prompt_tokens, p.len());
        assert_eq!(usage.completion_tokens, o.max_tokens);
    }
}

#[test]
fn requests_beyond_the_kv_budget_wait_until_memory_frees() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let layout = quantized(QuantBits::Eight);
    let budgets = [20usize, 4, 4, 20];
    let reserve = |i: usize| kv_bytes_for(&model, &layout, prompts[1].len() + budgets[i]);
    let budget = reserve(0) + reserve(1);
    let mut s = Scheduler::new(
        &model,
        SchedulerConfig {
            kv_budget_bytes: budget,
            ..config()
        },
    )
    .expect("scheduler");
    let ids: Vec<RequestId> = budgets
        .iter()
        .map(|&n| {
            s.submit(prompts[1].clone(), greedy(layout, n))
                .expect("submit")
        })
        .collect();
    let mut seen = HashMap::new();
    let mut step = 0;
    let mut admitted_at = HashMap::new();
    let mut done_at = HashMap::new();
    while !s.is_idle() {
        for (id, e) in s.step() {
            match &e {
                Event::Started { .. } => {
                    admitted_at.insert(id, step);
                }
                Event::Done { .. } => {
                    done_at.insert(id, step);
                }
                _ => {}
            }
            record(&mut seen, id, e);
        }
        let stats = s.stats();
        assert!(stats.reserved_bytes <= budget, "step {step}: over budget");
        if step == 0 {
            assert_eq!((stats.running, stats.queued), (2, 2), "two fit, two wait");
        }
        step += 1;
        assert!(step < 200);
    }
    assert_eq!(
        admitted_at[&ids[2]],
        done_at[&ids[1]] + 1,
        "the third is admitted at the step after the second frees its memory"
    );
    assert!(
        admitted_at[&ids[3]] > done_at[&ids[0]].min(done_at[&ids[2]]),
        "the fourth waits for memory"
    );
    for (id, &n) in ids.iter().zip(&budgets) {
        let want = alone(&model, &prompts[1], &greedy(layout, n), 4);
        assert_eq!(seen[id].tokens, want, "{id:?} equals decode alone");
    }
    assert_eq!(s.stats().reserved_bytes, 0);
}

#[test]
fn cancel_frees_kv_and_the_queue_is_bounded() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let mut s = Scheduler::new(
        &model,
        SchedulerConfig {
            max_batch: 2,
            max_queue: 2,
            ..config()
        },
    )
    .expect("scheduler");
    let idle = s.stats();
    assert_eq!((idle.kv_bytes, idle.reserved_bytes), (0, 0));
    let layouts = [
        CacheConfig::default(),
        quantized(QuantBits::Four),
        quantized(QuantBits::Eight),
    ];
    let a = s
        .submit(prompts[2].clone(), greedy(layouts[0], 50))
        .expect("a");
    let b = s
        .submit(prompts[1].clone(), greedy(layouts[1], 50))
        .expect("b");
    assert!(matches!(
        s.submit(prompts[0].clone(), greedy(layouts[2], 50)),
        Err(SubmitError::QueueFull { .. })
    ));
    for _ in 0..12 {
        s.step();
    }
    let c = s
        .submit(prompts[0].clone(), greedy(layouts[2], 50))
        .expect("c");
    let d = s
        .submit(prompts[0].clone(), greedy(layouts[2], 50))
        .expect("d");
    assert!(matches!(
        s.submit(prompts[0].clone(), GenOptions::default()),
        Err(SubmitError::QueueFull { .. })
    ));
    let busy = s.stats();
    assert_eq!((busy.running, busy.queued), (2, 2));
    assert!(busy.kv_bytes > 0 && busy.reserved_bytes > 0);
    assert!(s.cancel(d), "queued request cancelled");
    assert!(s.cancel(a) && s.cancel(b), "running requests cancelled");
    assert!(!s.cancel(a), "already gone");
    let after = s.stats();
    assert_eq!(
        (
            after.kv_bytes,
            after.reserved_bytes,
            after.running,
            after.queued
        ),
        (0, 0, 0, 1),
        "KV back to the idle figure"
    );
    // The queue head is admitted at the next step.
    let events = s.step();
    assert!(events
        .iter()
        .any(|(id, e)| *id == c && matches!(e, Event::Started { .. })));
    assert!(s.cancel(c));
    assert_eq!(s.stats().kv_bytes, 0);
    // Invalid requests are refused before queueing.
    let mut bad = GenOptions::default();
    bad.sampling.top_p = Some(2.0);
    assert!(matches!(
        s.submit(prompts[0].clone(), bad),
        Err(SubmitError::Invalid(candle_gemma::Error::InvalidOption {
            field: "top_p",
            ..
        }))
    ));
    assert!(matches!(
        s.submit(vec![3; 5000], GenOptions::default()),
        Err(SubmitError::PromptTooLong {
            tokens: 5000,
            limit: 4096
        })
    ));
    assert!(matches!(
        s.submit(vec![3, 9999], GenOptions::default()),
        Err(SubmitError::Invalid(candle_gemma::Error::TokenOutOfVocab {
            id: 9999,
            ..
        }))
    ));
}

#[test]
fn engine_serves_16_concurrent_mixed_layout_requests_as_if_alone() {
    let model = Arc::new(load("e2b-hf"));
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let layouts = [
        CacheConfig::default(),
        quantized(QuantBits::Eight),
        quantized(QuantBits::Four),
    ];
    let jobs: Vec<(Vec<u32>, GenOptions)> = (0..16)
        .map(|i| {
            let p = &prompts[i % 3];
            let cut = p.len() - (i / 3) % p.len().min(5);
            (p[..cut].to_vec(), greedy(layouts[i % 3], 4 + i % 5))
        })
        .collect();
    let want: Vec<Vec<u32>> = jobs.iter().map(|(p, o)| alone(&model, p, o, 8)).collect();
    let engine = Engine::start(
        model.clone(),
        SchedulerConfig {
            max_batch: 6,
            prefill_chunk: 8,
            prefix_cache_bytes: 1 << 26,
            ..config()
        },
    )
    .expect("engine");
    let handles: Vec<_> = jobs
        .into_iter()
        .map(|(p, o)| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let (tx, rx) = mpsc::channel();
                engine
                    .submit(p, o, Box::new(move |e| tx.send(e).is_ok()))
                    .expect("submit");
                let mut tokens = Vec::new();
                for e in rx.iter() {
                    match e {
                        Event::Token(s) => tokens.push(s.token),
                        Event::Done { .. } => return tokens,
                        Event::Failed(e) => panic!("failed: {e}"),
                        Event::Started { .. } => {}
                    }
                }
                panic!("the sink was dropped before Done");
            })
        })
        .collect();
    for (i, (h, w)) in handles.into_iter().zip(&want).enumerate() {
        assert_eq!(
            &h.join().expect("client"),
            w,
            "request {i} equals decode alone"
        );
    }

    // A client that goes away mid-stream is cancelled and its cache freed.
    let (tx, rx) = mpsc::channel();
    let mut left = 3;
    engine
        .submit(
            prompts[2].clone(),
            greedy(layouts[2], 500),
            Box::new(move |e| {
                if matches!(e, Event::Token(_)) {
                    left -= 1;
                }
                left > 0 && tx.send(e).is_ok()
            }),
        )
        .expect("submit");
    let tokens = rx.iter().filter(|e| matches!(e, Event::Token(_))).count();
    assert_eq!(tokens, 2, "the sink refused the third token");
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.stats().running > 0 || engine.stats().kv_bytes > 0 {
        assert!(Instant::now() < deadline, "the request was never cancelled");
        std::thread::sleep(Duration::from_millis(5));
    }
    engine.shutdown();
    assert!(matches!(
        engine.submit(
            prompts[0].clone(),
            GenOptions::default(),
            Box::new(|_| true)
        ),
        Err(SubmitError::ShutDown)
    ));
}

/// Runs `prompt` through `s` to the end; the tokens, the cached prompt tokens at start and the
/// usage.
fn run_one(
    s: &mut Scheduler<'_>,
    prompt: Vec<u32>,
    options: GenOptions,
) -> (Vec<u32>, usize, Usage) {
    let id = s.submit(prompt, options).expect("submit");
    let mut seen = HashMap::new();
    while !s.is_idle() {
        for (i, e) in s.step() {
            record(&mut seen, i, e);
        }
    }
    let r = &seen[&id];
    assert!(r.failed.is_none(), "failed: {:?}", r.failed);
    let (_, usage) = r.done.expect("done");
    (r.tokens.clone(), r.started.expect("started").1, usage)
}

#[test]
fn turn_two_of_a_chat_reuses_turn_one_in_its_own_layout_only() {
    let model = load("e2b-hf");
    let prompts: Vec<Vec<u32>> = golden("e2b-hf").into_iter().map(|c| c.prompt).collect();
    let with_store = || {
        Scheduler::new(
            &model,
            SchedulerConfig {
                prefix_cache_bytes: 1 << 26,
                ..config()
            },
        )
        .expect("scheduler")
    };
    for (label, layout) in cache_layouts() {
        let mut s = with_store();
        let (answer, cached, _) = run_one(&mut s, prompts[1].clone(), greedy(layout, 6));
        assert_eq!(cached, 0, "{label}: turn 1 starts cold");
        assert_eq!(s.stats().prefix_entries, 1, "{label}: turn 1 is kept");
        let turn2: Vec<u32> = [&prompts[1][..], &answer, &prompts[0]].concat();
        let (tokens, cached, usage) = run_one(&mut s, turn2.clone(), greedy(layout, 8));
        assert_eq!(
            cached,
            prompts[1].len() + answer.len() - 1,
            "{label}: turn 2 reuses turn 1's prompt and answer"
        );
        assert_eq!(usage.cached_tokens, cached);
        assert_eq!(usage.prompt_tokens, turn2.len());
        let mut cold = Scheduler::new(&model, config()).expect("scheduler");
        let (want, none, _) = run_one(&mut cold, turn2, greedy(layout, 8));
        assert_eq!(none, 0);
        assert_eq!(
            tokens, want,
            "{label}: reuse gives the tokens of a cold prefill"
        );
    }

    // The same conversation in another layout is not served from this one's entry.
    let mut s = with_store();
    let (answer, _, _) = run_one(
        &mut s,
        prompts[1].clone(),
        greedy(quantized(QuantBits::Eight), 6),
    );
    let turn2: Vec<u32> = [&prompts[1][..], &answer, &prompts[0]].concat();
    for (label, layout) in [
        ("4-bit", quantized(QuantBits::Four)),
        ("rotating", CacheConfig::default()),
    ] {
        let (_, cached, _) = run_one(&mut s, turn2.clone(), greedy(layout, 4));
        assert_eq!(cached, 0, "{label} request never gets the 8-bit entry");
    }
    let (_, cached, _) = run_one(&mut s, turn2, greedy(quantized(QuantBits::Eight), 4));
    assert!(cached > 0, "the 8-bit request does");
}

#[test]
fn engine_refuses_beyond_the_queue_bound_and_fails_pending_requests_on_shutdown() {
    let model = Arc::new(load("e2b-hf"));
    let prompt = golden("e2b-hf").remove(0).prompt;
    let engine = Engine::start(
        model,
        SchedulerConfig {
            max_batch: 1,
            max_queue: 1,
            ..config()
        },
    )
    .expect("engine");
    let (tx, rx) = mpsc::channel();
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        let tx = tx.clone();
        outcomes.push(engine.submit(
            prompt.clone(),
            greedy(CacheConfig::default(), 2000),
            Box::new(move |e| tx.send(e).is_ok()),
        ));
    }
    drop(tx);
    // One runs, at most one waits: the third is refused whatever the worker did meanwhile.
    assert!(outcomes[0].is_ok());
    assert!(matches!(
        outcomes[2],
        Err(SubmitError::QueueFull { retry_after_secs }) if retry_after_secs > 0
    ));
    assert!(engine.stats().queued <= 1);
    engine.shutdown();
    let failed = rx.iter().filter(|e| matches!(e, Event::Failed(_))).count();
    let accepted = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(
        failed, accepted,
        "every accepted request hears of the shutdown"
    );
    assert_eq!(engine.stats().queued, 0);
}

/// `n` greedy tokens after prefilling `reused` and then `rest`, each in chunks of `chunk` (the
/// chunking of a request served `reused` from the prefix store, whose state was prefilled in
/// the scheduler's chunks from the start).
fn chunked_reference(
    model: &Model,
    cache: CacheConfig,
    reused: &[u32],
    rest: &[u32],
    chunk: usize,
    n: usize,
) -> Vec<u32> {
    let mut state = model.new_cache(&cache).expect("cache");
    for piece in reused.chunks(chunk) {
        step(model, &mut state, piece);
    }
    run(model, &mut state, rest, n, Some(chunk)).0
}

#[test]
fn turn_two_with_a_rewritten_answer_reuses_turn_one_prompt_from_its_ring_checkpoint() {
    for name in ["e2b-hf", "e4b-text"] {
        rewritten_answer_reuses_the_prompt(name);
    }
}

/// Turn 1 runs cold; turn 2 is turn 1's prompt, an answer other than the one generated, and
/// new text. Its prompt's state comes from the ring checkpoint the scheduler took after turn
/// 1's prefill (the answer's decode wrapped the rings past it).
fn rewritten_answer_reuses_the_prompt(name: &str) {
    let model = load(name);
    let prompts: Vec<Vec<u32>> = golden(name).into_iter().map(|c| c.prompt).collect();
    let turn1 = &prompts[1]; // 19 tokens, then 6 answer tokens: every ring has wrapped
    assert!(
        model.config().sliding_window < turn1.len(),
        "the rings wrap"
    );
    let budget = 1 << 26;
    let layouts = [
        (
            "dense",
            CacheConfig {
                mode: CacheMode::Simple,
            },
        ),
        ("rotating", CacheConfig::default()),
        ("8-bit", quantized(QuantBits::Eight)),
        ("4-bit", quantized(QuantBits::Four)),
    ];
    for (label, layout) in layouts {
        let mut s = Scheduler::new(
            &model,
            SchedulerConfig {
                prefix_cache_bytes: budget,
                ..config()
            },
        )
        .expect("scheduler");
        let (answer, cached, _) = run_one(&mut s, turn1.clone(), greedy(layout, 6));
        assert_eq!(cached, 0, "{name} {label}: turn 1 starts cold");
        assert!(
            s.stats().prefix_bytes <= budget,
            "{name} {label}: within budget"
        );

        // The template renders turn 1's answer otherwise (its thinking dropped).
        let other = if answer[0] == 300 { 301 } else { 300 };
        let turn2: Vec<u32> = [&turn1[..], &[other, 302, 303], &prompts[0]].concat();
        let (tokens, cached, usage) = run_one(&mut s, turn2.clone(), greedy(layout, 8));
        assert!(
            cached + 1 >= turn1.len() && cached <= turn1.len(),
            "{name} {label}: turn 2 reuses turn 1's prompt ({cached} of {} tokens)",
            turn1.len()
        );
        assert_eq!(usage.cached_tokens, cached);
        assert!(
            s.stats().prefix_bytes <= budget,
            "{name} {label}: within budget"
        );

        let want = if let CacheMode::Quantized(_) = layout.mode {
            // A quantized cache quantizes what earlier chunks stored: the reference prefills in
            // the chunks the reused request saw.
            chunked_reference(&model, layout, &turn2[..cached], &turn2[cached..], 4, 8)
        } else {
            let mut cold = Scheduler::new(&model, config()).expect("scheduler");
            let (want, none, _) = run_one(&mut cold, turn2.clone(), greedy(layout, 8));
            assert_eq!(none, 0, "{name} {label}: reuse off");
            want
        };
        assert_eq!(
            tokens, want,
            "{name} {label}: reuse gives the tokens of a cold prefill"
        );
    }
}
