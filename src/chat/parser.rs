//! Streaming parser of Gemma 4 output: splits decoded text into thinking, visible text and
//! tool calls.
//!
//! The model writes its reasoning as `<|channel>thought\n…<channel|>` and its tool calls as
//! `<|tool_call>call:NAME{…}<tool_call|>` (see [`syntax`](super::syntax)). Decode with
//! special tokens kept, feed the text as it streams, and read [`OutputEvent`]s:
//!
//! ```
//! use candle_gemma::chat::{OutputEvent, OutputParser};
//!
//! let mut p = OutputParser::new();
//! let mut events = p.push("<|channel>thought\nThe user greets me.<chan");
//! events.extend(p.push("nel|>Hi!<|tool_call>call:wave{times:2}<tool_call|><turn|>"));
//! events.extend(p.finish());
//! assert_eq!(events, vec![
//!     OutputEvent::Thinking("The user greets me.".into()),
//!     OutputEvent::Text("Hi!".into()),
//!     OutputEvent::ToolCall { name: "wave".into(), arguments: serde_json::json!({"times": 2}) },
//! ]);
//! ```
//!
//! Guarantees:
//! - a tag may be split across chunks at any byte, and the events are the same however the
//!   text is split (up to how adjacent events of one kind are merged);
//! - no special-token string (`<turn|>`, `<eos>`, `<|turn>`, …) ever appears inside `Text` or
//!   `Thinking`, nor in all the `Text` (or all the `Thinking`) of a stream joined, as a client
//!   joins its deltas. Special tokens and role headers are dropped from the output, so the
//!   text on both sides of one can join into such a string (`<tu`, a dropped `<eos>`, `rn|>`):
//!   that string is dropped too, as the token it spells would be. Text that may still join
//!   later text into one (a trailing `<tu`) is held back until it cannot, or until
//!   [`OutputParser::finish`]; in ordinary output that is a few bytes;
//! - nothing else the model wrote is lost: an unterminated thought stays `Thinking`, a tool
//!   call that does not parse comes back as `Text` (its content, without the tags and with
//!   `<|"|>` shown as `"`).

use serde_json::Value;

use super::syntax::{parse_tool_calls, QUOTE};

/// One piece of parsed model output.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    /// Reasoning from a thought channel.
    Thinking(String),
    /// Text meant for the user.
    Text(String),
    /// A complete, well-formed tool call.
    ToolCall {
        /// The function name.
        name: String,
        /// The arguments, converted from Gemma syntax to a JSON object.
        arguments: Value,
    },
}

/// The special tokens the parser recognises in decoded text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    ChannelOpen,
    ChannelClose,
    ToolCallOpen,
    ToolCallClose,
    Quote,
    TurnOpen,
    TurnClose,
    /// Any other special token: never shown, otherwise ignored.
    Other,
}

const MARKERS: &[(&str, Marker)] = &[
    ("<|channel>", Marker::ChannelOpen),
    ("<channel|>", Marker::ChannelClose),
    ("<|tool_call>", Marker::ToolCallOpen),
    ("<tool_call|>", Marker::ToolCallClose),
    (QUOTE, Marker::Quote),
    ("<|turn>", Marker::TurnOpen),
    ("<turn|>", Marker::TurnClose),
    ("<eos>", Marker::Other),
    ("<bos>", Marker::Other),
    ("<pad>", Marker::Other),
    ("<unk>", Marker::Other),
    ("<mask>", Marker::Other),
    ("<|think|>", Marker::Other),
    ("<|tool>", Marker::Other),
    ("<tool|>", Marker::Other),
    ("<|tool_response>", Marker::Other),
    ("<tool_response|>", Marker::Other),
    ("<|image>", Marker::Other),
    ("<image|>", Marker::Other),
    ("<|audio>", Marker::Other),
    ("<audio|>", Marker::Other),
    ("<|image|>", Marker::Other),
    ("<|audio|>", Marker::Other),
    ("<|video|>", Marker::Other),
];

/// Every special-token string the parser recognises; none of them is ever shown as text or
/// thinking.
pub(crate) fn special_token_strings() -> impl Iterator<Item = &'static str> {
    MARKERS.iter().map(|(s, _)| *s)
}

/// A channel name (`thought`) or role (`model`) is at most this long.
const MAX_HEADER: usize = 32;

#[derive(Debug)]
enum Piece {
    Text(String),
    Marker(Marker),
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    Text,
    /// After `<|channel>`, reading the channel name line.
    ChannelHeader(String),
    Thinking,
    /// Inside `<|tool_call>`, collecting the raw call text.
    ToolCall(String),
    /// After `<|turn>`, reading the role line.
    TurnHeader(String),
}

