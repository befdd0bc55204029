//! [`ModelCache`]: the caches of every layer of a model, `None` for KV-consumer layers.

use candle_core::{DType, Device};

use super::{BatchCache, CacheConfig, CacheError, CacheMark, KvCache, LayerCache, LayerCacheSpec};

/// Caches of a whole model: `layers[l]` is `Some` for a KV-owning layer and `None` for a
/// KV-consumer layer, which reads its producer's view of the current step and owns no cache.
#[derive(Debug)]
pub struct ModelCache {
    /// One entry per decoder layer.
    pub layers: Vec<Option<LayerCache>>,
}

impl ModelCache {
    /// Builds every layer's cache: `specs[l]` is the geometry of layer `l`, `None` for a
    /// KV-consumer layer.
    ///
    /// # Errors
    /// Any [`CacheConfig::build`] error (bad group size for some head dimension, ...).
    pub fn new(
        config: &CacheConfig,
        specs: &[Option<LayerCacheSpec>],
        dtype: DType,
        device: &Device,
    ) -> Result<Self, CacheError> {
        let layers = specs
            .iter()
            .map(|s| {
                s.as_ref()
                    .map(|s| config.build(s, dtype, device))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { layers })
    }

    fn caches(&self) -> impl Iterator<Item = &LayerCache> {
        self.layers.iter().flatten()
    }

    /// Tokens seen per sequence (from the first cache; every cache agrees). Empty when the model
    /// owns no cache.
    pub fn offsets(&self) -> Vec<usize> {
        self.caches()
            .next()
            .map(|c| c.offsets())
            .unwrap_or_default()
    }

    /// Rolls every layer back by `n` tokens; checks every layer first, so either all roll back
    /// or none does.
    ///
    /// # Errors
    /// [`CacheError::CannotTrim`] naming the first layer that cannot.
    pub fn trim(&mut self, n: usize) -> Result<(), CacheError> {
        for (l, c) in self.layers.iter().enumerate() {
            if let Some(c) = c {
                let available = c.trimmable();
                if available < n {
                    let reason = format!("layer {l} ({}) can roll back only {available}", c.kind());
                    return Err(CacheError::CannotTrim {
                        requested: n,
                        available,
                        reason,
                    });
                }
            }
        }
        for c in self.layers.iter_mut().flatten() {
            c.trim(n)?;
        }
        Ok(())
    }

    /// Every layer's [`LayerCache::mark`]; `None` when some layer has no marks.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn marks(&self) -> Option<Vec<Option<CacheMark>>> {
        self.layers
            .iter()
            .map(|c| match c {
                Some(c) => c.mark().map(Some),
                None => Some(None),
            })
            .collect()
    }

    /// Puts back the counters of [`ModelCache::marks`].
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn restore(&mut self, marks: &[Option<CacheMark>]) {
        for (c, m) in self.layers.iter_mut().zip(marks) {
            if let (Some(c), Some(m)) = (c, m) {
                c.restore(m);
            }
        }
    }

