//! `POST /v1/chat/completions`: the conversation through the chat template into the engine,
//! the answer split into `content`, `reasoning_content` and `tool_calls`, whole or as
//! `chat.completion.chunk` deltas ending with `data: [DONE]`. `n` choices decode side by
//! side, each with the seed moved by its index.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::engine::{collect_all, Collected, Event};
use super::error::ApiError;
use super::logprobs;
use super::openai::{self, ChatRequest};
use super::split::{Gathered, OutputSplit, Piece};
use super::sse::{self, Frame, Translate};
use super::{body, new_id, unix_now, AppState};

/// The route handler.
pub async fn handle(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match run(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(state: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatRequest = body::parse(body)?;
    state.check_model(req.model.as_deref())?;
    let messages = req
        .messages
        .as_ref()
        .ok_or_else(|| ApiError::missing("messages"))?;
    let messages = openai::to_messages(messages)?;
    let (tools, forced) = openai::tools_for(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls.unwrap_or(true),
    )?;
    let thinking = req
        .chat_template_kwargs
        .as_ref()
        .and_then(|k| k.enable_thinking)
        .unwrap_or(false);
    // Field errors first: they do not depend on the prompt.
    req.knobs
        .to_options(&state.config.defaults, 0, state.context())?;
    let (prompt, options) =
        state.chat_request(&req.knobs, &messages, tools, forced.as_ref(), thinking)?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    let return_ids = req.knobs.return_token_ids;
    // One completion id for every choice's chunks.
    let new_stream = |id: &str, created: u64| {
        let mut each = ChatStream::new(
            state.model_id(),
            include_usage,
            return_ids,
            OutputSplit::new(state.hidden.clone()),
        )
        .with_logprobs(state.clone());
        each.id = id.to_string();
        each.created = created;
        each
    };
    let stream = new_stream(&new_id("chatcmpl-"), unix_now());
    let submissions = state
        .engine
        .submit_choices(&prompt, &options, req.knobs.choices())?;
    if req.stream {
        let streams = submissions
            .into_iter()
            .map(|s| (s, new_stream(&stream.id, stream.created)));
        return Ok(sse::respond_choices(streams.collect()));
    }
    let done = collect_all(submissions).await?;
    let response = openai::choices_answer(
        &done,
        |i, d| choice(&state, stream.return_ids, i, d),
        |choices| {
            openai::envelope(
                "chat.completion",
                &stream.id,
                stream.created,
                &stream.model,
                choices,
            )
        },
    );
    Ok(Json(response).into_response())
}

/// Choice `index` of a finished chat answer: its text split into content, reasoning and tool
/// calls.
fn choice(state: &AppState, return_ids: bool, index: usize, done: &Collected) -> Value {
    let mut split = OutputSplit::new(state.hidden.clone());
    let mut all = Gathered::default();
    for step in &done.steps {
        all.extend(split.push(step.token, &step.text));
    }
    all.extend(split.finish());
    let calls: Vec<Value> = all
        .tool_calls
        .iter()
        .map(|(name, args)| openai::tool_call(&new_id("call_"), name, args))
        .collect();
    let mut message = json!({
        "role": "assistant",
        "content": if all.content.is_empty() && !calls.is_empty() { Value::Null } else { Value::from(all.content) },
        "reasoning_content": if all.reasoning.is_empty() { Value::Null } else { Value::from(all.reasoning) },
    });
    if !calls.is_empty() {
        message["tool_calls"] = Value::from(calls.clone());
    }
    let entries: Vec<Value> = done
        .steps
        .iter()
        .filter_map(|s| {
            s.logprobs
                .as_ref()
                .map(|lp| logprobs::chat_entry(state.model(), s.token, lp))
        })
        .collect();
    let logprobs = if entries.is_empty() {
        Value::Null
    } else {
        json!({ "content": entries })
    };
    let mut choice = json!({
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": openai::finish_reason(done.finish, !calls.is_empty()),
    });
    if return_ids {
        choice["token_ids"] = json!(done.steps.iter().map(|s| s.token).collect::<Vec<_>>());
    }
    choice
}

/// Translates one chat answer into `chat.completion.chunk` events.
#[derive(Debug)]
pub struct ChatStream {
    /// The completion id shared by every chunk.
    pub id: String,
    /// Unix time of the request.
    pub created: u64,
    /// The reported model id.
    pub model: String,
    /// Send a last chunk with the usage.
    pub include_usage: bool,
    /// Put the generated ids (`token_ids`) in the chunks.
    pub return_ids: bool,
    /// The split of the answer.
    pub split: OutputSplit,
    /// Ids generated since the last chunk.
    pub pending_ids: Vec<u32>,
    /// The server, where the request asked for log-probabilities (its tokenizer names the
    /// tokens), and the entries of the tokens generated since the last chunk.
    logprobs: Option<Arc<AppState>>,
    pending_logprobs: Vec<Value>,
}

impl ChatStream {
    /// A translator for one answer of `model`.
    pub fn new(model: &str, include_usage: bool, return_ids: bool, split: OutputSplit) -> Self {
        Self {
            id: new_id("chatcmpl-"),
            created: unix_now(),
            model: model.to_string(),
            include_usage,
            return_ids,
            split,
            pending_ids: Vec::new(),
            logprobs: None,
            pending_logprobs: Vec::new(),
        }
    }

    /// Puts the log-probabilities of the tokens (where the request asked for them) in the
    /// chunks, named by `state`'s tokenizer.
    pub fn with_logprobs(mut self, state: Arc<AppState>) -> Self {
        self.logprobs = Some(state);
        self
    }

    fn chunk(&mut self, delta: Value, finish: Option<&str>) -> Frame {
        let lp = if self.pending_logprobs.is_empty() {
            Value::Null
        } else {
            json!({ "content": std::mem::take(&mut self.pending_logprobs) })
        };
        let mut choice =
            json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish});
        if self.return_ids {
            choice["token_ids"] = json!(std::mem::take(&mut self.pending_ids));
        }
        Frame::Data(openai::envelope(
            "chat.completion.chunk",
            &self.id,
            self.created,
            &self.model,
            json!([choice]),
        ))
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<Frame> {
        pieces
            .into_iter()
            .map(|p| {
                let delta = match p {
                    Piece::Content(t) => json!({"content": t}),
                    Piece::Reasoning(t) => json!({"reasoning_content": t}),
                    Piece::ToolCall { name, arguments } => {
                        let mut call = openai::tool_call(&new_id("call_"), &name, &arguments);
                        call["index"] = json!(self.split.tool_calls - 1);
                        json!({"tool_calls": [call]})
                    }
                };
                self.chunk(delta, None)
            })
            .collect()
    }

    fn error(&self, e: &ApiError) -> Vec<Frame> {
        vec![Frame::Data(e.body()), Frame::Done]
    }
}

impl Translate for ChatStream {
    fn event(&mut self, event: Event) -> (Vec<Frame>, bool) {
        match event {
            Event::Started { .. } => (
                vec![self.chunk(json!({"role": "assistant", "content": ""}), None)],
                false,
            ),
            Event::Token(step) => {
                self.pending_ids.push(step.token);
                if let (Some(state), Some(lp)) = (&self.logprobs, &step.logprobs) {
                    let entry = logprobs::chat_entry(state.model(), step.token, lp);
                    self.pending_logprobs.push(entry);
                }
                let pieces = self.split.push(step.token, &step.text);
                (self.pieces(pieces), false)
            }
            Event::Done { finish, usage } => {
                let pieces = self.split.finish();
                let mut out = self.pieces(pieces);
                let reason = openai::finish_reason(finish, self.split.tool_calls > 0);
                out.push(self.chunk(json!({}), Some(reason)));
                if self.include_usage {
                    let mut last = openai::envelope(
                        "chat.completion.chunk",
                        &self.id,
                        self.created,
                        &self.model,
                        json!([]),
                    );
                    last["usage"] = openai::usage(&usage);
                    out.push(Frame::Data(last));
                }
                out.push(Frame::Done);
                (out, true)
            }
            Event::Failed(message) => (self.error(&ApiError::internal(message)), true),
        }
    }

    fn closed(&mut self) -> Vec<Frame> {
        self.error(&ApiError::unavailable())
    }
}
