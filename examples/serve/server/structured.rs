//! Structured output: OpenAI's `response_format` as the library's output constraint
//! ([`candle_gemma::generate::Constraint`]), and vLLM's `guided_json` / `guided_regex` beside
//! it.
//!
//! | field | constraint |
//! |---|---|
//! | `response_format: {"type": "text"}` (or absent, `null`) | none |
//! | `response_format: {"type": "json_object"}` | a JSON object |
//! | `response_format: {"type": "json_schema", "json_schema": {"schema": {..}}}` | valid under the schema |
//! | `guided_json: {..}` (a schema) | valid under the schema |
//! | `guided_regex: "..."` | the whole answer matches the pattern |
//!
//! `json_schema.strict` is accepted and changes nothing: every schema is enforced. A schema
//! the constraint compiler does not take, or a malformed pattern, is a 400 naming the field.
//!
//! A forced tool choice (OpenAI's `tool_choice: "required"` or a named function, Anthropic's
//! `any` or `tool`) is held the same way, by the grammar of
//! [`candle_gemma::chat::tool_call_constraint`] ([`constrain`]); it cannot be combined with
//! the fields above.

use candle_gemma::chat::{tool_call_constraint, ForcedToolCall};
use candle_gemma::generate::Constraint;
use candle_gemma::{GenOptions, Model};
use serde_json::Value;

use super::error::ApiError;

/// The constraint the request's `response_format`, `guided_json` or `guided_regex` asks for
/// (at most one of them).
///
/// # Errors
/// A 400 naming the field: an unknown `response_format` type, a `json_schema` without a
/// `schema` object, more than one of the fields.
pub fn constraint(
    response_format: Option<&Value>,
    guided_json: Option<&Value>,
    guided_regex: Option<&Value>,
) -> Result<Option<Constraint>, ApiError> {
    let from_format = set(response_format)
        .map(format_constraint)
        .transpose()?
        .flatten();
    let from_json = set(guided_json)
        .map(|s| match s {
            Value::Object(_) => Ok(Constraint::JsonSchema(s.clone())),
            _ => Err(ApiError::invalid(
                "guided_json",
                "guided_json must be a JSON schema object",
            )),
        })
        .transpose()?;
    let from_regex = set(guided_regex)
        .map(|r| match r.as_str() {
            Some(rx) => Ok(Constraint::Regex(rx.to_string())),
            None => Err(ApiError::invalid(
                "guided_regex",
                "guided_regex must be a string",
            )),
        })
        .transpose()?;
    let mut asked = [from_format, from_json, from_regex].into_iter().flatten();
    let first = asked.next();
    if asked.next().is_some() {
        return Err(ApiError::invalid(
            "response_format",
            "send one of response_format (json), guided_json and guided_regex",
        ));
    }
    Ok(first)
}

/// The field's value unless absent or `null`.
fn set(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_null())
}

/// `response_format`'s constraint (`None` for text).
fn format_constraint(format: &Value) -> Result<Option<Constraint>, ApiError> {
    let kind = format.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => match format.pointer("/json_schema/schema") {
            Some(schema @ Value::Object(_)) => Ok(Some(Constraint::JsonSchema(schema.clone()))),
            _ => Err(ApiError::invalid(
                "response_format",
                "response_format of type \"json_schema\" needs json_schema.schema, a JSON schema object",
            )),
        },
        _ => Err(ApiError::invalid(
            "response_format",
            format!(
                "response_format type must be \"text\", \"json_object\" or \"json_schema\", got {}",
                kind.map_or_else(|| format.to_string(), |k| format!("\"{k}\""))
            ),
        )),
    }
}

/// Holds the output to the calls `forced` asks for (a `tool_choice` of `required` or a named
/// tool) through [`tool_call_constraint`]'s grammar over `tools`, with an optional thought
/// first where `thinking`; then [`check`]s the options' constraint, whichever it is.
///
/// # Errors
/// A 400 on `tool_choice`: a structured-output field set too (one grammar holds the output),
/// a named tool that is not in `tools`, no tools, a tool the grammar cannot name; and as
/// [`check`].
pub fn constrain(
    model: &Model,
    tools: &[Value],
    forced: Option<&ForcedToolCall>,
    thinking: bool,
    options: &mut GenOptions,
) -> Result<(), ApiError> {
    let Some(forced) = forced else {
        return check(model, options);
    };
    if options.constraint.is_some() {
        return Err(ApiError::invalid(
            "tool_choice",
            "a forced tool choice and response_format (or guided_json / guided_regex) cannot both hold the output",
        ));
    }
    let tokenizer = model
        .tokenizer()
        .ok_or_else(|| ApiError::unsupported("tool_choice", "this model has no tokenizer"))?;
    let c = tool_call_constraint(tokenizer, tools, forced, thinking)
        .map_err(|e| ApiError::invalid("tool_choice", e.to_string()))?;
    options.constraint = Some(c);
    check(model, options)
}

/// Compiles the options' constraint against `model`'s tokenizer before the request is queued,
/// so that a schema or pattern it cannot run is the client's 400, not a failed stream.
///
/// # Errors
/// A 400 on `response_format` with the compiler's message.
pub fn check(model: &Model, options: &GenOptions) -> Result<(), ApiError> {
    match &options.constraint {
        Some(c) => model
            .check_constraint(c)
            .map_err(|e| ApiError::invalid("response_format", e.to_string())),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn of(format: Value) -> Result<Option<Constraint>, String> {
        constraint(Some(&format), None, None).map_err(|e| e.param.unwrap_or_default())
    }

    #[test]
    fn each_format_maps_to_its_constraint_and_bad_ones_name_the_field() {
        assert_eq!(of(json!({"type": "text"})), Ok(None));
        assert_eq!(of(Value::Null), Ok(None));
        assert_eq!(
            of(json!({"type": "json_object"})),
            Ok(Some(Constraint::JsonObject))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            of(
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}})
            ),
            Ok(Some(Constraint::JsonSchema(schema.clone())))
        );
        for bad in [
            json!({"type": "json_schema", "json_schema": {}}),
            json!({"type": "json_schema", "json_schema": {"schema": "no"}}),
            json!({"type": "xml"}),
            json!("json"),
        ] {
            assert_eq!(of(bad.clone()), Err("response_format".to_string()), "{bad}");
        }
        let rx = json!("[0-9]+");
        assert_eq!(
            constraint(None, None, Some(&rx)).ok().flatten(),
            Some(Constraint::Regex("[0-9]+".to_string()))
        );
        assert_eq!(
            constraint(None, Some(&schema), None).ok().flatten(),
            Some(Constraint::JsonSchema(schema.clone()))
        );
        let two = constraint(Some(&json!({"type": "json_object"})), None, Some(&rx));
        assert!(two.is_err());
        assert!(constraint(None, Some(&json!("x")), None).is_err());
        assert!(constraint(None, None, Some(&json!(3))).is_err());
    }
}
