//! The streaming output split of a chat answer: generated token texts (special tokens kept) in,
//! reasoning, visible text and complete tool calls out, through the library's
//! [`OutputParser`].
//!
//! A tag split across tokens (`<|tool_` + `call>`) is held back by the parser until it is
//! known, so no tag ever reaches `content`; a tool call is reported once it is complete, with
//! its arguments parsed into JSON. Special tokens the parser does not need (`<unused…>`,
//! `<mask>`, image placeholders) are dropped by id before parsing, as `ChatSession` does.

use std::collections::HashSet;

use candle_gemma::chat::{OutputEvent, OutputParser};
use serde_json::Value;

/// One piece of a chat answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Thinking (OpenAI `reasoning_content`, Anthropic `thinking`).
    Reasoning(String),
    /// Visible text.
    Content(String),
    /// A complete tool call.
    ToolCall {
        /// The function name.
        name: String,
        /// The arguments (a JSON object).
        arguments: Value,
    },
}

/// Splits one answer as it streams.
#[derive(Debug)]
pub struct OutputSplit {
    parser: OutputParser,
    hidden: std::sync::Arc<HashSet<u32>>,
    /// Tool calls reported so far.
    pub tool_calls: usize,
}

impl OutputSplit {
    /// A split that drops the `hidden` ids.
    pub fn new(hidden: std::sync::Arc<HashSet<u32>>) -> Self {
        Self {
            parser: OutputParser::new(),
            hidden,
            tool_calls: 0,
        }
    }

    /// Feeds one generated token and its text; returns the pieces it completes.
    pub fn push(&mut self, token: u32, text: &str) -> Vec<Piece> {
        let text = if self.hidden.contains(&token) {
            ""
        } else {
            text
        };
        let events = self.parser.push(text);
        self.convert(events)
    }

    /// Ends the answer: flushes held-back text and any open block.
    pub fn finish(&mut self) -> Vec<Piece> {
        let events = self.parser.finish();
        self.convert(events)
    }

    fn convert(&mut self, events: Vec<OutputEvent>) -> Vec<Piece> {
        events
            .into_iter()
            .map(|e| match e {
                OutputEvent::Thinking(t) => Piece::Reasoning(t),
                OutputEvent::Text(t) => Piece::Content(t),
                OutputEvent::ToolCall { name, arguments } => {
                    self.tool_calls += 1;
                    Piece::ToolCall { name, arguments }
                }
            })
            .collect()
    }
}

/// A whole answer, gathered from its pieces.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gathered {
    /// The reasoning.
    pub reasoning: String,
    /// The visible text.
    pub content: String,
    /// The tool calls: name and arguments.
    pub tool_calls: Vec<(String, Value)>,
}

impl Gathered {
    /// Adds pieces in order.
    pub fn extend(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Reasoning(t) => self.reasoning.push_str(&t),
                Piece::Content(t) => self.content.push_str(&t),
                Piece::ToolCall { name, arguments } => self.tool_calls.push((name, arguments)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_split_across_tokens_stay_out_of_content() {
        let mut split = OutputSplit::new(Default::default());
        let mut all = Gathered::default();
        for (i, t) in [
            "<|chan",
            "nel>thought\nhm",
            "m<chann",
            "el|>Hi <|tool",
            "_call>call:f{a:",
            "1}<tool_",
            "call|>",
        ]
        .iter()
        .enumerate()
        {
            all.extend(split.push(i as u32, t));
        }
        all.extend(split.finish());
        assert_eq!(all.reasoning, "hmm");
        assert_eq!(all.content, "Hi ");
        assert_eq!(
            all.tool_calls,
            vec![("f".to_string(), serde_json::json!({"a": 1}))]
        );
    }
}
