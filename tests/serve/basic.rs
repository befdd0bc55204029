//! Both OpenAI endpoints and Anthropic Messages, streaming and not; greedy ids against the
//! library; `/v1/models`, `/health` and the API key.

use candle_gemma::CacheConfig;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common;
use crate::harness::{ids_of, openai_chunks, Harness, MODEL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_completion_ids_equal_the_library_for_the_golden_prompts() {
    let h = Harness::start(|_| {}).await;
    for (i, case) in common::golden(MODEL).iter().enumerate() {
        let n = case.greedy.len();
        let want = common::greedy(&h.model, &case.prompt, n, CacheConfig::default(), None);
        common::assert_matches_reference(&format!("case {i}"), &want, case, 0.01);
        let body = json!({
            "model": MODEL, "prompt": case.prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true,
        });
        let v = h.ok("/v1/completions", &body).await;
        assert_eq!(ids_of(&v), want, "case {i}: HTTP ids");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["prompt_tokens"], case.prompt.len());
        assert_eq!(v["usage"]["completion_tokens"], n);
        assert!(v["choices"][0]["text"].is_string());

        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let chunks = openai_chunks(&h.stream("/v1/completions", &streamed).await);
        let ids: Vec<u32> = chunks
            .iter()
            .flat_map(|c| {
                c["choices"][0]["token_ids"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .map(|i| i.as_u64().expect("id") as u32)
            .collect();
        assert_eq!(ids, want, "case {i}: streamed ids");
        let last = chunks.last().expect("usage chunk");
        assert_eq!(last["usage"]["completion_tokens"], n);
        assert_eq!(
            chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
            "length"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_and_not_agree() {
    let h = Harness::start(|_| {}).await;
    let body = json!({
        "model": MODEL, "max_tokens": 10, "temperature": 0, "return_token_ids": true,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    });
    let v = h.ok("/v1/chat/completions", &body).await;
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let ids = ids_of(&v);
    assert_eq!(v["usage"]["completion_tokens"], ids.len());
    assert!(v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens") > 4);
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().expect("reason")));
    let content = choice["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        !content.contains("<|") && !content.contains("|>"),
        "{content}"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = openai_chunks(&h.stream("/v1/chat/completions", &streamed).await);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut sids = Vec::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
        let ch = &c["choices"][0];
        text.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        sids.extend(ch["token_ids"].as_array().cloned().unwrap_or_default());
    }
    let sids: Vec<u32> = sids
        .iter()
        .map(|i| i.as_u64().expect("id") as u32)
        .collect();
    assert_eq!(sids, ids, "streamed ids");
    assert_eq!(text, content, "streamed content");
    let last = chunks.last().expect("finish chunk");
    assert_eq!(last["choices"][0]["finish_reason"], choice["finish_reason"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_streaming_and_not_agree() {
    let h = Harness::start(|_| {}).await;
    let body = json!({
        "model": MODEL, "max_tokens": 8, "temperature": 0, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
    });
    let v = h.ok("/v1/messages", &body).await;
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(["end_turn", "max_tokens"].contains(&v["stop_reason"].as_str().expect("reason")));
    assert!(v["usage"]["input_tokens"].as_u64().expect("input") > 4);
    let text: String = v["content"]
        .as_array()
        .expect("content")
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().expect("text").to_string())
        .collect();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = h.stream("/v1/messages", &streamed).await;
    let names: Vec<&str> = events
        .iter()
        .map(|(e, _)| e.as_deref().expect("named event"))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    assert_eq!(names[names.len() - 2], "message_delta");
    let mut stext = String::new();
    for (name, data) in &events {
        let d: Value = serde_json::from_str(data).expect("event JSON");
        assert_eq!(d["type"], name.as_deref().expect("name"));
        if d["type"] == "content_block_delta" && d["delta"]["type"] == "text_delta" {
            stext.push_str(d["delta"]["text"].as_str().expect("text"));
        }
        if d["type"] == "message_delta" {
            assert_eq!(d["delta"]["stop_reason"], v["stop_reason"]);
            assert_eq!(d["usage"]["output_tokens"], v["usage"]["output_tokens"]);
        }
    }
    assert_eq!(stext, text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_the_api_key() {
    let h = Harness::start(|c| c.api_key = Some("sekrit".into())).await;
    let get = |key: Option<&str>| {
        let mut r = h.client.get(h.url("/v1/models"));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    for key in [None, Some("wrong")] {
        let r = get(key).await.expect("sent");
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "key {key:?}");
        let v: Value = r.json().await.expect("json");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(v["error"]["type"], "authentication_error");
    }
    let r = get(Some("sekrit")).await.expect("sent");
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["data"][0]["id"], MODEL);
    let (status, _) = h
        .post(
            "/v1/completions",
            &json!({"prompt": [2, 200], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "POST without a key");
    let r = h
        .client
        .post(h.url("/v1/completions"))
        .bearer_auth("sekrit")
        .json(&json!({"prompt": [2, 200], "max_tokens": 1}))
        .send()
        .await
        .expect("sent");
    assert_eq!(r.status(), StatusCode::OK);
    let health = h.client.get(h.url("/health")).send().await.expect("sent");
    assert_eq!(health.status(), StatusCode::OK, "/health needs no key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_and_results_round_trip_on_both_apis() {
    let h = Harness::start(|_| {}).await;
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let openai = json!({
        "max_tokens": 4, "temperature": 0, "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": true},
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": schema}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "reasoning_content": "I should look it up.",
                "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    });
    let v = h.ok("/v1/chat/completions", &openai).await;
    let without_tools = {
        let mut b = openai.clone();
        b["tool_choice"] = json!("none");
        h.ok("/v1/chat/completions", &b).await
    };
    assert!(
        v["usage"]["prompt_tokens"].as_u64() > without_tools["usage"]["prompt_tokens"].as_u64(),
        "the declaration is rendered with tool_choice auto only"
    );
    let anthropic = json!({
        "max_tokens": 4, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 64},
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": schema}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should look it up.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]},
        ],
    });
    let a = h.ok("/v1/messages", &anthropic).await;
    // Anthropic's `input_tokens` leaves out the prompt tokens read from the prefix store (the
    // same prompt was just served through the other API, so most of it is).
    let anthropic_prompt = a["usage"]["input_tokens"].as_u64().unwrap_or(0)
        + a["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0);
    assert_eq!(
        Some(anthropic_prompt),
        v["usage"]["prompt_tokens"].as_u64(),
        "both APIs render the same prompt"
    );
    let (status, bad) = h
        .post(
            "/v1/chat/completions",
            &json!({"messages": [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "f", "arguments": "{not json"}}]}]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(bad["error"]["code"], "invalid_messages");
}
