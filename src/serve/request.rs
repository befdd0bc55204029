//! What a request receives: its id, the [`Event`]s of its generation, its [`Usage`], and why a
//! submission can be refused ([`SubmitError`]).

use crate::error::Error;
use crate::generate::{FinishReason, StepOutput};

/// Identifies a request of a [`super::Scheduler`] or [`super::Engine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix store (not prefilled again).
    pub cached_tokens: usize,
}

/// What happens to a request, in order: `Started`, then `Token`s, then `Done`; or `Failed` at
/// any point (nothing follows it).
#[derive(Debug)]
pub enum Event {
    /// The request left the queue and joined the batch.
    Started {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Prompt tokens reused from the prefix store.
        cached_tokens: usize,
    },
    /// One generated token (its id, the text it completes, and on the last one the finish).
    Token(StepOutput),
    /// The request finished normally.
    Done {
        /// Why it stopped.
        finish: FinishReason,
        /// Its token counts.
        usage: Usage,
    },
    /// The request failed (a model error, or the engine shut down); nothing follows.
    Failed(Error),
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The queue holds `max_queue` requests; try again later.
    #[error("the request queue is full; retry in {retry_after_secs} s")]
    QueueFull {
        /// A suggested wait before retrying.
        retry_after_secs: u64,
    },
    /// The options or the prompt are invalid ([`Error::InvalidOption`], [`Error::Input`],
    /// [`Error::TokenOutOfVocab`]).
    #[error(transparent)]
    Invalid(Error),
    /// The prompt leaves no room to generate within the model's context.
    #[error("the prompt has {tokens} tokens; the context holds {limit}")]
    PromptTooLong {
        /// Tokens in the prompt.
        tokens: usize,
        /// The model's context length.
        limit: usize,
    },
    /// The engine was shut down.
    #[error("the engine is shut down")]
    ShutDown,
}

/// A snapshot of a scheduler's load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Requests waiting in the queue.
    pub queued: usize,
    /// Requests in the batch (prefilling or decoding).
    pub running: usize,
    /// K/V bytes of the live caches (the batch and the joining prompts).
    pub kv_bytes: usize,
    /// K/V bytes the running requests reserve against the budget (prompt + max tokens each).
    pub reserved_bytes: usize,
    /// Bytes held by the prefix store.
    pub prefix_bytes: usize,
    /// Entries of the prefix store.
    pub prefix_entries: usize,
}
