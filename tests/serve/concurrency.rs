//! Concurrent greedy requests mixing KV layouts (dense, 8-bit, 4-bit) and prompt lengths each
//! give exactly the tokens of the same request sent alone.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use serde_json::{json, Value};

use crate::harness::{ids_of, prompt_ids, Harness};

fn request(i: usize) -> Value {
    let kv_bits = [Value::Null, json!(8), json!(4)][i % 3].clone();
    json!({
        "prompt": prompt_ids(5 + 3 * i, i as u32),
        "max_tokens": 6 + i % 4,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
        "kv_bits": kv_bits,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_requests_equal_each_alone() {
    let h = Harness::start(|c| {
        c.engine.prefix_cache_bytes = 0;
        c.engine.max_batch = 16;
    })
    .await;
    let requests: Vec<Value> = (0..16).map(request).collect();
    let mut alone = Vec::new();
    for r in &requests {
        alone.push(ids_of(&h.ok("/v1/completions", r).await));
    }
    let engine = h.running.state.engine.clone();
    let most = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (most, stop) = (most.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                most.fetch_max(engine.stats().running, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let together = join_all(requests.iter().map(|r| h.ok("/v1/completions", r))).await;
    stop.store(true, Ordering::Relaxed);
    monitor.await.expect("monitor");
    let most = most.load(Ordering::Relaxed);
    assert!(
        most > 1,
        "the requests shared the batch (at most {most} ran at once)"
    );
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            &ids_of(t),
            a,
            "request {i} (kv_bits {}, prompt {} tokens)",
            requests[i]["kv_bits"],
            requests[i]["prompt"].as_array().map_or(0, Vec::len)
        );
        assert_eq!(
            a.len(),
            requests[i]["max_tokens"].as_u64().unwrap_or(0) as usize
        );
    }
}
