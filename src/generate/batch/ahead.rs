//! Batched decoding one step ahead of the host ([`crate::GenOptions::lookahead`]).
//!
//! Where every live sequence's token is picked on the device (plain greedy decoding, or a
//! tempered draw the device makes, filtered or not), a step's picks stay on the device as the next step's
//! input: the host enqueues the step that runs them through the model, and the picks after
//! it, before it waits for their copy to the host, so the device has the next step queued
//! while the host hands out tokens, detokenizes and checks stops.
//!
//! A step ahead runs only while the batch is as it was when its tokens were picked. After a
//! sequence joins, finishes or is cancelled, the picks in flight are handed out to the
//! sequences still live and the batch restarts from the host's tokens; a sequence whose last
//! token was run through the model ahead has that token in its cache too (as with
//! [`crate::Generator`]). No step is run ahead for a batch in which a sequence is at its last
//! token, nor past the context. The tokens are those of decoding without it.

use candle_core::Tensor;

use super::sequence::{Picked, Sequence};
use super::{BatchSession, SeqId};
use crate::error::{Error, Result};
use crate::generate::choose::accept_device_pick;
use crate::generate::sampling::DeviceDraw;
use crate::generate::types::StepOutput;
use crate::kernels::ops::argmax::{pick_rows, IdReadback, PendingIds};

/// Tokens picked on the device for the live sequences, neither handed out nor run through the
/// model yet.
#[derive(Debug)]
pub(super) struct Ahead {
    /// The sequences they were picked for, in batch order.
    rows: Vec<SeqId>,
    /// `[rows, 1]` u32.
    ids: Tensor,
    pending: PendingIds,
}

