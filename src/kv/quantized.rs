//! [`QuantizedCache`]: K/V stored in MLX's group-wise affine format (4 or 8 bits), growing for
//! full layers or as a ring for sliding layers.

use candle_core::{DType, Tensor};

use super::buffer::{unallocated, Geometry, GrowBuf, PartSpec, RingBuf};
use super::rotating::{ring_trim, window_of};
use super::simple::pair;
use super::{CacheError, KeyPositions, KvCache, KvData, KvView, LayerCacheSpec, QuantSpec};
use crate::kernels::kv_write::{capturing_graph, writes_in_place};
use crate::kernels::{quantize, quantize_kv_into, PackedAffine};

/// The storage counters of a packed [`QuantizedCache`], to put back if a step is abandoned
/// before any kernel ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QuantMark {
    /// A growing store's tokens held.
    Grow(usize),
    /// A ring's `(first, offset)`.
    Ring((usize, usize)),
}

/// Growing (full layers) or ring (sliding layers) storage.
#[derive(Debug)]
enum Store {
    Grow(GrowBuf),
    Ring(RingBuf),
}

/// K/V quantized group-wise along the head dimension, in MLX's affine layout (see
/// [`PackedAffine`]): per token and KV head, codes `[head_dim * bits / 32]` `u32` words plus one
/// scale and one bias per group, in the activation dtype.
///
/// The cache stays dense until it has seen `start` tokens; the update that finds it there
/// first converts everything held to packed form, and from then on new tokens are quantized
/// before they are stored and every update returns [`KvData::Packed`] (attention reads the
/// current tokens quantized too, as mlx-lm does). `start == 0` packs from the first token.
///
/// With a window (`spec.window = Some(W)`) the storage is a ring of W slots with the same
/// semantics as [`super::RotatingCache`]: a quantized rotating cache, which mlx-lm lacks.
#[derive(Debug)]
pub struct QuantizedCache {
    geometry: Geometry,
    quant: QuantSpec,
    store: Store,
    packed: bool,
}

