//! Forced tool calls through the server: OpenAI's `tool_choice` naming a function or set to
//! `required` and Anthropic's `tool` / `any` answer with calls of the allowed tools whose
//! arguments fit their schemas (whole and streamed); choices that cannot hold are 400s naming
//! `tool_choice`, and the server keeps answering.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::harness::{openai_chunks, Harness, MODEL};

fn weather() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]},
            "days": {"type": "integer"}
        },
        "required": ["city", "days"]
    })
}

fn openai_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": weather()}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}
    ])
}

/// Whether `args` fit the schema of `name` in [`openai_tools`].
fn fits(name: &str, args: &Value) -> bool {
    let o = args.as_object();
    match name {
        "get_weather" => o.is_some_and(|o| {
            o.len() == 2
                && matches!(
                    o.get("city").and_then(Value::as_str),
                    Some("Paris" | "Oslo")
                )
                && o.get("days").is_some_and(Value::is_number)
        }),
        "get_time" => {
            o.is_some_and(|o| o.len() == 1 && o.get("utc").is_some_and(Value::is_boolean))
        }
        _ => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_choices_answer_with_fitting_calls_and_bad_ones_are_400() {
    let h = Harness::start(|_| {}).await;
    let chat = |choice: Value, extra: Value| {
        let mut b = json!({
            "model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "max_tokens": 80, "temperature": 1.0, "seed": 3,
            "tools": openai_tools(), "tool_choice": choice, "parallel_tool_calls": false,
        });
        for (k, v) in extra.as_object().into_iter().flatten() {
            b[k] = v.clone();
        }
        b
    };
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for (choice, names) in [
        (named.clone(), vec!["get_weather"]),
        (json!("required"), vec!["get_weather", "get_time"]),
    ] {
        let v = h
            .ok("/v1/chat/completions", &chat(choice.clone(), json!({})))
            .await;
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{choice}: {v}");
        let calls = c["message"]["tool_calls"].as_array().expect("tool_calls");
        assert_eq!(calls.len(), 1, "{v}");
        let name = calls[0]["function"]["name"].as_str().expect("name");
        let args: Value = serde_json::from_str(
            calls[0]["function"]["arguments"]
                .as_str()
                .expect("arguments"),
        )
        .expect("arguments are JSON");
        assert!(names.contains(&name), "{choice}: {v}");
        assert!(fits(name, &args), "{choice}: {args}");
    }
    // Streamed: the deltas carry one call of the named tool.
    let mut streamed = chat(named.clone(), json!({"stream": true}));
    streamed["seed"] = json!(4);
    let chunks = openai_chunks(&h.stream("/v1/chat/completions", &streamed).await);
    let deltas: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
        })
        .collect();
    let names: Vec<&str> = deltas
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(names, ["get_weather"], "{chunks:?}");
    let args: String = deltas
        .iter()
        .filter_map(|t| t["function"]["arguments"].as_str())
        .collect();
    let args: Value = serde_json::from_str(&args).expect("streamed arguments are JSON");
    assert!(fits("get_weather", &args), "{args}");

    // Anthropic: a named tool and `any`.
    for choice in [
        json!({"type": "tool", "name": "get_time"}),
        json!({"type": "any", "disable_parallel_tool_use": true}),
    ] {
        let body = json!({
            "model": MODEL, "max_tokens": 80, "temperature": 1.0, "seed": 7,
            "messages": [{"role": "user", "content": "What time is it?"}],
            "tools": [
                {"name": "get_weather", "input_schema": weather()},
                {"name": "get_time", "input_schema": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}
            ],
            "tool_choice": choice,
        });
        let v = h.ok("/v1/messages", &body).await;
        assert_eq!(v["stop_reason"], "tool_use", "{choice}: {v}");
        let uses: Vec<&Value> = v["content"]
            .as_array()
            .expect("content")
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert!(!uses.is_empty(), "{v}");
        for u in uses {
            let name = u["name"].as_str().expect("name");
            if choice["type"] == "tool" {
                assert_eq!(name, "get_time", "{v}");
            }
            assert!(fits(name, &u["input"]), "{v}");
        }
    }

    for (body, why) in [
        (
            chat(
                json!({"type": "function", "function": {"name": "nope"}}),
                json!({}),
            ),
            "unknown tool",
        ),
        (chat(json!("required"), json!({"tools": []})), "no tools"),
        (chat(json!("sometimes"), json!({})), "unknown choice"),
        (
            chat(
                named.clone(),
                json!({"response_format": {"type": "json_object"}}),
            ),
            "with response_format",
        ),
    ] {
        let (status, err) = h.post("/v1/chat/completions", &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{why}: {err}");
        assert_eq!(err["error"]["param"], "tool_choice", "{why}: {err}");
    }
    // Still serving.
    let v = h.ok("/v1/chat/completions", &chat(named, json!({}))).await;
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
}
