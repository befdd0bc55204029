//! Forced tool calls on a fixture (random weights, Gemma 4's tool tokens): the output of a
//! named or a required tool choice is a call of the allowed tools whose arguments fit the
//! tool's schema, greedy and sampled; a valid call's tokens pass the constraint one by one and
//! others are refused; a choice that cannot hold is a typed error.

mod common;

use candle_gemma::chat::{parse_tool_calls, tool_call_constraint, ChatError, ForcedToolCall};
use candle_gemma::generate::{Constraint, SamplingOptions};
use candle_gemma::{FinishReason, GenOptions, Model};
use common::*;
use serde_json::{json, Value};

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"}
                },
                "required": ["city", "days"]
            }
        }}),
        // The bare function object is taken too.
        json!({
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "hour": {"type": "integer"},
                    "repeat": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2}
                },
                "required": ["hour"]
            }
        }),
    ]
}

fn constraint(model: &Model, forced: &ForcedToolCall) -> Constraint {
    let tokenizer = model.tokenizer().expect("the fixture has a tokenizer");
    tool_call_constraint(tokenizer, &tools(), forced, false).expect("the grammar builds")
}

fn generate(model: &Model, c: Option<Constraint>, sampling: SamplingOptions) -> (String, bool) {
    let ids = model.encode("Call a tool", true).expect("encode");
    let opts = GenOptions {
        max_tokens: 96,
        constraint: c,
        sampling,
        skip_special_tokens: false,
        ..Default::default()
    };
    let out = model.generator(opts).generate(&ids).expect("generate");
    (out.text, matches!(out.finish, FinishReason::Eos(_)))
}

/// The calls of `text`, which must be nothing but `<|tool_call>…<tool_call|>` blocks and the
/// end-of-sequence token that ended them (with `cut`, a last block that `max_tokens` cut short
/// is left out).
fn calls_of(text: &str, cut: bool) -> Vec<(String, Value)> {
    let mut calls = Vec::new();
    let mut rest = ["<turn|>", "<|tool_response>", "<eos>"]
        .iter()
        .find_map(|e| text.strip_suffix(e))
        .unwrap_or(text);
    while !rest.is_empty() {
        let inner = rest
            .strip_prefix("<|tool_call>")
            .unwrap_or_else(|| panic!("not a tool-call block: {text:?}"));
        let Some(end) = inner.find("<tool_call|>") else {
            assert!(cut, "an unclosed block: {text:?}");
            break;
        };
        calls.extend(parse_tool_calls(&inner[..end]).unwrap_or_else(|e| panic!("{e}: {text:?}")));
        rest = &inner[end + "<tool_call|>".len()..];
    }
    calls
}

/// Whether `args` fit the named tool's schema in [`tools`].
fn fits(name: &str, args: &Value) -> bool {
    let Some(o) = args.as_object() else {
        return false;
    };
    let allowed_keys = |keys: &[&str]| o.keys().all(|k| keys.contains(&k.as_str()));
    match name {
        "get_weather" => {
            allowed_keys(&["city", "days", "metric"])
                && matches!(
                    o.get("city").and_then(Value::as_str),
                    Some("Paris" | "Oslo")
                )
                && o.get("days").is_some_and(|d| d.is_i64() || d.is_u64())
                && o.get("metric").is_none_or(Value::is_boolean)
        }
        "set_alarm" => {
            allowed_keys(&["hour", "repeat"])
                && o.get("hour").is_some_and(|d| d.is_i64() || d.is_u64())
                && o.get("repeat").is_none_or(|r| {
                    r.as_array().is_some_and(|a| {
                        a.len() <= 2 && a.iter().all(|d| matches!(d.as_str(), Some("mon" | "tue")))
                    })
                })
        }
        _ => false,
    }
}

