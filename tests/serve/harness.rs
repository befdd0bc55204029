//! Starting a server over a fixture, sending JSON, and reading SSE streams.

use std::sync::Arc;
use std::time::Duration;

use candle_gemma::Model;
use reqwest::StatusCode;
use serde_json::Value;

use crate::common;
use crate::server::engine::{EngineSettings, Served};
use crate::server::options::{head_dims, Defaults};
use crate::server::{self, Running, ServerConfig};

/// The served model's name in the tests.
pub const MODEL: &str = "e2b-hf";

/// A server and a client.
pub struct Harness {
    pub running: Running,
    pub client: reqwest::Client,
    pub model: Arc<Model>,
}

/// The test configuration: small batch and queue, 32-wide KV groups (the fixture's head
/// dimensions are 32 and 64).
pub fn config(model: &Model) -> ServerConfig {
    ServerConfig {
        model_names: vec![MODEL.to_string()],
        api_key: None,
        defaults: Defaults {
            kv_bits: None,
            kv_group_size: 32,
            rotating: true,
            max_tokens: 16,
            head_dims: head_dims(model),
            sampling: model.config().recommended_sampling.clone(),
            vocab_size: model.config().vocab_size,
        },
        engine: EngineSettings {
            max_batch: 8,
            kv_budget_bytes: 64 << 20,
            max_queue: 64,
            prefill_chunk: 16,
            prefix_cache_bytes: 16 << 20,
        },
    }
}

impl Harness {
    /// A server over the e2b-hf fixture with the test configuration changed by `tweak`.
    pub async fn start(tweak: impl FnOnce(&mut ServerConfig)) -> Self {
        let model = Arc::new(common::load(MODEL));
        let mut cfg = config(&model);
        tweak(&mut cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let running =
            server::start(Served::Single(model.clone()), cfg, listener).expect("server starts");
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client");
        Self {
            running,
            client,
            model,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.running.url())
    }

    /// POSTs a raw body; the status, headers and the JSON answer.
    pub async fn post_raw(&self, path: &str, body: &str) -> (StatusCode, Value) {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("request sent");
        let status = r.status();
        let v = r.json().await.unwrap_or(Value::Null);
        (status, v)
    }

    /// POSTs JSON; the status and the JSON answer.
    pub async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        self.post_raw(path, &body.to_string()).await
    }

    /// POSTs JSON that must succeed.
    pub async fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post(path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {v}");
        v
    }

    /// POSTs a streaming request that must succeed; its events as (event name, data).
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<(Option<String>, String)> {
        let r = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("request sent");
        assert_eq!(r.status(), StatusCode::OK);
        let ct = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
        parse_sse(&r.text().await.expect("stream body"))
    }
}

/// Splits an SSE body into (event name, data) pairs; comments (keep-alives) are skipped.
pub fn parse_sse(text: &str) -> Vec<(Option<String>, String)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut event = None;
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event:") {
                    event = Some(e.trim().to_string());
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
                }
            }
            (!data.is_empty()).then(|| (event, data.join("\n")))
        })
        .collect()
}

/// The JSON data of OpenAI stream chunks (all but `[DONE]`), checking that `[DONE]` ends it.
pub fn openai_chunks(events: &[(Option<String>, String)]) -> Vec<Value> {
    let (last, rest) = events.split_last().expect("a non-empty stream");
    assert_eq!(last.1, "[DONE]", "the stream ends with [DONE]");
    rest.iter()
        .map(|(_, d)| serde_json::from_str(d).expect("chunk is JSON"))
        .collect()
}

/// A prompt of `len` ids: `<bos>` then ids from the fixture's ordinary range [110, 512).
pub fn prompt_ids(len: usize, seed: u32) -> Vec<u32> {
    let mut ids = vec![2];
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12_345);
    while ids.len() < len {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        ids.push(110 + (x >> 8) % 402);
    }
    ids
}

/// The `token_ids` of a completion answer.
pub fn ids_of(v: &Value) -> Vec<u32> {
    v["choices"][0]["token_ids"]
        .as_array()
        .expect("token_ids")
        .iter()
        .map(|i| i.as_u64().expect("id") as u32)
        .collect()
}
