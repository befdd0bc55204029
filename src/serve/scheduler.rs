//! [`Scheduler`]: a request queue feeding one [`BatchSession`], step by step, with no threads
//! of its own (the [`super::Engine`] drives it from its worker; tests drive it directly).
//!
//! # Policy
//!
//! - **Admission order:** first in, first out. At the start of each [`Scheduler::step`] the
//!   oldest queued requests join the batch while the batch holds fewer than
//!   [`SchedulerConfig::max_batch`] requests and their KV reservation fits the budget. The head
//!   of the queue is never overtaken: a request that does not fit blocks the ones behind it,
//!   so a large request cannot starve.
//! - **KV budget:** each request reserves the K/V bytes its layout needs for
//!   `prompt + max_tokens` tokens ([`super::kv_bytes_for`]: the layout's real per-token size,
//!   sliding rings capped at their window). The reservations of the running requests never
//!   exceed [`SchedulerConfig::kv_budget_bytes`], except that a request reserving more than the
//!   whole budget runs alone once the batch is empty (it would otherwise wait forever). The
//!   reservation is returned when the request finishes, fails or is cancelled, and the queue
//!   head is admitted at the next step. The budget covers the running caches; the prefix store
//!   has its own budget ([`SchedulerConfig::prefix_cache_bytes`]). Growing caches allocate
//!   ahead (256-token steps, doubling), so the bytes allocated ([`EngineStats::kv_bytes`]) can
//!   exceed the reservations, by up to about 2x on full-attention layers: set the budget with
//!   that headroom.
//! - **Chunked prefill:** an admitted prompt is prefilled inside the decode steps, at most
//!   [`SchedulerConfig::prefill_chunk`] tokens per step (several joining prompts whose next
//!   chunks have equal lengths share one forward), so a long prompt delays the running streams
//!   by one chunk per step and every running stream gets one token per step. A request's
//!   own [`GenOptions::prefill_chunk`] is not used.
//! - **Prefix reuse:** on admission the prefix store is asked for the longest held prefix of
//!   the prompt in the request's cache layout (kind, bits, group size, dtype); only the rest is
//!   prefilled. A request that finishes normally leaves its cache (prompt and answer) in the
//!   store. When a prompt's prefill completes, before the request decodes, the store also
//!   takes a ring checkpoint of it ([`PrefixStore::checkpoint`]: deep copies of the sliding
//!   layers' rings only, charged to the store's budget and evicted like its entries), so that
//!   a next turn whose chat template re-renders the answer differently (Gemma 4 drops the
//!   thinking of earlier turns) still reuses this prompt, although the answer's decode has
//!   wrapped the rings past it. A store budget of 0 turns reuse off.
//! - **Queue full:** [`Scheduler::submit`] refuses a request when
//!   [`SchedulerConfig::max_queue`] requests wait ([`SubmitError::QueueFull`]).
//! - **Context:** a prompt longer than the context is refused
//!   ([`SubmitError::PromptTooLong`]); a request whose prompt and `max_tokens` exceed it
//!   stops with [`crate::FinishReason::Length`] where the context is full.
//! - **Cancellation:** [`Scheduler::cancel`] removes a queued request, or takes a running one
//!   out of the batch at once and frees its cache.

use std::collections::VecDeque;

use super::budget::kv_bytes_for;
use super::prefix::{LayoutKey, PrefixStore};
use super::request::{EngineStats, Event, RequestId, SubmitError, Usage};
use crate::error::{Error, Result};
use crate::generate::{BatchSession, GenOptions, SeqId};
use crate::model::Model;

/// Limits of a [`Scheduler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests in the batch at once (prefilling or decoding).
    pub max_batch: usize,
    /// K/V bytes the running requests may reserve together.
    pub kv_budget_bytes: usize,
    /// Most prompt tokens prefilled per step.
    pub prefill_chunk: usize,
    /// Most requests waiting in the queue.
    pub max_queue: usize,
    /// Byte budget of the prefix store (0: no prefix reuse).
    pub prefix_cache_bytes: usize,
}

impl Default for SchedulerConfig {
    /// 32 requests per batch, 8 GiB of KV, prefill chunks of 512 tokens, 256 queued requests,
    /// a 2 GiB prefix store.
    fn default() -> Self {
        Self {
            max_batch: 32,
            kv_budget_bytes: 8 << 30,
            prefill_chunk: 512,
            max_queue: 256,
            prefix_cache_bytes: 2 << 30,
        }
    }
}

impl SchedulerConfig {
    /// Checks the limits.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a zero `max_batch` or `prefill_chunk`.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("max_batch", self.max_batch),
            ("prefill_chunk", self.prefill_chunk),
        ] {
            if value == 0 {
                return Err(Error::InvalidOption {
                    field,
                    reason: "must be at least 1".to_string(),
                });
            }
        }
        Ok(())
    }
}

