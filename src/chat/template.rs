//! Chat messages and their rendering into a Gemma 4 prompt through a Jinja chat template —
//! the checkpoint's own (`chat_template.jinja` or `tokenizer_config.json`) or a built-in one
//! that follows Google's format.
//!
//! ```
//! use candle_gemma::chat::{ChatTemplate, Message, RenderOptions};
//!
//! let prompt = ChatTemplate::builtin().render(
//!     &[Message::system("Be brief."), Message::user("Hi!")],
//!     &RenderOptions::default(),
//! )?;
//! assert_eq!(
//!     prompt,
//!     "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi!<turn|>\n<|turn>model\n"
//! );
//! # Ok::<(), candle_gemma::chat::ChatError>(())
//! ```
//!
//! Tokenize the result **without** adding special tokens: the prompt already starts with
//! exactly one `<bos>`.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::syntax::{declaration, to_gemma};
use super::{pycompat, ChatError};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions for the whole conversation (rendered in the system turn).
    System,
    /// OpenAI's newer name for `system`; Gemma renders it the same way.
    Developer,
    /// The human.
    User,
    /// The model (rendered as the `model` role).
    #[serde(alias = "model")]
    Assistant,
    /// The result of a tool call.
    Tool,
}

impl Role {
    /// The role name as chat templates expect it (`"assistant"`, not `"model"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A tool call made by the model in an earlier assistant turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Identifier that tool messages can refer to via [`Message::tool_call_id`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The function name.
    pub name: String,
    /// The arguments: a JSON object (a string holding a JSON object is accepted too).
    pub arguments: Value,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// The text. For a model turn, any `<|channel>…<channel|>` thought in it is stripped
    /// when rendered.
    #[serde(default)]
    pub content: String,
    /// The model's reasoning for this turn; rendered only for a tool-calling turn after
    /// the last user message (the turn still in progress), as Google's template does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Tool calls made in this (assistant) message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the function that produced the result. When absent it is looked
    /// up from [`tool_call_id`](Self::tool_call_id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// For a tool message: the [`ToolCall::id`] it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For a tool message: a structured result, rendered instead of `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<Value>,
}

impl Message {
    /// A message with `role` and `content` and nothing else.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            reasoning: None,
            tool_calls: Vec::new(),
            name: None,
            tool_call_id: None,
            response: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant (model) message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// A tool result given as text.
    pub fn tool(name: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            name: Some(name.into()),
            ..Self::new(Role::Tool, content)
        }
    }

    /// A tool result given as JSON (an object renders as `response:NAME{key:value,…}`).
    pub fn tool_json(name: impl Into<String>, response: Value) -> Self {
        Self {
            name: Some(name.into()),
            response: Some(response),
            ..Self::new(Role::Tool, "")
        }
    }

    /// Adds a tool call to this message.
    pub fn with_tool_call(mut self, name: impl Into<String>, arguments: Value) -> Self {
        self.tool_calls.push(ToolCall {
            id: None,
            name: name.into(),
            arguments,
        });
        self
    }

    /// Sets the reasoning of this message.
    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning = Some(reasoning.into());
        self
    }
}

/// How to render a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderOptions {
    /// End with the opening of a model turn so that the model answers next.
    pub add_generation_prompt: bool,
    /// Ask the model to think first (`<|think|>` in the system turn).
    pub enable_thinking: bool,
    /// Tools the model may call: OpenAI-style `{"type": "function", "function": {"name",
    /// "description", "parameters": <JSON schema>}}`, or the bare function object.
    pub tools: Vec<Value>,
    /// The BOS token text; the prompt starts with exactly one.
    pub bos_token: String,
}

impl Default for RenderOptions {
    /// A generation prompt, no thinking, no tools, `<bos>`.
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            enable_thinking: false,
            tools: Vec::new(),
            bos_token: "<bos>".into(),
        }
    }
}

