//! [`SimpleCache`]: dense K/V of every token seen, for full-attention layers.

use candle_core::{DType, Device, Tensor};

use super::buffer::{Geometry, GrowBuf};
use super::{CacheError, KeyPositions, KvCache, KvData, KvView, LayerCacheSpec};

/// Dense K/V of every token seen, stored in preallocated buffers `[1, kv_heads, capacity,
/// head_dim]` that double when full; each update writes only its new tokens.
///
/// ```
/// # use candle_core::{DType, Device, Tensor};
/// # use candle_gemma::kv::{KvCache, LayerCacheSpec, SimpleCache};
/// let spec = LayerCacheSpec { kv_heads: 2, head_dim: 8, window: None };
/// let mut cache = SimpleCache::new(&spec, DType::F32);
/// let k = Tensor::zeros((1, 2, 3, 8), DType::F32, &Device::Cpu)?;
/// cache.update(&k, &k)?;
/// assert_eq!(cache.offsets(), vec![3]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct SimpleCache {
    geometry: Geometry,
    buf: GrowBuf,
}

impl SimpleCache {
    /// An empty cache for K/V of `spec.kv_heads × spec.head_dim` in `dtype` (`spec.window` is
    /// ignored: every token is kept). Storage is allocated on the device of the first update.
    pub fn new(spec: &LayerCacheSpec, dtype: DType) -> Self {
        let geometry = Geometry {
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            dtype,
        };
        Self {
            geometry,
            buf: GrowBuf::default(),
        }
    }

    /// Every token held, in order: `[1, kv_heads, tokens, head_dim]` K and V (views of the
    /// storage), or `None` when empty.
    pub fn kv(&self) -> Result<Option<(Tensor, Tensor)>, CacheError> {
        Ok(self.buf.live()?.and_then(pair))
    }

    /// Rebuilds the cache from K and V (`[1, kv_heads, tokens, head_dim]`), as saved.
    ///
    /// # Errors
    /// Shape or dtype disagreeing with the geometry.
    pub fn load(&mut self, k: &Tensor, v: &Tensor) -> Result<(), CacheError> {
        self.geometry.check(k, v)?;
        self.buf.reset();
        self.buf.append(&[k.clone(), v.clone()])?;
        Ok(())
    }

    /// KV heads and head dimension.
    pub fn geometry(&self) -> (usize, usize) {
        (self.geometry.kv_heads, self.geometry.head_dim)
    }

    /// The dtype K and V are stored in.
    pub fn dtype(&self) -> DType {
        self.geometry.dtype
    }

    /// How many tokens [`KvCache::trim`] can roll back now (all of them).
    pub fn trimmable(&self) -> usize {
        self.buf.len()
    }

    /// A deep copy: new storage, same tokens.
    ///
    /// # Errors
    /// Candle errors while copying.
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        Ok(Self {
            geometry: self.geometry.clone(),
            buf: self.buf.deep_clone()?,
        })
    }
}

/// `[k, v]` into a pair.
impl SimpleCache {
    /// The storage of the next `n` tokens' keys and values (`[1, kv_heads, n, head_dim]` views
    /// on `device`) for a kernel to write in place, growing the cache first if needed;
    /// [`SimpleCache::commit_slots`] then counts them. Always `Some` (a growing cache takes any
    /// run of tokens).
    pub(crate) fn reserve_slots(
        &mut self,
        n: usize,
        device: &Device,
    ) -> Result<Option<(Tensor, Tensor)>, CacheError> {
        let parts = self.buf.reserve(&self.geometry.dense_parts(device), n)?;
        Ok(pair(parts))
    }

    /// Counts `n` tokens written into reserved storage; returns what `update` would have.
    pub(crate) fn commit_slots(&mut self, n: usize) -> Result<KvView, CacheError> {
        let parts = self.buf.commit(n)?;
        dense_view(parts, KeyPositions::range(0..self.buf.len()))
    }

    /// The identity of the storage (see [`crate::kv::LayerCache::storage_ids`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn storage_id(&self) -> Option<candle_core::TensorId> {
        self.buf.storage_id()
    }

    /// Tokens held (see [`crate::kv::CacheMark`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn mark(&self) -> usize {
        self.buf.mark()
    }

    /// Sets the tokens held back to a [`SimpleCache::mark`].
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn restore(&mut self, len: usize) {
        self.buf.restore(len);
    }
}

pub(crate) fn pair(parts: Vec<Tensor>) -> Option<(Tensor, Tensor)> {
    let mut it = parts.into_iter();
    Some((it.next()?, it.next()?))
}

/// The view of a dense cache's stored `[k, v]` parts at `positions`.
pub(crate) fn dense_view(
    parts: Vec<Tensor>,
    positions: KeyPositions,
) -> Result<KvView, CacheError> {
    let (k, v) = pair(parts).ok_or_else(super::buffer::unallocated)?;
    Ok(KvView::Single {
        data: KvData::Dense { k, v },
        positions,
    })
}

impl KvCache for SimpleCache {
    /// Appends and returns every token held (`[1, kv_heads, offset, head_dim]`), positions
    /// `0..offset`.
    fn update(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView, CacheError> {
        self.geometry.check(k, v)?;
        let parts = self.buf.append(&[k.clone(), v.clone()])?;
        dense_view(parts, KeyPositions::range(0..self.buf.len()))
    }

    fn offsets(&self) -> Vec<usize> {
        vec![self.buf.len()]
    }

    fn trim(&mut self, n: usize) -> Result<(), CacheError> {
        if n > self.buf.len() {
            return Err(CacheError::CannotTrim {
                requested: n,
                available: self.buf.len(),
                reason: "more tokens than the cache holds".into(),
            });
        }
        self.buf.trim(n);
        Ok(())
    }

    /// Allocated bytes (capacity, not only the tokens held).
    fn memory_bytes(&self) -> usize {
        self.buf.bytes()
    }

    fn reset(&mut self) {
        self.buf.reset();
    }
}
