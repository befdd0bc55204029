//! Token storage shared by every cache: a set of tensors with a common token axis (axis 2),
//! either growing (amortised doubling) or a ring of fixed size. The caches put `[k, v]` in them
//! when dense and the six packed parts (codes, scales, biases of K then V) when quantized, so
//! the layout logic is written once.
//!
//! New tokens are written in place with `Tensor::slice_set`; views handed out are narrows of the
//! storage, so a view is only valid until the next write into the same cache (attention reads
//! it within the step, as every engine does).

use candle_core::{DType, Device, Tensor};

use super::{CacheError, KeyPositions};

/// Token axis of every stored tensor (`[1, heads, tokens, width]`).
const T: usize = 2;
/// First allocation of a growing buffer, in tokens; later ones double.
const GROW_STEP: usize = 256;

/// What a buffer's parts look like: `[1, heads, tokens, width]` with `(heads, width, dtype)`
/// per part, on one device.
#[derive(Debug, Clone)]
pub(crate) struct PartSpec {
    /// `(heads, width, dtype)` of each part.
    pub parts: Vec<(usize, usize, DType)>,
    /// Device of the storage.
    pub device: Device,
}

impl PartSpec {
    /// The spec of parts shaped like `like` (`[1, heads, n, width]` each).
    fn of(like: &[Tensor]) -> Result<Self, CacheError> {
        let first = like.first().ok_or_else(unallocated)?;
        let parts = like
            .iter()
            .map(|t| Ok((t.dim(1)?, t.dim(3)?, t.dtype())))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            parts,
            device: first.device().clone(),
        })
    }

    /// Zeroed parts with `tokens` on the token axis.
    fn alloc(&self, tokens: usize) -> Result<Vec<Tensor>, CacheError> {
        self.parts
            .iter()
            .map(|&(heads, width, dtype)| {
                Ok(Tensor::zeros(
                    (1, heads, tokens, width),
                    dtype,
                    &self.device,
                )?)
            })
            .collect()
    }
}

/// Copies `src` (tokens `from..from+len` of each part) into `dst` at token `at`.
fn write(
    dst: &[Tensor],
    src: &[Tensor],
    from: usize,
    len: usize,
    at: usize,
) -> Result<(), CacheError> {
    for (d, s) in dst.iter().zip(src) {
        let rows = if from == 0 && len == s.dim(T)? {
            s.clone()
        } else {
            s.narrow(T, from, len)?
        };
        // On CUDA one strided copy; elsewhere a contiguous copy, then the slice write.
        if crate::kernels::kv_write::copy_token_rows(&d.narrow(T, at, len)?, &rows)? {
            continue;
        }
        d.slice_set(&rows.contiguous()?, T, at)?;
    }
    Ok(())
}

fn narrow_all(parts: &[Tensor], start: usize, len: usize) -> Result<Vec<Tensor>, CacheError> {
    Ok(parts
        .iter()
        .map(|t| t.narrow(T, start, len))
        .collect::<candle_core::Result<_>>()?)
}

fn cat_all(a: &[Tensor], b: &[Tensor]) -> Result<Vec<Tensor>, CacheError> {
    Ok(a.iter()
        .zip(b)
        .map(|(x, y)| Tensor::cat(&[x, y], T))
        .collect::<candle_core::Result<_>>()?)
}

/// The storage was not allocated where it must be (a broken invariant, reported rather than
/// panicking).
pub(crate) fn unallocated() -> CacheError {
    CacheError::Config {
        field: "storage",
        reason: "internal: cache storage not allocated".into(),
    }
}

/// Fresh copies of stored `parts` (none before any storage is allocated).
fn copy_parts(parts: Option<&[Tensor]>) -> Result<Option<Vec<Tensor>>, CacheError> {
    Ok(match parts {
        Some(p) => Some(
            p.iter()
                .map(Tensor::copy)
                .collect::<candle_core::Result<_>>()?,
        ),
        None => None,
    })
}

fn bytes(parts: &[Tensor]) -> usize {
    parts
        .iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum()
}

/// A growing buffer: tokens `0..len` in storage order, capacity doubling when full.
#[derive(Debug, Default)]
pub(crate) struct GrowBuf {
    /// `[1, heads, cap, width_i]` per part; `None` until the first append.
    parts: Option<Vec<Tensor>>,
    /// Allocated tokens.
    cap: usize,
    /// Tokens held.
    len: usize,
}

