//! [`PrefixStore`]: K/V states of earlier requests, kept so that a new request whose prompt
//! starts with the same tokens skips prefilling them.
//!
//! # What is stored and how it is found
//!
//! Each entry is a single-sequence [`ModelCache`] holding the K/V of its `tokens` (a finished
//! request's prompt plus the answer tokens whose K/V the cache holds, or a prompt right after
//! its prefill), under a [`LayoutKey`]: cache kind, KV bits, group size, quantization start,
//! sliding window and dtype. A lookup only considers entries of the requested layout, so a
//! 4-bit request never receives a dense or 8-bit state, nor the reverse.
//!
//! [`PrefixStore::lookup`] scans the entries of the layout and takes, for each, the longest
//! common prefix with the new prompt (at most `prompt.len() - 1` tokens: the last prompt token
//! must still go through the model to produce the next logits). The longest usable match wins;
//! the answer is a deep copy of that entry's cache cut back to the match, so the entry stays
//! intact for later requests. A scan costs one token comparison per held token at most, and the
//! byte budget bounds the tokens held.
//!
//! # Sliding-window layers: ring checkpoints from the states handed in
//!
//! A rotating cache (and a quantized cache's ring on sliding layers) keeps only the last W
//! positions; once it has wrapped, the keys an earlier position needs are gone, and
//! [`ModelCache::trimmable`] says how far it can still roll back (every token while it has not
//! wrapped; 1 token once a ring of W slots has wrapped). Growing caches (full-attention layers,
//! and every layer of [`CacheMode::Simple`]) cut anywhere. So an entry of `n` tokens serves a
//! match of `m` tokens from its own cache only while its rings can roll back `n - m` tokens.
//!
//! For shorter matches the store keeps **ring checkpoints**: when a state is inserted whose
//! tokens are a prefix of an entry's (or the reverse) and the longer one cannot be cut back to
//! it, the shorter state's ring layers stay with the longer entry as a checkpoint (W tokens per
//! sliding layer), and its growing layers are dropped (the longer entry's growing layers, cut
//! back, serve in their place). A match of `m` tokens is then served by the entry's growing
//! layers cut to `m` and a checkpoint's rings cut to `m`, from the checkpoint that allows the
//! longest match. The store cannot make checkpoints itself (a wrapped ring has lost the earlier
//! keys); it keeps those it is given, by [`PrefixStore::insert`] or, copying only the rings, by
//! [`PrefixStore::checkpoint`] (say, a prompt's state right after its prefill, which waits for
//! the request's final state to be inserted):
//!
//! - **Multi-turn chat**: the next turn's prompt extends a finished request's tokens; when its
//!   template re-renders the answer identically the whole entry is reused, with any layout and
//!   length. When it differs inside the answer (thinking dropped from history, say), a
//!   checkpoint of the previous prompt still serves that prompt. A scheduler that checkpoints
//!   each prompt after its prefill and inserts each finished state gets both.
//! - **A shared system prompt**: served from any entry that has not outgrown the window since
//!   the divergence point, from any entry of [`CacheMode::Simple`], and from a checkpoint at or
//!   below the divergence point; a rotating or quantized layout with none of these prefills it
//!   afresh.
//! - A packed quantized cache with a nonzero `start` is never cut below `start` (it would
//!   resume packed where a fresh cache is still dense).
//!
//! # Memory
//!
//! Entries are charged their [`ModelCache::memory_bytes`] (allocated storage), checkpoints
//! their rings'. After an insert, least recently used entries (a lookup hit or an insert counts
//! as a use) are evicted with their checkpoints until the total fits the budget; checkpoints
//! still waiting for their entry are evicted the same way, and an entry larger than the whole
//! budget is not kept. An insert that extends an entry which it can be cut back to replaces
//! that entry, and one that such an entry already covers only refreshes it, so a conversation
//! holds one entry (plus ring checkpoints), not one per turn.

use candle_core::DType;

use crate::kv::{CacheConfig, CacheError, CacheMode, KvCache, LayerCache, ModelCache};
use crate::{Model, Result};

/// What a cached K/V state is compatible with: cache kind, KV bits, group size, quantization
/// start, sliding window and dtype. Two requests share prefix states only when their keys are
/// equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayoutKey {
    kind: KindKey,
    window: Option<usize>,
    dtype: DType,
}

/// The cache family part of a [`LayoutKey`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum KindKey {
    Simple,
    Rotating,
    Quantized {
        bits: usize,
        group_size: usize,
        start: usize,
    },
}

