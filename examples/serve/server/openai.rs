//! OpenAI wire types: the chat and completion requests, their conversion into the library's
//! chat messages, and the response, chunk and usage objects.

use candle_gemma::chat::{ForcedToolCall, Message, Role, ToolCall};
use candle_gemma::generate::FinishReason;
use serde::Deserialize;
use serde_json::{json, Value};

use super::engine::{Collected, Usage};
use super::error::ApiError;
use super::options::Knobs;

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The model name (checked against the served one).
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    /// Function tools the model may call.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `"auto"` (default), `"none"`, `"required"` or `{"type": "function", "function":
    /// {"name": …}}` (the last two held by a grammar: `structured::constrain`).
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Whether a required tool choice may make more than one call (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Template switches (vLLM): `enable_thinking`.
    #[serde(default)]
    pub chat_template_kwargs: Option<TemplateKwargs>,
    /// Sampling, limits and KV layout.
    #[serde(flatten)]
    pub knobs: Knobs,
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `chat_template_kwargs`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TemplateKwargs {
    /// Ask the model to think first.
    #[serde(default)]
    pub enable_thinking: Option<bool>,
}

/// One OpenAI chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: Role,
    /// A string, a list of text parts, or null (an assistant turn with tool calls only).
    #[serde(default)]
    pub content: Option<Content>,
    /// Tool calls of an assistant turn.
    #[serde(default)]
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// For a tool message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// For a tool message: the function name.
    #[serde(default)]
    pub name: Option<String>,
    /// Reasoning of an earlier assistant turn.
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// Message content.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts; only `{"type": "text", "text": ...}` is supported.
    Parts(Vec<Value>),
}

impl Content {
    /// The text of the content.
    ///
    /// # Errors
    /// 400 for a part that is not text.
    pub fn text(&self) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => out.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::unsupported(
                                "messages",
                                format!(
                                    "content part of type {} is not supported (text only)",
                                    kind.unwrap_or("?")
                                ),
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// A tool call as OpenAI writes it: `{"id", "type": "function", "function": {"name",
/// "arguments": "<JSON string>"}}`.
#[derive(Debug, Clone, Deserialize)]
pub struct WireToolCall {
    /// The call id.
    #[serde(default)]
    pub id: Option<String>,
    /// The function.
    pub function: WireFunction,
}

/// The function of a [`WireToolCall`].
#[derive(Debug, Clone, Deserialize)]
pub struct WireFunction {
    /// Its name.
    pub name: String,
    /// Its arguments: a JSON string (as OpenAI sends) or an object.
    #[serde(default)]
    pub arguments: Value,
}

/// Converts OpenAI messages into the library's.
///
/// # Errors
/// 400 for non-text content or tool-call arguments that are not JSON.
pub fn to_messages(messages: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
    messages
        .iter()
        .map(|m| {
            let content = match &m.content {
                Some(c) => c.text()?,
                None => String::new(),
            };
            let mut msg = Message::new(m.role, content);
            msg.name = m.name.clone();
            msg.tool_call_id = m.tool_call_id.clone();
            msg.reasoning = m.reasoning_content.clone();
            for call in m.tool_calls.iter().flatten() {
                let arguments = match &call.function.arguments {
                    Value::String(s) => serde_json::from_str(s).map_err(|e| {
                        ApiError::invalid(
                            "messages",
                            format!("tool call arguments are not JSON: {e}"),
                        )
                    })?,
                    Value::Null => json!({}),
                    v => v.clone(),
                };
                msg.tool_calls.push(ToolCall {
                    id: call.id.clone(),
                    name: call.function.name.clone(),
                    arguments,
                });
            }
            Ok(msg)
        })
        .collect()
}

/// The tools to render, given `tool_choice`, and the calls it forces (`required`: any tool,
/// several with `parallel`; a named function: that one).
///
/// # Errors
/// 400 for a `tool_choice` other than `auto`, `none`, `required` or a named function.
pub fn tools_for(
    tools: Option<&Vec<Value>>,
    choice: Option<&Value>,
    parallel: bool,
) -> Result<(Vec<Value>, Option<ForcedToolCall>), ApiError> {
    let tools = tools.cloned().unwrap_or_default();
    let named = choice
        .filter(|c| c.get("type").and_then(Value::as_str) == Some("function"))
        .and_then(|c| c.pointer("/function/name"))
        .and_then(Value::as_str);
    match (choice, named) {
        (None | Some(Value::Null), _) => Ok((tools, None)),
        (Some(Value::String(s)), _) if s == "auto" => Ok((tools, None)),
        (Some(Value::String(s)), _) if s == "none" => Ok((Vec::new(), None)),
        (Some(Value::String(s)), _) if s == "required" => {
            Ok((tools, Some(ForcedToolCall::Any { parallel })))
        }
        (_, Some(name)) => Ok((tools, Some(ForcedToolCall::Named(name.to_string())))),
        (Some(other), None) => Err(ApiError::invalid(
            "tool_choice",
            format!(
                "tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": …}}}}, got {other}"
            ),
        )),
    }
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(finish: FinishReason, tool_calls: bool) -> &'static str {
    match finish {
        FinishReason::Length => "length",
        _ if tool_calls => "tool_calls",
        _ => "stop",
    }
}