impl GrowBuf {
    /// The identity of the storage (its first part), `None` before any is allocated: it
    /// changes whenever the storage is replaced.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub fn storage_id(&self) -> Option<candle_core::TensorId> {
        self.parts.as_ref().and_then(|p| p.first()).map(Tensor::id)
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Appends `new` (`[1, heads, n, width_i]` per part) and returns the held tokens `0..len`.
    pub fn append(&mut self, new: &[Tensor]) -> Result<Vec<Tensor>, CacheError> {
        let n = new[0].dim(T)?;
        let need = self.len + n;
        self.ensure_cap(&PartSpec::of(new)?, need)?;
        let parts = self.parts.as_ref().ok_or_else(unallocated)?;
        write(parts, new, 0, n, self.len)?;
        self.len = need;
        narrow_all(parts, 0, self.len)
    }

    fn ensure_cap(&mut self, spec: &PartSpec, need: usize) -> Result<(), CacheError> {
        if need > self.cap || self.parts.is_none() {
            let cap = need.max(self.cap * 2).max(GROW_STEP).div_ceil(GROW_STEP) * GROW_STEP;
            let grown = spec.alloc(cap)?;
            if let Some(old) = &self.parts {
                // The whole old buffer is contiguous: copy it as is (slots past `len` included).
                write(&grown, old, 0, self.cap, 0)?;
            }
            self.parts = Some(grown);
            self.cap = cap;
        }
        Ok(())
    }

    /// The storage of the next `n` tokens (views, `[1, heads, n, width]` per part, growing the
    /// buffer first if needed) for a kernel to write in place; [`GrowBuf::commit`] then counts
    /// them.
    pub fn reserve(&mut self, spec: &PartSpec, n: usize) -> Result<Vec<Tensor>, CacheError> {
        self.ensure_cap(spec, self.len + n)?;
        let parts = self.parts.as_ref().ok_or_else(unallocated)?;
        narrow_all(parts, self.len, n)
    }

    /// Counts `n` tokens written into reserved storage and returns the held tokens `0..len`.
    pub fn commit(&mut self, n: usize) -> Result<Vec<Tensor>, CacheError> {
        let parts = self.parts.as_ref().ok_or_else(unallocated)?;
        if self.len + n > self.cap {
            return Err(unallocated());
        }
        self.len += n;
        narrow_all(parts, 0, self.len)
    }

    /// Tokens `0..len`, in order (views of the storage).
    pub fn live(&self) -> Result<Option<Vec<Tensor>>, CacheError> {
        match &self.parts {
            Some(p) if self.len > 0 => Ok(Some(narrow_all(p, 0, self.len)?)),
            _ => Ok(None),
        }
    }

    /// Drops the last `n` tokens (`n <= len`, checked by the caller).
    pub fn trim(&mut self, n: usize) {
        self.len -= n.min(self.len);
    }

    /// The counter a commit advances (see [`crate::kv::CacheMark`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub fn mark(&self) -> usize {
        self.len
    }

    /// Sets the counter back to `len` (storage untouched).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub fn restore(&mut self, len: usize) {
        self.len = len.min(self.cap);
    }

    /// Frees the storage.
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Allocated bytes.
    pub fn bytes(&self) -> usize {
        self.parts.as_deref().map_or(0, bytes)
    }

    /// A deep copy (new storage).
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        let parts = copy_parts(self.parts.as_deref())?;
        Ok(Self {
            parts,
            cap: self.cap,
            len: self.len,
        })
    }
}

/// Stored parts and the absolute position of each of their tokens.
type Positioned = (Vec<Tensor>, KeyPositions);

/// A ring of `size` slots: position `p` lives in slot `p % size`. Live positions are
/// `first..offset` (at most `size` of them). Storage grows up to `size` slots while the ring
/// has not wrapped, so a short sequence does not pay for the whole window.
#[derive(Debug)]
pub(crate) struct RingBuf {
    /// `[1, heads, cap, width_i]` per part, `cap <= size`; `None` until the first update.
    parts: Option<Vec<Tensor>>,
    /// Allocated slots.
    cap: usize,
    /// Slots of a full ring (`>= window`).
    size: usize,
    /// Keys a query sees, its own included.
    window: usize,
    /// Oldest live position.
    first: usize,
    /// Tokens seen: the position of the next token.
    offset: usize,
}

impl RingBuf {
    /// The identity of the storage (its first part), `None` before any is allocated: it
    /// changes whenever the storage is replaced.
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub fn storage_id(&self) -> Option<candle_core::TensorId> {
        self.parts.as_ref().and_then(|p| p.first()).map(Tensor::id)
    }

    /// An empty ring of `size >= window >= 1` slots.
    pub fn new(window: usize, size: usize) -> Self {
        Self {
            parts: None,
            cap: 0,
            size,
            window,
            first: 0,
            offset: 0,
        }
    }

    /// Position of the next token.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Oldest live position.
    pub fn first(&self) -> usize {
        self.first
    }

    /// Keys a query sees, its own included.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Slots of a full ring.
    pub fn size(&self) -> usize {
        self.size
    }

