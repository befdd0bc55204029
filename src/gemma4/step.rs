//! The per-forward context shared by every layer: where each sequence's queries sit and the
//! rotary tables of both layer kinds, computed once per forward.

use candle_core::{DType, Device, Result, Tensor};

use super::rope::Rope;
use crate::config::LayerKind;

/// Positions and rotary tables of one forward pass.
#[derive(Debug, Clone)]
pub struct Step {
    /// Absolute position of the first query of each sequence.
    pub offsets: Vec<usize>,
    /// Query tokens per sequence.
    pub seq_len: usize,
    /// `(cos, sin)`, `[batch, seq_len, head_dim/2]`, for sliding layers.
    sliding: (Tensor, Tensor),
    /// `(cos, sin)` for full layers.
    full: (Tensor, Tensor),
}

impl Step {
    /// Builds the tables for `seq_len` queries per sequence starting at `offsets`.
    ///
    /// # Errors
    /// Allocation failure.
    pub fn new(
        offsets: Vec<usize>,
        seq_len: usize,
        sliding: &Rope,
        full: &Rope,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            sliding: sliding.tables(&offsets, seq_len, dtype, device)?,
            full: full.tables(&offsets, seq_len, dtype, device)?,
            offsets,
            seq_len,
        })
    }

    /// A step whose tables are the two halves of `sliding` and `full` (each `[2, batch, seq_len,
    /// head_dim / 2]`, as [`Rope::both`] makes them): views, no copy.
    ///
    /// # Errors
    /// Tables of another shape.
    pub fn from_both(
        offsets: Vec<usize>,
        seq_len: usize,
        sliding: &Tensor,
        full: &Tensor,
    ) -> Result<Self> {
        Ok(Self {
            sliding: (sliding.get(0)?, sliding.get(1)?),
            full: (full.get(0)?, full.get(1)?),
            offsets,
            seq_len,
        })
    }

    /// The tables of a layer kind.
    pub fn rope(&self, kind: LayerKind) -> (&Tensor, &Tensor) {
        let t = match kind {
            LayerKind::Sliding => &self.sliding,
            LayerKind::Full => &self.full,
        };
        (&t.0, &t.1)
    }

    /// The same step restricted to its last query of each sequence (KV-shared layers at prefill
    /// only need the last position: they write no cache and feed no later position).
    ///
    /// # Errors
    /// Allocation failure.
    pub fn last_only(&self) -> Result<Self> {
        let last = self.seq_len.saturating_sub(1);
        let narrow = |t: &(Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((
                t.0.narrow(1, last, 1)?.contiguous()?,
                t.1.narrow(1, last, 1)?.contiguous()?,
            ))
        };
        Ok(Self {
            offsets: self.offsets.iter().map(|o| o + last).collect(),
            seq_len: 1,
            sliding: narrow(&self.sliding)?,
            full: narrow(&self.full)?,
        })
    }
}

/// The new tokens of a forward pass: ids on the host, one row per sequence, or a decode step's
/// ids `[seqs, 1]` u32 already on the model's device (the previous step's greedy picks, which
/// the host has not read yet).
#[derive(Debug, Clone, Copy)]
pub(crate) enum StepIds<'a> {
    /// Rows of ids, one per sequence.
    Host(&'a [Vec<u32>]),
    /// `[seqs, 1]` u32 on the model's device.
    Device(&'a Tensor),
}

impl StepIds<'_> {
    /// Sequences in the step.
    pub(crate) fn seqs(&self) -> usize {
        match self {
            StepIds::Host(b) => b.len(),
            StepIds::Device(t) => t.dims().first().copied().unwrap_or(0),
        }
    }

    /// Whether every sequence has exactly one new token.
    pub(crate) fn one_each(&self) -> bool {
        match self {
            StepIds::Host(b) => b.iter().all(|s| s.len() == 1),
            StepIds::Device(t) => t.dims().get(1) == Some(&1),
        }
    }

    /// The ids `[seqs, len]` on `device`, in a buffer of their own (a capture reads it at every
    /// replay).
    ///
    /// # Errors
    /// Allocation failure.
    pub(crate) fn to_owned_tensor(self, device: &Device) -> Result<Tensor> {
        match self {
            StepIds::Host(b) => {
                let len = b.first().map_or(0, Vec::len);
                let flat: Vec<u32> = b.iter().flatten().copied().collect();
                Tensor::from_vec(flat, (b.len(), len), device)
            }
            StepIds::Device(t) => t.copy(),
        }
    }
}