impl LayoutKey {
    /// The key of caches built from `cache` in `dtype`, with no sliding window recorded (one
    /// store serves one model, whose window is fixed; see [`LayoutKey::for_model`]).
    pub fn new(cache: &CacheConfig, dtype: DType) -> Self {
        let kind = match cache.mode {
            CacheMode::Simple => KindKey::Simple,
            CacheMode::Rotating => KindKey::Rotating,
            CacheMode::Quantized(q) => KindKey::Quantized {
                bits: q.bits.bits(),
                group_size: q.group_size,
                start: q.start,
            },
        };
        Self {
            kind,
            window: None,
            dtype,
        }
    }

    /// The key of caches `model` builds from `cache`: its dtype and sliding window.
    pub fn for_model(model: &Model, cache: &CacheConfig) -> Self {
        Self::new(cache, model.dtype()).with_window(model.config().sliding_window)
    }

    /// The same key with the sliding window `window` recorded.
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }

    /// The sliding window recorded, if any.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The activation dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Checks that `cache` was built with this layout, naming the first layer that disagrees.
    fn check(&self, cache: &ModelCache) -> std::result::Result<(), CacheError> {
        for (l, c) in cache.layers.iter().enumerate() {
            let Some(c) = c else { continue };
            let found = c.kind().to_string();
            let ok = match (self.kind, c) {
                (KindKey::Simple, LayerCache::Simple(_)) => true,
                (KindKey::Rotating, LayerCache::Simple(_)) => true,
                (KindKey::Rotating, LayerCache::Rotating(r)) => {
                    self.window.is_none_or(|w| w == r.window())
                }
                (
                    KindKey::Quantized {
                        bits,
                        group_size,
                        start,
                    },
                    LayerCache::Quantized(q),
                ) => {
                    let s = q.quant();
                    s.bits.bits() == bits
                        && s.group_size == group_size
                        && s.start == start
                        && q.window()
                            .is_none_or(|w| self.window.is_none_or(|mine| mine == w))
                }
                _ => false,
            };
            if !ok {
                return Err(mismatch(format!("kind of layer {l}"), found, self));
            }
            let dtype = c.storage_layout().map(|(d, _)| d);
            if let Some(d) = dtype.filter(|&d| d != self.dtype) {
                return Err(mismatch(format!("dtype of layer {l}"), d.as_str(), self));
            }
        }
        Ok(())
    }
}

fn mismatch(field: String, found: impl Into<String>, key: &LayoutKey) -> CacheError {
    CacheError::Mismatch {
        field,
        saved: found.into(),
        requested: format!("{key:?}"),
    }
}

/// One held state, with ring checkpoints at shorter prefixes of its tokens.
#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    layout: LayoutKey,
    cache: ModelCache,
    /// Cut limits of the whole cache.
    reach: Reach,
    /// The fewest tokens the growing layers can be cut back to.
    growing_floor: usize,
    /// Ring layers of earlier states along `tokens`.
    checkpoints: Vec<Checkpoint>,
    /// Bytes of the cache and the checkpoints.
    bytes: usize,
    /// Tick of the last use (insert or lookup hit).
    used: u64,
}

/// The ring layers (`None` elsewhere) of a state that held the first `len` tokens of its
/// entry.
#[derive(Debug)]
struct Checkpoint {
    len: usize,
    rings: Vec<Option<LayerCache>>,
    /// The fewest tokens the rings can be cut back to.
    floor: usize,
    bytes: usize,
}

/// A checkpoint waiting for an entry along its tokens (see [`PrefixStore::checkpoint`]).
#[derive(Debug)]
struct Pending {
    tokens: Vec<u32>,
    layout: LayoutKey,
    checkpoint: Checkpoint,
    used: u64,
}

/// How far a state of `len` tokens can be cut back: to any length in `floor..=len`.
#[derive(Debug, Clone, Copy)]
struct Reach {
    len: usize,
    floor: usize,
}

/// Whether a layer's cache is a ring (a sliding layer's rotating or quantized ring).
fn is_ring(c: &LayerCache) -> bool {
    match c {
        LayerCache::Rotating(_) => true,
        LayerCache::Quantized(q) => q.window().is_some(),
        _ => false,
    }
}

/// The fewest tokens `layers`, holding `n`, can be cut back to: what every layer can roll back,
/// and never below `start` for a packed quantized layer with a nonzero `start`.
fn floor<'a>(layers: impl Iterator<Item = &'a LayerCache>, n: usize) -> usize {
    let mut floor = 0;
    for c in layers {
        floor = floor.max(n.saturating_sub(c.trimmable()));
        if let LayerCache::Quantized(q) = c {
            if q.is_packed() {
                floor = floor.max(q.quant().start.min(n));
            }
        }
    }
    floor
}

