//! The engine adapter: the only file of the server that touches the library's serving engine.
//!
//! It turns a request's prompt and [`GenOptions`] into a submission, delivers the engine's
//! events on a tokio channel, and cancels the sequence when the receiver goes away (a client
//! that disconnects) or the [`Submission`] is dropped.

use std::sync::Arc;

use candle_gemma::generate::{FinishReason, GenOptions, StepOutput};
use candle_gemma::Model;
use tokio::sync::mpsc;

use super::error::ApiError;

/// What the engine reports about one request, in order: `Started`, `Token`s, then `Done` or
/// `Failed`.
#[derive(Debug)]
pub enum Event {
    /// The request left the queue: its prompt length and how many prompt tokens were reused.
    Started {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Prompt tokens served from the prefix store.
        cached_tokens: usize,
    },
    /// One generated token.
    Token(StepOutput),
    /// The request finished.
    Done {
        /// Why it finished.
        finish: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The request failed inside the engine.
    Failed(String),
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix store.
    pub cached_tokens: usize,
}

/// A snapshot of the engine's load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Requests waiting for admission.
    pub queued: usize,
    /// Requests in the batch.
    pub running: usize,
    /// KV bytes of the running sequences' caches.
    pub kv_bytes: usize,
    /// Bytes held by the prefix store.
    pub prefix_bytes: usize,
    /// Entries of the prefix store.
    pub prefix_entries: usize,
}

/// The engine settings the server passes through.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// Most sequences decoded together.
    pub max_batch: usize,
    /// KV memory budget of the running sequences, bytes.
    pub kv_budget_bytes: usize,
    /// Most requests waiting for admission; beyond it a submission is refused.
    pub max_queue: usize,
    /// Prompt tokens prefilled per step.
    pub prefill_chunk: usize,
    /// Byte budget of the prefix store (0 turns prefix reuse off).
    pub prefix_cache_bytes: usize,
}

/// One submitted request: its events, cancelled when dropped.
#[derive(Debug)]
pub struct Submission {
    /// The engine's events for this request.
    pub events: mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
}

/// A whole answer, for the non-streaming responses.
#[derive(Debug, Clone)]
pub struct Collected {
    /// Every generated step, in order.
    pub steps: Vec<StepOutput>,
    /// Why it finished.
    pub finish: FinishReason,
    /// Token counts.
    pub usage: Usage,
}

impl Submission {
    /// Marks the request complete, so dropping it cancels nothing.
    pub fn complete(&mut self) {
        self.guard.armed = false;
    }

    /// Waits for the whole answer.
    ///
    /// # Errors
    /// 500 when the engine fails or stops before the answer is done.
    pub async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut steps = Vec::new();
        while let Some(event) = self.events.recv().await {
            match event {
                Event::Started { .. } => {}
                Event::Token(step) => steps.push(step),
                Event::Done { finish, usage } => {
                    self.complete();
                    return Ok(Collected {
                        steps,
                        finish,
                        usage,
                    });
                }
                Event::Failed(message) => {
                    self.complete();
                    return Err(ApiError::internal(message));
                }
            }
        }
        self.complete();
        Err(ApiError::unavailable())
    }
}

#[derive(Debug)]
struct CancelOnDrop {
    engine: Engine,
    id: RequestId,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.engine.cancel(self.id);
        }
    }
}

use backend::{Engine, RequestId};

/// The serving engine behind the HTTP layer.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    engine: Engine,
    model: Arc<Model>,
}

