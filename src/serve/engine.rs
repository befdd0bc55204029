//! [`Engine`]: a cloneable handle to a worker thread that owns the model and a
//! [`Scheduler`], and streams each request's [`Event`]s to its own callback.
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

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, ThreadId};

use super::request::{EngineStats, Event, RequestId, SubmitError};
use super::scheduler::{check_request, Scheduler, SchedulerConfig};
use crate::error::{Error, Result};
use crate::generate::GenOptions;
use crate::model::Model;

/// Where a request's events go. Returning `false` (the receiver is gone: the client
/// disconnected) cancels the request at the next step and frees its cache.
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

/// The worker's inbox.
pub(super) enum Command {
    Submit {
        id: RequestId,
        prompt: Vec<u32>,
        options: GenOptions,
        sink: Sink,
    },
    Cancel(RequestId),
    Shutdown,
}

/// What the handles and the worker share.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// The scheduler's figures after the worker's last step.
    pub(super) stats: Mutex<EngineStats>,
    /// Requests accepted by `submit` and not yet admitted to the batch (or dropped).
    pub(super) waiting: AtomicUsize,
    pub(super) shut: AtomicBool,
}

#[derive(Debug)]
struct Inner {
    model: Arc<Model>,
    tx: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
    worker_id: ThreadId,
    next_id: AtomicU64,
    max_queue: usize,
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
    /// [`Error::InvalidOption`] for invalid limits; [`Error::Input`] when the thread cannot be
    /// spawned.
    pub fn start(model: Arc<Model>, config: SchedulerConfig) -> Result<Engine> {
        config.validate()?;
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let max_queue = config.max_queue;
        let worker = {
            let (model, shared) = (model.clone(), shared.clone());
            std::thread::Builder::new()
                .name("candle-gemma-engine".to_string())
                .spawn(move || run(&model, config, &rx, &shared))
                .map_err(|e| Error::Input(format!("cannot start the engine thread: {e}")))?
        };
        Ok(Engine {
            inner: Arc::new(Inner {
                model,
                tx: Mutex::new(tx),
                shared,
                worker_id: worker.thread().id(),
                worker: Mutex::new(Some(worker)),
                next_id: AtomicU64::new(0),
                max_queue,
            }),
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
        if inner.shared.shut.load(Ordering::Acquire) {
            return Err(SubmitError::ShutDown);
        }
        check_request(&inner.model, &prompt, &options)?;
        let max = inner.max_queue;
        inner
            .shared
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < max).then_some(w + 1)
            })
            .map_err(|_| SubmitError::QueueFull {
                retry_after_secs: 1,
            })?;
        let id = RequestId(inner.next_id.fetch_add(1, Ordering::Relaxed));
        let sent = self.send(Command::Submit {
            id,
            prompt,
            options,
            sink,
        });
        if !sent {
            inner.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::ShutDown);
        }
        Ok(id)
    }

    /// Cancels request `id` at the worker's next step (its cache is freed; its sink hears
    /// nothing more). Unknown or finished ids are ignored.
    pub fn cancel(&self, id: RequestId) {
        self.send(Command::Cancel(id));
    }

    /// The load after the worker's last step (`queued` counts requests accepted and not yet
    /// admitted).
    pub fn stats(&self) -> EngineStats {
        let mut stats = match self.inner.shared.stats.lock() {
            Ok(s) => *s,
            Err(poisoned) => *poisoned.into_inner(),
        };
        stats.queued = self.inner.shared.waiting.load(Ordering::Acquire);
        stats
    }

    /// Stops the worker: queued and running requests get [`Event::Failed`], later submissions
    /// [`SubmitError::ShutDown`]. Waits for the worker to exit (unless called from a sink, on
    /// the worker itself).
    pub fn shutdown(&self) {
        self.inner.shared.shut.store(true, Ordering::Release);
        self.send(Command::Shutdown);
        if std::thread::current().id() == self.inner.worker_id {
            return;
        }
        let handle = match self.inner.worker.lock() {
            Ok(mut h) => h.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(h) = handle {
            // A worker that panicked has nothing more to report.
            let _ = h.join();
        }
    }

    /// Sends a command; `false` when the worker is gone.
    fn send(&self, command: Command) -> bool {
        match self.inner.tx.lock() {
            Ok(tx) => tx.send(command).is_ok(),
            Err(poisoned) => poisoned.into_inner().send(command).is_ok(),
        }
    }
}

/// A request the worker knows.
pub(super) struct Entry {
    pub(super) sink: Sink,
    /// Whether it left the queue (counted out of `waiting`).
    pub(super) admitted: bool,
}

/// The worker loop: take commands (blocking while idle), run a scheduler step, hand the events
/// to the sinks, cancel the requests whose sink refused an event.
fn run(model: &Model, config: SchedulerConfig, rx: &Receiver<Command>, shared: &Shared) {
    let Ok(mut scheduler) = Scheduler::new(model, config) else {
        return;
    };
    let mut entries: HashMap<RequestId, Entry> = HashMap::new();
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
                    mut sink,
                } => match scheduler.submit_as(id, prompt, options) {
                    Ok(()) => {
                        entries.insert(
                            id,
                            Entry {
                                sink,
                                admitted: false,
                            },
                        );
                    }
                    Err(e) => {
                        shared.waiting.fetch_sub(1, Ordering::AcqRel);
                        sink(Event::Failed(Error::Input(e.to_string())));
                    }
                },
                Command::Cancel(id) => {
                    scheduler.cancel(id);
                    forget(&mut entries, id, shared);
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
                fail_every(&mut entries, shared, "internal error in a batch step");
                match Scheduler::new(model, scheduler.config().clone()) {
                    Ok(fresh) => scheduler = fresh,
                    Err(_) => break,
                }
                publish(&scheduler, shared);
                continue;
            }
        };
        let mut refused = Vec::new();
        for (id, event) in events {
            let Some(entry) = entries.get_mut(&id) else {
                continue;
            };
            let last = matches!(event, Event::Done { .. } | Event::Failed(_));
            if matches!(event, Event::Started { .. }) && !entry.admitted {
                entry.admitted = true;
                shared.waiting.fetch_sub(1, Ordering::AcqRel);
            }
            if !(entry.sink)(event) && !last {
                refused.push(id);
            }
            if last {
                forget(&mut entries, id, shared);
            }
        }
        for id in refused {
            scheduler.cancel(id);
            forget(&mut entries, id, shared);
        }
        publish(&scheduler, shared);
    }
    fail_every(&mut entries, shared, "the engine shut down");
    shared.shut.store(true, Ordering::Release);
    publish(&scheduler, shared);
}

/// Fails and forgets every request the worker knows.
pub(super) fn fail_every(entries: &mut HashMap<RequestId, Entry>, shared: &Shared, reason: &str) {
    for (_, mut entry) in entries.drain() {
        (entry.sink)(Event::Failed(Error::Input(reason.to_string())));
        if !entry.admitted {
            shared.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Drops a request's entry, counting it out of `waiting` if it never left the queue.
pub(super) fn forget(entries: &mut HashMap<RequestId, Entry>, id: RequestId, shared: &Shared) {
    if let Some(entry) = entries.remove(&id) {
        if !entry.admitted {
            shared.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

pub(super) fn publish(scheduler: &Scheduler<'_>, shared: &Shared) {
    let stats = scheduler.stats();
    match shared.stats.lock() {
        Ok(mut s) => *s = stats,
        Err(poisoned) => *poisoned.into_inner() = stats,
    }
}