/// The `usage` object, with cached prompt tokens.
pub fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// The `usage` object of several choices of one prompt: the prompt counted once, every
/// choice's generated tokens.
pub fn usage_of_choices<'a>(choices: impl Iterator<Item = &'a Usage>) -> Value {
    let mut total = Usage::default();
    for (i, u) in choices.enumerate() {
        if i == 0 {
            total.prompt_tokens = u.prompt_tokens;
            total.cached_tokens = u.cached_tokens;
        }
        total.completion_tokens += u.completion_tokens;
    }
    usage(&total)
}

/// The whole (not streamed) answer to one prompt's choices: each choice's object
/// (`choice(index, collected)`) in a list, wrapped by `envelope`, with their `usage`
/// ([`usage_of_choices`]).
pub fn choices_answer(
    done: &[Collected],
    choice: impl Fn(usize, &Collected) -> Value,
    envelope: impl FnOnce(Value) -> Value,
) -> Value {
    let listed: Vec<Value> = done.iter().enumerate().map(|(i, d)| choice(i, d)).collect();
    let mut response = envelope(Value::from(listed));
    response["usage"] = usage_of_choices(done.iter().map(|d| &d.usage));
    response
}

/// One tool call in OpenAI's shape, arguments as a JSON string.
pub fn tool_call(id: &str, name: &str, arguments: &Value) -> Value {
    json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments.to_string()},
    })
}

/// A `chat.completion` or `chat.completion.chunk` envelope around `choices`.
pub fn envelope(object: &str, id: &str, created: u64, model: &str, choices: Value) -> Value {
    json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "system_fingerprint": null,
        "choices": choices,
    })
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The model name.
    #[serde(default)]
    pub model: Option<String>,
    /// A string, a list of token ids, or a one-element list of either.
    #[serde(default)]
    pub prompt: Option<Value>,
    /// Stream the answer.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Sampling, limits and KV layout.
    #[serde(flatten)]
    pub knobs: Knobs,
}

/// A completion prompt: text to encode, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, encoded with `<bos>` first.
    Text(String),
    /// Token ids, used as given.
    Ids(Vec<u32>),
}

/// Reads `prompt`.
///
/// # Errors
/// 400 for a missing prompt, several prompts, or ids that are not u32.
pub fn prompt(value: Option<&Value>) -> Result<Prompt, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "prompt must be a string, a list of token ids, or a one-element list of either",
        )
    };
    let ids = |list: &[Value]| -> Result<Vec<u32>, ApiError> {
        list.iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(bad)
            })
            .collect()
    };
    match value {
        None | Some(Value::Null) => Err(ApiError::missing("prompt")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(list)) => match list.as_slice() {
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(inner)] => Ok(Prompt::Ids(ids(inner)?)),
            l if l.iter().all(Value::is_number) && !l.is_empty() => Ok(Prompt::Ids(ids(l)?)),
            l if l.len() > 1 && l.iter().all(|v| v.is_string() || v.is_array()) => Err(
                ApiError::unsupported("prompt", "one prompt per request (batch them as requests)"),
            ),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}
