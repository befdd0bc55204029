//! Anthropic Messages wire types: the request, its conversion into the library's chat
//! messages (text, `thinking`, `tool_use`, `tool_result`), and the response's content blocks,
//! stop reason and usage.

use candle_gemma::chat::{ForcedToolCall, Message, Role, ToolCall};
use candle_gemma::generate::FinishReason;
use serde::Deserialize;
use serde_json::{json, Value};

use super::engine::Usage;
use super::error::ApiError;
use super::options::Knobs;

/// `POST /v1/messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    /// The model name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation (user and assistant turns).
    #[serde(default)]
    pub messages: Option<Vec<AnthropicMessage>>,
    /// The system prompt: a string or text blocks.
    #[serde(default)]
    pub system: Option<Value>,
    /// Tools: `{"name", "description", "input_schema"}`.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto"}` (default) or `{"type": "none"}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled", ...}` asks the model to think.
    #[serde(default)]
    pub thinking: Option<Value>,
    /// Stop strings.
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    /// Stream the answer as Anthropic's events.
    #[serde(default)]
    pub stream: bool,
    /// `max_tokens`, sampling and the KV extensions (shared with the OpenAI routes).
    #[serde(flatten)]
    pub knobs: Knobs,
}

/// One message.
#[derive(Debug, Clone, Deserialize)]
pub struct AnthropicMessage {
    /// `user` or `assistant`.
    pub role: Role,
    /// A string or content blocks.
    pub content: Value,
}

fn blocks(content: &Value) -> Result<Vec<Value>, ApiError> {
    match content {
        Value::String(s) => Ok(vec![json!({"type": "text", "text": s})]),
        Value::Array(list) => Ok(list.clone()),
        Value::Null => Ok(Vec::new()),
        _ => Err(ApiError::invalid(
            "messages",
            "content must be a string or a list of blocks",
        )),
    }
}

fn str_field<'a>(block: &'a Value, key: &str) -> Result<&'a str, ApiError> {
    block.get(key).and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            "messages",
            format!("a content block lacks the string `{key}`"),
        )
    })
}

/// The text of a `tool_result`'s content (a string or text blocks).
fn result_text(content: Option<&Value>) -> Result<String, ApiError> {
    let mut out = String::new();
    for b in blocks(content.unwrap_or(&Value::Null))? {
        out.push_str(str_field(&b, "text")?);
    }
    Ok(out)
}

/// Converts the system prompt and messages into the library's messages.
///
/// # Errors
/// 400 for an unknown or unsupported block (images), or a block missing a field.
pub fn to_messages(
    system: Option<&Value>,
    messages: &[AnthropicMessage],
) -> Result<Vec<Message>, ApiError> {
    let mut out = Vec::new();
    if let Some(system) = system {
        let mut text = String::new();
        for b in blocks(system)? {
            text.push_str(str_field(&b, "text")?);
        }
        out.push(Message::system(text));
    }
    for m in messages {
        let mut text = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        for b in blocks(&m.content)? {
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push_str(str_field(&b, "text")?),
                Some("thinking") => reasoning.push_str(str_field(&b, "thinking")?),
                Some("redacted_thinking") => {}
                Some("tool_use") => calls.push(ToolCall {
                    id: Some(str_field(&b, "id")?.to_string()),
                    name: str_field(&b, "name")?.to_string(),
                    arguments: b.get("input").cloned().unwrap_or_else(|| json!({})),
                }),
                Some("tool_result") => {
                    let mut result = Message::new(Role::Tool, result_text(b.get("content"))?);
                    result.tool_call_id = Some(str_field(&b, "tool_use_id")?.to_string());
                    out.push(result);
                }
                other => {
                    return Err(ApiError::unsupported(
                        "messages",
                        format!(
                            "content block of type {} is not supported",
                            other.unwrap_or("?")
                        ),
                    ))
                }
            }
        }
        if text.is_empty() && reasoning.is_empty() && calls.is_empty() {
            continue;
        }
        let mut msg = Message::new(m.role, text);
        if !reasoning.is_empty() {
            msg.reasoning = Some(reasoning);
        }
        msg.tool_calls = calls;
        out.push(msg);
    }
    Ok(out)
}

/// The tools in the OpenAI shape the template takes, given `tool_choice`, and the calls it
/// forces (`any`: any tool, one only with `disable_parallel_tool_use`; `tool`: the named one).
///
/// # Errors
/// 400 for a `tool_choice` type other than `auto`, `none`, `any` or `tool`, a `tool` choice
/// without a name, or a tool without a name.
pub fn tools_for(
    tools: Option<&Vec<Value>>,
    choice: Option<&Value>,
) -> Result<(Vec<Value>, Option<ForcedToolCall>), ApiError> {
    let forced = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        None | Some("auto") => None,
        Some("none") => return Ok((Vec::new(), None)),
        Some("any") => Some(ForcedToolCall::Any {
            parallel: !choice
                .and_then(|c| c.get("disable_parallel_tool_use"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
        }),
        Some("tool") => match choice.and_then(|c| c.get("name")).and_then(Value::as_str) {
            Some(name) => Some(ForcedToolCall::Named(name.to_string())),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a tool_choice of type tool needs the tool's `name`",
                ))
            }
        },
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("tool_choice type must be auto, none, any or tool, got {other}"),
            ))
        }
    };
    let tools = tools
        .into_iter()
        .flatten()
        .map(|t| {
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid("tools", "every tool needs a string `name`")
            })?;
            Ok(json!({
                "type": "function",
                "function": {
                    "name": name,
                    "description": t.get("description").cloned().unwrap_or_else(|| json!("")),
                    "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"})),
                }
            }))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok((tools, forced))
}

/// Whether the request asks for thinking.
pub fn thinking_enabled(thinking: Option<&Value>) -> bool {
    thinking
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t == "enabled")
}

/// Anthropic's `stop_reason` and `stop_sequence`.
pub fn stop_reason(
    finish: FinishReason,
    tool_calls: bool,
    stops: &[String],
) -> (&'static str, Value) {
    match finish {
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::Stop(i) => (
            "stop_sequence",
            stops
                .get(i)
                .map_or(Value::Null, |s| Value::from(s.as_str())),
        ),
        _ if tool_calls => ("tool_use", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

/// Anthropic's usage: `input_tokens` excludes the prompt tokens read from the cache.
pub fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// A `tool_use` content block.
pub fn tool_use(id: &str, name: &str, input: &Value) -> Value {
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

/// The `message` object, with `content` blocks.
pub fn message(id: &str, model: &str, content: Value, stop: (&str, Value), usage: Value) -> Value {
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": if stop.0.is_empty() { Value::Null } else { Value::from(stop.0) },
        "stop_sequence": stop.1,
        "usage": usage,
    })
}