/// What a client sees of one output stream (every `Text`, or every `Thinking`, joined): a
/// special-token string that text on both sides of a dropped token forms is removed, and the
/// tail that later text could still turn into one is held back.
///
/// The joined stream is reduced as a stack: each character is pushed, and a special-token
/// string on top is popped at once. Every special-token string starts with its only `<` and
/// ends with its only `>`, so a character can still be popped only while it lies in the
/// longest tail made of `<`-led pieces that are each a proper prefix of one (`<tu<e` may
/// become `<tu` and then `<turn|>`); everything before that tail is final. The result depends
/// only on the joined text, never on how it was split.
#[derive(Debug, Clone, Default)]
struct Visible {
    /// The tail that may still be removed.
    held: String,
}

impl Visible {
    /// Appends `t`; returns the text that is now final.
    fn push(&mut self, t: &str) -> String {
        let mut s = std::mem::take(&mut self.held);
        for c in t.chars() {
            s.push(c);
            if c == '>' {
                if let Some((tag, _)) = MARKERS.iter().find(|(tag, _)| s.ends_with(tag)) {
                    s.truncate(s.len() - tag.len());
                }
            }
        }
        self.held = s.split_off(removable_from(&s));
        s
    }

    /// Ends the stream: the held tail is final.
    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Where the tail of `s` that later text could still remove begins (see [`Visible`]).
fn removable_from(s: &str) -> usize {
    let mut start = s.len();
    while let Some(at) = s[..start].rfind('<') {
        let piece = &s[at..start];
        let partial = MARKERS
            .iter()
            .any(|(tag, _)| tag.len() > piece.len() && tag.starts_with(piece));
        if !partial {
            break;
        }
        start = at;
    }
    start
}

/// Streaming parser of Gemma 4 output; see the [`chat`](crate::chat) module docs.
#[derive(Debug, Clone)]
pub struct OutputParser {
    /// Text held back because it may be the start of a special token.
    pending: String,
    state: State,
    initial: State,
    events: Vec<OutputEvent>,
    /// The visible text and thinking streams.
    text: Visible,
    thinking: Visible,
    /// Whether thinking was written after the last text.
    thinking_last: bool,
}

impl Default for OutputParser {
    fn default() -> Self {
        Self::new()
    }
}

impl OutputParser {
    /// A parser for output that starts as plain text (the usual generation prompt
    /// `<|turn>model\n`).
    pub fn new() -> Self {
        Self::starting_in(State::Text)
    }

    /// A parser for output that starts inside a thought, for templates whose generation
    /// prompt already ends with `<|channel>thought\n`.
    pub fn in_thinking() -> Self {
        Self::starting_in(State::Thinking)
    }

    fn starting_in(state: State) -> Self {
        Self {
            pending: String::new(),
            state: state.clone(),
            initial: state,
            events: Vec::new(),
            text: Visible::default(),
            thinking: Visible::default(),
            thinking_last: false,
        }
    }

    /// Feeds a chunk of decoded text (special tokens kept); returns the events it completes.
    ///
    /// Adjacent events of the same kind within one call are merged.
    pub fn push(&mut self, chunk: &str) -> Vec<OutputEvent> {
        for piece in self.lex(chunk, false) {
            self.handle(piece);
        }
        std::mem::take(&mut self.events)
    }

    /// Ends the stream: flushes held-back text and any open block, then resets the parser
    /// to its initial state. Held-back text and thinking come last, the stream written last
    /// first (it continues the last event).
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        for piece in self.lex("", true) {
            self.handle(piece);
        }
        match std::mem::replace(&mut self.state, self.initial.clone()) {
            State::ChannelHeader(h) if !"thought".starts_with(h.as_str()) => self.emit_thinking(&h),
            State::ToolCall(raw) => self.close_tool_call(raw),
            State::TurnHeader(h) if !is_header(&h) => self.emit_text(&h),
            _ => {}
        }
        let (text, thinking) = (self.text.finish(), self.thinking.finish());
        if std::mem::take(&mut self.thinking_last) {
            self.push_thinking(thinking);
            self.push_text(text);
        } else {
            self.push_text(text);
            self.push_thinking(thinking);
        }
        std::mem::take(&mut self.events)
    }

