//! What [`super::Engine`] and [`super::ShardedEngine`] share, written once: the handles' side
//! of a request ([`Intake`]: checks, the queue bound, request ids, the command channel to the
//! worker thread, the published figures, shutdown) and the worker's book of the requests'
//! sinks ([`Sinks`]: delivering a step's events, counting requests out of the queue, failing
//! what is left).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{JoinHandle, ThreadId};

use super::request::{EngineStats, Event, RequestId, SubmitError};
use super::scheduler::{check_request, Scheduler};
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
        /// Boxed: the options are most of a command's size.
        options: Box<GenOptions>,
        sink: Sink,
    },
    Cancel(RequestId),
    Shutdown,
}

/// Locks, taking a poisoned lock's value as it is: a sink that panicked leaves no half-made
/// update behind these locks.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the handles and the worker share.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// The scheduler's figures after the worker's last step.
    stats: Mutex<EngineStats>,
    /// Requests accepted by `submit` and not yet admitted to the batch (or dropped).
    waiting: AtomicUsize,
    shut: AtomicBool,
}

impl Shared {
    /// Publishes `scheduler`'s figures after its step.
    pub(super) fn publish(&self, scheduler: &Scheduler<'_>) {
        *lock(&self.stats) = scheduler.stats();
    }

    /// Refuses every later submission.
    pub(super) fn close(&self) {
        self.shut.store(true, Ordering::Release);
    }

    /// Counts one request out of the queue.
    fn left_queue(&self) {
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The handles' side of an engine: the command channel to its worker thread and what the
/// worker publishes.
#[derive(Debug)]
pub(super) struct Intake {
    tx: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
    worker_id: ThreadId,
    next_id: AtomicU64,
    max_queue: usize,
}

impl Intake {
    /// Starts the worker thread `name`, running `work` over the commands the handles send.
    ///
    /// # Errors
    /// [`Error::Input`] when the thread cannot be spawned.
    pub(super) fn spawn<F>(name: &str, max_queue: usize, work: F) -> Result<Self>
    where
        F: FnOnce(Receiver<Command>, &Shared) + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(name.to_string())
                .spawn(move || work(rx, &shared))
                .map_err(|e| Error::Input(format!("cannot start the engine thread: {e}")))?
        };
        Ok(Self {
            tx: Mutex::new(tx),
            shared,
            worker_id: worker.thread().id(),
            worker: Mutex::new(Some(worker)),
            next_id: AtomicU64::new(0),
            max_queue,
        })
    }

    /// Checks a request against `model`, reserves a queue place and sends it to the worker.
    ///
    /// # Errors
    /// [`SubmitError::Invalid`], [`SubmitError::PromptTooLong`], [`SubmitError::QueueFull`]
    /// when `max_queue` requests wait, [`SubmitError::ShutDown`].
    pub(super) fn submit(
        &self,
        model: &Model,
        prompt: Vec<u32>,
        options: GenOptions,
        sink: Sink,
    ) -> std::result::Result<RequestId, SubmitError> {
        if self.shared.shut.load(Ordering::Acquire) {
            return Err(SubmitError::ShutDown);
        }
        check_request(model, &prompt, &options)?;
        let max = self.max_queue;
        self.shared
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < max).then_some(w + 1)
            })
            .map_err(|_| SubmitError::QueueFull {
                retry_after_secs: 1,
            })?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let sent = self.send(Command::Submit {
            id,
            prompt,
            options: Box::new(options),
            sink,
        });
        if !sent {
            self.shared.left_queue();
            return Err(SubmitError::ShutDown);
        }
        Ok(id)
    }

    /// Asks the worker to cancel `id` at its next step.
    pub(super) fn cancel(&self, id: RequestId) {
        self.send(Command::Cancel(id));
    }

    /// The worker's last published figures, with `queued` counting the requests accepted and
    /// not yet admitted.
    pub(super) fn stats(&self) -> EngineStats {
        let mut stats = *lock(&self.shared.stats);
        stats.queued = self.shared.waiting.load(Ordering::Acquire);
        stats
    }

    /// Closes the engine and asks the worker to stop, then waits for it to exit, unless
    /// called on the worker thread or `delivering` (from a sink, which the worker calls).
    pub(super) fn shutdown(&self, delivering: bool) {
        self.shared.close();
        self.send(Command::Shutdown);
        if delivering || std::thread::current().id() == self.worker_id {
            return;
        }
        let handle = lock(&self.worker).take();
        if let Some(h) = handle {
            // A worker that panicked has nothing more to report.
            let _ = h.join();
        }
    }

    /// Sends a command; `false` when the worker is gone.
    fn send(&self, command: Command) -> bool {
        lock(&self.tx).send(command).is_ok()
    }
}

/// A request the worker knows.
struct Entry {
    sink: Sink,
    /// Whether it left the queue (counted out of `waiting`).
    admitted: bool,
}

/// The worker's book of the requests it knows, by id.
#[derive(Default)]
pub(super) struct Sinks {
    entries: HashMap<RequestId, Entry>,
}

impl Sinks {
    /// Records a submitted request's sink.
    pub(super) fn insert(&mut self, id: RequestId, sink: Sink) {
        self.entries.insert(
            id,
            Entry {
                sink,
                admitted: false,
            },
        );
    }

    /// Fails request `id`, which the scheduler refused, and forgets it.
    pub(super) fn reject(&mut self, id: RequestId, error: &SubmitError, shared: &Shared) {
        if let Some(mut entry) = self.entries.remove(&id) {
            if !entry.admitted {
                shared.left_queue();
            }
            (entry.sink)(Event::Failed(Error::Input(error.to_string())));
        }
    }

    /// Hands a step's events to their sinks, in order, and forgets the requests that finished
    /// or whose sink refused an event. Returns the refused ones, for the scheduler to cancel.
    pub(super) fn deliver(
        &mut self,
        events: Vec<(RequestId, Event)>,
        shared: &Shared,
    ) -> Vec<RequestId> {
        let mut refused = Vec::new();
        for (id, event) in events {
            let Some(entry) = self.entries.get_mut(&id) else {
                continue;
            };
            let last = matches!(event, Event::Done { .. } | Event::Failed(_));
            if matches!(event, Event::Started { .. }) && !entry.admitted {
                entry.admitted = true;
                shared.left_queue();
            }
            if !(entry.sink)(event) && !last {
                refused.push(id);
            }
            if last {
                self.forget(id, shared);
            }
        }
        for &id in &refused {
            self.forget(id, shared);
        }
        refused
    }

    /// Drops a request's entry, counting it out of `waiting` if it never left the queue.
    pub(super) fn forget(&mut self, id: RequestId, shared: &Shared) {
        if let Some(entry) = self.entries.remove(&id) {
            if !entry.admitted {
                shared.left_queue();
            }
        }
    }

    /// Fails and forgets every request.
    pub(super) fn fail_every(&mut self, shared: &Shared, reason: &str) {
        for (_, mut entry) in self.entries.drain() {
            (entry.sink)(Event::Failed(Error::Input(reason.to_string())));
            if !entry.admitted {
                shared.left_queue();
            }
        }
    }
}
