//! A client that drops its stream cancels the sequence: the KV bytes go back to the idle
//! figure and the server answers the next request.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::json;

use crate::harness::{prompt_ids, Harness};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_frees_its_cache() {
    let h = Harness::start(|c| c.engine.prefix_cache_bytes = 0).await;
    let engine = &h.running.state.engine;
    let idle = engine.stats();
    let body = json!({
        "prompt": prompt_ids(20, 7), "max_tokens": 3000, "temperature": 0, "ignore_eos": true,
        "stream": true,
    });
    let r = h
        .client
        .post(h.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("sent");
    let mut bytes = r.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        let chunk = bytes.next().await.expect("a chunk").expect("bytes");
        seen += String::from_utf8_lossy(&chunk).matches("data:").count();
    }
    let busy = engine.stats();
    assert_eq!(busy.running, 1, "{busy:?}");
    assert!(
        busy.kv_bytes > idle.kv_bytes,
        "{busy:?} against idle {idle:?}"
    );
    drop(bytes);

    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = engine.stats();
        if s.running == 0 && s.queued == 0 && s.kv_bytes == idle.kv_bytes {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not cancelled: {s:?} (idle {idle:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let v = h
        .ok(
            "/v1/completions",
            &json!({"prompt": [2, 300], "max_tokens": 2}),
        )
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
}
