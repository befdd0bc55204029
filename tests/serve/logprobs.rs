//! `logprobs` on both OpenAI endpoints, streaming and not: one entry a generated token, the
//! chosen token's log-probability against the library's log-softmax of the prompt's logits,
//! the alternatives most likely first, and the field errors; `logit_bias` forcing and banning
//! tokens; `n` choices.

use candle_gemma::CacheConfig;
use reqwest::StatusCode;
use serde_json::json;

use crate::common;
use crate::harness::{openai_chunks, prompt_ids, Harness, MODEL};

fn first_logprob(h: &Harness, prompt: &[u32], token: u32) -> f64 {
    let mut cache = h.model.new_cache(&CacheConfig::default()).expect("cache");
    common::log_softmax(&common::step(&h.model, &mut cache, prompt))[token as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_report_each_tokens_logprobs() {
    let h = Harness::start(|_| {}).await;
    let prompt = prompt_ids(12, 3);
    let body = json!({
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true, "logprobs": 3,
    });
    let v = h.ok("/v1/completions", &body).await;
    let lp = &v["choices"][0]["logprobs"];
    let ids: Vec<u32> = v["choices"][0]["token_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|i| i.as_u64().expect("id") as u32)
        .collect();
    let values: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .expect("token_logprobs")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect();
    assert_eq!(values.len(), 6, "{lp}");
    assert_eq!(lp["tokens"].as_array().expect("tokens").len(), 6);
    assert_eq!(lp["text_offset"].as_array().expect("offsets").len(), 6);
    let want = first_logprob(&h, &prompt, ids[0]);
    assert!((values[0] - want).abs() < 1e-4, "{} vs {want}", values[0]);
    for (i, top) in lp["top_logprobs"]
        .as_array()
        .expect("top")
        .iter()
        .enumerate()
    {
        let top = top.as_object().expect("map");
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
        // Greedy: the chosen token is the most likely one.
        let best = top
            .values()
            .map(|x| x.as_f64().expect("number"))
            .fold(f64::MIN, f64::max);
        assert!(
            (best - values[i]).abs() < 1e-6,
            "step {i}: {top:?} vs {}",
            values[i]
        );
    }

    // Streamed: one chunk a token, each with its own lists (the prompt now comes from the
    // prefix store, whose prefill rounds a little differently).
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = openai_chunks(&h.stream("/v1/completions", &streamed).await);
    let per_chunk: Vec<f64> = chunks
        .iter()
        .filter_map(|c| {
            c["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .cloned()
        })
        .flatten()
        .map(|x| x.as_f64().expect("number"))
        .collect();
    assert_eq!(per_chunk.len(), 6);
    for (a, b) in per_chunk.iter().zip(&values) {
        assert!((a - b).abs() < 1e-4, "{per_chunk:?} vs {values:?}");
    }

    // Chat, whole and streamed: an entry a generated token with two alternatives.
    let chat = json!({
        "model": MODEL, "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2,
        "messages": [{"role": "user", "content": "Hello there"}],
    });
    let v = h.ok("/v1/chat/completions", &chat).await;
    let entries = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content")
        .clone();
    assert_eq!(
        entries.len() as u64,
        v["usage"]["completion_tokens"].as_u64().expect("usage")
    );
    for e in &entries {
        assert!(e["token"].is_string() && e["bytes"].is_array(), "{e}");
        let top = e["top_logprobs"].as_array().expect("alternatives");
        assert_eq!(top.len(), 2, "{e}");
        assert!(e["logprob"].as_f64().expect("number") <= 0.0);
    }
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let chunks = openai_chunks(&h.stream("/v1/chat/completions", &streamed).await);
    let streamed_entries: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed_entries.len(), entries.len());
    for (a, b) in streamed_entries.iter().zip(&entries) {
        assert_eq!(a["token"], b["token"]);
    }

    // Without logprobs the field stays null.
    let plain = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let v = h.ok("/v1/completions", &plain).await;
    assert!(v["choices"][0]["logprobs"].is_null());

    for (bad, code) in [
        (json!({"top_logprobs": 2}), "invalid_top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 30}),
            "invalid_top_logprobs",
        ),
        (json!({"logprobs": "all"}), "invalid_logprobs"),
    ] {
        let mut body = chat.clone();
        body.as_object_mut().expect("object").remove("logprobs");
        body.as_object_mut().expect("object").remove("top_logprobs");
        for (k, v) in bad.as_object().expect("object") {
            body[k] = v.clone();
        }
        let (status, err) = h.post("/v1/chat/completions", &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
        assert_eq!(err["error"]["code"], code, "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_forces_and_bans_tokens() {
    let h = Harness::start(|_| {}).await;
    let prompt = prompt_ids(10, 5);
    let body = |bias: serde_json::Value| {
        json!({
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true, "logit_bias": bias,
        })
    };
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v["choices"][0]["token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|i| i.as_u64().expect("id"))
            .collect()
    };
    let plain = ids(&h.ok("/v1/completions", &body(json!({}))).await);
    let forced = ids(&h.ok("/v1/completions", &body(json!({"77": 100}))).await);
    assert_eq!(forced, vec![77; 4], "a +100 bias forces its token");
    let banned = ids(&h
        .ok(
            "/v1/completions",
            &body(json!({plain[0].to_string(): -100})),
        )
        .await);
    assert_ne!(banned[0], plain[0], "a -100 bias bans the greedy token");
    let (status, err) = h
        .post("/v1/completions", &body(json!({"1000000": 1})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{err}");
    assert_eq!(err["error"]["param"], "logit_bias", "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_choices_decode_side_by_side() {
    let h = Harness::start(|_| {}).await;
    let prompt = prompt_ids(9, 2);
    let body = |n: u32| {
        json!({
            "model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": 40,
            "ignore_eos": true, "return_token_ids": true, "n": n,
        })
    };
    let ids = |c: &serde_json::Value| -> Vec<u64> {
        c["token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|i| i.as_u64().expect("id"))
            .collect()
    };
    let v = h.ok("/v1/completions", &body(3)).await;
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(ids(c).len(), 5, "{v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 15, "{v}");
    let whole: Vec<Vec<u64>> = choices.iter().map(ids).collect();
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len(), "{v}");
    // Choice i draws with seed 40 + i: choice 0 is the single request's answer, and the
    // others differ from it (random weights leave the noise to decide).
    let single = h.ok("/v1/completions", &body(1)).await;
    assert_eq!(ids(&choices[0]), ids(&single["choices"][0]), "{v}");
    assert!(
        choices[1..].iter().any(|c| ids(c) != ids(&choices[0])),
        "{v}"
    );
    let chat = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "ignore_eos": true, "n": 2,
    });
    let v = h.ok("/v1/chat/completions", &chat).await;
    let answers = v["choices"].as_array().expect("choices");
    assert_eq!(answers.len(), 2, "{v}");
    assert_eq!(answers[1]["index"], 1, "{v}");
    assert_eq!(answers[1]["message"]["role"], "assistant", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    // Streamed: every choice's chunks carry its index, and they give the whole answers'
    // tokens; one usage chunk, then one [DONE].
    let mut streamed = body(3);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = openai_chunks(&h.stream("/v1/completions", &streamed).await);
    let mut got = vec![Vec::new(); 3];
    let mut usage = Vec::new();
    for c in &chunks {
        for choice in c["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            // The finishing chunk carries no ids.
            if !choice["token_ids"].is_null() {
                got[i].extend(ids(choice));
            }
        }
        if !c["usage"].is_null() {
            usage.push(c["usage"].clone());
        }
    }
    assert_eq!(got, whole, "{chunks:?}");
    assert_eq!(usage.len(), 1, "{usage:?}");
    assert_eq!(usage[0]["completion_tokens"], 15, "{usage:?}");
    // Streamed chat: both choices' chunks, each ending with its finish reason.
    let mut chat = chat;
    chat["stream"] = json!(true);
    let chunks = openai_chunks(&h.stream("/v1/chat/completions", &chat).await);
    let mut finished = [0, 0];
    for c in &chunks {
        for choice in c["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            if !choice["finish_reason"].is_null() {
                finished[i] += 1;
            }
        }
    }
    assert_eq!(finished, [1, 1], "{chunks:?}");
}
