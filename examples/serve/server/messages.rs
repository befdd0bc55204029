//! `POST /v1/messages` (Anthropic Messages): the conversation through the chat template into
//! the engine; the answer as `thinking`, `text` and `tool_use` blocks, whole or as Anthropic's
//! streaming events (`message_start`, `content_block_start` / `_delta` / `_stop`,
//! `message_delta`, `message_stop`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::anthropic::{self, MessagesRequest};
use super::engine::{Event, Usage};
use super::error::ApiError;
use super::options::StopField;
use super::split::{Gathered, OutputSplit, Piece};
use super::sse::{self, Frame, Translate};
use super::{body, new_id, AppState};

/// The route handler.
pub async fn handle(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match run(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(state: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let mut req: MessagesRequest = body::parse(body)?;
    state.check_model(req.model.as_deref())?;
    let stops = req.stop_sequences.take().unwrap_or_default();
    if !stops.is_empty() {
        req.knobs.stop = Some(StopField::Many(stops.clone()));
    }
    req.knobs
        .to_options(&state.config.defaults, 0, state.context())?;
    let messages = req
        .messages
        .as_ref()
        .ok_or_else(|| ApiError::missing("messages"))?;
    let messages = anthropic::to_messages(req.system.as_ref(), messages)?;
    let (tools, forced) = anthropic::tools_for(req.tools.as_ref(), req.tool_choice.as_ref())?;
    let thinking = anthropic::thinking_enabled(req.thinking.as_ref());
    let (prompt, options) =
        state.chat_request(&req.knobs, &messages, tools, forced.as_ref(), thinking)?;
    let submission = state.engine.submit(prompt, options)?;
    let mut stream = MessagesStream::new(
        state.model_id(),
        stops,
        OutputSplit::new(state.hidden.clone()),
    );
    if req.stream {
        return Ok(sse::respond(submission, stream));
    }
    let done = submission.collect().await?;
    let mut all = Gathered::default();
    for step in &done.steps {
        all.extend(stream.split.push(step.token, &step.text));
    }
    all.extend(stream.split.finish());
    let mut content = Vec::new();
    if !all.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": all.reasoning, "signature": ""}));
    }
    if !all.content.is_empty() {
        content.push(json!({"type": "text", "text": all.content}));
    }
    for (name, input) in &all.tool_calls {
        content.push(anthropic::tool_use(&new_id("toolu_"), name, input));
    }
    let stop = anthropic::stop_reason(done.finish, !all.tool_calls.is_empty(), &stream.stops);
    Ok(Json(anthropic::message(
        &stream.id,
        &stream.model,
        Value::from(content),
        stop,
        anthropic::usage(&done.usage),
    ))
    .into_response())
}

/// The kind of the open content block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
}

/// Translates one answer into Anthropic's streaming events.
#[derive(Debug)]
pub struct MessagesStream {
    id: String,
    model: String,
    stops: Vec<String>,
    split: OutputSplit,
    /// The open block and its index.
    block: Option<(usize, Block)>,
    next_index: usize,
}

impl MessagesStream {
    /// A translator for one answer of `model`; `stops` are the request's stop sequences.
    pub fn new(model: &str, stops: Vec<String>, split: OutputSplit) -> Self {
        Self {
            id: new_id("msg_"),
            model: model.to_string(),
            stops,
            split,
            block: None,
            next_index: 0,
        }
    }

    fn close(&mut self, out: &mut Vec<Frame>) {
        if let Some((index, _)) = self.block.take() {
            out.push(Frame::Named(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn open(&mut self, out: &mut Vec<Frame>, block: Value) -> usize {
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        out.push(Frame::Named(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn delta(out: &mut Vec<Frame>, index: usize, delta: Value) {
        out.push(Frame::Named(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }

    fn text(&mut self, out: &mut Vec<Frame>, kind: Block, text: String) {
        let open = self.block;
        let index = match open {
            Some((i, k)) if k == kind => i,
            _ => {
                let start = match kind {
                    Block::Thinking => json!({"type": "thinking", "thinking": ""}),
                    Block::Text => json!({"type": "text", "text": ""}),
                };
                let i = self.open(out, start);
                self.block = Some((i, kind));
                i
            }
        };
        let delta = match kind {
            Block::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Block::Text => json!({"type": "text_delta", "text": text}),
        };
        Self::delta(out, index, delta);
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<Frame> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(t) => self.text(&mut out, Block::Thinking, t),
                Piece::Content(t) => self.text(&mut out, Block::Text, t),
                Piece::ToolCall { name, arguments } => {
                    let start = anthropic::tool_use(&new_id("toolu_"), &name, &json!({}));
                    let index = self.open(&mut out, start);
                    let partial =
                        json!({"type": "input_json_delta", "partial_json": arguments.to_string()});
                    Self::delta(&mut out, index, partial);
                    out.push(Frame::Named(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": index}),
                    ));
                }
            }
        }
        out
    }

    fn error(e: &ApiError) -> Vec<Frame> {
        vec![Frame::Named("error", e.body())]
    }
}

impl Translate for MessagesStream {
    fn event(&mut self, event: Event) -> (Vec<Frame>, bool) {
        match event {
            Event::Started {
                prompt_tokens,
                cached_tokens,
            } => {
                let usage = anthropic::usage(&Usage {
                    prompt_tokens,
                    completion_tokens: 0,
                    cached_tokens,
                });
                let message =
                    anthropic::message(&self.id, &self.model, json!([]), ("", Value::Null), usage);
                (
                    vec![Frame::Named(
                        "message_start",
                        json!({"type": "message_start", "message": message}),
                    )],
                    false,
                )
            }
            Event::Token(step) => {
                let pieces = self.split.push(step.token, &step.text);
                (self.pieces(pieces), false)
            }
            Event::Done { finish, usage } => {
                let pieces = self.split.finish();
                let mut out = self.pieces(pieces);
                self.close(&mut out);
                let (reason, sequence) =
                    anthropic::stop_reason(finish, self.split.tool_calls > 0, &self.stops);
                out.push(Frame::Named(
                    "message_delta",
                    json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {"output_tokens": usage.completion_tokens},
                    }),
                ));
                out.push(Frame::Named(
                    "message_stop",
                    json!({"type": "message_stop"}),
                ));
                (out, true)
            }
            Event::Failed(message) => (Self::error(&ApiError::internal(message)), true),
        }
    }

    fn closed(&mut self) -> Vec<Frame> {
        Self::error(&ApiError::unavailable())
    }
}
