//! [`ShardedModel`]: a checkpoint loaded tensor-parallel over the GPUs of one host, one
//! [`Model`] per GPU (a rank, holding its [`crate::shard::ShardPlan`] part of every weight),
//! driven by one thread per GPU inside this process.
//!
//! Every rank runs the same program on the same inputs (SPMD, as one process per GPU would):
//! [`ShardedModel::run`] hands each rank's [`Model`] to a closure on that rank's thread. The
//! layers' all-reduces leave every rank with the same residual stream, so every rank computes
//! the same logits, samples the same tokens (same seed) and drives its own caches, generator
//! or batch session in step with the others. Rank 0's results are the ones to show.
//!
//! Failure: a rank that fails to load gives [`Error::Rank`] before any communicator exists.
//! A rank that fails while running returns its error; if another rank is still running
//! [`ShardedModel::failure_grace`] later (it may be waiting in an all-reduce the failed rank
//! never joins), the group is aborted: pending all-reduces are released and every later one
//! fails, so every rank returns an error and [`ShardedModel::run`] returns [`Error::Rank`]
//! naming the rank that failed first. An aborted group cannot run again: load it again.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::kernels::ops::collective::{self, GroupHandle};
use crate::model::Model;

/// A checkpoint sharded over several GPUs of this host: one [`Model`] per rank.
#[derive(Debug)]
pub struct ShardedModel {
    ranks: Vec<Model>,
    group: GroupHandle,
    grace: Duration,
}

/// How long the other ranks may keep running after one failed before the group is aborted.
const DEFAULT_GRACE: Duration = Duration::from_secs(5);

impl ShardedModel {
    /// Loads `world` ranks, rank `r` by `load(r)` on a thread of its own, then joins them into
    /// one NCCL group and runs one all-reduce on every rank (NCCL connects lazily).
    ///
    /// # Errors
    /// [`Error::Rank`] naming the first rank (by index) that failed to load, or the group
    /// that could not be set up.
    pub(crate) fn load(world: usize, load: impl Fn(usize) -> Result<Model> + Sync) -> Result<Self> {
        let loaded: Vec<Result<Model>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let load = &load;
                    s.spawn(move || load(rank))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Input("the loading thread panicked".into())))
                })
                .collect()
        });
        let mut ranks = Vec::with_capacity(world);
        for (rank, r) in loaded.into_iter().enumerate() {
            ranks.push(r.map_err(|e| Error::Rank {
                rank,
                reason: e.to_string(),
            })?);
        }
        let devices: Vec<_> = ranks.iter().map(|m| m.device().clone()).collect();
        let (collectives, group) = collective::group(&devices).map_err(|e| Error::Rank {
            rank: 0,
            reason: e.to_string(),
        })?;
        for (rank, (model, c)) in ranks.iter_mut().zip(collectives).enumerate() {
            model.set_collective(c).map_err(|e| Error::Rank {
                rank,
                reason: e.to_string(),
            })?;
        }
        let sharded = Self {
            ranks,
            group,
            grace: DEFAULT_GRACE,
        };
        sharded.run(|m| -> Result<()> {
            let probe = Tensor::zeros(8, m.dtype(), m.device())?;
            drop(m.text_model().collective().sum(&probe)?);
            m.device().synchronize()?;
            Ok(())
        })?;
        Ok(sharded)
    }

    /// The ranks' models, rank `i` at index `i`.
    pub fn ranks(&self) -> &[Model] {
        &self.ranks
    }

    /// Rank 0's model (config, tokenizer, encode/decode).
    pub fn first(&self) -> &Model {
        &self.ranks[0]
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// How long, after a rank failed, the others may keep running before the group is aborted
    /// (5 s by default). Ranks that fail alike (the same bad input) all return well within it,
    /// and the group stays usable.
    pub fn failure_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Runs `f` on every rank at once, each on a thread of its own with that rank's [`Model`],
    /// and returns every rank's result, rank order. `f` must issue the same model calls on
    /// every rank (the same forwards, batch shapes and cache operations), as with one process
    /// per GPU.
    ///
    /// # Errors
    /// [`Error::Rank`] naming the rank that failed first (its error as text); the group is
    /// aborted when another rank was still running after [`ShardedModel::failure_grace`].
    pub fn run<T, E, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        E: std::fmt::Display + Send,
        F: Fn(&Model) -> std::result::Result<T, E> + Sync,
    {
        if self.group.failed() {
            return Err(Error::Rank {
                rank: 0,
                reason: "the group was aborted after a rank failed; load the model again"
                    .to_string(),
            });
        }
        let n = self.ranks.len();
        let (tx, rx) = mpsc::channel::<(usize, std::result::Result<T, String>)>();
        std::thread::scope(|s| {
            for (rank, model) in self.ranks.iter().enumerate() {
                let (tx, f) = (tx.clone(), &f);
                s.spawn(move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(model)));
                    let r = match r {
                        Ok(Ok(v)) => Ok(v),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err("the rank's thread panicked".to_string()),
                    };
                    let _ = tx.send((rank, r));
                });
            }
            drop(tx);
            let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
            let mut first_err: Option<(usize, String)> = None;
            let mut done = 0;
            let mut aborted = false;
            while done < n {
                let msg = if first_err.is_some() && !aborted {
                    match rx.recv_timeout(self.grace) {
                        Ok(m) => Some(m),
                        Err(RecvTimeoutError::Timeout) => {
                            self.group.abort();
                            aborted = true;
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => None,
                    }
                } else {
                    rx.recv().ok()
                };
                let Some((rank, r)) = msg else { break };
                done += 1;
                match r {
                    Ok(v) => out[rank] = Some(v),
                    Err(e) => {
                        if first_err.is_none() {
                            first_err = Some((rank, e));
                        }
                    }
                }
            }
            if let Some((rank, reason)) = first_err {
                return Err(Error::Rank { rank, reason });
            }
            out.into_iter()
                .enumerate()
                .map(|(rank, v)| {
                    v.ok_or_else(|| Error::Rank {
                        rank,
                        reason: "the rank returned no result".to_string(),
                    })
                })
                .collect()
        })
    }
}

#[cfg(test)]
mod tests;