    fn ensure_cap(&mut self, spec: &PartSpec, slots: usize) -> Result<(), CacheError> {
        let slots = slots.min(self.size);
        if self.parts.is_some() && slots <= self.cap {
            return Ok(());
        }
        // Growing happens only before the ring wraps, so slot indices equal positions and the
        // old slots keep their index.
        let cap = slots
            .max(self.cap * 2)
            .max(GROW_STEP.min(self.size))
            .min(self.size);
        let grown = spec.alloc(cap)?;
        if let Some(old) = &self.parts {
            write(&grown, old, 0, self.cap, 0)?;
        }
        self.parts = Some(grown);
        self.cap = cap;
        Ok(())
    }

    /// Writes new tokens at positions `offset..offset+n`, keeping only the last `size` of them.
    fn store(&mut self, new: &[Tensor], n: usize) -> Result<(), CacheError> {
        self.ensure_cap(&PartSpec::of(new)?, self.offset + n)?;
        let parts = self.parts.as_ref().ok_or_else(unallocated)?;
        let keep = n.min(self.size);
        let from = n - keep; // skip what would be overwritten within this very update
        let p0 = self.offset + from;
        let s0 = p0 % self.size;
        let head = keep.min(self.size - s0);
        write(parts, new, from, head, s0)?;
        if keep > head {
            write(parts, new, from + head, keep - head, 0)?;
        }
        self.offset += n;
        self.first = self.first.max(self.offset.saturating_sub(self.size));
        Ok(())
    }

    /// Live tokens and their positions. Zero-copy when the live slots form one run (the usual
    /// case: a ring not yet wrapped, or a full one); a ring trimmed after wrapping is gathered.
    /// `ordered` forces position order (for saving and converting).
    fn view(&self, ordered: bool) -> Result<Option<Positioned>, CacheError> {
        let Some(parts) = &self.parts else {
            return Ok(None);
        };
        let count = self.offset - self.first;
        if count == 0 {
            return Ok(None);
        }
        let s0 = self.first % self.size;
        if count == self.cap && !ordered {
            // Every slot live: slot s holds the position congruent to s, so slots 0..s0 hold
            // the newest positions and slots s0.. the oldest.
            let mut positions = KeyPositions::new();
            positions.push_run(self.first + self.size - s0, s0);
            positions.push_run(self.first, self.cap - s0);
            return Ok(Some((parts.clone(), positions)));
        }
        let positions = KeyPositions::range(self.first..self.offset);
        if s0 + count <= self.cap {
            return Ok(Some((narrow_all(parts, s0, count)?, positions)));
        }
        let head = self.size - s0;
        let a = narrow_all(parts, s0, head)?;
        let b = narrow_all(parts, 0, count - head)?;
        Ok(Some((cat_all(&a, &b)?, positions)))
    }

    /// Live tokens in position order (`first..offset`), for saving and conversion.
    pub fn live(&self) -> Result<Option<Vec<Tensor>>, CacheError> {
        Ok(self.view(true)?.map(|(t, _)| t))
    }

    /// Appends `new` (`[1, heads, n, width_i]` per part) and returns every key some new query
    /// may see, with positions (older keys the mask hides may be included).
    ///
    /// In place when the write overwrites no key the new queries need (always for one token);
    /// otherwise the answer is `cat(live keys, new keys)` and the ring then keeps the last
    /// `size` positions.
    pub fn update(&mut self, new: &[Tensor]) -> Result<Positioned, CacheError> {
        let n = new[0].dim(T)?;
        if self.writes_in_place(n) {
            self.store(new, n)?;
            let (t, p) = self.view(false)?.ok_or_else(unallocated)?;
            return Ok((t, p));
        }
        let dense = match self.view(false)? {
            Some((old, mut positions)) => {
                positions.push_run(self.offset, n);
                let new_c: Vec<Tensor> = new
                    .iter()
                    .map(|t| t.contiguous())
                    .collect::<candle_core::Result<_>>()?;
                (cat_all(&old, &new_c)?, positions)
            }
            None => (
                new.to_vec(),
                KeyPositions::range(self.offset..self.offset + n),
            ),
        };
        self.store(new, n)?;
        Ok(dense)
    }

    /// Whether writing `n` new tokens in place overwrites no key the first new query needs.
    fn writes_in_place(&self, n: usize) -> bool {
        // Oldest position the first new query still needs.
        let needed = self
            .first
            .max((self.offset + 1).saturating_sub(self.window));
        // The write overwrites positions up to offset + n - 1 - size.
        self.offset + n < self.size + 1 + needed
    }

