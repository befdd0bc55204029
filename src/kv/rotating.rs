//! [`RotatingCache`]: a ring buffer for sliding-window layers, memory bounded by the window.

use candle_core::{DType, Device, Tensor};

use super::buffer::{Geometry, RingBuf};
use super::simple::{dense_view, pair};
use super::{CacheError, KvCache, KvView, LayerCacheSpec};

/// K/V of the last `window` tokens (plus optional slack slots) in a ring buffer.
///
/// The window holds W keys *including the current one*: key `k` is visible to query `q` iff
/// `q - W < k <= q`. Position `p` lives in slot `p % slots`; every view carries each key's
/// absolute position, so the storage never needs reordering and attention builds its mask from
/// positions.
///
/// * One-token update (decode): written in place; the view is the ring itself (after the ring
///   fills, exactly the W visible keys: no mask needed).
/// * Multi-token update whose writes would overwrite keys its first queries still need (a chunk
///   longer than the free slots): the view is `cat(live keys, new keys)`, dense and complete,
///   and the ring keeps the last `slots` positions afterwards.
///
/// Memory is bounded by `slots` tokens whatever the sequence length. Trimming works while the
/// keys needed after the rollback are still live; `slack` extra slots buy `slack` more tokens of
/// rollback after the ring has wrapped.
#[derive(Debug)]
pub struct RotatingCache {
    geometry: Geometry,
    ring: RingBuf,
}

impl RotatingCache {
    /// A ring of exactly `window` slots.
    ///
    /// # Errors
    /// [`CacheError::Config`] when `spec.window` is `None` or 0.
    pub fn new(spec: &LayerCacheSpec, dtype: DType) -> Result<Self, CacheError> {
        Self::with_slack(spec, 0, dtype)
    }

    /// A ring of `window + slack` slots: `slack` more tokens can be trimmed after it wraps
    /// (speculative decoding), at the price of `slack` tokens of memory.
    ///
    /// # Errors
    /// [`CacheError::Config`] when `spec.window` is `None` or 0.
    pub fn with_slack(
        spec: &LayerCacheSpec,
        slack: usize,
        dtype: DType,
    ) -> Result<Self, CacheError> {
        let window = window_of(spec)?;
        let geometry = Geometry {
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            dtype,
        };
        Ok(Self {
            geometry,
            ring: RingBuf::new(window, window + slack),
        })
    }

    /// Keys visible to a query, its own included.
    pub fn window(&self) -> usize {
        self.ring.window()
    }

    /// Slots of the ring (`window + slack`).
    pub fn slots(&self) -> usize {
        self.ring.size()
    }

    /// Live tokens in position order with the position of the first: `([1, kv_heads, n,
    /// head_dim]` K and V, first position), or `None` when empty. This is what a prompt cache
    /// saves.
    ///
    /// # Errors
    /// Candle errors while gathering a wrapped ring.
    pub fn live(&self) -> Result<Option<(Tensor, Tensor, usize)>, CacheError> {
        let first = self.ring.first();
        Ok(self.ring.live()?.and_then(pair).map(|(k, v)| (k, v, first)))
    }

    /// Rebuilds the ring from live K/V in position order, the first at position `first`
    /// (the inverse of [`RotatingCache::live`]).
    ///
    /// # Errors
    /// Shape or dtype disagreeing with the geometry.
    pub fn load(&mut self, k: &Tensor, v: &Tensor, first: usize) -> Result<(), CacheError> {
        self.geometry.check(k, v)?;
        self.ring.load(first, &[k.clone(), v.clone()])
    }

    /// KV heads and head dimension.
    pub fn geometry(&self) -> (usize, usize) {
        (self.geometry.kv_heads, self.geometry.head_dim)
    }

    /// The dtype K and V are stored in.
    pub fn dtype(&self) -> DType {
        self.geometry.dtype
    }

