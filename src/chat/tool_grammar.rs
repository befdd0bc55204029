//! Forced tool calls: a [`Constraint`] that holds the model's output to Gemma 4 tool calls
//! (`<|tool_call>call:NAME{key:value,…}<tool_call|>`) of the declared tools, their arguments
//! shaped by each tool's parameter schema. It is what OpenAI's `tool_choice: "required"` or
//! `{"type": "function", …}` and Anthropic's `{"type": "any"}` or `{"type": "tool", …}` ask
//! of a server.
//!
//! The grammar is llguidance's Lark dialect. Gemma's string quote `<|"|>` and the call
//! brackets are special tokens, so the grammar names them by id (`<[52]>`), and a string's text
//! is any run of tokens other than the quote and the control tokens.
//!
//! What the schema shapes (JSON-schema keywords, types in any case):
//! - `object` with `properties`: those keys in the declared order, the `required` ones always
//!   and the others optionally (no other keys);
//! - `string`, `integer`, `number`, `boolean`, `null`, `array` (with `items`), `enum` and
//!   `const` values, and alternatives (`anyOf`, `oneOf`, a list of types);
//! - anything else: any value in Gemma's syntax.
//!
//! Numbers have at most 18 digits before the point and 18 after. Strings are unbounded unless
//! `maxLength` bounds them, in tokens rather than characters (a string of `maxLength` n has at
//! most n tokens); arrays take `minItems` and `maxItems`.

use std::fmt::Write;

use serde_json::Value;
use tokenizers::Tokenizer;

use super::ChatError;
use crate::generate::Constraint;

/// Which calls a forced tool choice allows ([`tool_call_constraint`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForcedToolCall {
    /// A call to any of the declared tools (OpenAI's `tool_choice: "required"`, Anthropic's
    /// `{"type": "any"}`); with `parallel`, one or more calls (OpenAI's
    /// `parallel_tool_calls`, true by default there).
    Any {
        /// Whether more calls may follow the first.
        parallel: bool,
    },
    /// Exactly one call, to the tool of this name (OpenAI's `{"type": "function",
    /// "function": {"name": …}}`, Anthropic's `{"type": "tool", "name": …}`).
    Named(String),
}

/// Nesting of schemas past this depth takes any value (and bounds the grammar's size).
const MAX_DEPTH: usize = 16;

/// The constraint that holds a generation's output to calls of `tools` (OpenAI-style entries,
/// `{"type": "function", "function": {…}}` or the function object itself, each with a
/// `name` and an optional `parameters` schema) as `forced` asks. With `thinking`, a thought
/// channel (`<|channel>…<channel|>`) may come first, as a thinking model writes it.
///
/// The output then ends after the last call, where the model's end-of-sequence tokens
/// (Gemma 4's `<|tool_response>` among them) are allowed.
///
/// # Errors
/// [`ChatError::Tool`] for a tool without a name, or a name that is not letters, digits, `_`,
/// `-` and `.`; [`ChatError::ToolChoice`] for no tools, a named tool that is not declared, or
/// a tokenizer without Gemma 4's tool-call tokens.
pub fn tool_call_constraint(
    tokenizer: &Tokenizer,
    tools: &[Value],
    forced: &ForcedToolCall,
    thinking: bool,
) -> Result<Constraint, ChatError> {
    let id = |name: &str| tokenizer.token_to_id(name);
    let missing = |name: &str| ChatError::ToolChoice {
        reason: format!("the tokenizer has no `{name}` token"),
    };
    let (open, close, quote) = (
        id("<|tool_call>").ok_or_else(|| missing("<|tool_call>"))?,
        id("<tool_call|>").ok_or_else(|| missing("<tool_call|>"))?,
        id(super::QUOTE).ok_or_else(|| missing(super::QUOTE))?,
    );
    // Tokens a string's text may not hold: the quote, and the control tokens that would end
    // or leave the call.
    let mut control: Vec<u32> = [
        "<eos>",
        "<bos>",
        "<pad>",
        "<|turn>",
        "<turn|>",
        "<|tool_response>",
        "<tool_response|>",
        "<|channel>",
        "<channel|>",
    ]
    .iter()
    .filter_map(|t| id(t))
    .chain([open, close, quote])
    .collect();
    control.sort_unstable();
    control.dedup();
    let mut g = Grammar {
        rules: String::new(),
        count: 0,
        quote,
        text: format!("<[^{}]>", join(&control)),
        any_written: false,
    };
    let mut calls = Vec::new();
    for (index, tool) in tools.iter().enumerate() {
        let function = tool.get("function").unwrap_or(tool);
        let name = super::syntax::function_name(function, index)?;
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            return Err(ChatError::Tool {
                index,
                reason: format!(
                    "the function name {name:?} is not letters, digits, `_`, `-` and `.`"
                ),
            });
        }
        if let ForcedToolCall::Named(only) = forced {
            if only != name {
                continue;
            }
        }
        let args = match function.get("parameters").filter(|p| !p.is_null()) {
            Some(schema) => g.object_or_any(schema, 0),
            None => g.any_object(),
        };
        calls.push(format!("{} {args}", lit(&format!("call:{name}"))));
    }
    if calls.is_empty() {
        return Err(ChatError::ToolChoice {
            reason: match forced {
                ForcedToolCall::Named(n) => format!("no declared tool is named {n:?}"),
                ForcedToolCall::Any { .. } => {
                    "a tool call is required but no tools are declared".into()
                }
            },
        });
    }
    let call = g.rule(&calls.join(" | "));
    let block = format!("<[{open}]> {call} <[{close}]>");
    let body = match forced {
        ForcedToolCall::Any { parallel: true } => format!("({block})+"),
        _ => block,
    };
    let start = match (thinking, id("<|channel>"), id("<channel|>")) {
        (true, Some(co), Some(cc)) => {
            let mut inner: Vec<u32> = control.iter().copied().filter(|&t| t != cc).collect();
            inner.retain(|&t| t != co);
            format!("(<[{co}]> <[^{},{cc}]>* <[{cc}]>)? {body}", join(&inner))
        }
        _ => body,
    };
    Ok(Constraint::Lark(format!("start: {start}\n{}", g.rules)))
}

