//! [`ShardedEngine`]: the serving engine over a [`ShardedModel`], with the surface of
//! [`super::Engine`] (`submit`, `cancel`, `stats`, `shutdown`).
//!
//! Every rank runs its own [`Scheduler`] over its own shard, in lockstep, on the rank's thread
//! of [`ShardedModel::run`]. Rank 0 leads: it takes the commands received since the last step
//! (submissions, cancellations, shutdown) from the handles' channel, writes them into that
//! step's command log, sends the log to every other rank, and every rank (itself included)
//! applies the log in order and runs one [`Scheduler::step`]. The scheduler's decisions
//! (admission, prefill chunks, decode, prefix reuse) depend only on its inputs, not on time or
//! hash order, so every rank makes the same ones and calls the same forwards (which all-reduce
//! inside) together. The ranks' shards have equal K/V geometry, so
//! [`SchedulerConfig::kv_budget_bytes`] and the prefix budget count the K/V one rank holds.
//!
//! Only rank 0 holds the requests' sinks and delivers their events. A sink that returns
//! `false` becomes a cancellation in the next step's log, so every rank frees that request's
//! cache at the same step.
//!
//! Failure: a model error on any rank, or a rank that stops, ends every rank (a rank waiting
//! in an all-reduce is released by [`ShardedModel::run`]'s abort after
//! [`ShardedModel::failure_grace`]); every queued and running request gets
//! [`Event::Failed`](super::Event::Failed) and later submissions [`SubmitError::ShutDown`].
//! The group is then aborted: load the model again to serve again.

use std::cell::Cell;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};

use super::intake::{lock, Command, Intake, Shared, Sink, Sinks};
use super::request::{EngineStats, RequestId, SubmitError};
use super::scheduler::{Scheduler, SchedulerConfig};
use crate::error::{Error, Result};
use crate::generate::GenOptions;
use crate::parallel::ShardedModel;

/// One entry of a step's command log, as every rank applies it.
#[derive(Debug, Clone)]
enum Order {
    Submit {
        id: RequestId,
        prompt: Vec<u32>,
        options: Box<GenOptions>,
    },
    Cancel(RequestId),
    Shutdown,
}

/// A rank made to fail at a step (tests of the failure path).
#[derive(Debug, Clone, Copy)]
struct Fault {
    rank: usize,
    step: u64,
}

#[derive(Debug)]
struct Inner {
    model: Arc<ShardedModel>,
    intake: Intake,
    /// Each rank's scheduler figures after its last step.
    ranks: Arc<Mutex<Vec<EngineStats>>>,
}

/// A handle to the serving ranks of a [`ShardedModel`]. Clones share them; they stop on
/// [`ShardedEngine::shutdown`], once every handle is dropped and no request is left, or when
/// a rank fails.
#[derive(Debug, Clone)]
pub struct ShardedEngine {
    inner: Arc<Inner>,
}

thread_local! {
    /// Set on the thread that calls the sinks (rank 0), so that `shutdown` from a sink does
    /// not wait for itself.
    static DELIVERING: Cell<bool> = const { Cell::new(false) };
}

impl ShardedEngine {
    /// Starts a scheduler on every rank of `model` (see the module docs).
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for invalid limits; [`Error::Input`] when the thread cannot be
    /// spawned.
    pub fn start(model: Arc<ShardedModel>, config: SchedulerConfig) -> Result<Self> {
        Self::start_with(model, config, None)
    }

    fn start_with(
        model: Arc<ShardedModel>,
        config: SchedulerConfig,
        fault: Option<Fault>,
    ) -> Result<Self> {
        config.validate()?;
        let ranks = Arc::new(Mutex::new(vec![EngineStats::default(); model.world()]));
        let max_queue = config.max_queue;
        let intake = {
            let (model, ranks) = (model.clone(), ranks.clone());
            Intake::spawn(
                "candle-gemma-sharded-engine",
                max_queue,
                move |rx, shared| serve(&model, &config, rx, shared, &ranks, fault),
            )?
        };
        Ok(Self {
            inner: Arc::new(Inner {
                model,
                intake,
                ranks,
            }),
        })
    }

    /// The sharded model the engine serves.
    pub fn model(&self) -> &Arc<ShardedModel> {
        &self.inner.model
    }

    /// Queues a request, as [`super::Engine::submit`]; its events go to `sink` from rank 0's
    /// thread.
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
        inner
            .intake
            .submit(inner.model.first(), prompt, options, sink)
    }

    /// Cancels request `id` on every rank at the next step. Unknown or finished ids are
    /// ignored.
    pub fn cancel(&self, id: RequestId) {
        self.inner.intake.cancel(id);
    }

    /// Rank 0's load after its last step (`queued` counts requests accepted and not yet
    /// admitted).
    pub fn stats(&self) -> EngineStats {
        self.inner.intake.stats()
    }

    /// Every rank's scheduler figures after that rank's last step, rank order.
    pub fn rank_stats(&self) -> Vec<EngineStats> {
        lock(&self.inner.ranks).clone()
    }

    /// Stops every rank: queued and running requests get
    /// [`Event::Failed`](super::Event::Failed), later submissions [`SubmitError::ShutDown`].
    /// Waits for the ranks to exit (unless called from a sink).
    pub fn shutdown(&self) {
        self.inner.intake.shutdown(DELIVERING.with(Cell::get));
    }
}

