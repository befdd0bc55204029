//! Load: 200 requests from 32 concurrent clients all complete; the queue never holds more
//! than its bound, and the only refusals are the documented 429s with `Retry-After`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::harness::{prompt_ids, Harness};

const REQUESTS: usize = 200;
const CLIENTS: usize = 32;
const MAX_QUEUE: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_requests_from_32_clients_complete() {
    let h = Arc::new(
        Harness::start(|c| {
            c.engine.max_batch = 8;
            c.engine.max_queue = MAX_QUEUE;
        })
        .await,
    );
    let next = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let max_queued = Arc::new(AtomicUsize::new(0));

    let monitor = {
        let (h, stop, max_queued) = (h.clone(), stop.clone(), max_queued.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let q = h.running.state.engine.stats().queued;
                max_queued.fetch_max(q, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let clients = (0..CLIENTS).map(|_| {
        let (h, next, refused) = (h.clone(), next.clone(), refused.clone());
        async move {
            let mut done = 0;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= REQUESTS {
                    return done;
                }
                let body = json!({
                    "prompt": prompt_ids(3 + i % 9, i as u32), "max_tokens": 1 + i % 3,
                    "temperature": 0.7, "seed": i, "stream": i % 4 == 0,
                });
                loop {
                    let r = h
                        .client
                        .post(h.url("/v1/completions"))
                        .json(&body)
                        .send()
                        .await
                        .expect("sent");
                    match r.status() {
                        StatusCode::OK => {
                            let text = r.text().await.expect("body");
                            if i % 4 == 0 {
                                assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
                            } else {
                                let v: Value = serde_json::from_str(&text).expect("json");
                                assert_eq!(v["usage"]["completion_tokens"], 1 + i % 3);
                            }
                            break;
                        }
                        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                            assert!(r.headers().contains_key("retry-after"));
                            refused.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        other => panic!("request {i}: unexpected {other}: {:?}", r.text().await),
                    }
                }
                done += 1;
            }
        }
    });
    let completed: usize = join_all(clients).await.into_iter().sum();
    stop.store(true, Ordering::Relaxed);
    monitor.await.expect("monitor");
    assert_eq!(completed, REQUESTS);
    let q = max_queued.load(Ordering::Relaxed);
    assert!(q <= MAX_QUEUE, "queue held {q} > {MAX_QUEUE}");
    eprintln!(
        "load: {REQUESTS} requests, {} refusals (429), max queued {q}",
        refused.load(Ordering::Relaxed)
    );
}