impl<'m> BatchSession<'m> {
    /// One batched decode step of the live sequences: one token each, handed out.
    pub(super) fn decode(&mut self, out: &mut Vec<(SeqId, StepOutput)>) -> Result<()> {
        let started = std::time::Instant::now();
        let runs = self.runs_ahead();
        match self.ahead.take() {
            Some(a) if runs && self.live.iter().map(|s| s.id).eq(a.rows.iter().copied()) => {
                self.advance(a, out)?;
            }
            Some(a) => {
                // The batch changed since these were picked: hand them out, then start again
                // from the host's tokens (sequences that just joined get theirs next step).
                self.hand_out(a, false, out)?;
                if runs && !self.live.is_empty() {
                    let logits = self.forward_last()?;
                    self.ahead = Some(self.pick_on_device(&logits, 0)?);
                }
            }
            None => {
                let logits = self.forward_last()?;
                if runs {
                    let a = self.pick_on_device(&logits, 0)?;
                    self.advance(a, out)?;
                } else {
                    let tokens = super::pick_tokens(&logits, &mut self.live)?;
                    self.emit_rows(tokens.into_iter().map(Some).collect(), false, out)?;
                }
            }
        }
        self.decode_secs += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Whether this step may run ahead: a CUDA device that takes ids it picked, and live
    /// sequences that all pick their tokens there ([`Sequence::runs_ahead`]).
    fn runs_ahead(&mut self) -> bool {
        if self.live.is_empty() || !self.live.iter().all(Sequence::runs_ahead) {
            return false;
        }
        if self.readback.is_none() && self.model.text_model().takes_device_ids() {
            self.readback = IdReadback::new(self.model.device());
        }
        self.readback.is_some()
    }

    /// Runs every live sequence's last token (known on the host) through the model.
    fn forward_last(&mut self) -> Result<Tensor> {
        let cache = self
            .cache
            .as_mut()
            .ok_or_else(|| Error::Input("live sequences without a batch cache".to_string()))?;
        let batch: Vec<Vec<u32>> = self.live.iter().map(|s| vec![s.last]).collect();
        self.model.forward(&batch, cache)
    }

    /// Enqueues the step that runs `a`'s tokens through the model and picks the tokens after
    /// them (unless a sequence is at its last token or the context is full), then hands `a`'s
    /// tokens out.
    fn advance(&mut self, a: Ahead, out: &mut Vec<(SeqId, StepOutput)>) -> Result<()> {
        let cache = self
            .cache
            .as_mut()
            .ok_or_else(|| Error::Input("live sequences without a batch cache".to_string()))?;
        let max = self.model.config().max_position_embeddings;
        let fits = cache.offsets().iter().all(|&o| o < max);
        let next = if fits && self.live.iter().all(Sequence::wants_more_after_next) {
            let logits = self.model.text_model().forward_device_ids(&a.ids, cache)?;
            Some(self.pick_on_device(&logits, 1)?)
        } else {
            None
        };
        let forwarded = next.is_some();
        self.hand_out(a, forwarded, out)?;
        self.ahead = next;
        Ok(())
    }

    /// Picks each live sequence's token from `logits` `[live, vocab]` on the device (its argmax,
    /// or its draw `skip` draws past the next one its sampler makes) and starts their copy.
    fn pick_on_device(&mut self, logits: &Tensor, skip: u64) -> Result<Ahead> {
        let rows = self.live.len();
        let unavailable = || Error::Input("no device pick for a batch decoding ahead".to_string());
        let picks: Vec<Option<DeviceDraw>> = self
            .live
            .iter()
            .map(|s| {
                let pick = s.device_pick().ok_or_else(unavailable)?;
                Ok(pick.map(|d| DeviceDraw {
                    draw: d.draw + skip,
                    ..d
                }))
            })
            .collect::<Result<_>>()?;
        let ids = pick_rows(logits, &picks)?.ok_or_else(unavailable)?;
        let ids = ids.reshape((rows, 1))?;
        let readback = self.readback.as_mut().ok_or_else(unavailable)?;
        let pending = readback.start(&ids)?;
        Ok(Ahead {
            rows: self.live.iter().map(|s| s.id).collect(),
            ids,
            pending,
        })
    }

    /// Waits for `a`'s copy and hands each token to its sequence if it is still live
    /// (`forwarded`: a step ahead already ran it through the model).
    fn hand_out(
        &mut self,
        a: Ahead,
        forwarded: bool,
        out: &mut Vec<(SeqId, StepOutput)>,
    ) -> Result<()> {
        let readback = self
            .readback
            .as_mut()
            .ok_or_else(|| Error::Input("tokens picked ahead without a readback".to_string()))?;
        let ids = readback.finish(a.pending)?;
        let tokens: Vec<Option<Picked>> = self
            .live
            .iter_mut()
            .map(|s| {
                let row = a.rows.iter().position(|&id| id == s.id)?;
                let token = *ids.get(row)?;
                accept_device_pick(s, token);
                Some(Picked {
                    token,
                    logprobs: None,
                })
            })
            .collect();
        self.emit_rows(tokens, forwarded, out)
    }

    /// Hands each live sequence its token (`None`: none this step), then lets the finished
    /// ones leave the batch.
    pub(super) fn emit_rows(
        &mut self,
        tokens: Vec<Option<Picked>>,
        forwarded: bool,
        out: &mut Vec<(SeqId, StepOutput)>,
    ) -> Result<()> {
        let mut done = Vec::new();
        for (i, (seq, token)) in self.live.iter_mut().zip(tokens).enumerate() {
            let Some(token) = token else {
                continue;
            };
            let step = seq.emit(token)?;
            seq.last_forwarded = forwarded;
            if step.finish.is_some() {
                done.push(i);
            }
            out.push((seq.id, step));
        }
        let mut leaving = Vec::with_capacity(done.len());
        if let Some(cache) = self.cache.as_mut() {
            for &i in done.iter().rev() {
                leaving.push((self.live.remove(i), cache.remove_sequence(i)?));
            }
        }
        if self.live.is_empty() {
            self.cache = None;
        }
        for (seq, single) in leaving.into_iter().rev() {
            self.retire(seq, single);
        }
        Ok(())
    }
}