/// A request waiting for admission.
#[derive(Debug)]
struct Queued {
    id: RequestId,
    prompt: Vec<u32>,
    options: GenOptions,
    reserve: usize,
}

/// A request in the batch.
#[derive(Debug)]
struct Running {
    id: RequestId,
    seq: SeqId,
    reserve: usize,
    usage: Usage,
}

/// A request queue feeding one batch; see the module docs for the policy.
#[derive(Debug)]
pub struct Scheduler<'m> {
    model: &'m Model,
    config: SchedulerConfig,
    queue: VecDeque<Queued>,
    session: BatchSession<'m>,
    running: Vec<Running>,
    /// Sum of the running requests' reservations.
    reserved: usize,
    prefix: Option<PrefixStore>,
    /// Events produced outside a step (requests failed by a reset), delivered by the next.
    deferred: Vec<(RequestId, Event)>,
    next_id: u64,
}

impl<'m> Scheduler<'m> {
    /// An idle scheduler over `model`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for invalid limits.
    pub fn new(model: &'m Model, config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let mut session = BatchSession::new(model, GenOptions::default());
        session.set_prefill_chunk(config.prefill_chunk);
        let prefix =
            (config.prefix_cache_bytes > 0).then(|| PrefixStore::new(config.prefix_cache_bytes));
        session.set_keep_finished(prefix.is_some());
        Ok(Self {
            model,
            config,
            queue: VecDeque::new(),
            session,
            running: Vec::new(),
            reserved: 0,
            prefix,
            deferred: Vec::new(),
            next_id: 0,
        })
    }

    /// The limits.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request.
    ///
    /// # Errors
    /// [`SubmitError::Invalid`] for invalid options ([`GenOptions::validate`]), an empty prompt
    /// or ids outside the vocabulary; [`SubmitError::PromptTooLong`];
    /// [`SubmitError::QueueFull`].
    pub fn submit(
        &mut self,
        prompt: Vec<u32>,
        options: GenOptions,
    ) -> std::result::Result<RequestId, SubmitError> {
        let id = RequestId(self.next_id);
        self.submit_as(id, prompt, options)?;
        self.next_id += 1;
        Ok(id)
    }

    /// [`Scheduler::submit`] under an id chosen by the caller (the engine numbers requests on
    /// the submitting thread).
    pub(crate) fn submit_as(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        options: GenOptions,
    ) -> std::result::Result<(), SubmitError> {
        check_request(self.model, &prompt, &options)?;
        if self.queue.len() >= self.config.max_queue {
            return Err(SubmitError::QueueFull {
                retry_after_secs: 1,
            });
        }
        let context = self.model.config().max_position_embeddings;
        let tokens = prompt.len().saturating_add(options.max_tokens).min(context);
        let reserve = kv_bytes_for(self.model, &options.cache, tokens);
        self.queue.push_back(Queued {
            id,
            prompt,
            options,
            reserve,
        });
        Ok(())
    }

