//! Serving many requests at once, without HTTP: a step-driven [`Scheduler`] (request queue,
//! admission by batch size and KV-memory budget, chunked prefill, cancellation, prefix reuse)
//! and an [`Engine`], a handle to a worker thread that owns the model and a scheduler and
//! streams [`Event`]s to one callback per request.

mod budget;
mod engine;
mod prefix_stub;
mod request;
mod scheduler;

pub use budget::{kv_bytes_for, kv_bytes_per_token};
pub use engine::{Engine, Sink};
pub use request::{EngineStats, Event, RequestId, SubmitError, Usage};
pub use scheduler::{Scheduler, SchedulerConfig};
