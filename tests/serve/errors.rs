//! Every bad input gets its status and OpenAI error object, and the server still answers.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::harness::{prompt_ids, Harness};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const MESSAGES: &str = "/v1/messages";

fn chat(extra: Value) -> String {
    let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_400_with_an_error_object_and_the_server_keeps_answering() {
    let h = Harness::start(|_| {}).await;
    let too_long = json!({"prompt": prompt_ids(4100, 1), "max_tokens": 1}).to_string();
    let escape = r#"{"messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"p": {"type": "string", "pattern": "\s+"}}}}}]}"#;
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (CHAT, r#"{"messages": [{"role": "user""#.into(), 400, "invalid_json"),
        (CHAT, escape.into(), 400, "invalid_json"),
        (CHAT, r#"{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}"#.into(), 400, "invalid_json"),
        (CHAT, chat(json!({"model": "gpt-4"})), 400, "model_not_found"),
        (CHAT, chat(json!({"kv_bits": 5})), 400, "invalid_kv_bits"),
        (CHAT, chat(json!({"kv_bits": "8"})), 400, "invalid_kv_bits"),
        (CHAT, chat(json!({"kv_bits": 4, "kv_group_size": 48})), 400, "invalid_kv_group_size"),
        (CHAT, chat(json!({"temperature": -0.5})), 400, "invalid_temperature"),
        (CHAT, chat(json!({"top_p": 0.0})), 400, "invalid_top_p"),
        (CHAT, chat(json!({"top_p": 1.5})), 400, "invalid_top_p"),
        (CHAT, chat(json!({"min_p": 2.0})), 400, "invalid_min_p"),
        (CHAT, chat(json!({"repetition_penalty": 0.0})), 400, "invalid_repetition_penalty"),
        (CHAT, chat(json!({"n": 17})), 400, "invalid_n"),
        (CHAT, chat(json!({"max_tokens": 0})), 400, "invalid_max_tokens"),
        (CHAT, chat(json!({"tool_choice": "required"})), 400, "invalid_tool_choice"),
        (CHAT, chat(json!({"tool_choice": "sometimes"})), 400, "invalid_tool_choice"),
        (CHAT, chat(json!({"response_format": {"type": "yaml"}})), 400, "invalid_response_format"),
        (CHAT, chat(json!({"functions": [{"name": "f", "parameters": {}}]})), 400, "unsupported"),
        (COMPLETIONS, json!({"prompt": "Hi", "echo": true}).to_string(), 400, "unsupported"),
        (COMPLETIONS, json!({"prompt": "Hi", "suffix": "end"}).to_string(), 400, "unsupported"),
        (COMPLETIONS, json!({"prompt": "Hi", "n": 2, "best_of": 4}).to_string(), 400, "unsupported"),
        (CHAT, json!({"max_tokens": 2}).to_string(), 400, "missing_required_parameter"),
        (CHAT, json!({"messages": []}).to_string(), 400, "invalid_messages"),
        (COMPLETIONS, too_long, 400, "context_length_exceeded"),
        (COMPLETIONS, json!({"prompt": [2, 99999]}).to_string(), 400, "invalid_prompt"),
        (COMPLETIONS, json!({"prompt": ["a", "b"]}).to_string(), 400, "unsupported"),
        (COMPLETIONS, json!({"prompt": "Hi", "n": 0}).to_string(), 400, "invalid_n"),
        (MESSAGES, json!({"max_tokens": 2, "kv_bits": 3, "messages": [{"role": "user", "content": "Hi"}]}).to_string(), 400, "invalid_kv_bits"),
        (MESSAGES, json!({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]}).to_string(), 400, "unsupported"),
        ("/v1/nothing", "{}".into(), 404, "not_found"),
    ];
    for (path, body, status, code) in &cases {
        let (got, v) = h.post_raw(path, body).await;
        assert_eq!(got.as_u16(), *status, "{path} {body}: {v}");
        let e = &v["error"];
        assert_eq!(e["code"], *code, "{path} {body}: {v}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some(), "{v}");
    }
    // The bad escape is reported with its position.
    let (_, v) = h.post_raw(CHAT, escape).await;
    let message = v["error"]["message"].as_str().expect("message");
    assert!(message.contains("line 3 column"), "{message}");
    // A field error names its field.
    let (_, v) = h.post_raw(CHAT, &chat(json!({"top_p": 2}))).await;
    assert_eq!(v["error"]["param"], "top_p");
    let (_, v) = h
        .post_raw(
            CHAT,
            &chat(json!({"response_format": {"type": "json_schema"}})),
        )
        .await;
    assert_eq!(v["error"]["param"], "response_format");
    // Those fields at their defaults are served.
    let (status, v) = h
        .post(
            CHAT,
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "response_format": {"type": "text"}, "functions": []}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "response_format text: {v}");

    let (status, v) = h
        .post(
            COMPLETIONS,
            &json!({"prompt": [2, 300, 301], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "still answering: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429_with_retry_after() {
    let h = Harness::start(|c| {
        c.engine.max_queue = 0;
    })
    .await;
    let r = h
        .client
        .post(h.url(COMPLETIONS))
        .json(&json!({"prompt": [2, 300], "max_tokens": 1}))
        .send()
        .await
        .expect("sent");
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in seconds");
    assert!(retry >= 1);
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["error"]["code"], "queue_full");
}