impl QuantizedCache {
    /// An empty quantized cache: growing when `spec.window` is `None`, a ring of W slots when
    /// it is `Some(W)`.
    ///
    /// # Errors
    /// [`CacheError::BadGroupSize`] when the group size is not 32, 64 or 128 or does not divide
    /// `head_dim`; [`CacheError::DType`] for a non-float dtype; [`CacheError::Config`] for a
    /// window of 0.
    pub fn new(spec: &LayerCacheSpec, quant: &QuantSpec, dtype: DType) -> Result<Self, CacheError> {
        quant.affine().check(spec.head_dim)?;
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(CacheError::DType {
                what: "quantized cache activations",
                expected: DType::BF16,
                found: dtype,
            });
        }
        let store = match spec.window {
            None => Store::Grow(GrowBuf::default()),
            Some(_) => {
                let w = window_of(spec)?;
                Store::Ring(RingBuf::new(w, w))
            }
        };
        let geometry = Geometry {
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            dtype,
        };
        Ok(Self {
            geometry,
            quant: *quant,
            store,
            packed: false,
        })
    }

    /// The quantization parameters.
    pub fn quant(&self) -> &QuantSpec {
        &self.quant
    }

    /// The sliding window, `None` for a growing cache.
    pub fn window(&self) -> Option<usize> {
        match &self.store {
            Store::Grow(_) => None,
            Store::Ring(r) => Some(r.window()),
        }
    }

    /// Whether the cache holds packed K/V (it has reached `start`).
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    fn offset(&self) -> usize {
        match &self.store {
            Store::Grow(b) => b.len(),
            Store::Ring(r) => r.offset(),
        }
    }

    /// `[k, v]` → the six stored parts (codes, scales, biases of K, then of V).
    fn pack(&self, k: &Tensor, v: &Tensor) -> Result<Vec<Tensor>, CacheError> {
        let pk = quantize(k, self.quant.bits, self.quant.group_size)?;
        let pv = quantize(v, self.quant.bits, self.quant.group_size)?;
        Ok(vec![
            pk.codes, pk.scales, pk.biases, pv.codes, pv.scales, pv.biases,
        ])
    }

    fn data(&self, parts: Vec<Tensor>) -> Result<KvData, CacheError> {
        if !self.packed {
            let (k, v) = pair(parts).ok_or_else(unallocated)?;
            return Ok(KvData::Dense { k, v });
        }
        let spec = self.quant.affine();
        let mut it = parts.into_iter();
        let mut next = || it.next().ok_or_else(unallocated);
        let k = PackedAffine::from_parts(next()?, next()?, next()?, spec);
        let v = PackedAffine::from_parts(next()?, next()?, next()?, spec);
        Ok(KvData::Packed { k, v })
    }

    /// The six packed parts of this cache on `device`.
    fn packed_parts(&self, device: &candle_core::Device) -> PartSpec {
        let g = &self.geometry;
        let words = g.head_dim * self.quant.bits.bits() / 32;
        let groups = g.head_dim / self.quant.group_size;
        let side = [
            (g.kv_heads, words, DType::U32),
            (g.kv_heads, groups, g.dtype),
            (g.kv_heads, groups, g.dtype),
        ];
        PartSpec {
            parts: side.iter().chain(side.iter()).copied().collect(),
            device: device.clone(),
        }
    }

    /// Packed storage for the next `n` tokens (the six parts, codes, scales and biases of K
    /// then of V, as `[1, kv_heads, n, ..]` views on `device`) for a kernel that quantizes
    /// them in place; `None` where this cache cannot take them so (not packed yet, so the next
    /// update may first convert; a ring write that wraps or overwrites a needed key). A `Some`
    /// must be followed by [`QuantizedCache::commit_slots`] once they are written.
    ///
    /// # Errors
    /// Allocation errors.
    pub(crate) fn reserve_slots(
        &mut self,
        n: usize,
        device: &candle_core::Device,
    ) -> Result<Option<Vec<Tensor>>, CacheError> {
        if !self.packed {
            return Ok(None);
        }
        let spec = self.packed_parts(device);
        match &mut self.store {
            Store::Grow(b) => b.reserve(&spec, n).map(Some),
            Store::Ring(r) => r.reserve(&spec, n),
        }
    }

    /// Counts `n` tokens written into the storage of [`QuantizedCache::reserve_slots`]; returns
    /// what `update` would have.
    ///
    /// # Errors
    /// [`CacheError::Config`] when no such storage was reserved.
    pub(crate) fn commit_slots(&mut self, n: usize) -> Result<KvView, CacheError> {
        if !self.packed {
            return Err(CacheError::Config {
                field: "slots",
                reason: "a quantized cache offers slots only once packed; none were reserved"
                    .into(),
            });
        }
        let (parts, positions) = match &mut self.store {
            Store::Grow(b) => {
                let parts = b.commit(n)?;
                (parts, KeyPositions::range(0..b.len()))
            }
            Store::Ring(r) => r.commit(n)?,
        };
        Ok(KvView::Single {
            data: self.data(parts)?,
            positions,
        })
    }

    /// The storage counters (see [`crate::kv::CacheMark`]); `None` before the cache is packed
    /// (the next update may convert it, which no mark can undo).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn mark(&self) -> Option<QuantMark> {
        self.packed.then(|| match &self.store {
            Store::Grow(b) => QuantMark::Grow(b.mark()),
            Store::Ring(r) => QuantMark::Ring(r.mark()),
        })
    }

    /// The identity of the storage (see [`crate::kv::LayerCache::storage_ids`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn storage_id(&self) -> Option<candle_core::TensorId> {
        match &self.store {
            Store::Grow(b) => b.storage_id(),
            Store::Ring(r) => r.storage_id(),
        }
    }

    /// Sets the counters back to a [`QuantizedCache::mark`]; a mark of the other store kind
    /// is ignored.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub(crate) fn restore(&mut self, mark: QuantMark) {
        match (&mut self.store, mark) {
            (Store::Grow(b), QuantMark::Grow(len)) => b.restore(len),
            (Store::Ring(r), QuantMark::Ring(m)) => r.restore(m),
            _ => {}
        }
    }

    /// The dtype of the scales and biases once packed (the activations'); `None` before.
    pub(crate) fn packed_dtype(&self) -> Option<DType> {
        self.packed.then_some(self.geometry.dtype)
    }

    /// Packed `update` that quantizes the new rows straight into the storage's next slots (one
    /// CUDA launch instead of two quantizations, six fresh tensors and six copies); `None`,
    /// having written nothing, where that cannot be done (off CUDA, a ring write that wraps or
    /// overwrites a needed key).
    fn update_in_place(&mut self, k: &Tensor, v: &Tensor) -> Result<Option<KvView>, CacheError> {
        if !writes_in_place(k.device()) {
            return Ok(None);
        }
        let n = k.dim(2)?;
        let Some(slots) = self.reserve_slots(n, k.device())? else {
            return Ok(None);
        };
        if !quantize_kv_into(k, v, self.quant.bits, self.quant.group_size, &slots)? {
            return Ok(None);
        }
        self.commit_slots(n).map(Some)
    }

    /// Converts everything held to packed form (the `start` threshold was reached).
    fn convert(&mut self) -> Result<(), CacheError> {
        let live = match &self.store {
            Store::Grow(b) => b.live()?.map(|p| (p, 0)),
            Store::Ring(r) => r.live()?.map(|p| (p, r.first())),
        };
        let packed = match &live {
            Some((parts, first)) => Some((self.pack(&parts[0], &parts[1])?, *first)),
            None => None,
        };
        match &mut self.store {
            Store::Grow(b) => {
                b.reset();
                if let Some((parts, _)) = &packed {
                    b.append(parts)?;
                }
            }
            Store::Ring(r) => match &packed {
                Some((parts, first)) => r.load(*first, parts)?,
                // Nothing live (all trimmed away): keep the position.
                None => r.restart_at(r.offset()),
            },
        }
        self.packed = true;
        Ok(())
    }

    /// Live tokens in position order and the position of the first: `[k, v]` when dense, the
    /// six packed parts (codes, scales, biases of K then V) when packed; `None` when empty.
    /// This is what a prompt cache saves.
    ///
    /// # Errors
    /// Candle errors while gathering a wrapped ring.
    pub fn live(&self) -> Result<Option<(Vec<Tensor>, usize)>, CacheError> {
        Ok(match &self.store {
            Store::Grow(b) => b.live()?.map(|p| (p, 0)),
            Store::Ring(r) => r.live()?.map(|p| (p, r.first())),
        })
    }

    /// Rebuilds the cache from parts as [`QuantizedCache::live`] returns them (`packed` says
    /// which form), the first at position `first` (must be 0 for a growing cache).
    ///
    /// # Errors
    /// [`CacheError::Shape`] for a wrong number of parts or shapes; candle errors.
    pub fn load(&mut self, packed: bool, parts: &[Tensor], first: usize) -> Result<(), CacheError> {
        let want = if packed { 6 } else { 2 };
        if parts.len() != want {
            return Err(CacheError::Shape {
                what: "quantized cache parts",
                expected: format!("{want} tensors"),
                found: vec![parts.len()],
            });
        }
        if packed {
            let g = &self.geometry;
            let n = parts[0].dim(2)?;
            let words = g.head_dim * self.quant.bits.bits() / 32;
            let groups = g.head_dim / self.quant.group_size;
            for (i, t) in parts.iter().enumerate() {
                let last = if i % 3 == 0 { words } else { groups };
                let dtype = if i % 3 == 0 { DType::U32 } else { g.dtype };
                if t.dims() != [1, g.kv_heads, n, last] || t.dtype() != dtype {
                    return Err(CacheError::Shape {
                        what: "packed cache part",
                        expected: format!("[1, {}, {n}, {last}] of {dtype:?}", g.kv_heads),
                        found: t.dims().to_vec(),
                    });
                }
            }
        } else {
            self.geometry.check(&parts[0], &parts[1])?;
        }
        if first != 0 && matches!(self.store, Store::Grow(_)) {
            return Err(CacheError::Shape {
                what: "first position of a growing cache",
                expected: "0".into(),
                found: vec![first],
            });
        }
        self.packed = packed;
        match &mut self.store {
            Store::Grow(b) => {
                b.reset();
                b.append(parts)?;
            }
            Store::Ring(r) => r.load(first, parts)?,
        }
        Ok(())
    }

    /// KV heads and head dimension.
    pub fn geometry(&self) -> (usize, usize) {
        (self.geometry.kv_heads, self.geometry.head_dim)
    }

    /// How many tokens [`KvCache::trim`] can roll back now.
    pub fn trimmable(&self) -> usize {
        match &self.store {
            Store::Grow(b) => b.len(),
            Store::Ring(r) => r.trimmable(),
        }
    }

    /// Empties the cache with the next token at position `offset` (`packed`: whether it had
    /// reached `start`).
    ///
    /// # Errors
    /// [`CacheError::Shape`] for a nonzero offset on a growing cache (it cannot be empty there).
    pub(crate) fn restart_at(&mut self, packed: bool, offset: usize) -> Result<(), CacheError> {
        match &mut self.store {
            Store::Grow(b) if offset == 0 => b.reset(),
            Store::Grow(_) => {
                return Err(CacheError::Shape {
                    what: "empty growing cache",
                    expected: "offset 0".into(),
                    found: vec![offset],
                })
            }
            Store::Ring(r) => r.restart_at(offset),
        }
        self.packed = packed;
        Ok(())
    }

    /// A deep copy: new storage, same tokens.
    ///
    /// # Errors
    /// Candle errors while copying.
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        let store = match &self.store {
            Store::Grow(b) => Store::Grow(b.deep_clone()?),
            Store::Ring(r) => Store::Ring(r.deep_clone()?),
        };
        Ok(Self {
            geometry: self.geometry.clone(),
            quant: self.quant,
            store,
            packed: self.packed,
        })
    }
}

