//! Server-sent events: drives one request's engine events through a protocol's
//! [`Translate`] into an SSE response.
//!
//! The response stream owns the request's [`Submission`]: when the client disconnects, the
//! stream is dropped with it and the sequence is cancelled in the engine (see
//! [`engine`](super::engine)).

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::engine::{Event, Submission, Usage};

/// One server-sent event.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// A `data:` line holding JSON (OpenAI's style).
    Data(Value),
    /// An `event: NAME` line and a JSON `data:` line (Anthropic's style).
    Named(&'static str, Value),
    /// OpenAI's end-of-stream marker, `data: [DONE]`.
    Done,
}

impl Frame {
    fn into_event(self) -> SseEvent {
        match self {
            Frame::Data(v) => SseEvent::default().data(v.to_string()),
            Frame::Named(name, v) => SseEvent::default().event(name).data(v.to_string()),
            Frame::Done => SseEvent::default().data("[DONE]"),
        }
    }
}

/// Turns engine events into SSE frames, for one protocol.
pub trait Translate: Send + 'static {
    /// The frames for one engine event, and whether the stream is complete.
    fn event(&mut self, event: Event) -> (Vec<Frame>, bool);
    /// The last frames when the engine's channel closes before the request is done.
    fn closed(&mut self) -> Vec<Frame>;
}

struct Driver<T> {
    submission: Submission,
    translate: T,
    pending: VecDeque<Frame>,
    finished: bool,
}

/// The SSE response of `submission`, translated by `translate`.
pub fn respond<T: Translate>(submission: Submission, translate: T) -> Response {
    let driver = Driver {
        submission,
        translate,
        pending: VecDeque::new(),
        finished: false,
    };
    let stream = futures_util::stream::unfold(driver, |mut d| async move {
        loop {
            if let Some(event) = d.pending.pop_front() {
                return Some((Ok::<_, Infallible>(event.into_event()), d));
            }
            if d.finished {
                return None;
            }
            match d.submission.events.recv().await {
                Some(event) => {
                    let (events, complete) = d.translate.event(event);
                    d.pending.extend(events);
                    if complete {
                        d.finished = true;
                        d.submission.complete();
                    }
                }
                None => {
                    d.pending.extend(d.translate.closed());
                    d.finished = true;
                    d.submission.complete();
                }
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// One choice's frames for [`respond_choices`]: its index, the frames, its usage once done,
/// and whether it is done.
type ChoiceFrames = (usize, Vec<Frame>, Option<Usage>, bool);

/// The SSE response of several choices of one prompt (`n`), each submission with its own
/// translator (one shared completion id): every chunk's choices get the submission's index,
/// and once every choice is done the usage chunk (where the translators send one) comes once,
/// the prompt counted once, then `data: [DONE]`. Dropping the response cancels every choice.
/// One choice is [`respond`]'s response.
pub fn respond_choices<T: Translate>(mut choices: Vec<(Submission, T)>) -> Response {
    use futures_util::StreamExt;
    if choices.len() == 1 {
        let (submission, translate) = choices.remove(0);
        return respond(submission, translate);
    }
    let n = choices.len();
    let per_choice = choices
        .into_iter()
        .enumerate()
        .map(|(i, (submission, translate))| {
            futures_util::stream::unfold(Some((submission, translate)), move |state| async move {
                let (mut submission, mut translate) = state?;
                let item: ChoiceFrames = match submission.events.recv().await {
                    Some(event) => {
                        let usage = match &event {
                            Event::Done { usage, .. } => Some(*usage),
                            _ => None,
                        };
                        let (frames, complete) = translate.event(event);
                        if complete {
                            submission.complete();
                            return Some(((i, frames, usage, true), None));
                        }
                        (i, frames, usage, false)
                    }
                    None => return Some(((i, translate.closed(), None, true), None)),
                };
                Some((item, Some((submission, translate))))
            })
            .boxed()
        });
    let mut usages: Vec<Option<Usage>> = vec![None; n];
    let mut usage_chunk: Option<Value> = None;
    let mut done = 0;
    let stream = futures_util::stream::select_all(per_choice).flat_map(
        move |(i, frames, usage, complete): ChoiceFrames| {
            let mut out = Vec::new();
            for frame in frames {
                match frame {
                    Frame::Done => {}
                    Frame::Data(mut v) => {
                        match v.get_mut("choices").and_then(Value::as_array_mut) {
                            // The usage chunk: sent once, at the end.
                            Some(listed) if listed.is_empty() => usage_chunk = Some(v),
                            Some(listed) => {
                                for c in listed.iter_mut() {
                                    c["index"] = Value::from(i);
                                }
                                out.push(Frame::Data(v));
                            }
                            None => out.push(Frame::Data(v)),
                        }
                    }
                    other => out.push(other),
                }
            }
            if let Some(slot) = usages.get_mut(i) {
                *slot = usage.or(*slot);
            }
            if complete {
                done += 1;
                if done == n {
                    if let Some(mut last) = usage_chunk.take() {
                        let listed: Vec<Usage> = usages.iter().flatten().copied().collect();
                        last["usage"] = super::openai::usage_of_choices(listed.iter());
                        out.push(Frame::Data(last));
                    }
                    out.push(Frame::Done);
                }
            }
            futures_util::stream::iter(out.into_iter().map(|f| Ok::<_, Infallible>(f.into_event())))
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
