//! The streaming output parser: any text, split into chunks anywhere, gives the same events as
//! the whole text at once, never shows a special-token string in its text or thinking (nor in
//! all of either joined), and never panics.
//!
//! Input: one byte (bit 0: the output starts inside a thought), then the text, in which each
//! `0xFF` byte (never part of UTF-8) marks a chunk boundary.

#![no_main]

use candle_gemma::chat::{OutputEvent, OutputParser};
use libfuzzer_sys::fuzz_target;

/// Every special-token string the parser knows.
const SPECIAL_TOKEN_STRINGS: &[&str] = &[
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|\"|>",
    "<|turn>",
    "<turn|>",
    "<eos>",
    "<bos>",
    "<pad>",
    "<unk>",
    "<mask>",
    "<|think|>",
    "<|tool>",
    "<tool|>",
    "<|tool_response>",
    "<tool_response|>",
    "<|image>",
    "<image|>",
    "<|audio>",
    "<audio|>",
    "<|image|>",
    "<|audio|>",
    "<|video|>",
];

fn parser(in_thinking: bool) -> OutputParser {
    if in_thinking {
        OutputParser::in_thinking()
    } else {
        OutputParser::new()
    }
}

fn parse<'a>(in_thinking: bool, chunks: impl IntoIterator<Item = &'a str>) -> Vec<OutputEvent> {
    let mut p = parser(in_thinking);
    let mut events = Vec::new();
    for chunk in chunks {
        events.extend(p.push(chunk));
    }
    events.extend(p.finish());
    merged(events)
}

/// Joins adjacent text and adjacent thinking events (the parser merges only within one call).
fn merged(events: Vec<OutputEvent>) -> Vec<OutputEvent> {
    let mut out: Vec<OutputEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(OutputEvent::Text(a)), OutputEvent::Text(b))
            | (Some(OutputEvent::Thinking(a)), OutputEvent::Thinking(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, text)) = data.split_first() else {
        return;
    };
    let in_thinking = mode & 1 == 1;
    let chunks: Vec<String> = text
        .split(|&b| b == 0xFF)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    let chunked = parse(in_thinking, chunks.iter().map(String::as_str));
    let whole = parse(in_thinking, [chunks.concat().as_str()]);
    assert_eq!(chunked, whole, "chunks {chunks:?}");
    let mut joined = [String::new(), String::new()];
    for e in &chunked {
        match e {
            OutputEvent::Text(t) => joined[0].push_str(t),
            OutputEvent::Thinking(t) => joined[1].push_str(t),
            OutputEvent::ToolCall { .. } => {}
        }
    }
    for s in SPECIAL_TOKEN_STRINGS {
        for j in &joined {
            assert!(!j.contains(s), "{s} in {j:?} from chunks {chunks:?}");
        }
    }
});