#[test]
fn forced_calls_are_calls_of_the_allowed_tools_that_fit_their_schemas() {
    let model = load("e2b-hf");
    let (free, _) = generate(&model, None, SamplingOptions::default());
    assert!(
        !free.starts_with("<|tool_call>"),
        "the unconstrained output should not already be a call: {free:?}"
    );
    let cases = [
        (
            ForcedToolCall::Named("get_weather".into()),
            vec!["get_weather"],
        ),
        (ForcedToolCall::Named("set_alarm".into()), vec!["set_alarm"]),
        (
            ForcedToolCall::Any { parallel: false },
            vec!["get_weather", "set_alarm"],
        ),
        (
            ForcedToolCall::Any { parallel: true },
            vec!["get_weather", "set_alarm"],
        ),
    ];
    for (forced, names) in cases {
        let c = constraint(&model, &forced);
        let samplings = [0u64, 1, 2, 3].map(|seed| match seed {
            0 => SamplingOptions::default(),
            s => SamplingOptions {
                temperature: 1.0,
                top_k: Some(64),
                seed: s,
                ..Default::default()
            },
        });
        for sampling in samplings {
            let (text, eos) = generate(&model, Some(c.clone()), sampling.clone());
            let parallel = forced == ForcedToolCall::Any { parallel: true };
            // Parallel calls may go on past `max_tokens` (random weights rarely stop).
            assert!(
                eos || parallel,
                "{forced:?} {sampling:?}: no end in {text:?}"
            );
            let calls = calls_of(&text, !eos);
            assert!(!calls.is_empty(), "{text:?}");
            if !parallel {
                assert_eq!(calls.len(), 1, "{text:?}");
            }
            for (name, args) in &calls {
                assert!(names.contains(&name.as_str()), "{name} in {text:?}");
                assert!(fits(name, args), "{name} {args} from {text:?}");
            }
        }
    }
}

#[test]
fn a_valid_calls_tokens_pass_one_by_one_and_others_are_refused() {
    let model = load("e2b-hf");
    let c = constraint(&model, &ForcedToolCall::Named("get_weather".into()));
    let valid =
        "<|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>,days:3,metric:true}<tool_call|>";
    let mut tc = model.constraint(&c).expect("starts");
    for t in model.encode(valid, false).expect("encode") {
        assert_eq!(
            tc.allowed().expect("mask")[t as usize],
            1,
            "token {t} of {valid}"
        );
        tc.accept(t).expect("accept");
    }
    let eos = model.encode("<tool_response|>", false).expect("encode");
    let end = tc.allowed().expect("mask");
    assert_eq!(end[1], 1, "<eos> ends a complete call");
    assert_eq!(
        end[eos[0] as usize], 0,
        "only the end-of-sequence tokens follow"
    );
    for bad in [
        // Another tool, an undeclared key, a value outside the enum, a missing required key.
        "<|tool_call>call:set_alarm{hour:7}<tool_call|>",
        "<|tool_call>call:get_weather{town:<|\"|>Oslo<|\"|>,days:3}<tool_call|>",
        "<|tool_call>call:get_weather{city:<|\"|>Rome<|\"|>,days:3}<tool_call|>",
        "<|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}<tool_call|>",
        "Sure, <|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>,days:3}<tool_call|>",
    ] {
        let mut tc = model.constraint(&c).expect("starts");
        let refused = model
            .encode(bad, false)
            .expect("encode")
            .into_iter()
            .any(|t| {
                if tc.allowed().expect("mask")[t as usize] == 0 {
                    return true;
                }
                tc.accept(t).expect("an allowed token is accepted");
                false
            });
        assert!(refused, "{bad} passed");
    }
}

#[test]
fn a_forced_choice_that_cannot_hold_is_a_typed_error() {
    let model = load("e2b-hf");
    let tokenizer = model.tokenizer().expect("tokenizer");
    let named = |n: &str| ForcedToolCall::Named(n.into());
    let err = |tools: &[Value], forced: &ForcedToolCall| {
        tool_call_constraint(tokenizer, tools, forced, false).expect_err("should fail")
    };
    assert!(matches!(
        err(&tools(), &named("get_time")),
        ChatError::ToolChoice { .. }
    ));
    assert!(matches!(
        err(&[], &ForcedToolCall::Any { parallel: false }),
        ChatError::ToolChoice { .. }
    ));
    assert!(matches!(
        err(
            &[json!({"description": "no name"})],
            &ForcedToolCall::Any { parallel: false }
        ),
        ChatError::Tool { index: 0, .. }
    ));
    assert!(matches!(
        err(
            &[json!({"name": "two words"})],
            &ForcedToolCall::Any { parallel: false }
        ),
        ChatError::Tool { index: 0, .. }
    ));
    // A thinking model may think first; the grammar still compiles and holds the call.
    let thinking = tool_call_constraint(
        tokenizer,
        &tools(),
        &ForcedToolCall::Any { parallel: true },
        true,
    )
    .expect("builds");
    model.check_constraint(&thinking).expect("compiles");
}
