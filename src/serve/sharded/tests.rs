//! The sharded engine on two CPU ranks: concurrent requests with mixed K/V layouts give the
//! plain engine's tokens on the whole model, a cancellation frees the K/V on every rank, and
//! a failing rank fails the requests instead of hanging.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::Device;

use super::*;
use crate::kv::{CacheMode, QuantBits, QuantSpec};
use crate::serve::{Engine, Event};
use crate::{CacheConfig, Model};

const FIXTURE: &str = "e2b-kvq";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(FIXTURE)
}

fn sharded(grace: Duration) -> Arc<ShardedModel> {
    let sm = Model::builder()
        .path(fixture())
        .build_sharded_on(2, |_| Ok(Device::Cpu))
        .unwrap()
        .failure_grace(grace);
    Arc::new(sm)
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

fn options(bits: Option<QuantBits>, max_tokens: usize) -> GenOptions {
    let mode = bits.map_or(CacheMode::Simple, |bits| {
        CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 32,
            start: 0,
        })
    });
    GenOptions {
        max_tokens,
        ignore_eos: true,
        cache: CacheConfig { mode },
        ..Default::default()
    }
}

/// What one request received: its tokens, and its end (`Ok` when done, the error otherwise).
type Outcome = (Vec<u32>, std::result::Result<(), String>);

/// A sink sending every event of request `i` to `tx`.
fn sink(tx: mpsc::Sender<(usize, Event)>, i: usize) -> Sink {
    Box::new(move |event| tx.send((i, event)).is_ok())
}

/// Waits for `n` requests to end, gathering their tokens.
fn gather(rx: &mpsc::Receiver<(usize, Event)>, n: usize) -> HashMap<usize, Outcome> {
    let mut out: HashMap<usize, Outcome> = HashMap::new();
    let mut ended = 0;
    while ended < n {
        let (i, event) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the engine hung");
        let o = out.entry(i).or_insert_with(|| (Vec::new(), Ok(())));
        match event {
            Event::Token(step) => o.0.push(step.token),
            Event::Done { .. } => ended += 1,
            Event::Failed(e) => {
                o.1 = Err(e.to_string());
                ended += 1;
            }
            Event::Started { .. } => {}
        }
    }
    out
}

#[test]
fn concurrent_mixed_layouts_give_the_plain_engines_tokens() {
    let sm = sharded(Duration::from_secs(5));
    let whole = Arc::new(Model::builder().path(fixture()).build().unwrap());
    let layouts = [None, Some(QuantBits::Eight), Some(QuantBits::Four)];
    let requests: Vec<(Vec<u32>, GenOptions)> = (0..8)
        .map(|i| {
            let prompt: Vec<u32> = std::iter::once(2)
                .chain((0..3 + 2 * i).map(|k| (17 + 31 * i + 7 * k) as u32 % 500))
                .collect();
            (prompt, options(layouts[i % 3], 6 + i))
        })
        .collect();
    let run = |submit: &dyn Fn(Vec<u32>, GenOptions, Sink)| {
        let (tx, rx) = mpsc::channel();
        for (i, (prompt, opts)) in requests.iter().enumerate() {
            submit(prompt.clone(), opts.clone(), sink(tx.clone(), i));
        }
        gather(&rx, requests.len())
    };
    let engine = ShardedEngine::start(sm, config()).unwrap();
    let got = run(&|p, o, s| {
        engine.submit(p, o, s).unwrap();
    });
    engine.shutdown();
    let plain = Engine::start(whole, config()).unwrap();
    let want = run(&|p, o, s| {
        plain.submit(p, o, s).unwrap();
    });
    plain.shutdown();
    for i in 0..requests.len() {
        let (g, w) = (&got[&i], &want[&i]);
        assert_eq!(g.1, Ok(()), "request {i} failed");
        assert_eq!(g.0.len(), requests[i].1.max_tokens, "request {i}");
        assert_eq!(
            g.0, w.0,
            "request {i}: sharded tokens differ from the whole model's"
        );
    }
}

#[test]
fn a_cancelled_stream_frees_its_kv_on_every_rank() {
    let engine = ShardedEngine::start(sharded(Duration::from_secs(5)), config()).unwrap();
    let (tx, rx) = mpsc::channel();
    // The sink refuses its third token: the request is cancelled on every rank.
    let mut seen = 0;
    let refusing: Sink = Box::new(move |event| {
        if matches!(event, Event::Token(_)) {
            seen += 1;
        }
        let keep = seen < 3;
        let _ = tx.send(event);
        keep
    });
    engine
        .submit(
            vec![2, 40, 41, 42, 43],
            options(Some(QuantBits::Four), 500),
            refusing,
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut tokens = 0;
    while tokens < 3 {
        match rx.recv_timeout(Duration::from_secs(20)).expect("no event") {
            Event::Token(_) => tokens += 1,
            Event::Started { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    loop {
        let ranks = engine.rank_stats();
        let freed = ranks.iter().all(|s| s.running == 0 && s.kv_bytes == 0);
        if freed && engine.stats().queued == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "K/V not freed: {ranks:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(engine.rank_stats().len(), 2);
    // The sink heard nothing after it refused.
    assert!(rx.try_recv().is_err());
    engine.shutdown();
}

#[test]
fn a_failing_rank_fails_the_requests_instead_of_hanging() {
    let sm = sharded(Duration::from_millis(300));
    let fault = Fault { rank: 1, step: 3 };
    let engine = ShardedEngine::start_with(sm, config(), Some(fault)).unwrap();
    let (tx, rx) = mpsc::channel();
    for i in 0..2 {
        engine
            .submit(
                vec![2, 10 + i as u32, 20, 30],
                options(None, 50),
                sink(tx.clone(), i),
            )
            .unwrap();
    }
    let out = gather(&rx, 2);
    for (i, o) in &out {
        let err =
            o.1.as_ref()
                .expect_err("a request finished on a failed group");
        assert!(err.contains("rank"), "request {i}: {err}");
    }
    // The engine is down: later submissions are refused or failed at once.
    let started = Instant::now();
    loop {
        match engine.submit(vec![2, 5], options(None, 2), sink(tx.clone(), 9)) {
            Err(SubmitError::ShutDown) => break,
            Err(e) => panic!("{e}"),
            Ok(_) => {
                assert!(gather(&rx, 1)[&9].1.is_err());
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the engine did not stop"
        );
    }
    engine.shutdown();
}
