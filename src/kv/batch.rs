//! [`BatchCache`]: one single-sequence cache per sequence, for batched and continuous decoding.

use candle_core::Tensor;

use super::{CacheError, KvCache, KvView, LayerCache};
use crate::kernels::kv_write::{scatter_kv_batch, writes_in_place};
use crate::kernels::quantize_kv_into_batch;

/// The caches of a batch of sequences, one single-sequence [`LayerCache`] each.
///
/// Sequences keep their own offsets and storage: nothing is padded, so sequences of different
/// lengths (and caches of any kind: simple, rotating, quantized) batch without masks for
/// padding, a finished sequence is dropped with [`BatchCache::remove`] and a new one, prefilled
/// on its own, joins between steps with [`BatchCache::push`] (continuous batching). The cost is
/// one attention call per sequence; the projections and MLP still run batched.
///
/// `update` takes `[batch, kv_heads, tokens, head_dim]` (every sequence appends the same number
/// of tokens) and returns [`KvView::Batch`], one view per sequence in batch order.
#[derive(Debug, Default)]
pub struct BatchCache {
    seqs: Vec<LayerCache>,
}

impl BatchCache {
    /// A batch of the given single-sequence caches, in batch order.
    ///
    /// # Errors
    /// [`CacheError::NestedBatch`] when one of them is itself a batch.
    pub fn new(seqs: Vec<LayerCache>) -> Result<Self, CacheError> {
        if seqs.iter().any(|c| matches!(c, LayerCache::Batch(_))) {
            return Err(CacheError::NestedBatch);
        }
        Ok(Self { seqs })
    }

    /// Sequences held.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no sequence is held.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Adds a sequence at the end of the batch (its cache prefilled on its own).
    ///
    /// # Errors
    /// [`CacheError::NestedBatch`] when `cache` is a batch.
    pub fn push(&mut self, cache: LayerCache) -> Result<(), CacheError> {
        if matches!(cache, LayerCache::Batch(_)) {
            return Err(CacheError::NestedBatch);
        }
        self.seqs.push(cache);
        Ok(())
    }

    /// Removes sequence `i` and returns its cache; later sequences move down by one.
    ///
    /// # Errors
    /// [`CacheError::SequenceIndex`] when `i` is out of range.
    pub fn remove(&mut self, i: usize) -> Result<LayerCache, CacheError> {
        if i >= self.seqs.len() {
            return Err(CacheError::SequenceIndex {
                index: i,
                len: self.seqs.len(),
            });
        }
        Ok(self.seqs.remove(i))
    }

    /// The per-sequence caches, in batch order.
    pub fn sequences(&self) -> &[LayerCache] {
        &self.seqs
    }

    /// Takes the per-sequence caches out, in batch order.
    pub fn into_sequences(self) -> Vec<LayerCache> {
        self.seqs
    }

    /// Tokens every sequence can roll back (the smallest of them).
    pub fn trimmable(&self) -> usize {
        self.seqs
            .iter()
            .map(LayerCache::trimmable)
            .min()
            .unwrap_or(0)
    }

    /// A deep copy (new storage).
    ///
    /// # Errors
    /// Candle errors while copying.
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        Ok(Self {
            seqs: self
                .seqs
                .iter()
                .map(LayerCache::deep_clone)
                .collect::<Result<_, _>>()?,
        })
    }
}

impl BatchCache {
    /// A batch of one sequence: that sequence's [`LayerCache::reserve_slots`]; `None` for
    /// larger batches (each sequence's slots lie elsewhere).
    pub(crate) fn reserve_slots(
        &mut self,
        n: usize,
        device: &candle_core::Device,
    ) -> Result<Option<(Tensor, Tensor)>, CacheError> {
        match self.seqs.as_mut_slice() {
            [only] => only.reserve_slots(n, device),
            _ => Ok(None),
        }
    }

    /// A batch of one sequence: that sequence's [`LayerCache::reserve_packed_slots`]; `None`
    /// for larger batches.
    pub(crate) fn reserve_packed_slots(
        &mut self,
        n: usize,
        device: &candle_core::Device,
    ) -> Result<Option<Vec<Tensor>>, CacheError> {
        match self.seqs.as_mut_slice() {
            [only] => only.reserve_packed_slots(n, device),
            _ => Ok(None),
        }
    }

    /// The sequences' caches, mutably (crate only: their count must not change behind the
    /// batch's back).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn sequences_mut(&mut self) -> &mut [LayerCache] {
        &mut self.seqs
    }

    /// Commits the slots of [`BatchCache::reserve_slots`] or
    /// [`BatchCache::reserve_packed_slots`]: the batch view `update` would have
    /// returned.
    pub(crate) fn commit_slots(&mut self, n: usize) -> Result<KvView, CacheError> {
        match self.seqs.as_mut_slice() {
            [only] => Ok(KvView::Batch(vec![only.commit_slots(n)?])),
            _ => Err(CacheError::Config {
                field: "slots",
                reason: "a batch of several sequences writes through `update`".into(),
            }),
        }
    }
}

