//! [`Engine`]: a cloneable handle to a worker thread that owns the model and a
//! [`Scheduler`], and streams each request's [`Event`](super::Event)s to its own callback.
//!
//! ```
//! use std::sync::{mpsc, Arc};
//! use candle_gemma::serve::{Engine, Event, SchedulerConfig};
//! use candle_gemma::{GenOptions, Model};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/e2b-hf");
//! let model = Arc::new(Model::builder().path(dir).build()?);
//! let engine = Engine::start(model.clone(), SchedulerConfig::default())?;
//! let (tx, rx) = mpsc::channel();
//! let prompt = model.encode("Hello", true)?;
//! let options = GenOptions { max_tokens: 4, ..Default::default() };
//! engine.submit(prompt, options, Box::new(move |event| tx.send(event).is_ok()))?;
//! for event in rx {
//!     match event {
//!         Event::Token(step) => print!("{}", step.text),
//!         Event::Done { usage, .. } => { println!("\n{} tokens", usage.completion_tokens); break }
//!         Event::Failed(e) => return Err(e.into()),
//!         Event::Started { .. } => {}
//!     }
//! }
//! engine.shutdown();
//! # Ok(()) }
//! ```

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use super::intake::{Command, Intake, Shared, Sink, Sinks};
use super::request::{EngineStats, RequestId, SubmitError};
use super::scheduler::{Scheduler, SchedulerConfig};
use crate::error::Result;
use crate::generate::GenOptions;
use crate::model::Model;

#[derive(Debug)]
struct Inner {
    model: Arc<Model>,
    intake: Intake,
}

/// A handle to the serving worker. Clones share the worker; it stops on
/// [`Engine::shutdown`], or once every handle is dropped and no request is left.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

// The worker thread holds the model: it must be shareable across threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Model>();
    send_sync::<Engine>();
};

impl Engine {
    /// Starts the worker thread with a scheduler over `model`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidOption`] for invalid limits; [`crate::Error::Input`] when the
    /// thread cannot be spawned.
    pub fn start(model: Arc<Model>, config: SchedulerConfig) -> Result<Engine> {
        config.validate()?;
        let max_queue = config.max_queue;
        let intake = {
            let model = model.clone();
            Intake::spawn("candle-gemma-engine", max_queue, move |rx, shared| {
                run(&model, config, &rx, shared)
            })?
        };
        Ok(Engine {
            inner: Arc::new(Inner { model, intake }),
        })
    }

    /// The model the engine serves.
    pub fn model(&self) -> &Arc<Model> {
        &self.inner.model
    }

    /// Queues a request; its events go to `sink` from the worker thread (`Started`, `Token`s,
    /// then `Done`, or `Failed`). The options and prompt are checked here, before queueing.
    ///
    /// # Errors
    /// [`SubmitError::Invalid`], [`SubmitError::PromptTooLong`], [`SubmitError::QueueFull`]
    /// when `max_queue` requests wait, [`SubmitError::ShutDown`].
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        options: GenOptions,
        sink: Sink,
    ) -> std::result::Result<RequestId, SubmitError> {
        let inner = &self.inner;
        inner.intake.submit(&inner.model, prompt, options, sink)
    }

    /// Cancels request `id` at the worker's next step (its cache is freed; its sink hears
    /// nothing more). Unknown or finished ids are ignored.
    pub fn cancel(&self, id: RequestId) {
        self.inner.intake.cancel(id);
    }

    /// The load after the worker's last step (`queued` counts requests accepted and not yet
    /// admitted).
    pub fn stats(&self) -> EngineStats {
        self.inner.intake.stats()
    }

    /// Stops the worker: queued and running requests get [`super::Event::Failed`], later
    /// submissions [`SubmitError::ShutDown`]. Waits for the worker to exit (unless called from
    /// a sink, on the worker itself).
    pub fn shutdown(&self) {
        self.inner.intake.shutdown(false);
    }
}

/// The worker loop: take commands (blocking while idle), run a scheduler step, hand the events
/// to the sinks, cancel the requests whose sink refused an event.
fn run(model: &Model, config: SchedulerConfig, rx: &Receiver<Command>, shared: &Shared) {
    let Ok(mut scheduler) = Scheduler::new(model, config) else {
        return;
    };
    let mut sinks = Sinks::default();
    let mut open = true;
    while open {
        let mut commands = Vec::new();
        if scheduler.is_idle() {
            match rx.recv() {
                Ok(c) => commands.push(c),
                Err(_) => break,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(c) => commands.push(c),
                Err(TryRecvError::Empty) => break,
                // No handle is left: what is queued and running finishes, then `recv` ends
                // the loop.
                Err(TryRecvError::Disconnected) => break,
            }
        }
        for command in commands {
            match command {
                Command::Submit {
                    id,
                    prompt,
                    options,
                    sink,
                } => {
                    sinks.insert(id, sink);
                    if let Err(e) = scheduler.submit_as(id, prompt, *options) {
                        sinks.reject(id, &e, shared);
                    }
                }
                Command::Cancel(id) => {
                    scheduler.cancel(id);
                    sinks.forget(id, shared);
                }
                Command::Shutdown => open = false,
            }
        }
        if !open {
            break;
        }
        let events = match catch_unwind(AssertUnwindSafe(|| scheduler.step())) {
            Ok(events) => events,
            Err(_) => {
                // A bug, not an input: every request known so far fails, and a fresh
                // scheduler serves the next ones rather than leaving clients hanging.
                sinks.fail_every(shared, "internal error in a batch step");
                match Scheduler::new(model, scheduler.config().clone()) {
                    Ok(fresh) => scheduler = fresh,
                    Err(_) => break,
                }
                shared.publish(&scheduler);
                continue;
            }
        };
        for id in sinks.deliver(events, shared) {
            scheduler.cancel(id);
        }
        shared.publish(&scheduler);
    }
    sinks.fail_every(shared, "the engine shut down");
    shared.close();
    shared.publish(&scheduler);
}