/// Name under which the template is stored in its environment.
const ENTRY: &str = "chat";

/// A compiled chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    name: String,
    source: String,
    env: Environment<'static>,
}

impl ChatTemplate {
    /// The built-in Gemma 4 template (see `builtin.jinja`), used when a checkpoint has none.
    pub fn builtin() -> Self {
        let (env, _) = environment(BUILTIN.to_string());
        // A compile error is impossible here (covered by tests); were it to happen, `render`
        // reports it as a typed error instead of this constructor panicking.
        Self {
            name: "builtin".into(),
            source: BUILTIN.into(),
            env,
        }
    }

    /// Compiles a template from its Jinja source; `name` is used in error messages.
    ///
    /// # Errors
    /// [`ChatError::Syntax`] if the source does not compile.
    pub fn from_source(
        name: impl Into<String>,
        source: impl Into<String>,
    ) -> Result<Self, ChatError> {
        let name = name.into();
        let source = source.into();
        let (env, compiled) = environment(source.clone());
        compiled.map_err(|e| ChatError::Syntax {
            name: name.clone(),
            reason: describe(&e),
        })?;
        Ok(Self { name, source, env })
    }

    /// The checkpoint's template: `chat_template.jinja` if present, else the
    /// `chat_template` of `tokenizer_config.json` (a string, or a list of `{name, template}`
    /// from which `default` or else the first is taken), else [`builtin`](Self::builtin).
    ///
    /// # Errors
    /// [`ChatError::Io`] if a present file cannot be read, [`ChatError::Config`] if
    /// `tokenizer_config.json` is malformed, [`ChatError::Syntax`] if the template does not
    /// compile.
    pub fn from_checkpoint_dir(dir: impl AsRef<Path>) -> Result<Self, ChatError> {
        let dir = dir.as_ref();
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = read(&jinja)?;
            return Self::from_source("chat_template.jinja", source);
        }
        let config = dir.join("tokenizer_config.json");
        if config.is_file() {
            if let Some(source) = template_from_tokenizer_config(&config)? {
                return Self::from_source("tokenizer_config.json", source);
            }
        }
        Ok(Self::builtin())
    }

    /// Where the template came from (`builtin`, `chat_template.jinja`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` into a prompt string that starts with exactly one BOS token.
    ///
    /// The template sees HF-style variables: `messages` (each with `role`, `content`, and
    /// where set `tool_calls` as `[{id, type: "function", function: {name, arguments}}]`,
    /// `reasoning`/`reasoning_content`, `name`, `tool_call_id`), `tools`,
    /// `add_generation_prompt`, `enable_thinking` and `bos_token`.
    ///
    /// # Errors
    /// [`ChatError::Tool`] for a tool without a function name, [`ChatError::Render`] if the
    /// template fails (including its own `raise_exception`), [`ChatError::MisplacedBos`] if
    /// a BOS token appears after the start (e.g. inside a message).
    pub fn render(&self, messages: &[Message], opts: &RenderOptions) -> Result<String, ChatError> {
        let tools = normalize_tools(&opts.tools)?;
        let ctx = json!({
            "messages": messages_context(messages),
            "tools": if tools.is_empty() { Value::Null } else { Value::Array(tools) },
            "add_generation_prompt": opts.add_generation_prompt,
            "enable_thinking": opts.enable_thinking,
            "bos_token": opts.bos_token,
        });
        let rendered = self
            .env
            .get_template(ENTRY)
            .and_then(|t| t.render(minijinja::Value::from_serialize(&ctx)))
            .map_err(|e| ChatError::Render {
                name: self.name.clone(),
                reason: describe(&e),
            })?;
        single_bos(rendered, &opts.bos_token)
    }
}