/// The rules of a grammar as they are written, and what its strings share.
struct Grammar {
    rules: String,
    count: usize,
    quote: u32,
    /// One token of a string's text.
    text: String,
    /// Whether the any-value rules are written.
    any_written: bool,
}

impl Grammar {
    /// A new rule with body `body`, by name.
    fn rule(&mut self, body: &str) -> String {
        self.count += 1;
        let name = format!("r{}", self.count);
        let _ = writeln!(self.rules, "{name}: {body}");
        name
    }

    /// A tool's arguments: the schema's object, or any object where the schema is not one.
    fn object_or_any(&mut self, schema: &Value, depth: usize) -> String {
        if schema.get("properties").is_some_and(Value::is_object) {
            self.value(schema, depth)
        } else {
            self.any_object()
        }
    }

    /// A value valid under `schema` (as far as the module docs say), as a rule name.
    fn value(&mut self, schema: &Value, depth: usize) -> String {
        if depth > MAX_DEPTH {
            return self.any_value();
        }
        let Some(map) = schema.as_object() else {
            return self.any_value();
        };
        if let Some(c) = map.get("const") {
            let v = self.literal(c);
            return self.rule(&v);
        }
        if let Some(Value::Array(options)) = map.get("enum") {
            let alts: Vec<String> = options.iter().map(|v| self.literal(v)).collect();
            if !alts.is_empty() {
                return self.rule(&alts.join(" | "));
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(options)) = map.get(key) {
                let alts: Vec<String> = options.iter().map(|s| self.value(s, depth + 1)).collect();
                if !alts.is_empty() {
                    return self.rule(&alts.join(" | "));
                }
            }
        }
        let types: Vec<String> = match map.get("type") {
            Some(Value::String(t)) => vec![t.to_ascii_lowercase()],
            Some(Value::Array(ts)) => ts
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_ascii_lowercase)
                .collect(),
            _ if map.contains_key("properties") => vec!["object".into()],
            _ => Vec::new(),
        };
        if types.is_empty() {
            return self.any_value();
        }
        let alts: Vec<String> = types.iter().map(|t| self.typed(t, map, depth)).collect();
        self.rule(&alts.join(" | "))
    }

    /// A value of JSON-schema type `t` under the rest of `map`, as an expression.
    fn typed(&mut self, t: &str, map: &serde_json::Map<String, Value>, depth: usize) -> String {
        match t {
            "string" => {
                let q = self.quote;
                match map.get("maxLength").and_then(Value::as_u64) {
                    Some(n) => {
                        let n = n.min(4096);
                        format!("<[{q}]> {}{{0,{n}}} <[{q}]>", self.text)
                    }
                    None => format!("<[{q}]> {}* <[{q}]>", self.text),
                }
            }
            "integer" => "/-?(0|[1-9][0-9]{0,17})/".into(),
            "number" => NUMBER.into(),
            "boolean" => "\"true\" | \"false\"".into(),
            "null" => "\"null\"".into(),
            "array" => {
                let item = match map.get("items") {
                    Some(items) => self.value(items, depth + 1),
                    None => self.any_value(),
                };
                let min = map.get("minItems").and_then(Value::as_u64).unwrap_or(0);
                let max = map
                    .get("maxItems")
                    .and_then(Value::as_u64)
                    .map(|m| m.min(4096));
                let rest = match max {
                    Some(m) => format!("{{{},{}}}", min.saturating_sub(1), m.saturating_sub(1)),
                    None if min > 1 => format!("{{{},}}", min - 1),
                    None => "*".into(),
                };
                match (min, max) {
                    (_, Some(0)) => "\"[\" \"]\"".into(),
                    (0, _) => format!("\"[\" ({item} (\",\" {item}){rest})? \"]\""),
                    _ => format!("\"[\" {item} (\",\" {item}){rest} \"]\""),
                }
            }
            "object" => match map.get("properties").and_then(Value::as_object) {
                Some(props) => self.object(props, map.get("required"), depth),
                None => self.any_object(),
            },
            _ => self.any_value(),
        }
    }

    /// An object of `props` in their order: the required ones always, the others optionally,
    /// commas between those present.
    fn object(
        &mut self,
        props: &serde_json::Map<String, Value>,
        required: Option<&Value>,
        depth: usize,
    ) -> String {
        let required: Vec<&str> = required
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let members: Vec<(String, bool)> = props
            .iter()
            .map(|(k, s)| {
                let v = self.value(s, depth + 1);
                (
                    format!("{} \":\" {v}", self.key(k)),
                    required.contains(&k.as_str()),
                )
            })
            .collect();
        // Built from the last member back: `first` is the rest when nothing came before,
        // `after` the rest after a member (each present member then starts with a comma).
        let (mut first, mut after) = (EMPTY.to_string(), EMPTY.to_string());
        for (member, req) in members.iter().rev() {
            let f = format!("{member} {after}");
            let a = format!("\",\" {member} {after}");
            let (f, a) = if *req {
                (f, a)
            } else {
                (format!("({f}) | {first}"), format!("({a}) | {after}"))
            };
            first = self.rule(&f);
            after = self.rule(&a);
        }
        format!("\"{{\" {first} \"}}\"")
    }

    /// A key as Gemma writes it: bare where it holds none of `:,{}[]` and no quote or
    /// whitespace, else quoted.
    fn key(&self, k: &str) -> String {
        let bare = !k.is_empty()
            && !k.contains([':', ',', '{', '}', '[', ']', '"', '<', '>'])
            && !k.chars().any(char::is_whitespace);
        if bare {
            lit(k)
        } else {
            let q = self.quote;
            format!("<[{q}]> {} <[{q}]>", lit(k))
        }
    }

    /// `v` written in Gemma's syntax, as an expression.
    fn literal(&self, v: &Value) -> String {
        match v {
            Value::String(s) => {
                let q = self.quote;
                if s.is_empty() {
                    format!("<[{q}]> <[{q}]>")
                } else {
                    format!("<[{q}]> {} <[{q}]>", lit(s))
                }
            }
            other => lit(&super::to_gemma(other)),
        }
    }

    /// Any value in Gemma's syntax (the rules are written once).
    fn any_value(&mut self) -> String {
        self.any_rules();
        "any_value".into()
    }

    /// Any object in Gemma's syntax.
    fn any_object(&mut self) -> String {
        self.any_rules();
        "any_object".into()
    }

    fn any_rules(&mut self) {
        if std::mem::replace(&mut self.any_written, true) {
            return;
        }
        let q = self.quote;
        let _ = writeln!(
            self.rules,
            "any_value: any_object | any_array | <[{q}]> {}* <[{q}]> | {NUMBER} | \"true\" | \"false\" | \"null\"",
            self.text
        );
        let _ = writeln!(
            self.rules,
            "any_object: \"{{\" (any_pair (\",\" any_pair)*)? \"}}\""
        );
        let _ = writeln!(
            self.rules,
            "any_pair: /[A-Za-z_][A-Za-z0-9_]*/ \":\" any_value"
        );
        let _ = writeln!(
            self.rules,
            "any_array: \"[\" (any_value (\",\" any_value)*)? \"]\""
        );
    }
}

/// The empty expression.
const EMPTY: &str = "\"\"";

/// A number as Gemma writes it bare.
const NUMBER: &str = "/-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,18})?([eE][+-]?[0-9]{1,3})?/";

/// `s` as a Lark string literal.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Ids as a token range list.
fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}
