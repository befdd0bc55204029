//! Serving many requests at once, without HTTP: the pieces a server builds on. A step-driven
//! [`Scheduler`] (request queue, admission by batch size and KV-memory budget, chunked prefill,
//! cancellation, prefix reuse), an [`Engine`], a handle to a worker thread that owns the model
//! and a scheduler and streams [`Event`]s to one callback per request, [`ShardedEngine`], the
//! same over a [`crate::ShardedModel`] (one scheduler per rank, in lockstep), and [`prefix`],
//! which keeps K/V states of earlier requests so that a prompt starting with the same tokens
//! (a conversation's next turn, a shared system prompt) skips prefilling them.

mod budget;
mod engine;
mod intake;
pub mod prefix;
mod request;
mod scheduler;
mod sharded;

pub use budget::{kv_bytes_for, kv_bytes_per_token};
pub use engine::Engine;
pub use intake::Sink;
pub use prefix::{LayoutKey, PrefixStore};
pub use request::{EngineStats, Event, RequestId, SubmitError, Usage};
pub use scheduler::{Scheduler, SchedulerConfig};
pub use sharded::ShardedEngine;
