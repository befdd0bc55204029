//! The engine adapter: the only file of the server that touches the library's serving engine.
//!
//! It turns a request's prompt and [`GenOptions`] into a submission, delivers the engine's
//! events on a tokio channel, and cancels the sequence when the receiver goes away (a client
//! that disconnects) or the [`Submission`] is dropped.

use std::sync::Arc;

use candle_gemma::generate::{FinishReason, GenOptions, StepOutput};
use candle_gemma::{Model, ShardedModel};
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

/// Token counts of a finished request, and a snapshot of the engine's load: the library's own.
pub use candle_gemma::serve::{EngineStats as Stats, Usage};

/// The model a server serves: one model, or one sharded over several devices
/// (tensor parallel; the HTTP layer reads its tokenizer, template and config from rank 0).
#[derive(Debug, Clone)]
pub enum Served {
    /// One model on one device.
    Single(Arc<Model>),
    /// A model sharded over several devices, served by one scheduler per rank.
    Sharded(Arc<ShardedModel>),
}

impl Served {
    /// The model the HTTP layer reads (rank 0 of a sharded one).
    pub fn model(&self) -> &Model {
        match self {
            Served::Single(m) => m,
            Served::Sharded(m) => m.first(),
        }
    }
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

/// Every submission's whole answer, in order.
///
/// # Errors
/// The first failed answer.
pub async fn collect_all(submissions: Vec<Submission>) -> Result<Vec<Collected>, ApiError> {
    futures_util::future::try_join_all(submissions.into_iter().map(Submission::collect)).await
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
    served: Served,
}

impl EngineHandle {
    /// Starts the engine's worker over `served` (one worker thread per rank when sharded).
    ///
    /// # Errors
    /// The engine cannot start.
    pub fn start(served: Served, settings: EngineSettings) -> anyhow::Result<Self> {
        let engine = Engine::start(&served, settings)?;
        Ok(Self { engine, served })
    }

    /// The model (rank 0 of a sharded one).
    pub fn model(&self) -> &Model {
        self.served.model()
    }

    /// Queues a request; its events arrive on the returned [`Submission`].
    ///
    /// # Errors
    /// A full queue (429), a prompt longer than the context, invalid options (400), a stopped
    /// engine (503).
    pub fn submit(&self, prompt: Vec<u32>, options: GenOptions) -> Result<Submission, ApiError> {
        let limit = self.model().config().max_position_embeddings;
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

    /// `n` choices of one prompt, choice i with the seed moved by i so that sampled choices
    /// differ, all queued before any is awaited so that they decode together.
    ///
    /// # Errors
    /// As [`Engine::submit`]; the choices queued before the failing one are cancelled.
    pub fn submit_choices(
        &self,
        prompt: &[u32],
        options: &GenOptions,
        n: usize,
    ) -> Result<Vec<Submission>, ApiError> {
        (0..n.max(1))
            .map(|i| {
                let mut o = options.clone();
                o.sampling.seed = o.sampling.seed.wrapping_add(i as u64);
                self.submit(prompt.to_vec(), o)
            })
            .collect()
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

/// The library's engine, its events converted to the server's.
mod backend {
    use candle_gemma::generate::GenOptions;
    use candle_gemma::serve::{self, SchedulerConfig, SubmitError};
    use candle_gemma::Error;

    use super::super::error::ApiError;
    use super::{EngineSettings, Event, Served, Stats};

    pub use candle_gemma::serve::RequestId;

    /// The library's engine for one model or for a sharded one.
    #[derive(Debug, Clone)]
    pub enum Engine {
        Single(serve::Engine),
        Sharded(serve::ShardedEngine),
    }

    impl Engine {
        pub fn start(served: &Served, s: EngineSettings) -> anyhow::Result<Self> {
            let config = SchedulerConfig {
                max_batch: s.max_batch,
                kv_budget_bytes: s.kv_budget_bytes,
                prefill_chunk: s.prefill_chunk,
                max_queue: s.max_queue,
                prefix_cache_bytes: s.prefix_cache_bytes,
            };
            Ok(match served {
                Served::Single(m) => Self::Single(serve::Engine::start(m.clone(), config)?),
                Served::Sharded(m) => {
                    Self::Sharded(serve::ShardedEngine::start(m.clone(), config)?)
                }
            })
        }

        pub fn submit(
            &self,
            prompt: Vec<u32>,
            options: GenOptions,
            mut sink: Box<dyn FnMut(Event) -> bool + Send>,
        ) -> Result<RequestId, ApiError> {
            let sink = Box::new(move |event: serve::Event| sink(convert(event)));
            match self {
                Self::Single(e) => e.submit(prompt, options, sink),
                Self::Sharded(e) => e.submit(prompt, options, sink),
            }
            .map_err(refused)
        }

        pub fn cancel(&self, id: RequestId) {
            match self {
                Self::Single(e) => e.cancel(id),
                Self::Sharded(e) => e.cancel(id),
            }
        }

        pub fn stats(&self) -> Stats {
            match self {
                Self::Single(e) => e.stats(),
                Self::Sharded(e) => e.stats(),
            }
        }

        pub fn shutdown(&self) {
            match self {
                Self::Single(e) => e.shutdown(),
                Self::Sharded(e) => e.shutdown(),
            }
        }
    }

    fn convert(event: serve::Event) -> Event {
        match event {
            serve::Event::Started {
                prompt_tokens,
                cached_tokens,
            } => Event::Started {
                prompt_tokens,
                cached_tokens,
            },
            serve::Event::Token(step) => Event::Token(step),
            serve::Event::Done { finish, usage } => Event::Done { finish, usage },
            serve::Event::Failed(e) => {
                // The client gets the message in its stream; the operator sees it here.
                eprintln!("serve: request failed: {e}");
                Event::Failed(e.to_string())
            }
        }
    }

    /// The HTTP answer to a refused submission.
    fn refused(e: SubmitError) -> ApiError {
        match e {
            SubmitError::QueueFull { retry_after_secs } => ApiError::queue_full(retry_after_secs),
            SubmitError::PromptTooLong { tokens, limit } => ApiError::context_length(tokens, limit),
            SubmitError::ShutDown => ApiError::unavailable(),
            SubmitError::Invalid(Error::InvalidOption { field, reason }) => {
                let param = field.rsplit('.').next().unwrap_or(field);
                let param = match param {
                    "group_size" => "kv_group_size",
                    "bits" => "kv_bits",
                    p => p,
                };
                ApiError::invalid(param, format!("{field}: {reason}"))
            }
            SubmitError::Invalid(e) => ApiError::invalid("prompt", e.to_string()),
        }
    }
}
