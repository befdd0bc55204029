//! Prefix reuse across requests: turn 2 of a chat reports cached prompt tokens and gives the
//! tokens of a server with reuse off; another KV layout is not served from the entry.

use serde_json::{json, Value};

use crate::harness::{ids_of, Harness};

fn turn(messages: Value, kv_bits: Value) -> Value {
    json!({
        "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true, "kv_bits": kv_bits,
    })
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_two_reuses_turn_one_and_layouts_stay_apart() {
    let on = Harness::start(|_| {}).await;
    let off = Harness::start(|c| c.engine.prefix_cache_bytes = 0).await;
    let first = json!([
        {"role": "system", "content": "You are a helpful assistant who answers briefly."},
        {"role": "user", "content": "Hello there, how are you today?"},
    ]);
    let one = on
        .ok("/v1/chat/completions", &turn(first.clone(), Value::Null))
        .await;
    assert_eq!(cached(&one), 0, "nothing to reuse on turn 1");
    let answer = one["choices"][0]["message"]["content"].clone();
    let mut second = first.as_array().cloned().expect("list");
    second.push(json!({"role": "assistant", "content": answer}));
    second.push(json!({"role": "user", "content": "And now?"}));
    let second = Value::from(second);

    let two = on
        .ok("/v1/chat/completions", &turn(second.clone(), Value::Null))
        .await;
    assert!(cached(&two) > 0, "turn 2 reuses turn 1: {}", two["usage"]);
    let plain = off
        .ok("/v1/chat/completions", &turn(second.clone(), Value::Null))
        .await;
    assert_eq!(cached(&plain), 0, "reuse off");
    assert_eq!(ids_of(&two), ids_of(&plain), "reuse changes no token");
    assert_eq!(
        two["usage"]["prompt_tokens"],
        plain["usage"]["prompt_tokens"]
    );

    // The same conversation with an 8-bit cache: the dense entries are not for it.
    let q8 = on
        .ok("/v1/chat/completions", &turn(second.clone(), json!(8)))
        .await;
    assert_eq!(cached(&q8), 0, "an 8-bit request never gets a dense state");
    let q8_again = on.ok("/v1/chat/completions", &turn(second, json!(8))).await;
    assert!(cached(&q8_again) > 0, "its own layout's entry is reused");
    assert_eq!(ids_of(&q8_again), ids_of(&q8));
    assert!(on.running.state.engine.stats().prefix_entries > 0);
}
