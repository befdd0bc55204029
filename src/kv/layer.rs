//! [`LayerCache`]: the one cache type a layer holds, dispatching by `match` (no `dyn`).

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::quantized::QuantMark;
use super::{BatchCache, CacheError, KvCache, KvView, QuantizedCache, RotatingCache, SimpleCache};
use crate::kernels::kv_write::capturing_graph;

/// The cache of one KV-owning layer.
#[derive(Debug)]
pub enum LayerCache {
    /// Dense, every token.
    Simple(SimpleCache),
    /// Dense ring of the window.
    Rotating(RotatingCache),
    /// Affine-quantized, growing or ring.
    Quantized(QuantizedCache),
    /// One single-sequence cache per sequence of a batch.
    Batch(BatchCache),
}

/// What kind of cache a layer holds, with its parameters (recorded in prompt caches and
/// compared on restore).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum CacheKind {
    /// [`SimpleCache`].
    Simple,
    /// [`RotatingCache`].
    Rotating {
        /// Keys visible to a query, its own included.
        window: usize,
        /// Ring slots (`window + slack`).
        slots: usize,
    },
    /// [`QuantizedCache`].
    Quantized {
        /// Bits per element (4 or 8).
        bits: usize,
        /// Elements per group.
        group_size: usize,
        /// Tokens kept dense before packing.
        start: usize,
        /// `Some(W)`: ring layout.
        window: Option<usize>,
    },
    /// [`BatchCache`].
    Batch {
        /// Sequences held.
        sequences: usize,
    },
}

impl std::fmt::Display for CacheKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheKind::Simple => write!(f, "simple"),
            CacheKind::Rotating { window, slots } => {
                write!(f, "rotating(window {window}, slots {slots})")
            }
            CacheKind::Quantized {
                bits,
                group_size,
                start,
                window,
            } => {
                write!(
                    f,
                    "quantized({bits} bits, group {group_size}, start {start}"
                )?;
                match window {
                    Some(w) => write!(f, ", window {w})"),
                    None => write!(f, ")"),
                }
            }
            CacheKind::Batch { sequences } => write!(f, "batch of {sequences}"),
        }
    }
}

impl LayerCache {
    /// What kind of cache this is, with its parameters.
    pub fn kind(&self) -> CacheKind {
        match self {
            LayerCache::Simple(_) => CacheKind::Simple,
            LayerCache::Rotating(c) => CacheKind::Rotating {
                window: c.window(),
                slots: c.slots(),
            },
            LayerCache::Quantized(c) => {
                let q = c.quant();
                CacheKind::Quantized {
                    bits: q.bits.bits(),
                    group_size: q.group_size,
                    start: q.start,
                    window: c.window(),
                }
            }
            LayerCache::Batch(b) => CacheKind::Batch { sequences: b.len() },
        }
    }

    /// KV heads and head dimension (those of the first sequence for a batch; `(0, 0)` for an
    /// empty batch).
    pub fn geometry(&self) -> (usize, usize) {
        match self {
            LayerCache::Simple(c) => c.geometry(),
            LayerCache::Rotating(c) => c.geometry(),
            LayerCache::Quantized(c) => c.geometry(),
            LayerCache::Batch(c) => c.sequences().first().map_or((0, 0), LayerCache::geometry),
        }
    }

    /// How many tokens [`KvCache::trim`] can roll back now.
    pub fn trimmable(&self) -> usize {
        match self {
            LayerCache::Simple(c) => c.trimmable(),
            LayerCache::Rotating(c) => c.trimmable(),
            LayerCache::Quantized(c) => c.trimmable(),
            LayerCache::Batch(c) => c.trimmable(),
        }
    }

    /// A deep copy (new storage): the in-memory prompt-cache path.
    ///
    /// # Errors
    /// Candle errors while copying.
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        Ok(match self {
            LayerCache::Simple(c) => LayerCache::Simple(c.deep_clone()?),
            LayerCache::Rotating(c) => LayerCache::Rotating(c.deep_clone()?),
            LayerCache::Quantized(c) => LayerCache::Quantized(c.deep_clone()?),
            LayerCache::Batch(c) => LayerCache::Batch(c.deep_clone()?),
        })
    }
}

