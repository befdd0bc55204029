//! Request fields that would change what an answer means but that this server does not
//! implement. A request that sets one of them to anything but its default gets a 400
//! `unsupported` naming the field, instead of an answer that silently ignores it (serde
//! ignores fields a request struct does not name, so without this a client asking for
//! `echo` would get an answer without its prompt and no error). Fields that only label a request (`user`,
//! `metadata`, `store`, `service_tier`) are still ignored.

use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;

/// The unimplemented fields of OpenAI's chat and completion requests, as sent.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Unimplemented {
    /// The legacy function-calling API (use `tools`).
    #[serde(default)]
    pub functions: Option<Value>,
    /// The legacy function-calling API's choice (use `tool_choice`).
    #[serde(default)]
    pub function_call: Option<Value>,
    /// Completions: the prompt repeated before the answer.
    #[serde(default)]
    pub echo: Option<Value>,
    /// Completions: text after the insertion point.
    #[serde(default)]
    pub suffix: Option<Value>,
    /// Completions: candidates generated to return the `n` best of them.
    #[serde(default)]
    pub best_of: Option<Value>,
}

impl Unimplemented {
    /// Checks that every field is absent, `null` or its default (`best_of` may equal `n`).
    ///
    /// # Errors
    /// A 400 `unsupported` naming the first field set to something this server does not do.
    pub fn check(&self, n: usize) -> Result<(), ApiError> {
        let set = |v: &Option<Value>| !matches!(v, None | Some(Value::Null));
        for (param, value) in [
            ("functions", &self.functions),
            ("function_call", &self.function_call),
        ] {
            let empty = matches!(value, Some(Value::Array(a)) if a.is_empty());
            if set(value) && !empty {
                return Err(ApiError::unsupported(
                    param,
                    format!(
                        "{param} (the legacy function-calling API) is not supported: send tools"
                    ),
                ));
            }
        }
        if set(&self.echo) && self.echo != Some(Value::Bool(false)) {
            return Err(ApiError::unsupported("echo", "echo is not supported"));
        }
        if set(&self.suffix) && self.suffix != Some(Value::String(String::new())) {
            return Err(ApiError::unsupported(
                "suffix",
                "suffix (insertion) is not supported",
            ));
        }
        if set(&self.best_of) && self.best_of.as_ref().and_then(Value::as_u64) != Some(n as u64) {
            return Err(ApiError::unsupported(
                "best_of",
                format!("best_of other than n ({n}) is not supported"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value, n: usize) -> Result<(), String> {
        let u: Unimplemented = serde_json::from_value(v).map_err(|e| e.to_string())?;
        u.check(n).map_err(|e| e.param.unwrap_or_default())
    }

    #[test]
    fn defaults_pass_and_anything_else_names_its_field() {
        for ok in [
            json!({}),
            json!({"echo": false, "suffix": "", "best_of": 2}),
            json!({"functions": [], "function_call": null}),
        ] {
            assert_eq!(check(ok.clone(), 2), Ok(()), "{ok}");
        }
        for (bad, field) in [
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"function_call": "auto"}), "function_call"),
            (json!({"echo": true}), "echo"),
            (json!({"suffix": "end"}), "suffix"),
            (json!({"best_of": 3}), "best_of"),
        ] {
            assert_eq!(check(bad.clone(), 2), Err(field.to_string()), "{bad}");
        }
    }
}
