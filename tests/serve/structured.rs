//! Structured output: `response_format` (a JSON schema), vLLM's `guided_regex`, on the
//! completions and chat endpoints, streaming and not; the answers parse and match; a schema
//! or pattern that does not compile is a 400 naming `response_format`, and the server keeps
//! answering.

use reqwest::StatusCode;
use serde_json::json;

use crate::common;
use crate::harness::{openai_chunks, Harness, MODEL};

fn assert_matches_schema(text: &str) {
    assert!(common::fits_bounded_schema(text), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schemas_and_patterns_hold_answers_and_bad_ones_are_400() {
    let h = Harness::start(|_| {}).await;
    let format = json!({"type": "json_schema", "json_schema": {"name": "thing", "schema": common::bounded_schema(), "strict": true}});
    let body = json!({
        "model": MODEL, "prompt": "Describe it", "max_tokens": 60, "temperature": 0,
        "response_format": format,
    });
    let v = h.ok("/v1/completions", &body).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_matches_schema(v["choices"][0]["text"].as_str().expect("text"));

    let chat = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "Describe it"}],
        "max_tokens": 60, "temperature": 1.0, "seed": 5, "response_format": format,
    });
    let v = h.ok("/v1/chat/completions", &chat).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_matches_schema(
        v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content"),
    );
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let text: String = openai_chunks(&h.stream("/v1/chat/completions", &streamed).await)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_matches_schema(&text);

    let rx = json!({
        "model": MODEL, "prompt": "Code:", "max_tokens": 20, "temperature": 0,
        "guided_regex": "[a-c]{3}-[0-9]{2}",
    });
    let v = h.ok("/v1/completions", &rx).await;
    let code = v["choices"][0]["text"].as_str().expect("text");
    assert_eq!(code.len(), 6, "{code:?}");
    assert_eq!(&code[3..4], "-", "{code:?}");

    for bad in [
        json!({"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}),
        json!({"type": "yaml"}),
    ] {
        let mut b = body.clone();
        b["response_format"] = bad.clone();
        let (status, err) = h.post("/v1/completions", &b).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {err}");
        assert_eq!(err["error"]["param"], "response_format", "{err}");
    }
    let mut b = rx.clone();
    b["guided_regex"] = json!("([a-z");
    let (status, err) = h.post("/v1/completions", &b).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    // Still serving.
    let v = h.ok("/v1/completions", &body).await;
    assert_matches_schema(v["choices"][0]["text"].as_str().expect("text"));
}