    /// The identity of every layer's (and sequence's) storage, in order (see
    /// [`LayerCache::storage_ids`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn storage_ids(&self) -> Vec<Option<candle_core::TensorId>> {
        let mut out = Vec::new();
        for c in &self.layers {
            match c {
                Some(c) => c.storage_ids(&mut out),
                None => out.push(None),
            }
        }
        out
    }

    /// Moves each sequence's caches out of a cache whose every layer is a batch (or empty), one
    /// `ModelCache` a sequence, leaving the batches empty until
    /// [`ModelCache::join_sequences`] puts them back; `None`, moving nothing, when some layer
    /// is not a batch or the batches differ in size.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn split_sequences(&mut self) -> Option<Vec<ModelCache>> {
        let mut n = None;
        for c in self.layers.iter().flatten() {
            let LayerCache::Batch(b) = c else {
                return None;
            };
            if *n.get_or_insert(b.len()) != b.len() {
                return None;
            }
        }
        let n = n?;
        let mut seqs: Vec<ModelCache> = (0..n)
            .map(|_| ModelCache {
                layers: Vec::with_capacity(self.layers.len()),
            })
            .collect();
        for c in &mut self.layers {
            match c {
                Some(LayerCache::Batch(b)) => {
                    for (seq, layer) in seqs.iter_mut().zip(b.take_sequences()) {
                        seq.layers.push(Some(layer));
                    }
                }
                _ => seqs.iter_mut().for_each(|s| s.layers.push(None)),
            }
        }
        Some(seqs)
    }

    /// Puts back the sequences [`ModelCache::split_sequences`] moved out.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn join_sequences(&mut self, seqs: Vec<ModelCache>) {
        let mut per_layer: Vec<Vec<LayerCache>> = self.layers.iter().map(|_| Vec::new()).collect();
        for seq in seqs {
            for (l, c) in seq.layers.into_iter().enumerate() {
                if let (Some(c), Some(out)) = (c, per_layer.get_mut(l)) {
                    out.push(c);
                }
            }
        }
        for (c, seqs) in self.layers.iter_mut().zip(per_layer) {
            if let Some(LayerCache::Batch(b)) = c {
                b.put_sequences(seqs);
            }
        }
    }

    /// How many tokens every layer can roll back.
    pub fn trimmable(&self) -> usize {
        self.caches().map(LayerCache::trimmable).min().unwrap_or(0)
    }

    /// Allocated K/V bytes of every layer.
    pub fn memory_bytes(&self) -> usize {
        self.caches().map(|c| c.memory_bytes()).sum()
    }

    /// Forgets every token of every layer.
    pub fn reset(&mut self) {
        self.layers.iter_mut().flatten().for_each(|c| c.reset());
    }

    /// A deep copy (new storage).
    ///
    /// # Errors
    /// Candle errors while copying.
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        let layers = self
            .layers
            .iter()
            .map(|c| c.as_ref().map(LayerCache::deep_clone).transpose())
            .collect::<Result<_, _>>()?;
        Ok(Self { layers })
    }

    /// Sequences held: 1 for single-sequence caches, the batch size for batched ones.
    pub fn batch_size(&self) -> usize {
        match self.caches().next() {
            Some(LayerCache::Batch(b)) => b.len(),
            _ => 1,
        }
    }

    /// Whether the layers hold batch caches.
    pub fn is_batched(&self) -> bool {
        matches!(self.caches().next(), Some(LayerCache::Batch(_)))
    }

    /// Combines single-sequence model caches into one batched cache: layer `l` becomes a
    /// [`BatchCache`] of every sequence's layer `l`, in the order given.
    ///
    /// # Errors
    /// [`CacheError::NestedBatch`] when one of them is batched; [`CacheError::Layout`] when
    /// they disagree on which layers own a cache or on a layer's kind.
    pub fn batch(seqs: Vec<ModelCache>) -> Result<ModelCache, CacheError> {
        let n_layers = seqs.first().map_or(0, |s| s.layers.len());
        let mut layers: Vec<Option<Vec<LayerCache>>> = match seqs.first() {
            Some(s) => s
                .layers
                .iter()
                .map(|c| c.as_ref().map(|_| Vec::with_capacity(seqs.len())))
                .collect(),
            None => Vec::new(),
        };
        for (i, seq) in seqs.into_iter().enumerate() {
            if seq.is_batched() {
                return Err(CacheError::NestedBatch);
            }
            if seq.layers.len() != n_layers {
                return Err(CacheError::Layout {
                    layer: n_layers.min(seq.layers.len()),
                    reason: format!(
                        "sequence {i} has {} layers, sequence 0 has {n_layers}",
                        seq.layers.len()
                    ),
                });
            }
            for (l, (slot, c)) in layers.iter_mut().zip(seq.layers).enumerate() {
                match (slot, c) {
                    (Some(v), Some(c)) => {
                        if let Some(first) = v.first() {
                            if first.kind() != c.kind() {
                                return Err(CacheError::Layout { layer: l, reason: format!("sequence {i} has a {} cache, sequence 0 a {}", c.kind(), first.kind()) });
                            }
                        }
                        v.push(c);
                    }
                    (None, None) => {}
                    _ => return Err(CacheError::Layout { layer: l, reason: format!("sequence {i} disagrees with sequence 0 on whether the layer owns a cache") }),
                }
            }
        }
        let layers = layers
            .into_iter()
            .map(|v| {
                v.map(|v| BatchCache::new(v).map(LayerCache::Batch))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        Ok(ModelCache { layers })
    }

    /// Adds a sequence (a single-sequence model cache, prefilled on its own) to a batched
    /// cache, at the end of the batch.
    ///
    /// # Errors
    /// [`CacheError::NotBatched`] when `self` is not batched; [`CacheError::NestedBatch`] when
    /// `seq` is; [`CacheError::Layout`] when the layers disagree (nothing is added then).
    pub fn push_sequence(&mut self, seq: ModelCache) -> Result<(), CacheError> {
        if !self.is_batched() {
            return Err(CacheError::NotBatched);
        }
        if seq.is_batched() {
            return Err(CacheError::NestedBatch);
        }
        if seq.layers.len() != self.layers.len() {
            return Err(CacheError::Layout {
                layer: seq.layers.len().min(self.layers.len()),
                reason: format!(
                    "the sequence has {} layers, the batch {}",
                    seq.layers.len(),
                    self.layers.len()
                ),
            });
        }
        for (l, (mine, theirs)) in self.layers.iter().zip(&seq.layers).enumerate() {
            match (mine, theirs) {
                (Some(LayerCache::Batch(b)), Some(c)) => {
                    if let Some(first) = b.sequences().first() {
                        if first.kind() != c.kind() {
                            return Err(CacheError::Layout {
                                layer: l,
                                reason: format!(
                                    "the sequence has a {} cache, the batch a {}",
                                    c.kind(),
                                    first.kind()
                                ),
                            });
                        }
                    }
                }
                (None, None) => {}
                _ => return Err(CacheError::Layout {
                    layer: l,
                    reason:
                        "the sequence disagrees with the batch on whether the layer owns a cache"
                            .into(),
                }),
            }
        }
        for (mine, theirs) in self.layers.iter_mut().zip(seq.layers) {
            if let (Some(LayerCache::Batch(b)), Some(c)) = (mine, theirs) {
                b.push(c)?;
            }
        }
        Ok(())
    }

    /// Removes sequence `i` from a batched cache and returns it as a single-sequence model
    /// cache.
    ///
    /// # Errors
    /// [`CacheError::NotBatched`]; [`CacheError::SequenceIndex`] when `i` is out of range.
    pub fn remove_sequence(&mut self, i: usize) -> Result<ModelCache, CacheError> {
        if !self.is_batched() {
            return Err(CacheError::NotBatched);
        }
        let len = self.batch_size();
        if i >= len {
            return Err(CacheError::SequenceIndex { index: i, len });
        }
        let mut out = Vec::with_capacity(self.layers.len());
        for c in self.layers.iter_mut() {
            out.push(match c {
                Some(LayerCache::Batch(b)) => Some(b.remove(i)?),
                _ => None,
            });
        }
        Ok(ModelCache { layers: out })
    }
}