    /// Splits `pending + chunk` into text and markers, holding back a possible partial
    /// marker at the end unless `fin`.
    fn lex(&mut self, chunk: &str, fin: bool) -> Vec<Piece> {
        self.pending.push_str(chunk);
        let s = std::mem::take(&mut self.pending);
        let mut pieces = Vec::new();
        let (mut text_start, mut i) = (0, 0);
        while let Some(off) = s[i..].find('<') {
            let at = i + off;
            let rest = &s[at..];
            if let Some((tag, marker)) = MARKERS.iter().find(|(tag, _)| rest.starts_with(tag)) {
                if at > text_start {
                    pieces.push(Piece::Text(s[text_start..at].to_string()));
                }
                pieces.push(Piece::Marker(*marker));
                i = at + tag.len();
                text_start = i;
                continue;
            }
            if !fin && MARKERS.iter().any(|(tag, _)| tag.starts_with(rest)) {
                if at > text_start {
                    pieces.push(Piece::Text(s[text_start..at].to_string()));
                }
                self.pending = rest.to_string();
                return pieces;
            }
            // `<` is one byte, so `at + 1` is a char boundary.
            i = at + 1;
        }
        if text_start < s.len() {
            pieces.push(Piece::Text(s[text_start..].to_string()));
        }
        pieces
    }

    fn handle(&mut self, piece: Piece) {
        let state = std::mem::replace(&mut self.state, State::Text);
        self.state = match (state, piece) {
            (State::Text, Piece::Text(t)) => {
                self.emit_text(&t);
                State::Text
            }
            (State::Text, Piece::Marker(m)) => match m {
                Marker::ChannelOpen => State::ChannelHeader(String::new()),
                Marker::ToolCallOpen => State::ToolCall(String::new()),
                Marker::TurnOpen => State::TurnHeader(String::new()),
                _ => State::Text,
            },
            (State::ChannelHeader(mut h), Piece::Text(t)) => {
                h.push_str(&t);
                self.resolve_header(h, true)
            }
            (State::ChannelHeader(h), Piece::Marker(m)) => {
                if h != "thought" {
                    self.emit_thinking(&h);
                }
                self.state = State::Thinking;
                return self.handle(Piece::Marker(m));
            }
            (State::Thinking, Piece::Text(t)) => {
                self.emit_thinking(&t);
                State::Thinking
            }
            (State::Thinking, Piece::Marker(m)) => match m {
                Marker::ChannelClose | Marker::TurnClose => State::Text,
                // A tool call that opens inside an unclosed thought ends the thought.
                Marker::ToolCallOpen => State::ToolCall(String::new()),
                _ => State::Thinking,
            },
            (State::ToolCall(mut raw), Piece::Text(t)) => {
                raw.push_str(&t);
                State::ToolCall(raw)
            }
            (State::ToolCall(mut raw), Piece::Marker(Marker::Quote)) => {
                raw.push_str(QUOTE);
                State::ToolCall(raw)
            }
            (State::ToolCall(raw), Piece::Marker(m)) => {
                self.close_tool_call(raw);
                if m != Marker::ToolCallClose {
                    // An unterminated call: whatever ended it is handled as usual.
                    self.state = State::Text;
                    return self.handle(Piece::Marker(m));
                }
                State::Text
            }
            (State::TurnHeader(mut h), Piece::Text(t)) => {
                h.push_str(&t);
                self.resolve_header(h, false)
            }
            (State::TurnHeader(h), Piece::Marker(m)) => {
                if !is_header(&h) {
                    self.emit_text(&h);
                }
                self.state = State::Text;
                return self.handle(Piece::Marker(m));
            }
        };
    }

    /// Decides, once the header line of a `<|channel>` (`thinking`) or `<|turn>` block is
    /// known, whether it is a name to drop or content to keep.
    fn resolve_header(&mut self, header: String, thinking: bool) -> State {
        let newline = header.find('\n');
        let name = &header[..newline.unwrap_or(header.len())];
        let body = match newline {
            Some(n) if is_header(name) => &header[n + 1..],
            // Still possibly a name: wait for the end of the line.
            None if thinking && is_header(name) => return State::ChannelHeader(header),
            None if is_header(name) => return State::TurnHeader(header),
            _ => header.as_str(),
        };
        if thinking {
            self.emit_thinking(body);
            State::Thinking
        } else {
            self.emit_text(body);
            State::Text
        }
    }

    fn close_tool_call(&mut self, raw: String) {
        match parse_tool_calls(&raw) {
            Ok(calls) => {
                for (name, arguments) in calls {
                    self.events.push(OutputEvent::ToolCall { name, arguments });
                }
            }
            // Kept as text, with its string quotes made plain so no special token leaks.
            Err(_) => self.emit_text(&raw.replace(QUOTE, "\"")),
        }
    }

