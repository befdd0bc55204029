//! The server over a model sharded on two CPU ranks (what `serve --tp 2 --device cpu` runs):
//! one scheduler per rank fed the same steps. Greedy ids over HTTP equal mlx-lm's goldens and
//! the unsharded library decode, while a 4-bit KV request runs in the same batch; a request
//! under a JSON schema gives the unsharded model's answer; `/health` reports the load.

use std::sync::Arc;
use std::time::Duration;

use candle_gemma::{CacheConfig, Model};
use serde_json::json;

use crate::common;
use crate::harness::{config, ids_of, Harness};
use crate::server::{self, engine::Served};

/// A fixture whose heads split over two ranks.
const FIXTURE: &str = "e2b-kvq";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rank_server_gives_the_goldens_beside_a_4_bit_request() {
    let sharded = Model::builder()
        .path(common::fixture(FIXTURE))
        .build_sharded_cpu(2)
        .expect("two CPU ranks");
    assert_eq!(sharded.world(), 2);
    let single = Arc::new(common::load(FIXTURE));
    let mut cfg = config(sharded.first());
    cfg.model_names = vec![FIXTURE.to_string()];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let running =
        server::start(Served::Sharded(Arc::new(sharded)), cfg, listener).expect("server starts");
    let h = Harness {
        running,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client"),
        model: single.clone(),
    };
    for (i, case) in common::golden(FIXTURE).iter().enumerate() {
        let n = case.greedy.len();
        let dense = json!({
            "model": FIXTURE, "prompt": case.prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true,
        });
        let mut four = dense.clone();
        four["kv_bits"] = json!(4);
        four["kv_group_size"] = json!(32);
        let (a, b) = tokio::join!(
            h.ok("/v1/completions", &dense),
            h.ok("/v1/completions", &four)
        );
        let got = ids_of(&a);
        common::assert_matches_reference(&format!("case {i} (2 ranks)"), &got, case, 0.01);
        let alone = common::greedy(&single, &case.prompt, n, CacheConfig::default(), None);
        assert_eq!(got, alone, "case {i}: 2 ranks against one model");
        assert_eq!(ids_of(&b).len(), n, "case {i}: the 4-bit request's tokens");
        assert_eq!(b["usage"]["completion_tokens"], n);
    }
    // A constrained request: every rank masks and picks alike, so the answer is the one the
    // unsharded model gives.
    let prompt = single.encode("Describe it", true).expect("encode");
    let body = json!({
        "model": FIXTURE, "prompt": prompt, "max_tokens": 60, "temperature": 1.0, "seed": 4,
        "top_k": 64, "top_p": 0.95, "return_token_ids": true,
        "response_format": {"type": "json_schema", "json_schema": {"schema": common::bounded_schema()}},
    });
    let v = h.ok("/v1/completions", &body).await;
    let text = v["choices"][0]["text"].as_str().expect("text");
    assert!(common::fits_bounded_schema(text), "{text:?}");
    let options = candle_gemma::GenOptions {
        max_tokens: 60,
        constraint: Some(candle_gemma::generate::Constraint::JsonSchema(
            common::bounded_schema(),
        )),
        sampling: candle_gemma::generate::SamplingOptions {
            temperature: 1.0,
            top_k: Some(64),
            top_p: Some(0.95),
            seed: 4,
            ..Default::default()
        },
        ..Default::default()
    };
    let alone = single.generator(options).generate(&prompt).expect("alone");
    assert_eq!(
        ids_of(&v),
        alone.tokens,
        "constrained: 2 ranks against one model"
    );
    // The ranks publish their load after each step; the last one may trail the answers.
    let mut running = None;
    for _ in 0..40 {
        let health = h
            .client
            .get(h.url("/health"))
            .send()
            .await
            .expect("health")
            .json::<serde_json::Value>()
            .await
            .expect("health json");
        assert_eq!(health["status"], "ok");
        running = health["running"].as_u64();
        if running == Some(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(running, Some(0), "no request left running");
}
