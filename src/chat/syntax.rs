//! Gemma 4's tool syntax and its conversion to and from JSON.
//!
//! Gemma writes values like JSON with two differences: object keys are bare
//! (`{city:…}`), and strings are delimited by the special token `<|"|>` instead of `"`, with
//! no escaping inside (`<|"|>say "hi"<|"|>`). A call is `call:NAME{…}`, a declaration
//! `declaration:NAME{description:…,parameters:{…}}`, with JSON-schema `type` values written
//! in upper case.
//!
//! ```
//! use candle_gemma::chat::{parse_tool_call, to_gemma};
//! use serde_json::json;
//!
//! let (name, args) = parse_tool_call(r#"call:get_weather{city:<|"|>Paris<|"|>,days:3}"#)?;
//! assert_eq!((name.as_str(), &args), ("get_weather", &json!({"city": "Paris", "days": 3})));
//! assert_eq!(to_gemma(&args), r#"{city:<|"|>Paris<|"|>,days:3}"#);
//! # Ok::<(), candle_gemma::chat::ChatError>(())
//! ```

use serde_json::{Map, Number, Value};

use super::ChatError;

/// The string delimiter token of Gemma's tool syntax.
pub const QUOTE: &str = "<|\"|>";

/// Nesting deeper than this is rejected rather than risking the stack.
const MAX_DEPTH: usize = 64;

/// Parses one tool call, `call:NAME{…}` (the `call:` prefix is optional), into its name and
/// its arguments as a JSON object.
///
/// # Errors
/// [`ChatError::ToolCallSyntax`] with the byte offset where parsing stopped.
pub fn parse_tool_call(text: &str) -> Result<(String, Value), ChatError> {
    let mut calls = parse_tool_calls(text)?;
    match (calls.pop(), calls.is_empty()) {
        (Some(call), true) => Ok(call),
        (Some(_), false) => Err(syntax_error(0, "more than one call")),
        (None, _) => Err(syntax_error(0, "no call")),
    }
}

/// Parses the content of one `<|tool_call>…<tool_call|>` block, which may hold several
/// calls back to back (`call:a{…}call:b{…}`, optionally separated by whitespace or commas).
///
/// # Errors
/// [`ChatError::ToolCallSyntax`] if any call is malformed or nothing is found.
pub fn parse_tool_calls(text: &str) -> Result<Vec<(String, Value)>, ChatError> {
    let mut p = Parser { src: text, pos: 0 };
    let mut calls = Vec::new();
    loop {
        p.skip_ws_and(",");
        if p.pos >= text.len() {
            break;
        }
        p.eat("call:");
        let name_start = p.pos;
        let name_len = p
            .rest()
            .find('{')
            .ok_or_else(|| p.error("expected `{` after the name"))?;
        let name = text[name_start..name_start + name_len].trim();
        if name.is_empty() || name.contains(|c: char| c.is_whitespace() || c == '}' || c == ',') {
            return Err(syntax_error(name_start, "missing or invalid function name"));
        }
        p.pos += name_len;
        let args = p.object(0)?;
        calls.push((name.to_string(), args));
    }
    if calls.is_empty() {
        return Err(syntax_error(0, "no call"));
    }
    Ok(calls)
}

/// Parses one Gemma value (object, array, `<|"|>`string, number, `true`/`false`/`null`, or a
/// JSON `"string"`) spanning the whole of `text` (surrounding whitespace allowed).
///
/// # Errors
/// [`ChatError::ToolCallSyntax`] on malformed input or trailing text.
pub fn parse_value(text: &str) -> Result<Value, ChatError> {
    let mut p = Parser { src: text, pos: 0 };
    let v = p.value(0)?;
    p.skip_ws();
    if p.pos != text.len() {
        return Err(p.error("trailing text after the value"));
    }
    Ok(v)
}

/// Writes a JSON value in Gemma syntax, keys bare and in the object's order, as the chat
/// templates do for tool-call arguments and tool responses.
pub fn to_gemma(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value, false);
    out
}

/// Writes a tool declaration, `declaration:NAME{description:…,parameters:{…}}`, from an
/// OpenAI-style function object (`{"name", "description", "parameters", "response"?}`).
///
/// Inside schemas, `description` comes first, `type` last (upper-cased) and the other keys
/// in sorted order, matching Google's template.
///
/// # Errors
/// [`ChatError::Tool`] (with `index`) if `function` has no string `name`.
pub fn declaration(function: &Value, index: usize) -> Result<String, ChatError> {
    let name = function_name(function, index)?;
    let mut out = format!("declaration:{name}{{description:{QUOTE}");
    out.push_str(
        function
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or(""),
    );
    out.push_str(QUOTE);
    for key in ["parameters", "response"] {
        if let Some(schema) = function.get(key).filter(|v| !v.is_null()) {
            out.push(',');
            out.push_str(key);
            out.push(':');
            write_value(&mut out, schema, true);
        }
    }
    out.push('}');
    Ok(out)
}