    /// The slots of the next `n` tokens (views, `[1, heads, n, width]` per part) for a kernel
    /// to write in place, when they form one run and overwrite no key the new queries need
    /// (always for one token); `None` otherwise (the caller then goes through
    /// [`RingBuf::update`]). [`RingBuf::commit`] then counts them.
    pub fn reserve(
        &mut self,
        spec: &PartSpec,
        n: usize,
    ) -> Result<Option<Vec<Tensor>>, CacheError> {
        let s0 = self.offset % self.size;
        if n == 0 || !self.writes_in_place(n) || s0 + n > self.size {
            return Ok(None);
        }
        self.ensure_cap(spec, self.offset + n)?;
        let parts = self.parts.as_ref().ok_or_else(unallocated)?;
        if s0 + n > self.cap {
            return Ok(None);
        }
        Ok(Some(narrow_all(parts, s0, n)?))
    }

    /// Counts `n` tokens written into reserved slots and returns what [`RingBuf::update`]
    /// would have.
    pub fn commit(&mut self, n: usize) -> Result<Positioned, CacheError> {
        if self.parts.is_none() || (self.offset % self.size) + n > self.cap {
            return Err(unallocated());
        }
        self.offset += n;
        self.first = self.first.max(self.offset.saturating_sub(self.size));
        self.view(false)?.ok_or_else(unallocated)
    }

    /// Tokens that can be rolled back: every key the next query will need must still be live.
    pub fn trimmable(&self) -> usize {
        if self.first == 0 {
            self.offset
        } else {
            self.offset.saturating_sub(self.first + self.window - 1)
        }
    }

    /// Rolls back `n <= trimmable()` tokens (checked by the caller).
    pub fn trim(&mut self, n: usize) {
        self.offset -= n.min(self.offset);
        self.first = self.first.min(self.offset);
    }

    /// The counters a commit advances: `(first, offset)` (see [`crate::kv::CacheMark`]).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub fn mark(&self) -> (usize, usize) {
        (self.first, self.offset)
    }

    /// Sets the counters back (storage untouched).
    #[allow(dead_code)] // used by the decode-graph driver (CUDA builds)
    pub fn restore(&mut self, (first, offset): (usize, usize)) {
        self.first = first;
        self.offset = offset;
    }

    /// Frees the storage.
    pub fn reset(&mut self) {
        *self = Self::new(self.window, self.size);
    }

    /// Empties the ring, the next token at position `offset` (a ring whose live keys were all
    /// trimmed away: with a window of 1 the next query needs none of them).
    pub fn restart_at(&mut self, offset: usize) {
        self.reset();
        self.offset = offset;
        self.first = offset;
    }

    /// Rebuilds a ring from live tokens in position order (`first..first+len`).
    pub fn load(&mut self, first: usize, live: &[Tensor]) -> Result<(), CacheError> {
        self.reset();
        let n = live[0].dim(T)?;
        if first.checked_add(n).is_none() {
            return Err(CacheError::Shape {
                what: "first position of a ring",
                expected: "a position that fits".into(),
                found: vec![first, n],
            });
        }
        self.offset = first;
        self.first = first;
        self.store(live, n)
    }

    /// Allocated bytes.
    pub fn bytes(&self) -> usize {
        self.parts.as_deref().map_or(0, bytes)
    }

    /// A deep copy (new storage).
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        let parts = copy_parts(self.parts.as_deref())?;
        Ok(Self { parts, ..*self })
    }
}

/// What a single-sequence cache accepts: `[1, kv_heads, n >= 1, head_dim]` K and V of one dtype.
#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Activation dtype of K/V.
    pub dtype: candle_core::DType,
}

impl Geometry {
    /// The K and V parts of a dense cache on `device`.
    pub fn dense_parts(&self, device: &Device) -> PartSpec {
        PartSpec {
            parts: vec![(self.kv_heads, self.head_dim, self.dtype); 2],
            device: device.clone(),
        }
    }

    /// Validates one update and returns its token count.
    pub fn check(&self, k: &Tensor, v: &Tensor) -> Result<usize, CacheError> {
        for (what, t) in [("keys", k), ("values", v)] {
            let d = t.dims();
            if d.len() != 4
                || d[0] != 1
                || d[1] != self.kv_heads
                || d[2] == 0
                || d[3] != self.head_dim
            {
                return Err(CacheError::Shape {
                    what,
                    expected: format!("[1, {}, tokens >= 1, {}]", self.kv_heads, self.head_dim),
                    found: d.to_vec(),
                });
            }
            if t.dtype() != self.dtype {
                return Err(CacheError::DType {
                    what,
                    expected: self.dtype,
                    found: t.dtype(),
                });
            }
        }
        if k.dims() != v.dims() {
            return Err(CacheError::Shape {
                what: "values",
                expected: format!("{:?} like the keys", k.dims()),
                found: v.dims().to_vec(),
            });
        }
        Ok(k.dim(T)?)
    }
}
