//! Batched decoding one step ahead of the host ([`crate::GenOptions::lookahead`]).
//!
//! Where every live sequence's token is picked on the device (plain greedy decoding, or a
//! tempered draw the device makes, filtered or not), a step's picks stay on the device as the next step's
//! input: the host enqueues the step that runs them through the model, and the picks after
//! it, before it waits for their copy to the host, so the device has the next step queued
//! while the host hands out tokens, detokenizes and checks stops.
//!
//! The batch may change between steps and still run ahead: sequences that finish or are
//! cancelled leave (the picks of those still live are gathered on the device), and sequences
//! that join are appended with the token the host picked for them after their prefill. Only a
//! batch in another order, or a sequence whose token the device cannot pick, hands the picks
//! in flight out and restarts from the host's tokens. A sequence whose last token was run
//! through the model ahead (a stop the host saw after the step ahead was queued, or its
//! last token by budget run with the others) has that token in its cache too (as with
//! [`crate::Generator`]). No step is run ahead past the context, nor when no sequence wants a
//! token after its next one. The tokens are those of decoding without it.

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
    /// The sequences they were picked for, in the readback's order.
    rows: Vec<SeqId>,
    /// `[live, 1]` u32: the next step's input, in the batch's order.
    ids: Tensor,
    pending: PendingIds,
}

impl<'m> BatchSession<'m> {
    /// One batched decode step of the live sequences: one token each, handed out.
    pub(super) fn decode(&mut self, out: &mut Vec<(SeqId, StepOutput)>) -> Result<()> {
        let started = std::time::Instant::now();
        let runs = self.runs_ahead();
        match self.ahead.take() {
            Some(a) if runs => match self.carry_over(&a)? {
                Some(ids) => self.advance(Ahead { ids, ..a }, out)?,
                None => self.restart(a, out)?,
            },
            Some(a) => self.restart(a, out)?,
            None => {
                let logits = self.forward_last()?;
                if runs {
                    let a = self.pick_on_device(&logits, &[])?;
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

    /// The batch changed in a way a step ahead cannot follow: hands `a`'s tokens out, then
    /// starts again from the host's tokens (sequences that just joined get theirs next step).
    fn restart(&mut self, a: Ahead, out: &mut Vec<(SeqId, StepOutput)>) -> Result<()> {
        self.hand_out(a, false, out)?;
        if self.runs_ahead() && !self.live.is_empty() {
            let logits = self.forward_last()?;
            self.ahead = Some(self.pick_on_device(&logits, &[])?);
        }
        Ok(())
    }

    /// The next step's input after the batch changed since `a` was picked, where the step
    /// ahead can go on: the live sequences are `a`'s still live (sequences that finished or
    /// were cancelled left, the order kept) followed by sequences that joined since, whose
    /// last token the host holds. Their ids, in the batch's order: the picks on the device,
    /// then the joiners' tokens. `None` where the batch is in another order.
    fn carry_over(&self, a: &Ahead) -> Result<Option<Tensor>> {
        let mut picked = Vec::new();
        let mut joined = Vec::new();
        let mut from = 0;
        for s in &self.live {
            match a.rows[from..].iter().position(|&r| r == s.id) {
                Some(p) if joined.is_empty() => {
                    picked.push((from + p) as u32);
                    from += p + 1;
                }
                None if !s.last_forwarded => joined.push(s.last),
                _ => return Ok(None),
            }
        }
        if joined.is_empty() && picked.len() == a.rows.len() {
            return Ok(Some(a.ids.clone()));
        }
        let device = a.ids.device();
        let mut parts = Vec::new();
        if !picked.is_empty() {
            let n = picked.len();
            let at = Tensor::from_vec(picked, n, device)?;
            parts.push(a.ids.index_select(&at, 0)?);
        }
        if !joined.is_empty() {
            let n = joined.len();
            parts.push(Tensor::from_vec(joined, (n, 1), device)?);
        }
        Ok(Some(Tensor::cat(&parts, 0)?))
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

    /// Enqueues the step that runs `a`'s input through the model and picks the tokens after it
    /// (unless no sequence wants a token after its next one, or the context is full), then
    /// hands `a`'s tokens out. A sequence at its last token runs it through the model with the
    /// others (its cache then holds it too).
    fn advance(&mut self, a: Ahead, out: &mut Vec<(SeqId, StepOutput)>) -> Result<()> {
        let cache = self
            .cache
            .as_mut()
            .ok_or_else(|| Error::Input("live sequences without a batch cache".to_string()))?;
        let max = self.model.config().max_position_embeddings;
        let fits = cache.offsets().iter().all(|&o| o < max);
        let next = if fits && self.live.iter().any(Sequence::wants_more_after_next) {
            let logits = self.model.text_model().forward_device_ids(&a.ids, cache)?;
            // A sequence whose token `a` holds draws its next one a draw further; one that
            // joined since has taken its token on the host already.
            let skip: Vec<u64> = self
                .live
                .iter()
                .map(|s| u64::from(a.rows.contains(&s.id)))
                .collect();
            Some(self.pick_on_device(&logits, &skip)?)
        } else {
            None
        };
        let forwarded = next.is_some();
        self.hand_out(a, forwarded, out)?;
        self.ahead = next;
        Ok(())
    }

    /// Picks each live sequence's token from `logits` `[live, vocab]` on the device (its argmax,
    /// or its draw `skip[row]` draws past the next one its sampler makes; none where `skip` is
    /// short) and starts their copy.
    fn pick_on_device(&mut self, logits: &Tensor, skip: &[u64]) -> Result<Ahead> {
        let rows = self.live.len();
        let unavailable = || Error::Input("no device pick for a batch decoding ahead".to_string());
        let picks: Vec<Option<DeviceDraw>> = self
            .live
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let pick = s.device_pick().ok_or_else(unavailable)?;
                Ok(pick.map(|d| DeviceDraw {
                    draw: d.draw + skip.get(i).copied().unwrap_or(0),
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