impl LayerCache {
    /// Dense storage for the next `n` tokens' keys and values (`[1, kv_heads, n, head_dim]`
    /// views on `device`) for a kernel that writes them in place, skipping a copy; `None` where
    /// this cache cannot take them so (quantized caches, batches of several sequences, a
    /// rotating write that wraps or overwrites a needed key): the caller then calls `update`. A `Some` must be followed
    /// by [`LayerCache::commit_slots`] once the keys and values are written.
    ///
    /// # Errors
    /// Allocation errors.
    pub(crate) fn reserve_slots(
        &mut self,
        n: usize,
        device: &candle_core::Device,
    ) -> Result<Option<(Tensor, Tensor)>, CacheError> {
        match self {
            LayerCache::Simple(c) => c.reserve_slots(n, device),
            LayerCache::Rotating(c) => c.reserve_slots(n, device),
            LayerCache::Batch(c) => c.reserve_slots(n, device),
            LayerCache::Quantized(_) => Ok(None),
        }
    }

    /// Packed storage for the next `n` tokens of a packed quantized cache (a batch's when it
    /// holds one sequence): the six parts, codes, scales and biases of K then of V, as
    /// `[1, kv_heads, n, ..]` views, for a kernel that quantizes them in place; `None` for
    /// dense caches, a quantized cache not packed yet, or a ring write that wraps or overwrites
    /// a needed key. A `Some` must be followed by [`LayerCache::commit_slots`].
    ///
    /// # Errors
    /// Allocation errors.
    pub(crate) fn reserve_packed_slots(
        &mut self,
        n: usize,
        device: &candle_core::Device,
    ) -> Result<Option<Vec<Tensor>>, CacheError> {
        match self {
            LayerCache::Quantized(c) => c.reserve_slots(n, device),
            LayerCache::Batch(c) => c.reserve_packed_slots(n, device),
            LayerCache::Simple(_) | LayerCache::Rotating(_) => Ok(None),
        }
    }

    /// Counts `n` tokens written into storage from [`LayerCache::reserve_slots`] or
    /// [`LayerCache::reserve_packed_slots`] and returns the view `update` would have returned.
    ///
    /// # Errors
    /// [`CacheError::Config`] when no such storage was reserved.
    pub(crate) fn commit_slots(&mut self, n: usize) -> Result<KvView, CacheError> {
        let offsets = self.offsets();
        let view = match self {
            LayerCache::Simple(c) => c.commit_slots(n),
            LayerCache::Rotating(c) => c.commit_slots(n),
            LayerCache::Batch(c) => c.commit_slots(n),
            LayerCache::Quantized(c) => c.commit_slots(n),
        }?;
        Ok(view.settled_below(&offsets))
    }
}

/// The counters of a dense cache that writing a token advances, taken before a step and put
/// back if the step is abandoned before any kernel ran (storage is never touched).
#[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CacheMark {
    /// A [`SimpleCache`]'s tokens held.
    Simple(usize),
    /// A [`RotatingCache`]'s `(first, offset)`.
    Rotating((usize, usize)),
    /// A packed [`QuantizedCache`]'s storage counters.
    Quantized(QuantMark),
    /// One mark per sequence of a [`BatchCache`].
    Batch(Vec<CacheMark>),
}

#[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
impl LayerCache {
    /// The counters to restore this cache to; `None` for kinds without marks (quantized).
    pub(crate) fn mark(&self) -> Option<CacheMark> {
        Some(match self {
            LayerCache::Simple(c) => CacheMark::Simple(c.mark()),
            LayerCache::Rotating(c) => CacheMark::Rotating(c.mark()),
            LayerCache::Batch(b) => CacheMark::Batch(
                b.sequences()
                    .iter()
                    .map(LayerCache::mark)
                    .collect::<Option<Vec<_>>>()?,
            ),
            LayerCache::Quantized(c) => CacheMark::Quantized(c.mark()?),
        })
    }