    /// Sends `t` to the visible text stream.
    fn emit_text(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        self.thinking_last = false;
        let out = self.text.push(t);
        self.push_text(out);
    }

    /// Sends `t` to the visible thinking stream.
    fn emit_thinking(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        self.thinking_last = true;
        let out = self.thinking.push(t);
        self.push_thinking(out);
    }

    /// Adds final text to the events.
    fn push_text(&mut self, t: String) {
        if t.is_empty() {
            return;
        }
        match self.events.last_mut() {
            Some(OutputEvent::Text(prev)) => prev.push_str(&t),
            _ => self.events.push(OutputEvent::Text(t)),
        }
    }

    /// Adds final thinking to the events.
    fn push_thinking(&mut self, t: String) {
        if t.is_empty() {
            return;
        }
        match self.events.last_mut() {
            Some(OutputEvent::Thinking(prev)) => prev.push_str(&t),
            _ => self.events.push(OutputEvent::Thinking(t)),
        }
    }
}

/// A channel name or role: short, non-empty, `[A-Za-z0-9_-]`.
fn is_header(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_HEADER
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_all(chunks: &[&str]) -> Vec<OutputEvent> {
        let mut p = OutputParser::new();
        let mut out: Vec<OutputEvent> = Vec::new();
        for c in chunks {
            out.extend(p.push(c));
        }
        out.extend(p.finish());
        out
    }

    fn text(s: &str) -> OutputEvent {
        OutputEvent::Text(s.into())
    }

    fn think(s: &str) -> OutputEvent {
        OutputEvent::Thinking(s.into())
    }

    #[test]
    fn thought_text_and_call() {
        let got = parse_all(&["<|channel>thought\nhmm<channel|>Sure.<|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|><turn|>"]);
        assert_eq!(
            got,
            vec![
                think("hmm"),
                text("Sure."),
                OutputEvent::ToolCall {
                    name: "f".into(),
                    arguments: json!({"a": "x"})
                }
            ]
        );
    }

    #[test]
    fn partial_marker_is_held_then_released() {
        let mut p = OutputParser::new();
        assert_eq!(p.push("a <|to"), vec![text("a ")]);
        assert_eq!(p.push("y"), vec![text("<|toy")]);
        assert_eq!(p.push("<tur"), vec![]);
        assert_eq!(p.finish(), vec![text("<tur")]);
    }

    #[test]
    fn malformed_call_becomes_text_and_unterminated_thought_stays_thinking() {
        assert_eq!(
            parse_all(&["<|tool_call>call:f{a:<tool_call|>ok"]),
            vec![text("call:f{a:ok")]
        );
        assert_eq!(
            parse_all(&["<|channel>thought\nstill going"]),
            vec![think("still going")]
        );
        assert_eq!(
            parse_all(&["<|tool_call>call:f{a:1}<eos>"]),
            vec![OutputEvent::ToolCall {
                name: "f".into(),
                arguments: json!({"a": 1})
            }]
        );
    }

    #[test]
    fn turn_header_and_specials_are_dropped() {
        assert_eq!(
            parse_all(&["A<turn|>\n<|turn>model\nB<eos>"]),
            vec![text("A\nB")]
        );
        assert_eq!(
            parse_all(&["<|turn>not a role!"]),
            vec![text("not a role!")]
        );
    }

    #[test]
    fn text_joined_across_a_dropped_token_never_spells_one() {
        // `<tu` + dropped `<eos>` + `rn|>` would read `<turn|>`: dropped as that token.
        assert_eq!(parse_all(&["a<tu<eos>rn|>b"]), vec![text("ab")]);
        // Nested: the inner join completes first, then the outer one.
        assert_eq!(parse_all(&["x<tu<e<pad>os>rn|>y"]), vec![text("xy")]);
        // Across a role header, in two pushes: `<tu` is held back until it cannot join.
        let mut p = OutputParser::new();
        assert_eq!(p.push("a<tu"), vec![text("a")]);
        assert_eq!(p.push("<|turn>model\nrn|>b"), vec![text("b")]);
        assert_eq!(p.push("<tu"), vec![]);
        assert_eq!(p.push("x"), vec![text("<tux")]);
        assert_eq!(p.finish(), vec![]);
    }

    #[test]
    fn in_thinking_start() {
        let mut p = OutputParser::in_thinking();
        let mut got = p.push("plan<channel|>answer");
        got.extend(p.finish());
        assert_eq!(got, vec![think("plan"), text("answer")]);
    }
}
