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

use super::engine::{Event, Submission};

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