/// The `name` of an OpenAI-style function object, the tool at `index`.
///
/// # Errors
/// [`ChatError::Tool`] if it has no string `name`.
pub(crate) fn function_name(function: &Value, index: usize) -> Result<&str, ChatError> {
    function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ChatError::Tool {
            index,
            reason: "the function has no string `name`".into(),
        })
}

fn write_value(out: &mut String, value: &Value, schema: bool) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => {
            out.push_str(QUOTE);
            out.push_str(s);
            out.push_str(QUOTE);
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item, schema);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut keys: Vec<&String> = map.keys().collect();
            if schema {
                keys.sort_by_key(|k| (schema_key_rank(k), k.as_str()));
            }
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(key);
                out.push(':');
                match (schema, key.as_str(), &map[key.as_str()]) {
                    (true, "type", Value::String(t)) => {
                        write_value(out, &Value::String(t.to_uppercase()), false)
                    }
                    (true, "type", Value::Array(ts)) => {
                        let upper = ts
                            .iter()
                            .map(|t| match t {
                                Value::String(s) => Value::String(s.to_uppercase()),
                                other => other.clone(),
                            })
                            .collect();
                        write_value(out, &Value::Array(upper), false)
                    }
                    (_, _, v) => write_value(out, v, schema),
                }
            }
            out.push('}');
        }
    }
}

fn schema_key_rank(key: &str) -> u8 {
    match key {
        "description" => 0,
        "type" => 2,
        _ => 1,
    }
}

fn syntax_error(position: usize, reason: &str) -> ChatError {
    ChatError::ToolCallSyntax {
        position,
        reason: reason.to_string(),
    }
}

/// A recursive-descent parser over `src[pos..]`.
struct Parser<'a> {
    src: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn rest(&self) -> &'a str {
        &self.src[self.pos..]
    }

    fn error(&self, reason: &str) -> ChatError {
        syntax_error(self.pos, reason)
    }

    fn skip_ws(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn skip_ws_and(&mut self, extra: &str) {
        loop {
            self.skip_ws();
            if !self.eat(extra) {
                break;
            }
        }
    }

    fn eat(&mut self, s: &str) -> bool {
        if self.rest().starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, s: &str) -> Result<(), ChatError> {
        self.skip_ws();
        if self.eat(s) {
            Ok(())
        } else {
            Err(self.error(&format!("expected `{s}`")))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, ChatError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting too deep"));
        }
        self.skip_ws();
        let rest = self.rest();
        if rest.starts_with(QUOTE) {
            self.pos += QUOTE.len();
            return self.quoted_string().map(Value::String);
        }
        match rest.as_bytes().first() {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => self.json_string().map(Value::String),
            Some(_) => self.scalar(),
            None => Err(self.error("expected a value")),
        }
    }

    /// After an opening `<|"|>`: everything up to the closing one, verbatim.
    fn quoted_string(&mut self) -> Result<String, ChatError> {
        let len = self
            .rest()
            .find(QUOTE)
            .ok_or_else(|| self.error("unterminated <|\"|> string"))?;
        let s = self.rest()[..len].to_string();
        self.pos += len + QUOTE.len();
        Ok(s)
    }

    /// A JSON-style `"…"` string with escapes, which models sometimes emit instead.
    fn json_string(&mut self) -> Result<String, ChatError> {
        let bytes = self.rest().as_bytes();
        let mut i = 1;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => i += 2,
                b'"' => {
                    let lit = &self.rest()[..=i];
                    let s = serde_json::from_str::<String>(lit)
                        .map_err(|e| self.error(&format!("bad string: {e}")))?;
                    self.pos += i + 1;
                    return Ok(s);
                }
                _ => i += 1,
            }
        }
        Err(self.error("unterminated string"))
    }

    /// A bare token up to the next delimiter: a number, `true`/`false`/`null`, or else kept
    /// as a string (models sometimes leave enum-like values unquoted).
    fn scalar(&mut self) -> Result<Value, ChatError> {
        let rest = self.rest();
        let end = rest.find([',', '}', ']']).unwrap_or(rest.len());
        let token = rest[..end].trim();
        if token.is_empty() {
            return Err(self.error("expected a value"));
        }
        if token.contains([':', '{', '[', '"']) || (token.contains('<') && token.contains("|>")) {
            return Err(self.error("unexpected character in a bare value"));
        }
        let value = match token {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            "null" | "None" => Value::Null,
            _ => number(token).unwrap_or_else(|| Value::String(token.to_string())),
        };
        self.pos += end;
        Ok(value)
    }

    fn key(&mut self) -> Result<String, ChatError> {
        self.skip_ws();
        if self.eat(QUOTE) {
            return self.quoted_string();
        }
        if self.rest().starts_with('"') {
            return self.json_string();
        }
        let rest = self.rest();
        let end = rest
            .find([':', ',', '{', '}', '[', ']'])
            .ok_or_else(|| self.error("expected `:` after a key"))?;
        let key = rest[..end].trim();
        if key.is_empty() {
            return Err(self.error("empty key"));
        }
        self.pos += end;
        Ok(key.to_string())
    }

    fn object(&mut self, depth: usize) -> Result<Value, ChatError> {
        self.expect("{")?;
        let mut map = Map::new();
        self.skip_ws();
        if self.eat("}") {
            return Ok(Value::Object(map));
        }
        loop {
            let key = self.key()?;
            self.expect(":")?;
            let value = self.value(depth + 1)?;
            map.insert(key, value);
            self.skip_ws();
            if self.eat(",") {
                continue;
            }
            if self.eat("}") {
                return Ok(Value::Object(map));
            }
            return Err(self.error("expected `,` or `}`"));
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, ChatError> {
        self.expect("[")?;
        let mut items = Vec::new();
        self.skip_ws();
        if self.eat("]") {
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value(depth + 1)?);
            self.skip_ws();
            if self.eat(",") {
                continue;
            }
            if self.eat("]") {
                return Ok(Value::Array(items));
            }
            return Err(self.error("expected `,` or `]`"));
        }
    }
}