fn layer_bytes<'a>(layers: impl Iterator<Item = &'a LayerCache>) -> usize {
    layers.map(KvCache::memory_bytes).sum()
}

impl Checkpoint {
    /// The ring layers of `cache` (holding `len` tokens); its other layers are dropped.
    fn of(cache: ModelCache, len: usize) -> Self {
        let rings = cache
            .layers
            .into_iter()
            .map(|c| c.filter(is_ring))
            .collect();
        Self::from_rings(rings, len)
    }

    /// Deep copies of the ring layers of `cache` (holding `len` tokens).
    fn copy_of(cache: &ModelCache, len: usize) -> std::result::Result<Self, CacheError> {
        let rings = cache
            .layers
            .iter()
            .map(|c| match c {
                Some(c) if is_ring(c) => c.deep_clone().map(Some),
                _ => Ok(None),
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self::from_rings(rings, len))
    }

    fn from_rings(rings: Vec<Option<LayerCache>>, len: usize) -> Self {
        let floor = floor(rings.iter().flatten(), len);
        let bytes = layer_bytes(rings.iter().flatten());
        Self {
            len,
            rings,
            floor,
            bytes,
        }
    }
}

impl Entry {
    /// The most tokens of a prompt sharing `common` tokens with this entry that can be reused,
    /// and the checkpoint that serves them (`None`: the entry's own cache).
    fn best_cut(&self, common: usize) -> Option<(usize, Option<usize>)> {
        if common == 0 {
            return None;
        }
        if common >= self.reach.floor {
            return Some((common, None));
        }
        self.checkpoints
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let m = c.len.min(common);
                (m > 0 && m >= c.floor && m >= self.growing_floor).then_some((m, Some(i)))
            })
            .max_by_key(|&(m, _)| m)
    }

    /// A deep copy cut to `m` tokens, its ring layers from checkpoint `from` when given.
    fn cut_copy(
        &self,
        m: usize,
        from: Option<usize>,
    ) -> std::result::Result<ModelCache, CacheError> {
        let Some(ck) = from.and_then(|i| self.checkpoints.get(i)) else {
            let mut cache = self.cache.deep_clone()?;
            cache.trim(self.reach.len - m)?;
            return Ok(cache);
        };
        let mut layers = Vec::with_capacity(self.cache.layers.len());
        for (own, ring) in self.cache.layers.iter().zip(&ck.rings) {
            layers.push(match (own, ring) {
                (Some(_), Some(ring)) => {
                    let mut c = ring.deep_clone()?;
                    c.trim(ck.len - m)?;
                    Some(c)
                }
                (Some(own), None) => {
                    let mut c = own.deep_clone()?;
                    c.trim(self.reach.len - m)?;
                    Some(c)
                }
                (None, _) => None,
            });
        }
        Ok(ModelCache { layers })
    }

    /// Takes `ck` when it reaches back further than the entry's own cache and no checkpoint of
    /// that length is held already.
    fn add_checkpoint(&mut self, ck: Checkpoint) {
        let useful = ck.len < self.reach.len && ck.floor < self.reach.floor;
        if useful && self.checkpoints.iter().all(|c| c.len != ck.len) {
            self.bytes += ck.bytes;
            self.checkpoints.push(ck);
        }
    }
}

/// K/V states of earlier requests keyed by tokens and [`LayoutKey`], bounded by a byte budget
/// with least-recently-used eviction (see the module documentation for the matching and
/// sliding-window rules).
///
/// ```
/// use candle_gemma::serve::prefix::{LayoutKey, PrefixStore};
/// use candle_gemma::{CacheConfig, Model};
///
/// # fn main() -> candle_gemma::Result<()> {
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/e2b-hf");
/// let model = Model::builder().path(dir).build()?;
/// let config = CacheConfig::default();
/// let layout = LayoutKey::for_model(&model, &config);
/// let mut store = PrefixStore::new(64 << 20);
///
/// let first = vec![2, 10, 11, 12, 13];
/// let mut cache = model.new_cache(&config)?;
/// model.forward(&[first.clone()], &mut cache)?;
/// store.insert(first, layout, cache)?;
///
/// // A prompt that extends it reuses all five tokens and prefills only the rest.
/// let (mut cache, held) = store.lookup(&[2, 10, 11, 12, 13, 14, 15], &layout)?.unwrap();
/// assert_eq!(held, 5);
/// let logits = model.forward(&[vec![14, 15]], &mut cache)?;
/// # let _ = logits;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PrefixStore {
    budget: usize,
    entries: Vec<Entry>,
    /// Checkpoints that no entry extends yet.
    pending: Vec<Pending>,
    bytes: usize,
    tick: u64,
}