/// Builds the environment (HF-compatible settings, helpers, our filters) and adds `source`.
fn environment(source: String) -> (Environment<'static>, Result<(), JinjaError>) {
    let mut env = Environment::new();
    // Hugging Face renders with trim_blocks and lstrip_blocks.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    pycompat::install(&mut env);
    env.add_filter("gemma_value", gemma_value);
    env.add_filter("gemma_declaration", gemma_declaration);
    env.add_filter("strip_thinking", strip_thinking);
    let compiled = env.add_template_owned(ENTRY, source);
    (env, compiled)
}

/// The engine's message with its detail and location.
fn describe(e: &JinjaError) -> String {
    let mut s = e.to_string();
    if let Some(detail) = e.detail() {
        if !s.contains(detail) {
            s.push_str(": ");
            s.push_str(detail);
        }
    }
    s
}

fn read(path: &Path) -> Result<String, ChatError> {
    std::fs::read_to_string(path).map_err(|source| ChatError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn template_from_tokenizer_config(path: &Path) -> Result<Option<String>, ChatError> {
    let config_error = |reason: String| ChatError::Config {
        path: PathBuf::from(path),
        reason,
    };
    let text = read(path)?;
    let config: Value = serde_json::from_str(&text).map_err(|e| config_error(e.to_string()))?;
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            let entry = named("default").or_else(|| list.first());
            match entry
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
            {
                Some(s) => Ok(Some(s.to_string())),
                None => Err(config_error(
                    "`chat_template` list has no entry with a `template` string".into(),
                )),
            }
        }
        Some(_) => Err(config_error(
            "`chat_template` is neither a string nor a list".into(),
        )),
    }
}

/// Accepts OpenAI-style tools or bare function objects; returns the OpenAI form.
fn normalize_tools(tools: &[Value]) -> Result<Vec<Value>, ChatError> {
    tools
        .iter()
        .enumerate()
        .map(|(index, tool)| {
            let function = match tool.get("function") {
                Some(f) => f,
                None => tool,
            };
            if function.get("name").and_then(Value::as_str).is_none() {
                return Err(ChatError::Tool {
                    index,
                    reason: "expected an object with a string `name` (or `function.name`)".into(),
                });
            }
            Ok(json!({ "type": "function", "function": function }))
        })
        .collect()
}

/// The messages as HF templates expect them.
fn messages_context(messages: &[Message]) -> Value {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let mut obj = Map::new();
        obj.insert("role".into(), m.role.as_str().into());
        let content = match (&m.response, m.role) {
            (Some(response), Role::Tool) => response.clone(),
            _ => Value::String(m.content.clone()),
        };
        obj.insert("content".into(), content);
        if let Some(r) = &m.reasoning {
            obj.insert("reasoning".into(), r.as_str().into());
            obj.insert("reasoning_content".into(), r.as_str().into());
        }
        if !m.tool_calls.is_empty() {
            let calls: Vec<Value> = m.tool_calls.iter().map(tool_call_context).collect();
            obj.insert("tool_calls".into(), Value::Array(calls));
        }
        let name = m.name.clone().or_else(|| match (m.role, &m.tool_call_id) {
            (Role::Tool, Some(id)) => called_name(&messages[..i], id),
            _ => None,
        });
        if let Some(name) = name {
            obj.insert("name".into(), name.into());
        }
        if let Some(id) = &m.tool_call_id {
            obj.insert("tool_call_id".into(), id.as_str().into());
        }
        out.push(Value::Object(obj));
    }
    Value::Array(out)
}

fn tool_call_context(call: &ToolCall) -> Value {
    let arguments = match &call.arguments {
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => call.arguments.clone(),
        },
        other => other.clone(),
    };
    let mut obj = json!({
        "type": "function",
        "function": { "name": call.name, "arguments": arguments },
    });
    if let (Some(id), Some(map)) = (&call.id, obj.as_object_mut()) {
        map.insert("id".into(), id.as_str().into());
    }
    obj
}

/// The function name of the latest earlier tool call with this id.
fn called_name(earlier: &[Message], id: &str) -> Option<String> {
    earlier
        .iter()
        .rev()
        .flat_map(|m| m.tool_calls.iter())
        .find(|c| c.id.as_deref() == Some(id))
        .map(|c| c.name.clone())
}

