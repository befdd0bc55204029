//! The logit bias and penalties of [`super::SamplingOptions`], applied before temperature in
//! this order: OpenAI's logit bias, transformers' repetition penalty over the history (prompt
//! and generated tokens), then OpenAI's frequency and presence penalties over the tokens the
//! sampler drew.
//!
//! A sampler whose bias and penalties can only lower logits (biases below 0, a repetition
//! penalty above 1, frequency and presence penalties of at least 0) may rank its row on the
//! device without them: the best
//! `k` after the penalties are among the best `k + m` before them, where `m` counts the tokens
//! the penalties touch (each of the `k + m` first ones it passes over is a touched token).

use std::collections::{HashMap, HashSet};

/// The penalties of one sampler and the counts of the tokens it drew.
#[derive(Debug, Clone, Default)]
pub(super) struct Penalties {
    repetition: Option<f32>,
    frequency: Option<f32>,
    presence: Option<f32>,
    /// The logit bias, by id (finite and not 0).
    bias: HashMap<u32, f32>,
    /// How often the sampler drew each token.
    drawn: HashMap<u32, u32>,
}

/// A penalty that changes logits: finite and not its no-op value (`none`).
fn active(p: Option<f32>, none: f32, positive: bool) -> Option<f32> {
    p.filter(|&p| p.is_finite() && p != none && (!positive || p > 0.0))
}

impl Penalties {
    /// The active penalties of the options (no-op values dropped; a later bias for an id
    /// replaces an earlier one).
    pub(super) fn new(
        repetition: Option<f32>,
        frequency: Option<f32>,
        presence: Option<f32>,
        bias: &[(u32, f32)],
    ) -> Self {
        let mut by_id = HashMap::new();
        for &(id, b) in bias {
            by_id.insert(id, b);
        }
        by_id.retain(|_, b| b.is_finite() && *b != 0.0);
        Self {
            repetition: active(repetition, 1.0, true),
            frequency: active(frequency, 0.0, false),
            presence: active(presence, 0.0, false),
            bias: by_id,
            drawn: HashMap::new(),
        }
    }

    /// Whether any bias or penalty changes logits.
    pub(super) fn any(&self) -> bool {
        self.repetition.is_some()
            || self.frequency.is_some()
            || self.presence.is_some()
            || !self.bias.is_empty()
    }

    /// Records a drawn token (frequency and presence count these).
    pub(super) fn record(&mut self, token: u32) {
        if self.frequency.is_some() || self.presence.is_some() {
            *self.drawn.entry(token).or_insert(0) += 1;
        }
    }

    /// Applies the penalties to `scores` (indexed by id); `history` for the repetition
    /// penalty (ids outside the scores are ignored).
    pub(super) fn apply(&self, scores: &mut [f32], history: &[u32]) {
        for (&id, &b) in &self.bias {
            if let Some(s) = scores.get_mut(id as usize) {
                *s += b;
            }
        }
        if let Some(p) = self.repetition {
            let mut seen = HashSet::with_capacity(history.len());
            for &id in history {
                if seen.insert(id) {
                    if let Some(s) = scores.get_mut(id as usize) {
                        *s = repeat(*s, p);
                    }
                }
            }
        }
        for (&id, &n) in &self.drawn {
            if let Some(s) = scores.get_mut(id as usize) {
                *s = self.openai(*s, n);
            }
        }
    }

    /// Applies the penalties to `(id, score)` pairs.
    pub(super) fn apply_pairs(&self, pairs: &mut [(u32, f32)], history: &[u32]) {
        let repeated: HashSet<u32> = match self.repetition {
            Some(_) => history.iter().copied().collect(),
            None => HashSet::new(),
        };
        for (id, s) in pairs.iter_mut() {
            if let Some(&b) = self.bias.get(id) {
                *s += b;
            }
            if let (Some(p), true) = (self.repetition, repeated.contains(id)) {
                *s = repeat(*s, p);
            }
            if let Some(&n) = self.drawn.get(id) {
                *s = self.openai(*s, n);
            }
        }
    }

    /// `m`: how many tokens the penalties touch at this step, where they can only lower logits;
    /// `None` where one can raise them.
    pub(super) fn lowered(&self, history: &[u32]) -> Option<usize> {
        if self.repetition.is_some_and(|p| p < 1.0)
            || self.frequency.is_some_and(|f| f < 0.0)
            || self.presence.is_some_and(|p| p < 0.0)
            || self.bias.values().any(|&b| b > 0.0)
        {
            return None;
        }
        let mut touched: HashSet<u32> = self.drawn.keys().copied().collect();
        touched.extend(self.bias.keys().copied());
        if self.repetition.is_some() {
            touched.extend(history.iter().copied());
        }
        Some(touched.len())
    }

    /// A drawn token's score after the frequency and presence penalties (`n` draws so far).
    fn openai(&self, s: f32, n: u32) -> f32 {
        let lower = self.frequency.map_or(0.0, |f| f * n as f32) + self.presence.unwrap_or(0.0);
        s - lower
    }
}

/// transformers' repetition penalty on one score.
fn repeat(s: f32, p: f32) -> f32 {
    if s > 0.0 {
        s / p
    } else {
        s * p
    }
}