impl EngineHandle {
    /// Starts the engine's worker over `model`.
    ///
    /// # Errors
    /// The engine cannot start.
    pub fn start(model: Arc<Model>, settings: EngineSettings) -> anyhow::Result<Self> {
        let engine = Engine::start(model.clone(), settings)?;
        Ok(Self { engine, model })
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Queues a request; its events arrive on the returned [`Submission`].
    ///
    /// # Errors
    /// A full queue (429), a prompt longer than the context, invalid options (400), a stopped
    /// engine (503).
    pub fn submit(&self, prompt: Vec<u32>, options: GenOptions) -> Result<Submission, ApiError> {
        let limit = self.model.config().max_position_embeddings;
        if prompt.len() >= limit {
            return Err(ApiError::context_length(prompt.len(), limit));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let sink = Box::new(move |event: Event| tx.send(event).is_ok());
        let id = self.engine.submit(prompt, options, sink)?;
        Ok(Submission {
            events: rx,
            guard: CancelOnDrop {
                engine: self.engine.clone(),
                id,
                armed: true,
            },
        })
    }

    /// The engine's load.
    pub fn stats(&self) -> Stats {
        self.engine.stats()
    }

    /// Stops the worker; queued and running requests end.
    pub fn shutdown(&self) {
        self.engine.shutdown();
    }
}

/// A sequential stand-in engine: one request at a time through a `Generator`.
mod backend {
    use std::collections::{HashSet, VecDeque};
    use std::sync::{Arc, Condvar, Mutex};

    use candle_gemma::generate::{FinishReason, GenOptions};
    use candle_gemma::Model;

    use super::super::error::ApiError;
    use super::{EngineSettings, Event, Stats, Usage};

    pub type RequestId = u64;
    type Sink = Box<dyn FnMut(Event) -> bool + Send>;

    struct Job {
        id: RequestId,
        prompt: Vec<u32>,
        options: GenOptions,
        sink: Sink,
    }

    #[derive(Default)]
    struct Shared {
        queue: VecDeque<Job>,
        cancelled: HashSet<RequestId>,
        next_id: RequestId,
        running: usize,
        stopped: bool,
    }

    #[derive(Clone)]
    pub struct Engine {
        shared: Arc<(Mutex<Shared>, Condvar)>,
        max_queue: usize,
    }

    impl std::fmt::Debug for Engine {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Engine").finish_non_exhaustive()
        }
    }

    impl Engine {
        pub fn start(model: Arc<Model>, settings: EngineSettings) -> anyhow::Result<Self> {
            let engine = Self {
                shared: Arc::new((Mutex::new(Shared::default()), Condvar::new())),
                max_queue: settings.max_queue,
            };
            let worker = engine.clone();
            std::thread::spawn(move || worker.run(&model));
            Ok(engine)
        }

        pub fn submit(
            &self,
            prompt: Vec<u32>,
            options: GenOptions,
            sink: Sink,
        ) -> Result<RequestId, ApiError> {
            let (lock, cv) = &*self.shared;
            let mut s = lock.lock().map_err(|_| ApiError::unavailable())?;
            if s.stopped {
                return Err(ApiError::unavailable());
            }
            if s.queue.len() >= self.max_queue {
                return Err(ApiError::queue_full(1));
            }
            s.next_id += 1;
            let id = s.next_id;
            s.queue.push_back(Job {
                id,
                prompt,
                options,
                sink,
            });
            cv.notify_one();
            Ok(id)
        }

        pub fn cancel(&self, id: RequestId) {
            if let Ok(mut s) = self.shared.0.lock() {
                s.cancelled.insert(id);
            }
        }

        pub fn stats(&self) -> Stats {
            let s = match self.shared.0.lock() {
                Ok(s) => s,
                Err(_) => return Stats::default(),
            };
            Stats {
                queued: s.queue.len(),
                running: s.running,
                ..Stats::default()
            }
        }

        pub fn shutdown(&self) {
            if let Ok(mut s) = self.shared.0.lock() {
                s.stopped = true;
                s.queue.clear();
            }
            self.shared.1.notify_all();
        }

        fn next_job(&self) -> Option<Job> {
            let (lock, cv) = &*self.shared;
            let mut s = lock.lock().ok()?;
            loop {
                if s.stopped {
                    return None;
                }
                if let Some(job) = s.queue.pop_front() {
                    s.running = 1;
                    return Some(job);
                }
                s = cv.wait(s).ok()?;
            }
        }

        fn is_cancelled(&self, id: RequestId) -> bool {
            self.shared
                .0
                .lock()
                .map(|s| s.cancelled.contains(&id) || s.stopped)
                .unwrap_or(true)
        }

        fn run(&self, model: &Model) {
            while let Some(mut job) = self.next_job() {
                self.run_job(model, &mut job);
                if let Ok(mut s) = self.shared.0.lock() {
                    s.running = 0;
                    s.cancelled.remove(&job.id);
                }
            }
        }

        fn run_job(&self, model: &Model, job: &mut Job) {
            let prompt_tokens = job.prompt.len();
            if !(job.sink)(Event::Started {
                prompt_tokens,
                cached_tokens: 0,
            }) {
                return;
            }
            let mut generator = model.generator(job.options.clone());
            let mut stream = match generator.stream(&job.prompt) {
                Ok(s) => s,
                Err(e) => {
                    (job.sink)(Event::Failed(e.to_string()));
                    return;
                }
            };
            let mut completion_tokens = 0;
            for step in stream.by_ref() {
                let step = match step {
                    Ok(s) => s,
                    Err(e) => {
                        (job.sink)(Event::Failed(e.to_string()));
                        return;
                    }
                };
                completion_tokens += 1;
                let finish = step.finish;
                if !(job.sink)(Event::Token(step)) || self.is_cancelled(job.id) {
                    return;
                }
                if let Some(finish) = finish {
                    (job.sink)(Event::Done {
                        finish,
                        usage: Usage {
                            prompt_tokens,
                            completion_tokens,
                            cached_tokens: 0,
                        },
                    });
                    return;
                }
            }
            (job.sink)(Event::Done {
                finish: FinishReason::Length,
                usage: Usage {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens: 0,
                },
            });
        }
    }
}
