//! Decoding one step ahead of the host ([`crate::GenOptions::lookahead`]): greedy decoding, and
//! tempered sampling that the device draws itself, filtered or not
//! ([`crate::generate::sampling::Sampler::device_draw`]).
//!
//! Such decoding on CUDA picks each token on the device (an argmax, or a draw) and copies the
//! id back, and the host enqueues the next step only once it has the id: between two steps
//! the device waits for the copy, the host's token handling and the next step's launch. Here
//! the next step takes its id straight from the pick's output on the device and is enqueued
//! before the host waits for the copy, which then waits for that copy alone (a page-locked
//! slot, [`IdReadback`]): the device always has the next step queued.
//!
//! A token is run through the model before the host has seen it, so the step after the last
//! token is already queued when the host sees an EOS or a stop string: the cache then holds
//! the last token too (the caller records it). A step is not queued past `max_tokens`, nor
//! past the context.

use std::collections::VecDeque;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::generate::sampling::DeviceDraw;
use crate::kernels::ops::argmax::{pick_rows, IdReadback, PendingIds};
use crate::kv::ModelCache;
use crate::model::Model;

/// The tokens picked on the device and not handed out yet.
#[derive(Debug)]
pub(super) struct Lookahead {
    readback: IdReadback,
    /// Oldest first: the next token to hand out, then the one being computed after it.
    queue: VecDeque<Picked>,
    /// Tokens picked so far.
    picked: usize,
    max_tokens: usize,
    /// The sampler's draw for the first token, `None` for greedy decoding; the `n`-th token
    /// picked takes draw index `draw + n`.
    draw: Option<DeviceDraw>,
}

/// A token picked on the device.
#[derive(Debug)]
struct Picked {
    /// `[1, 1]` u32: the input of the step after it.
    ids: Tensor,
    pending: PendingIds,
    /// Whether the step that runs this token through the model was enqueued.
    forwarded: bool,
}

/// A token handed out by [`Lookahead::next`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Next {
    pub token: u32,
    /// Whether the cache already holds this token (the step after it was enqueued).
    pub forwarded: bool,
}

impl Lookahead {
    /// Starts from the prompt's last logits `[vocab]`: picks the first token on the device, by
    /// argmax or, where `draw` is given, by that draw (later tokens take the next draw
    /// indices). `None` where decoding cannot run ahead: not CUDA, or a checkpoint whose
    /// per-layer table does not cover every id the logits can pick.
    ///
    /// # Errors
    /// Device errors.
    pub(super) fn start(
        model: &Model,
        logits: &Tensor,
        max_tokens: usize,
        draw: Option<DeviceDraw>,
    ) -> Result<Option<Self>> {
        if !model.text_model().takes_device_ids() {
            return Ok(None);
        }
        let Some(readback) = IdReadback::new(model.device()) else {
            return Ok(None);
        };
        let mut ahead = Self {
            readback,
            queue: VecDeque::new(),
            picked: 0,
            max_tokens,
            draw,
        };
        match ahead.pick(logits)? {
            Some(p) => {
                ahead.queue.push_back(p);
                Ok(Some(ahead))
            }
            None => Ok(None),
        }
    }

    /// Picks a token from `logits` `[vocab]` on the device and starts its copy to the host.
    fn pick(&mut self, logits: &Tensor) -> Result<Option<Picked>> {
        let rows = logits.unsqueeze(0)?;
        let pick = self.draw.map(|d| DeviceDraw {
            draw: d.draw + self.picked as u64,
            ..d
        });
        let Some(ids) = pick_rows(&rows, &[pick])? else {
            return Ok(None);
        };
        let ids = ids.reshape((1, 1))?;
        let pending = self.readback.start(&ids)?;
        self.picked += 1;
        Ok(Some(Picked {
            ids,
            pending,
            forwarded: false,
        }))
    }

    /// The next token. First it enqueues the step that runs the newest picked token through
    /// the model and picks the token after it (unless that one would pass `max_tokens` or the
    /// context), so the device has work while the host waits for the id.
    ///
    /// # Errors
    /// Errors of the step, device errors.
    pub(super) fn next(&mut self, model: &Model, cache: &mut ModelCache) -> Result<Next> {
        let fits = cache
            .offsets()
            .first()
            .is_some_and(|&o| o < model.config().max_position_embeddings);
        let ahead = match self.queue.back() {
            Some(newest) if !newest.forwarded && self.picked < self.max_tokens && fits => {
                Some(newest.ids.clone())
            }
            _ => None,
        };
        if let Some(ids) = ahead {
            let logits = model.text_model().forward_device_ids(&ids, cache)?;
            if let Some(newest) = self.queue.back_mut() {
                newest.forwarded = true;
            }
            if let Some(p) = self.pick(&logits.squeeze(0)?)? {
                self.queue.push_back(p);
            }
        }
        let front = self
            .queue
            .pop_front()
            .ok_or_else(|| Error::Input("no token was picked ahead".to_string()))?;
        let ids = self.readback.finish(front.pending)?;
        let token = ids
            .first()
            .copied()
            .ok_or_else(|| Error::Input("the device picked no token".to_string()))?;
        Ok(Next {
            token,
            forwarded: front.forwarded,
        })
    }
}