impl PrefixStore {
    /// An empty store that holds at most `budget_bytes` of K/V (0 keeps nothing).
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget: budget_bytes,
            entries: Vec::new(),
            pending: Vec::new(),
            bytes: 0,
            tick: 0,
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// The longest held prefix of `tokens` for this layout, at most `tokens.len() - 1` tokens
    /// (one token must still go through the model for the next logits): a deep copy of the
    /// cache cut to that length, and the length. Never a state of another layout. `None` when
    /// no entry of the layout shares a usable prefix.
    ///
    /// # Errors
    /// Candle errors while copying; a cut the cache refuses (not expected: the store only
    /// picks cuts the cache reported it can make).
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        layout: &LayoutKey,
    ) -> Result<Option<(ModelCache, usize)>> {
        let limit = tokens.len().saturating_sub(1);
        // (entry index, tokens reused, checkpoint)
        let mut best: Option<(usize, usize, Option<usize>)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            if e.layout != *layout {
                continue;
            }
            let Some((m, from)) = e.best_cut(common_prefix(&e.tokens, &tokens[..limit])) else {
                continue;
            };
            let better = match best {
                None => true,
                Some((j, n, _)) => m > n || (m == n && e.bytes < self.entries[j].bytes),
            };
            if better {
                best = Some((i, m, from));
            }
        }
        let Some((i, m, from)) = best else {
            return Ok(None);
        };
        self.tick += 1;
        let entry = &mut self.entries[i];
        entry.used = self.tick;
        Ok(Some((entry.cut_copy(m, from)?, m)))
    }

    /// Keeps `cache`, holding the K/V of `tokens`; evicts least recently used entries beyond
    /// the budget. An empty `tokens` is ignored.
    ///
    /// A state along an entry's tokens is merged with it: one that the entry can be cut back to
    /// only refreshes the entry, one that extends the entry and can be cut back to it replaces
    /// it, and otherwise the shorter state's ring layers stay as a checkpoint of the longer
    /// one (its growing layers are dropped: the longer state's growing layers, cut back, serve
    /// in their place).
    ///
    /// # Errors
    /// [`CacheError::Batched`] for a batched cache; [`CacheError::Mismatch`] when the cache
    /// holds another number of tokens than `tokens.len()` or was not built with `layout`.
    pub fn insert(&mut self, tokens: Vec<u32>, layout: LayoutKey, cache: ModelCache) -> Result<()> {
        validate(&tokens, &layout, &cache)?;
        if tokens.is_empty() {
            return Ok(());
        }
        self.tick += 1;
        let n = tokens.len();
        let reach = Reach {
            len: n,
            floor: floor(cache.layers.iter().flatten(), n),
        };
        // Along an existing entry: covered by it, or kept as its checkpoint.
        if let Some(i) = self
            .entries
            .iter()
            .position(|e| e.layout == layout && is_prefix(&tokens, &e.tokens))
        {
            let e = &mut self.entries[i];
            e.used = self.tick;
            if e.reach.floor > reach.floor {
                let before = e.bytes;
                e.add_checkpoint(Checkpoint::of(cache, n));
                self.bytes += e.bytes - before;
                self.evict();
            }
            return Ok(());
        }
        let mut entry = Entry {
            growing_floor: floor(cache.layers.iter().flatten().filter(|c| !is_ring(c)), n),
            bytes: cache.memory_bytes(),
            tokens,
            layout,
            cache,
            reach,
            checkpoints: Vec::new(),
            used: self.tick,
        };
        // Entries along the new one's tokens fold into it.
        let mut i = 0;
        while i < self.entries.len() {
            let e = &self.entries[i];
            if e.layout != layout || !is_prefix(&e.tokens, &entry.tokens) {
                i += 1;
                continue;
            }
            let old = self.entries.swap_remove(i);
            self.bytes -= old.bytes;
            for ck in old.checkpoints {
                entry.add_checkpoint(ck);
            }
            entry.add_checkpoint(Checkpoint::of(old.cache, old.reach.len));
        }
        // Pending checkpoints along the new entry's tokens join it.
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            if p.layout != layout || !is_prefix(&p.tokens, &entry.tokens) {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            self.bytes -= p.checkpoint.bytes;
            entry.add_checkpoint(p.checkpoint);
        }
        self.bytes += entry.bytes;
        self.entries.push(entry);
        self.evict();
        Ok(())
    }

    /// Keeps deep copies of the ring layers of `cache`, which holds the K/V of `tokens`, as a
    /// checkpoint for a later state along the same tokens: typically a prompt's state right
    /// after its prefill, before the request's final state is inserted. Only the sliding
    /// layers' rings (at most W tokens each) are copied, so this is cheaper than inserting a
    /// deep copy of the whole state. Until an entry whose tokens extend `tokens` is inserted,
    /// the checkpoint serves nothing; it counts in [`PrefixStore::bytes`] and is evicted like
    /// an entry. Nothing is kept for a cache without rings (growing caches cut anywhere), for
    /// rings larger than the whole budget (keeping them would only evict everything else), or
    /// when an entry already reaches back to `tokens`.
    ///
    /// # Errors
    /// As [`PrefixStore::insert`]; candle errors while copying.
    pub fn checkpoint(
        &mut self,
        tokens: &[u32],
        layout: &LayoutKey,
        cache: &ModelCache,
    ) -> Result<()> {
        validate(tokens, layout, cache)?;
        let n = tokens.len();
        let rings = layer_bytes(cache.layers.iter().flatten().filter(|c| is_ring(c)));
        if n == 0 || rings == 0 || rings > self.budget {
            return Ok(());
        }
        self.tick += 1;
        let along = self
            .entries
            .iter()
            .position(|e| e.layout == *layout && is_prefix(tokens, &e.tokens));
        if let Some(i) = along {
            let e = &mut self.entries[i];
            e.used = self.tick;
            let rings = cache.layers.iter().flatten().filter(|c| is_ring(c));
            if floor(rings, n) < e.reach.floor {
                let before = e.bytes;
                e.add_checkpoint(Checkpoint::copy_of(cache, n)?);
                self.bytes += e.bytes - before;
                self.evict();
            }
            return Ok(());
        }
        if let Some(p) = self
            .pending
            .iter_mut()
            .find(|p| p.layout == *layout && p.tokens == tokens)
        {
            p.used = self.tick;
            return Ok(());
        }
        let checkpoint = Checkpoint::copy_of(cache, n)?;
        self.bytes += checkpoint.bytes;
        self.pending.push(Pending {
            tokens: tokens.to_vec(),
            layout: *layout,
            checkpoint,
            used: self.tick,
        });
        self.evict();
        Ok(())
    }

    /// Bytes of K/V held by every entry and checkpoint.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries held (checkpoints are not counted).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every entry and pending checkpoint.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.pending.clear();
        self.bytes = 0;
    }

    /// Evicts least recently used entries and pending checkpoints until the total fits the
    /// budget.
    fn evict(&mut self) {
        while self.bytes > self.budget {
            let entry = self.entries.iter().enumerate().min_by_key(|(_, e)| e.used);
            let pending = self.pending.iter().enumerate().min_by_key(|(_, p)| p.used);
            match (entry, pending) {
                (Some((_, e)), Some((j, p))) if p.used < e.used => {
                    let p = self.pending.swap_remove(j);
                    self.bytes -= p.checkpoint.bytes;
                }
                (Some((i, _)), _) => {
                    let e = self.entries.swap_remove(i);
                    self.bytes -= e.bytes;
                }
                (None, Some((j, _))) => {
                    let p = self.pending.swap_remove(j);
                    self.bytes -= p.checkpoint.bytes;
                }
                (None, None) => break,
            }
        }
    }
}

/// Checks that `cache` is a single-sequence state of `layout` holding `tokens.len()` tokens.
fn validate(tokens: &[u32], layout: &LayoutKey, cache: &ModelCache) -> Result<()> {
    if cache.is_batched() {
        return Err(CacheError::Batched {
            what: "keeping a prefix state",
            batch: cache.batch_size(),
        }
        .into());
    }
    let held = cache.offsets();
    if held != [tokens.len()] {
        return Err(CacheError::Mismatch {
            field: "cached token count".into(),
            saved: format!("{held:?}"),
            requested: tokens.len().to_string(),
        }
        .into());
    }
    Ok(layout.check(cache)?)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Whether `a` is a prefix of `b`.
fn is_prefix(a: &[u32], b: &[u32]) -> bool {
    a.len() <= b.len() && a == &b[..a.len()]
}
