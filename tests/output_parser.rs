//! The streaming output parser: the same events however the text is split, malformed and
//! unterminated blocks kept, special tokens never leaking into text or thinking (nor into all
//! of a stream's text joined, where the text around a dropped token could spell one).

use candle_gemma::chat::{to_gemma, OutputEvent, OutputParser};
use candle_gemma::fuzz_api;
use proptest::prelude::*;
use serde_json::json;

/// Merges adjacent Text/Thinking events, so that results compare independently of chunking.
fn normalize(events: Vec<OutputEvent>) -> Vec<OutputEvent> {
    let mut out: Vec<OutputEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(OutputEvent::Text(a)), OutputEvent::Text(b)) => a.push_str(&b),
            (Some(OutputEvent::Thinking(a)), OutputEvent::Thinking(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fn parse(chunks: &[&str]) -> Vec<OutputEvent> {
    let mut p = OutputParser::new();
    let mut events = Vec::new();
    for c in chunks {
        events.extend(p.push(c));
    }
    events.extend(p.finish());
    normalize(events)
}

fn boundaries(s: &str) -> Vec<usize> {
    (0..=s.len()).filter(|&i| s.is_char_boundary(i)).collect()
}

/// No special-token string inside any `Text` or `Thinking` event, nor in all the text (or all
/// the thinking) joined, as a client joins its deltas.
fn assert_no_leak(events: &[OutputEvent]) {
    if let Some((s, kind, joined)) = fuzz_api::leaked_special_token(events) {
        panic!("{s} leaked into the {kind} {joined:?}");
    }
}

/// Every split into two and three chunks gives `expected`.
fn check_all_splits(input: &str, expected: &[OutputEvent]) {
    let b = boundaries(input);
    for &i in &b {
        assert_eq!(parse(&[&input[..i], &input[i..]]), expected, "split at {i}");
    }
    for (n, &i) in b.iter().enumerate() {
        for &j in &b[n..] {
            let got = parse(&[&input[..i], &input[i..j], &input[j..]]);
            assert_eq!(got, expected, "split at {i}, {j}");
        }
    }
    let bytes: Vec<&str> = b.windows(2).map(|w| &input[w[0]..w[1]]).collect();
    assert_eq!(parse(&bytes), expected, "one char per chunk");
}

fn text(s: &str) -> OutputEvent {
    OutputEvent::Text(s.into())
}

fn think(s: &str) -> OutputEvent {
    OutputEvent::Thinking(s.into())
}

fn call(name: &str, arguments: serde_json::Value) -> OutputEvent {
    OutputEvent::ToolCall {
        name: name.into(),
        arguments,
    }
}

#[test]
fn full_turn_split_everywhere() {
    let input = "<|channel>thought\nLet me think — ok.<channel|>Calling 🌦 now.\
                 <|tool_call>call:get_weather{city:<|\"|>São Paulo, {BR}<|\"|>,n:3,nested:{a:[1,2]}}<tool_call|>\
                 <|tool_response>";
    let expected = vec![
        think("Let me think — ok."),
        text("Calling 🌦 now."),
        call(
            "get_weather",
            json!({"city": "São Paulo, {BR}", "n": 3, "nested": {"a": [1, 2]}}),
        ),
    ];
    check_all_splits(input, &expected);
}

#[test]
fn special_tokens_never_reach_text() {
    let input = "<|turn>model\nHi<eos> there<turn|>\n<pad>!<|image|>";
    let expected = vec![text("Hi there\n!")];
    check_all_splits(input, &expected);
}

#[test]
fn text_around_a_dropped_token_never_spells_one() {
    // The text on both sides of a dropped token (or role header) would read as a special
    // token: that string is dropped as the token would be, and a partial one is held back.
    check_all_splits("<turn<channel|>|>", &[]);
    check_all_splits("A<tu<eos>rn|>B", &[text("AB")]);
    check_all_splits("x<tu<e<pad>os>rn|>y", &[text("xy")]);
    check_all_splits("A<turn|<|turn>model\n>B", &[text("AB")]);
    check_all_splits(
        "<|channel>thought\nx<e<pad>os>y<channel|>z",
        &[think("xy"), text("z")],
    );
    // Text joins across a thought into what a client's content reads as one string.
    check_all_splits(
        "<tu<|channel>thought\nhm<channel|>rn|>ok",
        &[think("hm"), text("ok")],
    );
    // Partial tokens that cannot complete are shown as written.
    check_all_splits("a <t b <tu<e", &[text("a <t b <tu<e")]);
    check_all_splits("<<tool_call|", &[text("<<tool_call|")]);
}

#[test]
fn malformed_tool_call_is_kept_as_text() {
    // The content survives without the tags; its `<|"|>` quotes become plain `"`.
    check_all_splits(
        "A<|tool_call>call:f{x:<|\"|>unterminated}<tool_call|>B",
        &[text("Acall:f{x:\"unterminated}B")],
    );
    assert_eq!(
        parse(&["A<|tool_call>call:f{x:1,,}<tool_call|>B"]),
        vec![text("Acall:f{x:1,,}B")]
    );
}

#[test]
fn unterminated_blocks_are_flushed() {
    check_all_splits("<|channel>thought\nhalf a thou", &[think("half a thou")]);
    check_all_splits(
        "ok<|tool_call>call:f{a:1}",
        &[text("ok"), call("f", json!({"a": 1}))],
    );
    check_all_splits("ok<|tool_call>call:f{a:", &[text("okcall:f{a:")]);
    check_all_splits("tail <|tool_c", &[text("tail <|tool_c")]);
}

#[test]
fn lookalikes_are_plain_text() {
    check_all_splits(
        "a < b <| c <|channel d <tool_call>",
        &[text("a < b <| c <|channel d <tool_call>")],
    );
}

#[test]
fn thought_without_name_line_is_kept() {
    check_all_splits(
        "<|channel>no newline, just text<channel|>x",
        &[think("no newline, just text"), text("x")],
    );
    check_all_splits("<|channel>thought<channel|>x", &[text("x")]);
}

#[test]
fn two_calls_and_text_between() {
    check_all_splits(
        "<|tool_call>call:a{}<tool_call|> and <|tool_call>call:b{s:<|\"|><|\"|>}<tool_call|>",
        &[
            call("a", json!({})),
            text(" and "),
            call("b", json!({"s": ""})),
        ],
    );
}

#[test]
fn parser_is_reusable_after_finish() {
    let mut p = OutputParser::new();
    let first = [p.push("<|channel>thought\nx"), p.finish()].concat();
    assert_eq!(first, vec![think("x")]);
    assert_eq!(
        normalize([p.push("y"), p.finish()].concat()),
        vec![text("y")]
    );
}

fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z {}:,\\[\\]<>|\"é世🎉\n]{0,8}",
        proptest::sample::select(fuzz_api::special_token_strings()).prop_map(str::to_string),
        Just("call:f{a:1}".to_string()),
        Just("thought\n".to_string()),
    ]
}

