//! A streaming tool call, teacher-forced: the fixture tokenizer's ids of a thought, some text
//! and a tool call, detokenized one token at a time as the engine does, through the OpenAI
//! and Anthropic stream translations. The deltas must be well formed and no tag may leak.

use std::sync::Arc;

use candle_gemma::generate::detok::StreamDecoder;
use candle_gemma::generate::{FinishReason, StepOutput};
use serde_json::{json, Value};

use crate::common;
use crate::harness::MODEL;
use crate::server::chat::ChatStream;
use crate::server::engine::{Event, Usage};
use crate::server::messages::MessagesStream;
use crate::server::split::OutputSplit;
use crate::server::sse::{Frame, Translate};
use candle_gemma::chat::hidden_token_ids;

const ANSWER: &str = "<|channel>thought\nThe user wants weather.<channel|>Let me check.\
<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:3}<tool_call|><turn|>";

/// The engine events of a model that wrote `ANSWER`, one token at a time.
fn scripted() -> (Vec<Event>, Arc<std::collections::HashSet<u32>>) {
    let model = common::load(MODEL);
    let tok = model.tokenizer().expect("fixture tokenizer");
    let ids = model.encode(ANSWER, false).expect("encode");
    assert!(ids.len() > 10, "many tokens: {ids:?}");
    let mut dec = StreamDecoder::new(tok, false);
    let mut events = vec![Event::Started {
        prompt_tokens: 5,
        cached_tokens: 0,
    }];
    for (i, &id) in ids.iter().enumerate() {
        let text = dec.push(id).expect("decode").unwrap_or_default();
        let last = i + 1 == ids.len();
        events.push(Event::Token(StepOutput {
            token: id,
            text,
            finish: last.then_some(FinishReason::Eos(id)),
            logprobs: None,
        }));
    }
    let eos = *ids.last().expect("ids");
    events.push(Event::Done {
        finish: FinishReason::Eos(eos),
        usage: Usage {
            prompt_tokens: 5,
            completion_tokens: ids.len(),
            cached_tokens: 0,
        },
    });
    (events, Arc::new(hidden_token_ids(&model)))
}

fn run(mut t: impl Translate, events: Vec<Event>) -> Vec<Frame> {
    let mut out = Vec::new();
    for e in events {
        let (frames, done) = t.event(e);
        out.extend(frames);
        if done {
            break;
        }
    }
    out
}

#[test]
fn openai_stream_yields_well_formed_tool_call_deltas() {
    let (events, hidden) = scripted();
    let frames = run(
        ChatStream::new(MODEL, true, true, OutputSplit::new(hidden)),
        events,
    );
    assert_eq!(frames.last(), Some(&Frame::Done));
    let (mut content, mut reasoning, mut calls, mut finish) =
        (String::new(), String::new(), Vec::new(), None);
    for f in &frames[..frames.len() - 1] {
        let Frame::Data(v) = f else {
            panic!("OpenAI frames are data: {f:?}")
        };
        let Some(choice) = v["choices"].get(0) else {
            assert!(v["usage"]["completion_tokens"].as_u64().is_some());
            continue;
        };
        let d = &choice["delta"];
        content.push_str(d["content"].as_str().unwrap_or(""));
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        calls.extend(d["tool_calls"].as_array().cloned().unwrap_or_default());
        if let Some(r) = choice["finish_reason"].as_str() {
            finish = Some(r.to_string());
        }
    }
    assert_eq!(reasoning, "The user wants weather.");
    assert_eq!(content, "Let me check.");
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls.len(), 1, "{calls:?}");
    let call = &calls[0];
    assert_eq!(call["index"], 0);
    assert_eq!(call["type"], "function");
    assert!(call["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("call_")));
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(
        call["function"]["arguments"]
            .as_str()
            .expect("a JSON string"),
    )
    .expect("arguments parse");
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
}

#[test]
fn anthropic_stream_yields_thinking_text_and_tool_use_blocks() {
    let (events, hidden) = scripted();
    let frames = run(
        MessagesStream::new(MODEL, Vec::new(), OutputSplit::new(hidden)),
        events,
    );
    let mut blocks: Vec<(String, String)> = Vec::new();
    let mut stop = None;
    for f in &frames {
        let Frame::Named(name, v) = f else {
            panic!("Anthropic frames are named: {f:?}")
        };
        assert_eq!(v["type"], *name);
        match *name {
            "content_block_start" => {
                assert_eq!(v["index"], blocks.len());
                let kind = v["content_block"]["type"]
                    .as_str()
                    .expect("type")
                    .to_string();
                if kind == "tool_use" {
                    assert_eq!(v["content_block"]["name"], "get_weather");
                }
                blocks.push((kind, String::new()));
            }
            "content_block_delta" => {
                let d = &v["delta"];
                let piece = d["text"]
                    .as_str()
                    .or(d["thinking"].as_str())
                    .or(d["partial_json"].as_str());
                blocks
                    .last_mut()
                    .expect("open block")
                    .1
                    .push_str(piece.expect("delta text"));
            }
            "message_delta" => stop = v["delta"]["stop_reason"].as_str().map(str::to_string),
            _ => {}
        }
    }
    let kinds: Vec<&str> = blocks.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use"]);
    assert_eq!(blocks[0].1, "The user wants weather.");
    assert_eq!(blocks[1].1, "Let me check.");
    let input: Value = serde_json::from_str(&blocks[2].1).expect("input JSON");
    assert_eq!(input, json!({"city": "Paris", "days": 3}));
    assert_eq!(stop.as_deref(), Some("tool_use"));
    assert!(matches!(
        frames.last(),
        Some(Frame::Named("message_stop", _))
    ));
}