    /// Removes request `id`: from the queue, or from the batch (its cache freed and its
    /// reservation returned). Returns whether it was queued or running.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.queue.iter().position(|q| q.id == id) {
            self.queue.remove(i);
            return true;
        }
        let Some(i) = self.running.iter().position(|r| r.id == id) else {
            return false;
        };
        let r = self.running.remove(i);
        self.reserved -= r.reserve;
        if self.session.cancel(r.seq).is_err() {
            // The batch cache could not give the sequence back: start the batch over rather
            // than decode with a cache that no longer matches its sequences.
            let failed = self.fail_all("the batch was reset after a failed cancellation");
            self.deferred.extend(failed);
        }
        true
    }

    /// Whether nothing is queued or running and no event waits for a step.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.session.is_empty() && self.deferred.is_empty()
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Requests in the batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// The load: queue, batch, live and reserved K/V bytes, prefix store.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            queued: self.queue.len(),
            running: self.running.len(),
            kv_bytes: self.session.kv_bytes(),
            reserved_bytes: self.reserved,
            prefix_bytes: self.prefix.as_ref().map_or(0, PrefixStore::bytes),
            prefix_entries: self.prefix.as_ref().map_or(0, PrefixStore::len),
        }
    }

    /// Admits what fits, then runs one batch step (one token for every decoding request, one
    /// prefill chunk for the joining ones). Returns every request's events of this step, in
    /// order.
    ///
    /// A model error in the batched decode fails every running request (each gets
    /// [`Event::Failed`]) and leaves the scheduler ready for the queued ones.
    pub fn step(&mut self) -> Vec<(RequestId, Event)> {
        let mut events = Vec::new();
        if let Err(e) = self.advance(&mut events) {
            let reason = e.to_string();
            events.extend(self.fail_all(&reason));
        }
        events
    }

    /// [`Scheduler::step`], except that a model error in the batched decode is returned
    /// rather than failing the running requests (the sharded engine stops every rank on it).
    pub(crate) fn try_step(&mut self) -> Result<Vec<(RequestId, Event)>> {
        let mut events = Vec::new();
        self.advance(&mut events)?;
        Ok(events)
    }

    /// One step's work, its events appended to `events`; stops at a batched-decode error.
    fn advance(&mut self, events: &mut Vec<(RequestId, Event)>) -> Result<()> {
        events.append(&mut self.deferred);
        self.admit(events);
        if self.session.is_empty() {
            return Ok(());
        }
        let model = self.model;
        let stepped = match self.prefix.as_mut() {
            Some(store) => self.session.step_with(&mut |prompt, options, cache| {
                let layout = LayoutKey::for_model(model, &options.cache);
                // A checkpoint the store cannot take only loses a future reuse.
                let _ = store.checkpoint(prompt, &layout, cache);
            }),
            None => self.session.step(),
        };
        let steps = stepped?;
        for (seq, step) in steps {
            let Some(i) = self.running.iter().position(|r| r.seq == seq) else {
                continue;
            };
            self.running[i].usage.completion_tokens += 1;
            let id = self.running[i].id;
            let finish = step.finish;
            events.push((id, Event::Token(step)));
            if let Some(finish) = finish {
                let r = self.running.remove(i);
                self.reserved -= r.reserve;
                events.push((
                    id,
                    Event::Done {
                        finish,
                        usage: r.usage,
                    },
                ));
            }
        }
        for (seq, error) in self.session.take_failed() {
            if let Some(i) = self.running.iter().position(|r| r.seq == seq) {
                let r = self.running.remove(i);
                self.reserved -= r.reserve;
                events.push((r.id, Event::Failed(error)));
            }
        }
        let finished = self.session.take_finished();
        if let Some(store) = self.prefix.as_mut() {
            for f in finished {
                let layout = LayoutKey::for_model(self.model, &f.options.cache);
                // A store that cannot take an entry only loses a future reuse.
                let _ = store.insert(f.tokens, layout, f.cache);
            }
        }
        Ok(())
    }

    /// Moves queued requests into the batch while they fit (see the module docs).
    fn admit(&mut self, events: &mut Vec<(RequestId, Event)>) {
        while let Some(head) = self.queue.front() {
            let full = self.running.len() >= self.config.max_batch;
            let over = self.reserved + head.reserve > self.config.kv_budget_bytes;
            if full || (over && !self.running.is_empty()) {
                break;
            }
            let Some(q) = self.queue.pop_front() else {
                break;
            };
            let layout = LayoutKey::for_model(self.model, &q.options.cache);
            let prefix = match self.prefix.as_mut() {
                // A failed lookup is a miss.
                Some(store) => store.lookup(&q.prompt, &layout).unwrap_or(None),
                None => None,
            };
            let cached_tokens = prefix.as_ref().map_or(0, |p| p.1);
            let prompt_tokens = q.prompt.len();
            match self.session.enqueue(q.prompt, q.options, prefix) {
                Ok(seq) => {
                    self.reserved += q.reserve;
                    self.running.push(Running {
                        id: q.id,
                        seq,
                        reserve: q.reserve,
                        usage: Usage {
                            prompt_tokens,
                            completion_tokens: 0,
                            cached_tokens,
                        },
                    });
                    events.push((
                        q.id,
                        Event::Started {
                            prompt_tokens,
                            cached_tokens,
                        },
                    ));
                }
                Err(e) => events.push((q.id, Event::Failed(e))),
            }
        }
    }

    /// Fails every running request and starts an empty batch; the queue stays.
    fn fail_all(&mut self, reason: &str) -> Vec<(RequestId, Event)> {
        let mut session = BatchSession::new(self.model, GenOptions::default());
        session.set_prefill_chunk(self.config.prefill_chunk);
        session.set_keep_finished(self.prefix.is_some());
        self.session = session;
        self.reserved = 0;
        self.running
            .drain(..)
            .map(|r| {
                let error = Error::Input(format!("batch step failed: {reason}"));
                (r.id, Event::Failed(error))
            })
            .collect()
    }
}

/// The checks [`Scheduler::submit`] makes before queueing (also run by the engine on the
/// submitting thread, so a bad request is refused at once).
pub(crate) fn check_request(
    model: &Model,
    prompt: &[u32],
    options: &GenOptions,
) -> std::result::Result<(), SubmitError> {
    options.validate().map_err(SubmitError::Invalid)?;
    if prompt.is_empty() {
        return Err(SubmitError::Invalid(Error::Input(
            "the prompt is empty".to_string(),
        )));
    }
    let vocab_size = model.config().vocab_size;
    if let Some((position, &id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab_size)
    {
        return Err(SubmitError::Invalid(Error::TokenOutOfVocab {
            id,
            position,
            vocab_size,
        }));
    }
    let limit = model.config().max_position_embeddings;
    if prompt.len() > limit {
        return Err(SubmitError::PromptTooLong {
            tokens: prompt.len(),
            limit,
        });
    }
    Ok(())
}