/// The worker: runs the leader on rank 0 and a follower on every other rank until they stop,
/// then fails every request left.
fn serve(
    model: &ShardedModel,
    config: &SchedulerConfig,
    rx: Receiver<Command>,
    shared: &Shared,
    ranks: &Mutex<Vec<EngineStats>>,
    fault: Option<Fault>,
) {
    let sinks: Mutex<Sinks> = Mutex::new(Sinks::default());
    let (logs, inboxes): (Vec<_>, Vec<_>) = (1..model.world())
        .map(|_| {
            let (tx, rx) = mpsc::channel::<Vec<Order>>();
            (tx, Mutex::new(Some(rx)))
        })
        .unzip();
    let leader_parts = Mutex::new(Some((rx, logs)));
    let result = model.run(|m| -> Result<()> {
        let rank = m.rank();
        let mut scheduler = Scheduler::new(m, config.clone())?;
        let publish_rank = |s: &Scheduler<'_>| {
            if let Some(slot) = lock(ranks).get_mut(rank) {
                *slot = s.stats();
            }
        };
        if rank == 0 {
            let Some((rx, logs)) = lock(&leader_parts).take() else {
                return Err(Error::Input("rank 0 started twice".to_string()));
            };
            DELIVERING.with(|d| d.set(true));
            let led = lead(
                &mut scheduler,
                &rx,
                &logs,
                &sinks,
                shared,
                fault,
                &publish_rank,
            );
            DELIVERING.with(|d| d.set(false));
            led
        } else {
            let inbox = inboxes.get(rank - 1).and_then(|i| lock(i).take());
            let Some(inbox) = inbox else {
                return Err(Error::Input(format!("rank {rank} has no command log")));
            };
            follow(&mut scheduler, rank, &inbox, fault, &publish_rank)
        }
    });
    let reason = match result {
        Ok(_) => "the engine shut down".to_string(),
        Err(e) => format!("the engine stopped: {e}"),
    };
    shared.close();
    lock(&sinks).fail_every(shared, &reason);
}

/// Fails rank `rank` at step `step` when a test asks for it.
fn inject(fault: Option<Fault>, rank: usize, step: u64) -> Result<()> {
    match fault {
        Some(f) if f.rank == rank && f.step == step => {
            Err(Error::Input(format!("injected failure at step {step}")))
        }
        _ => Ok(()),
    }
}

/// Rank 0: gathers the commands into each step's log, sends it to the other ranks, applies
/// it, steps, and delivers the events.
fn lead(
    scheduler: &mut Scheduler<'_>,
    rx: &Receiver<Command>,
    logs: &[Sender<Vec<Order>>],
    sinks: &Mutex<Sinks>,
    shared: &Shared,
    fault: Option<Fault>,
    publish_rank: &dyn Fn(&Scheduler<'_>),
) -> Result<()> {
    let mut refused: Vec<RequestId> = Vec::new();
    let mut step = 0u64;
    loop {
        let mut commands = Vec::new();
        if scheduler.is_idle() && refused.is_empty() {
            match rx.recv() {
                Ok(c) => commands.push(c),
                // No handle is left and nothing runs: stop every rank.
                Err(_) => commands.push(Command::Shutdown),
            }
        }
        // Disconnected: no handle is left; what is queued and running finishes first.
        while let Ok(c) = rx.try_recv() {
            commands.push(c);
        }
        let mut log: Vec<Order> = refused.drain(..).map(Order::Cancel).collect();
        {
            let mut sinks = lock(sinks);
            for command in commands {
                match command {
                    Command::Submit {
                        id,
                        prompt,
                        options,
                        sink,
                    } => {
                        sinks.insert(id, sink);
                        log.push(Order::Submit {
                            id,
                            prompt,
                            options,
                        });
                    }
                    Command::Cancel(id) => {
                        sinks.forget(id, shared);
                        log.push(Order::Cancel(id));
                    }
                    Command::Shutdown => log.push(Order::Shutdown),
                }
            }
        }
        for (i, tx) in logs.iter().enumerate() {
            tx.send(log.clone()).map_err(|_| Error::Rank {
                rank: i + 1,
                reason: "the rank stopped".to_string(),
            })?;
        }
        let mut rejected = Vec::new();
        if !apply(scheduler, log, &mut rejected) {
            return Ok(());
        }
        inject(fault, 0, step)?;
        step += 1;
        let events = scheduler.try_step()?;
        let mut sinks = lock(sinks);
        for (id, e) in rejected {
            sinks.reject(id, &e, shared);
        }
        refused = sinks.deliver(events, shared);
        drop(sinks);
        shared.publish(scheduler);
        publish_rank(scheduler);
    }
}

/// Every other rank: applies each step's log as rank 0 sent it and steps.
fn follow(
    scheduler: &mut Scheduler<'_>,
    rank: usize,
    inbox: &Receiver<Vec<Order>>,
    fault: Option<Fault>,
    publish_rank: &dyn Fn(&Scheduler<'_>),
) -> Result<()> {
    let mut step = 0u64;
    // Rank 0 gone (it stopped or failed): its failure is the one reported.
    while let Ok(log) = inbox.recv() {
        if !apply(scheduler, log, &mut Vec::new()) {
            return Ok(());
        }
        inject(fault, rank, step)?;
        step += 1;
        scheduler.try_step()?;
        publish_rank(scheduler);
    }
    Ok(())
}

/// Applies a step's log to a rank's scheduler, collecting the submissions it refused; `false`
/// on shutdown.
fn apply(
    scheduler: &mut Scheduler<'_>,
    log: Vec<Order>,
    rejected: &mut Vec<(RequestId, SubmitError)>,
) -> bool {
    for order in log {
        match order {
            Order::Submit {
                id,
                prompt,
                options,
            } => {
                if let Err(e) = scheduler.submit_as(id, prompt, *options) {
                    rejected.push((id, e));
                }
            }
            Order::Cancel(id) => {
                scheduler.cancel(id);
            }
            Order::Shutdown => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests;