fn number(token: &str) -> Option<Value> {
    if let Ok(i) = token.parse::<i64>() {
        return Some(Value::Number(i.into()));
    }
    if let Ok(u) = token.parse::<u64>() {
        return Some(Value::Number(u.into()));
    }
    let looks_numeric = token
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'));
    if !looks_numeric {
        return None;
    }
    token
        .parse::<f64>()
        .ok()
        .and_then(Number::from_f64)
        .map(Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_the_spec_example() {
        let (name, args) = parse_tool_call(
            r#"call:f{key:<|"|>str, with {braces}: and "quotes"<|"|>,n:3,nested:{a:[1,2]},x:-1.5e2,b:true,z:null}"#,
        )
        .expect("parse");
        assert_eq!(name, "f");
        assert_eq!(
            args,
            json!({"key": "str, with {braces}: and \"quotes\"", "n": 3,
                   "nested": {"a": [1, 2]}, "x": -150.0, "b": true, "z": null})
        );
    }

    #[test]
    fn tolerates_whitespace_quoted_keys_and_json_strings() {
        let (_, args) =
            parse_tool_call("call:g { <|\"|>a b<|\"|> : \"x\\ny\" , c : [ ] , d:{} , e: word }")
                .expect("parse");
        assert_eq!(args, json!({"a b": "x\ny", "c": [], "d": {}, "e": "word"}));
    }

    #[test]
    fn several_calls_in_one_block() {
        let calls = parse_tool_calls("call:a{x:1}\ncall:b{}").expect("parse");
        assert_eq!(
            calls,
            vec![("a".into(), json!({"x": 1})), ("b".into(), json!({}))]
        );
        assert!(parse_tool_call("call:a{x:1}call:b{}").is_err());
    }

    #[test]
    fn malformed_inputs_are_errors_not_panics() {
        for bad in [
            "",
            "call:",
            "call:f",
            "call:f{",
            "call:f{a}",
            "call:f{a:}",
            "call:f{a:1",
            "call:f{a:[1,}",
            "call:{a:1}",
            "call:f{a:<|\"|>open}",
            "call:f{a:\"open}",
            "call:f{a:1}}",
            "call:f{a:1 b:2}",
            "call:f{a:<tool_call|>}",
            "é{",
            "call:é{:",
        ] {
            assert!(parse_tool_calls(bad).is_err(), "{bad:?}");
        }
        let deep = format!("call:f{{a:{}{}}}", "[".repeat(500), "]".repeat(500));
        assert!(parse_tool_call(&deep).is_err());
    }

    #[test]
    fn round_trips_through_gemma_syntax() {
        let v = json!({"s": "a,b:{c}", "n": 1, "f": 2.5, "l": [true, null, {"k": "v"}], "o": {}});
        assert_eq!(parse_value(&to_gemma(&v)).expect("parse"), v);
    }

    #[test]
    fn declaration_follows_google_layout() {
        let f = json!({
            "name": "get_weather",
            "description": "Weather now.",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "description": "City"}},
                "required": ["city"]}
        });
        assert_eq!(
            declaration(&f, 0).expect("decl"),
            "declaration:get_weather{description:<|\"|>Weather now.<|\"|>,parameters:{\
             properties:{city:{description:<|\"|>City<|\"|>,type:<|\"|>STRING<|\"|>}},\
             required:[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}"
        );
        assert!(declaration(&json!({"description": "x"}), 3).is_err());
    }
}