impl BatchCache {
    /// Several sequences on CUDA, all dense (simple or rotating) or all packed quantized:
    /// every sequence's new K/V written into its own next slots by one launch (up to 16
    /// sequences a launch; a copy for dense sequences, a quantization for packed ones) instead
    /// of one or two launches per sequence. `None`, having changed nothing, where that does not
    /// apply (fewer than two sequences, mixed kinds or quantizations, a sequence not packed yet,
    /// a ring write that wraps or overwrites a needed key, off CUDA); the caller then updates
    /// sequence by sequence.
    fn update_together(
        &mut self,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Option<Vec<KvView>>, CacheError> {
        if self.seqs.len() < 2 || !writes_in_place(k.device()) {
            return Ok(None);
        }
        let (n, device) = (k.dim(2)?, k.device());
        let written = match self.seqs.first() {
            Some(LayerCache::Quantized(c)) => {
                let quant = *c.quant();
                match self.reserve_each(|c| c.reserve_packed_slots(n, device))? {
                    Some(slots) => {
                        quantize_kv_into_batch(k, v, quant.bits, quant.group_size, &slots)?
                    }
                    None => false,
                }
            }
            Some(LayerCache::Simple(_) | LayerCache::Rotating(_)) => {
                match self.reserve_each(|c| c.reserve_slots(n, device))? {
                    Some(slots) => scatter_kv_batch(k, v, &slots)?,
                    None => false,
                }
            }
            _ => false,
        };
        if !written {
            return Ok(None);
        }
        self.seqs
            .iter_mut()
            .map(|c| c.commit_slots(n))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// Moves the sequences' caches out, leaving the batch empty until
    /// [`BatchCache::put_sequences`] returns them (crate only: a replayed decode step records
    /// each sequence on its own).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn take_sequences(&mut self) -> Vec<LayerCache> {
        std::mem::take(&mut self.seqs)
    }

    /// Puts back what [`BatchCache::take_sequences`] took.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn put_sequences(&mut self, seqs: Vec<LayerCache>) {
        self.seqs = seqs;
    }

    /// Every sequence's slots from `reserve`, or `None` as soon as one has none. Reserving grows
    /// storage at most; nothing is counted until the slots are committed.
    fn reserve_each<S>(
        &mut self,
        mut reserve: impl FnMut(&mut LayerCache) -> Result<Option<S>, CacheError>,
    ) -> Result<Option<Vec<S>>, CacheError> {
        let mut slots = Vec::with_capacity(self.seqs.len());
        for c in self.seqs.iter_mut() {
            match reserve(c)? {
                Some(s) => slots.push(s),
                None => return Ok(None),
            }
        }
        Ok(Some(slots))
    }
}

impl KvCache for BatchCache {
    /// Splits `k`, `v` along the batch axis, updates each sequence, and returns one view per
    /// sequence.
    ///
    /// # Errors
    /// [`CacheError::BatchSize`] when the batch axis is not the number of sequences; any
    /// sequence's error (the sequences before it are already updated).
    fn update(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView, CacheError> {
        let found = k.dims().first().copied().unwrap_or(0);
        if found != self.seqs.len() || v.dims().first().copied().unwrap_or(0) != found {
            return Err(CacheError::BatchSize {
                expected: self.seqs.len(),
                found,
            });
        }
        if let Some(views) = self.update_together(k, v)? {
            return Ok(KvView::Batch(views));
        }
        let mut views = Vec::with_capacity(found);
        for (b, cache) in self.seqs.iter_mut().enumerate() {
            views.push(cache.update(&k.narrow(0, b, 1)?, &v.narrow(0, b, 1)?)?);
        }
        Ok(KvView::Batch(views))
    }

    /// One offset per sequence, in batch order.
    fn offsets(&self) -> Vec<usize> {
        self.seqs.iter().flat_map(|c| c.offsets()).collect()
    }

    /// Rolls every sequence back by `n`; checks all of them first, so either all roll back or
    /// none does.
    fn trim(&mut self, n: usize) -> Result<(), CacheError> {
        if let Some((i, c)) = self
            .seqs
            .iter()
            .enumerate()
            .find(|(_, c)| c.trimmable() < n)
        {
            // Let the sequence's own trim explain why.
            let mut probe = c.deep_clone()?;
            return match probe.trim(n) {
                Err(CacheError::CannotTrim {
                    requested,
                    available,
                    reason,
                }) => Err(CacheError::CannotTrim {
                    requested,
                    available,
                    reason: format!("sequence {i}: {reason}"),
                }),
                Err(e) => Err(e),
                Ok(()) => Err(CacheError::CannotTrim {
                    requested: n,
                    available: c.trimmable(),
                    reason: format!("sequence {i}"),
                }),
            };
        }
        for c in self.seqs.iter_mut() {
            c.trim(n)?;
        }
        Ok(())
    }

    fn memory_bytes(&self) -> usize {
        self.seqs.iter().map(|c| c.memory_bytes()).sum()
    }

    fn reset(&mut self) {
        self.seqs.iter_mut().for_each(|c| c.reset());
    }
}