impl KvCache for QuantizedCache {
    /// Appends and returns the keys the new queries may see with their positions: dense before
    /// `start`, packed after (the new tokens are quantized before attention reads them).
    fn update(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView, CacheError> {
        self.geometry.check(k, v)?;
        if !self.packed && self.offset() >= self.quant.start {
            self.convert()?;
        }
        if self.packed {
            if let Some(view) = self.update_in_place(k, v)? {
                return Ok(view);
            }
        }
        // A step captured into a CUDA graph must write where the graph's parameter area says;
        // the paths below would write to addresses fixed at capture.
        if capturing_graph() {
            return Err(CacheError::Config {
                field: "quantized cache",
                reason: "a captured decode step must quantize K/V into reserved slots in place"
                    .into(),
            });
        }
        let new = if self.packed {
            self.pack(k, v)?
        } else {
            vec![k.clone(), v.clone()]
        };
        let (parts, positions) = match &mut self.store {
            Store::Grow(b) => {
                let parts = b.append(&new)?;
                (parts, KeyPositions::range(0..b.len()))
            }
            Store::Ring(r) => r.update(&new)?,
        };
        Ok(KvView::Single {
            data: self.data(parts)?,
            positions,
        })
    }

    fn offsets(&self) -> Vec<usize> {
        vec![self.offset()]
    }

    fn trim(&mut self, n: usize) -> Result<(), CacheError> {
        match &mut self.store {
            Store::Grow(b) => {
                if n > b.len() {
                    return Err(CacheError::CannotTrim {
                        requested: n,
                        available: b.len(),
                        reason: "more tokens than the cache holds".into(),
                    });
                }
                b.trim(n);
                Ok(())
            }
            Store::Ring(r) => ring_trim(r, n),
        }
    }

    /// Allocated bytes: codes, scales and biases (or dense K/V before `start`).
    fn memory_bytes(&self) -> usize {
        match &self.store {
            Store::Grow(b) => b.bytes(),
            Store::Ring(r) => r.bytes(),
        }
    }

    /// Forgets every token; the cache is dense again until it reaches `start`.
    fn reset(&mut self) {
        match &mut self.store {
            Store::Grow(b) => b.reset(),
            Store::Ring(r) => r.reset(),
        }
        self.packed = false;
    }
}