/// A piece of the templates' vocabulary: a special token, part of one (the text left around a
/// dropped token), a role or channel header, or a little text.
fn template_piece() -> impl Strategy<Value = String> {
    let special = proptest::sample::select(fuzz_api::special_token_strings());
    prop_oneof![
        3 => special.clone().prop_map(str::to_string),
        3 => (special, any::<prop::sample::Index>(), any::<bool>()).prop_map(|(s, at, head)| {
            let i = at.index(s.len());
            if head { s[..i].to_string() } else { s[i..].to_string() }
        }),
        1 => proptest::sample::select(vec!["model\n", "user\n", "thought\n", "call:f{a:1}"])
            .prop_map(str::to_string),
        1 => "[a-z <>|\n]{0,4}",
    ]
}

/// Feeds `chunks` to a fresh parser and returns every event, unmerged.
fn events_of(in_thinking: bool, chunks: &[&str]) -> Vec<OutputEvent> {
    let mut p = if in_thinking {
        OutputParser::in_thinking()
    } else {
        OutputParser::new()
    };
    let mut events = Vec::new();
    for c in chunks {
        events.extend(p.push(c));
    }
    events.extend(p.finish());
    events
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn no_special_token_string_survives_any_chunking_of_template_tokens(
        parts in proptest::collection::vec(template_piece(), 0..16),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        in_thinking in any::<bool>(),
    ) {
        let input: String = parts.concat();
        let b = boundaries(&input);
        let mut points: Vec<usize> = cuts.iter().map(|c| b[c.index(b.len())]).collect();
        points.sort_unstable();
        let mut chunks = Vec::new();
        let mut last = 0;
        for p in points {
            chunks.push(&input[last..p]);
            last = p;
        }
        chunks.push(&input[last..]);
        let chunked = events_of(in_thinking, &chunks);
        assert_no_leak(&chunked);
        let whole = events_of(in_thinking, &[&input]);
        assert_no_leak(&whole);
        prop_assert_eq!(normalize(chunked), normalize(whole));
    }
}

proptest! {
    #[test]
    fn chunking_never_changes_the_result(
        parts in proptest::collection::vec(fragment(), 0..12),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let input: String = parts.concat();
        let b = boundaries(&input);
        let mut points: Vec<usize> = cuts.iter().map(|c| b[c.index(b.len())]).collect();
        points.sort_unstable();
        let mut chunks = Vec::new();
        let mut last = 0;
        for p in points {
            chunks.push(&input[last..p]);
            last = p;
        }
        chunks.push(&input[last..]);
        let whole = parse(&[&input]);
        prop_assert_eq!(parse(&chunks), whole.clone());
        assert_no_leak(&whole);
    }

    #[test]
    fn plain_text_passes_through(s in "[^<]{0,40}") {
        let expected = if s.is_empty() { vec![] } else { vec![text(&s)] };
        prop_assert_eq!(parse(&[&s]), expected);
    }

    #[test]
    fn generated_calls_round_trip(
        name in "[a-z_][a-z0-9_]{0,10}",
        s in "[^<]{0,12}",
        n in any::<i32>(),
        b in any::<bool>(),
    ) {
        let args = json!({"s": s, "n": n, "b": b, "l": [n, {"s": s}]});
        let input = format!("<|tool_call>call:{name}{}<tool_call|>", to_gemma(&args));
        prop_assert_eq!(parse(&[&input]), vec![call(&name, args)]);
    }
}
