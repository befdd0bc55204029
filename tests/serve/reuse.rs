//! Prefix reuse across requests: turn 2 of a chat reports cached prompt tokens and gives the
//! tokens of a server with reuse off; a prefix held for one KV layout is not served to another.
//!
//! The chat turns run with the simple dense layout: turn 2 re-renders turn 1's answer through
//! the template, so it may diverge inside the held tokens, and only growing caches can be cut
//! back there (sliding-window rings of 8 slots, the fixture's window, cannot; see
//! `candle_gemma::serve::prefix`). The layout check extends turn 1's exact tokens, which every
//! layout can reuse.

use serde_json::{json, Value};

use crate::harness::{ids_of, prompt_ids, Harness};

fn turn(messages: Value) -> Value {
    json!({
        "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true,
    })
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_two_reuses_turn_one_and_layouts_stay_apart() {
    let on = Harness::start(|c| c.defaults.rotating = false).await;
    let off = Harness::start(|c| {
        c.defaults.rotating = false;
        c.engine.prefix_cache_bytes = 0;
    })
    .await;
    let first = json!([
        {"role": "system", "content": "You are a helpful assistant who answers briefly."},
        {"role": "user", "content": "Hello there, how are you today?"},
    ]);
    let one = on.ok("/v1/chat/completions", &turn(first.clone())).await;
    assert_eq!(cached(&one), 0, "nothing to reuse on turn 1");
    let answer = one["choices"][0]["message"]["content"].clone();
    let mut second = first.as_array().cloned().expect("list");
    second.push(json!({"role": "assistant", "content": answer}));
    second.push(json!({"role": "user", "content": "And now?"}));
    let second = Value::from(second);

    let two = on.ok("/v1/chat/completions", &turn(second.clone())).await;
    assert!(cached(&two) > 0, "turn 2 reuses turn 1: {}", two["usage"]);
    let plain = off.ok("/v1/chat/completions", &turn(second)).await;
    assert_eq!(cached(&plain), 0, "reuse off");
    assert_eq!(ids_of(&two), ids_of(&plain), "reuse changes no token");
    assert_eq!(
        two["usage"]["prompt_tokens"],
        plain["usage"]["prompt_tokens"]
    );

    // An 8-bit turn 1, then turn 2 extending its exact tokens: a dense request gets nothing
    // from the 8-bit entry, an 8-bit one reuses it and gives the tokens of reuse off.
    let complete = |prompt: &[u32], kv_bits: Value| {
        json!({
            "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
            "return_token_ids": true, "kv_bits": kv_bits,
        })
    };
    let p1 = prompt_ids(20, 11);
    let a1 = ids_of(&on.ok("/v1/completions", &complete(&p1, json!(8))).await);
    let mut p2 = p1.clone();
    p2.extend(&a1);
    p2.extend(prompt_ids(6, 12).into_iter().skip(1));
    let dense = on.ok("/v1/completions", &complete(&p2, Value::Null)).await;
    // (The dense entries of the chat share only `<bos>` with it.)
    assert!(
        cached(&dense) < p1.len() as u64,
        "a dense request never gets the 8-bit state: {}",
        dense["usage"]
    );
    let q8 = on.ok("/v1/completions", &complete(&p2, json!(8))).await;
    assert!(cached(&q8) >= p1.len() as u64, "{}", q8["usage"]);
    let q8_plain = off.ok("/v1/completions", &complete(&p2, json!(8))).await;
    assert_eq!(
        ids_of(&q8),
        ids_of(&q8_plain),
        "8-bit reuse changes no token"
    );
    assert!(on.running.state.engine.stats().prefix_entries > 0);
}