    /// How many tokens [`KvCache::trim`] can roll back now: every key the next query needs
    /// must still be in the ring.
    pub fn trimmable(&self) -> usize {
        self.ring.trimmable()
    }

    /// Empties the ring with the next token at position `offset`.
    pub(crate) fn restart_at(&mut self, offset: usize) {
        self.ring.restart_at(offset);
    }

    /// A deep copy: new storage, same tokens.
    ///
    /// # Errors
    /// Candle errors while copying.
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        Ok(Self {
            geometry: self.geometry.clone(),
            ring: self.ring.deep_clone()?,
        })
    }
}

/// The window of a sliding layer's spec.
pub(crate) fn window_of(spec: &LayerCacheSpec) -> Result<usize, CacheError> {
    match spec.window {
        Some(w) if w > 0 => Ok(w),
        Some(_) => Err(CacheError::Config {
            field: "window",
            reason: "a sliding window must hold at least 1 token".into(),
        }),
        None => Err(CacheError::Config {
            field: "window",
            reason: "a rotating cache needs a sliding window (got None)".into(),
        }),
    }
}

/// The `CannotTrim` error of a ring.
pub(crate) fn ring_trim(ring: &mut RingBuf, n: usize) -> Result<(), CacheError> {
    let available = ring.trimmable();
    if n > available {
        let reason = if n > ring.offset() {
            "more tokens than the cache has seen".to_string()
        } else {
            let next = ring.offset() - n;
            format!(
                "the ring keeps positions {}..{}, but the next query (position {next}) needs keys from position {}",
                ring.first(),
                ring.offset(),
                (next + 1).saturating_sub(ring.window())
            )
        };
        return Err(CacheError::CannotTrim {
            requested: n,
            available,
            reason,
        });
    }
    ring.trim(n);
    Ok(())
}

impl RotatingCache {
    /// The slots of the next `n` tokens' keys and values (`[1, kv_heads, n, head_dim]` views on
    /// `device`) for a kernel to write in place, when they form one run of the ring and
    /// overwrite no key the new queries need (always for one token); `None` otherwise.
    /// [`RotatingCache::commit_slots`] then counts them.
    pub(crate) fn reserve_slots(
        &mut self,
        n: usize,
        device: &Device,
    ) -> Result<Option<(Tensor, Tensor)>, CacheError> {
        let parts = self.ring.reserve(&self.geometry.dense_parts(device), n)?;
        Ok(parts.and_then(pair))
    }

    /// Counts `n` tokens written into reserved slots; returns what `update` would have.
    pub(crate) fn commit_slots(&mut self, n: usize) -> Result<KvView, CacheError> {
        let (parts, positions) = self.ring.commit(n)?;
        dense_view(parts, positions)
    }

    /// The identity of the storage (see [`crate::kv::LayerCache::storage_ids`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn storage_id(&self) -> Option<candle_core::TensorId> {
        self.ring.storage_id()
    }

    /// The ring's counters (see [`crate::kv::CacheMark`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn mark(&self) -> (usize, usize) {
        self.ring.mark()
    }

    /// Sets the counters back to a [`RotatingCache::mark`].
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn restore(&mut self, mark: (usize, usize)) {
        self.ring.restore(mark);
    }
}

impl KvCache for RotatingCache {
    /// Appends and returns the keys the new queries may see, each with its absolute position
    /// (storage order; older keys outside every window may be included and are masked).
    fn update(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView, CacheError> {
        self.geometry.check(k, v)?;
        let (parts, positions) = self.ring.update(&[k.clone(), v.clone()])?;
        dense_view(parts, positions)
    }

    fn offsets(&self) -> Vec<usize> {
        vec![self.ring.offset()]
    }

    fn trim(&mut self, n: usize) -> Result<(), CacheError> {
        ring_trim(&mut self.ring, n)
    }

    /// Allocated bytes (at most `slots` tokens).
    fn memory_bytes(&self) -> usize {
        self.ring.bytes()
    }

    fn reset(&mut self) {
        self.ring.reset();
    }
}