/// Collapses leading BOS tokens to one (adding it if the template did not), and rejects a
/// BOS anywhere else.
fn single_bos(rendered: String, bos: &str) -> Result<String, ChatError> {
    if bos.is_empty() {
        return Ok(rendered);
    }
    let mut rest = rendered.as_str();
    while let Some(r) = rest.strip_prefix(bos) {
        rest = r;
    }
    if let Some(p) = rest.find(bos) {
        return Err(ChatError::MisplacedBos {
            bos: bos.to_string(),
            position: rendered.len() - rest.len() + p,
        });
    }
    Ok(format!("{bos}{rest}"))
}

fn to_json(value: &minijinja::Value) -> Result<Value, JinjaError> {
    serde_json::to_value(value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// Filter: a value in Gemma syntax (`{key:<|"|>text<|"|>,n:3}`).
fn gemma_value(value: minijinja::Value) -> Result<String, JinjaError> {
    Ok(to_gemma(&to_json(&value)?))
}

/// Filter: an OpenAI-style tool as a Gemma declaration (`declaration:NAME{…}`).
fn gemma_declaration(tool: minijinja::Value) -> Result<String, JinjaError> {
    let tool = to_json(&tool)?;
    let function = tool.get("function").unwrap_or(&tool);
    declaration(function, 0)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// Filter: model text with every `<|channel>…<channel|>` thought removed, trimmed.
fn strip_thinking(text: String) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(start) = rest.find("<|channel>") {
        out.push_str(&rest[..start]);
        match rest[start..].find("<channel|>") {
            Some(end) => rest = &rest[start + end + "<channel|>".len()..],
            None => {
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out.trim().to_string()
}

/// The built-in Gemma 4 template (SPEC §5): system turn with `<|think|>`, system text and
/// tool declarations; `model` for `assistant`; earlier thoughts stripped; tool calls and
/// their responses kept inside the model turn, which the next model message continues.
const BUILTIN: &str = include_str!("builtin.jinja");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_compiles() {
        let (_, compiled) = environment(BUILTIN.to_string());
        assert!(compiled.is_ok(), "{compiled:?}");
    }

    #[test]
    fn strip_thinking_removes_closed_and_open_thoughts() {
        assert_eq!(
            strip_thinking("<|channel>thought\nx<channel|>Answer ".into()),
            "Answer"
        );
        assert_eq!(
            strip_thinking("A<|channel>thought\nunterminated".into()),
            "A"
        );
    }

    #[test]
    fn bos_is_collapsed_added_or_rejected() {
        assert_eq!(
            single_bos("<bos><bos>x".into(), "<bos>").ok().as_deref(),
            Some("<bos>x")
        );
        assert_eq!(
            single_bos("x".into(), "<bos>").ok().as_deref(),
            Some("<bos>x")
        );
        assert!(matches!(
            single_bos("<bos>a<bos>".into(), "<bos>"),
            Err(ChatError::MisplacedBos { position: 6, .. })
        ));
    }

    #[test]
    fn tokenizer_config_list_prefers_default() {
        let dir = std::env::temp_dir().join(format!("cg-tpl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let cfg = json!({"chat_template": [
            {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}
        ]});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write");
        let t = ChatTemplate::from_checkpoint_dir(&dir).expect("load");
        assert_eq!(t.source(), "D{{ bos_token }}");
        std::fs::write(dir.join("chat_template.jinja"), "J").expect("write");
        assert_eq!(
            ChatTemplate::from_checkpoint_dir(&dir)
                .expect("load")
                .source(),
            "J"
        );
        std::fs::write(dir.join("chat_template.jinja"), "{% if %}").expect("write");
        assert!(matches!(
            ChatTemplate::from_checkpoint_dir(&dir),
            Err(ChatError::Syntax { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
