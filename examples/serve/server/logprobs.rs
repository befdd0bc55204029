//! Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content` entries (token,
//! logprob, UTF-8 bytes, alternatives) and the completions API's parallel lists (`tokens`,
//! `token_logprobs`, `top_logprobs`, `text_offset`). A token's text is its id decoded alone
//! (`token_id:N` without a tokenizer, as vLLM writes ids); a log-probability of -inf (a token
//! the model rules out) is written as -9999.0, as OpenAI does, since JSON has no infinity.

use candle_gemma::generate::TokenLogprobs;
use candle_gemma::Model;
use serde_json::{json, Map, Value};

/// `id` as text.
pub fn token_text(model: &Model, id: u32) -> String {
    match model.tokenizer() {
        Some(_) => model
            .decode(&[id], false)
            .unwrap_or_else(|_| format!("token_id:{id}")),
        None => format!("token_id:{id}"),
    }
}

fn number(lp: f32) -> Value {
    if lp.is_finite() {
        json!(lp)
    } else {
        json!(-9999.0)
    }
}

fn chat_one(model: &Model, id: u32, lp: f32) -> Value {
    let text = token_text(model, id);
    json!({"token": text, "logprob": number(lp), "bytes": text.as_bytes()})
}

/// Chat's entry for one generated token.
pub fn chat_entry(model: &Model, token: u32, lp: &TokenLogprobs) -> Value {
    let mut entry = chat_one(model, token, lp.logprob);
    entry["top_logprobs"] = lp
        .top
        .iter()
        .map(|&(id, v)| chat_one(model, id, v))
        .collect::<Vec<_>>()
        .into();
    entry
}

/// The completions API's lists for `steps` (token, its log-probabilities, and the offset of
/// its text in the completion).
pub fn completion_lists(model: &Model, steps: &[(u32, &TokenLogprobs, usize)]) -> Value {
    let tokens: Vec<String> = steps.iter().map(|s| token_text(model, s.0)).collect();
    let logprobs: Vec<Value> = steps.iter().map(|s| number(s.1.logprob)).collect();
    let top: Vec<Value> = steps
        .iter()
        .map(|s| {
            let mut m = Map::new();
            for &(id, v) in &s.1.top {
                m.entry(token_text(model, id)).or_insert_with(|| number(v));
            }
            Value::Object(m)
        })
        .collect();
    let offsets: Vec<usize> = steps.iter().map(|s| s.2).collect();
    json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets})
}