    /// Puts back the counters of [`LayerCache::mark`]; a mark of another kind is ignored.
    pub(crate) fn restore(&mut self, mark: &CacheMark) {
        match (self, mark) {
            (LayerCache::Simple(c), CacheMark::Simple(m)) => c.restore(*m),
            (LayerCache::Rotating(c), CacheMark::Rotating(m)) => c.restore(*m),
            (LayerCache::Quantized(c), CacheMark::Quantized(m)) => c.restore(*m),
            (LayerCache::Batch(b), CacheMark::Batch(marks)) => {
                for (c, m) in b.sequences_mut().iter_mut().zip(marks) {
                    c.restore(m);
                }
            }
            _ => {}
        }
    }

    /// The layout of the stored K/V: the dtype of dense K/V or of a packed cache's scales and
    /// biases, and a packed cache's bits and group size. A batch has one when every sequence
    /// has the same; `None` otherwise, and for quantized caches not packed yet.
    pub(crate) fn storage_layout(&self) -> Option<(candle_core::DType, Option<(usize, usize)>)> {
        match self {
            LayerCache::Simple(c) => Some((c.dtype(), None)),
            LayerCache::Rotating(c) => Some((c.dtype(), None)),
            LayerCache::Quantized(c) => {
                let q = c.quant();
                Some((c.packed_dtype()?, Some((q.bits.bits(), q.group_size))))
            }
            LayerCache::Batch(b) => {
                let mut seqs = b.sequences().iter().map(LayerCache::storage_layout);
                let first = seqs.next()??;
                seqs.all(|l| l == Some(first)).then_some(first)
            }
        }
    }

    /// Appends the identity of each sequence's storage (one entry, or one a sequence of a
    /// batch) to `out`: an entry changes whenever that storage is replaced, so a step planned
    /// against the same counters and the same identities addresses the same memory.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn storage_ids(&self, out: &mut Vec<Option<candle_core::TensorId>>) {
        match self {
            LayerCache::Simple(c) => out.push(c.storage_id()),
            LayerCache::Rotating(c) => out.push(c.storage_id()),
            LayerCache::Quantized(c) => out.push(c.storage_id()),
            LayerCache::Batch(b) => b.sequences().iter().for_each(|c| c.storage_ids(out)),
        }
    }
}

impl KvCache for LayerCache {
    fn update(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView, CacheError> {
        let dense_in_capture = || CacheError::Config {
            field: "dense cache",
            reason: "a captured decode step must write K/V into reserved slots in place".into(),
        };
        // Keys held before this update are settled: only its own writes may still run.
        let offsets = self.offsets();
        let view = match self {
            LayerCache::Simple(_) | LayerCache::Rotating(_) if capturing_graph() => {
                Err(dense_in_capture())
            }
            LayerCache::Simple(c) => c.update(k, v),
            LayerCache::Rotating(c) => c.update(k, v),
            LayerCache::Quantized(c) => c.update(k, v),
            LayerCache::Batch(c) => c.update(k, v),
        }?;
        Ok(view.settled_below(&offsets))
    }

    fn offsets(&self) -> Vec<usize> {
        match self {
            LayerCache::Simple(c) => c.offsets(),
            LayerCache::Rotating(c) => c.offsets(),
            LayerCache::Quantized(c) => c.offsets(),
            LayerCache::Batch(c) => c.offsets(),
        }
    }

    fn trim(&mut self, n: usize) -> Result<(), CacheError> {
        match self {
            LayerCache::Simple(c) => c.trim(n),
            LayerCache::Rotating(c) => c.trim(n),
            LayerCache::Quantized(c) => c.trim(n),
            LayerCache::Batch(c) => c.trim(n),
        }
    }

    fn memory_bytes(&self) -> usize {
        match self {
            LayerCache::Simple(c) => c.memory_bytes(),
            LayerCache::Rotating(c) => c.memory_bytes(),
            LayerCache::Quantized(c) => c.memory_bytes(),
            LayerCache::Batch(c) => c.memory_bytes(),
        }
    }

    fn reset(&mut self) {
        match self {
            LayerCache::Simple(c) => c.reset(),
            LayerCache::Rotating(c) => c.reset(),
            LayerCache::Quantized(c) => c.reset(),
            LayerCache::Batch(c) => c.reset(),
        }
    }
}
