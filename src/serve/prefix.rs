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
//! # Sliding-window layers: reuse only while the cut fits what the cache can roll back
//!
//! A rotating cache (and a quantized cache's ring on sliding layers) keeps only the last W
//! positions; once it has wrapped, the keys an earlier position needs are gone, and
//! [`ModelCache::trimmable`] says how far it can still roll back (every token while it has not
//! wrapped; 1 token once a ring of W slots has wrapped). The store keeps no ring checkpoints: an
//! entry of `n` tokens serves a match of `m` tokens only when `n - m` tokens can be cut, and
//! otherwise another entry (or none) is used. Growing caches (full-attention layers, and every
//! layer of [`CacheMode::Simple`]) cut anywhere. What this means:
//!
//! - **Multi-turn chat** (the new prompt extends an entry's tokens): the match is the whole
//!   entry, nothing is cut, reuse works with every layout and any length. Asking for exactly an
//!   entry's tokens cuts one token, which a wrapped ring also allows.
//! - **A shared system prompt** (the new prompt diverges inside an entry): reused with every
//!   layout while the entry has not outgrown the window, and at any length with
//!   [`CacheMode::Simple`]; a rotating or quantized layout whose rings have wrapped past the
//!   divergence point is prefilled afresh. A caller that wants such prefixes reused inserts the
//!   state at the prefix boundary (any inserted state serves every prompt that extends it).
//! - A packed quantized cache with a nonzero `start` is never cut below `start` (it would
//!   resume packed where a fresh cache is still dense).
//!
//! # Memory
//!
//! Entries are charged their [`ModelCache::memory_bytes`] (allocated storage). After an insert,
//! least recently used entries (a lookup hit or an insert counts as a use) are evicted until the
//! total fits the budget; an entry larger than the whole budget is not kept. An insert that
//! extends an entry which it can be cut back to replaces that entry, and one that such an entry
//! already covers only refreshes it, so a conversation holds one entry, not one per turn.

use candle_core::DType;

use crate::kv::{CacheConfig, CacheError, CacheMode, LayerCache, ModelCache};
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
                    self.window.map_or(true, |w| w == r.window())
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
                            .map_or(true, |w| self.window.map_or(true, |mine| mine == w))
                }
                _ => false,
            };
            if !ok {
                return Err(mismatch(format!("kind of layer {l}"), found, self));
            }
            let dtype = c.dense_dtype().or_else(|| c.packed_dtype());
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

/// One held state.
#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    layout: LayoutKey,
    cache: ModelCache,
    /// The fewest tokens the cache can be cut back to.
    floor: usize,
    bytes: usize,
    /// Tick of the last use (insert or lookup hit).
    used: u64,
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
    bytes: usize,
    tick: u64,
}

impl PrefixStore {
    /// An empty store that holds at most `budget_bytes` of K/V (0 keeps nothing).
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget: budget_bytes,
            entries: Vec::new(),
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
        let mut best: Option<(usize, usize)> = None; // (entry index, tokens reused)
        for (i, e) in self.entries.iter().enumerate() {
            if e.layout != *layout {
                continue;
            }
            let m = common_prefix(&e.tokens, &tokens[..limit]);
            if m == 0 || m < e.floor {
                continue;
            }
            let better = match best {
                None => true,
                Some((j, n)) => m > n || (m == n && e.bytes < self.entries[j].bytes),
            };
            if better {
                best = Some((i, m));
            }
        }
        let Some((i, m)) = best else {
            return Ok(None);
        };
        self.tick += 1;
        let entry = &mut self.entries[i];
        entry.used = self.tick;
        let mut cache = entry.cache.deep_clone()?;
        cache.trim(entry.tokens.len() - m)?;
        Ok(Some((cache, m)))
    }

    /// Keeps `cache`, holding the K/V of `tokens`; evicts least recently used entries beyond
    /// the budget. An empty `tokens` is ignored.
    ///
    /// # Errors
    /// [`CacheError::Batched`] for a batched cache; [`CacheError::Mismatch`] when the cache
    /// holds another number of tokens than `tokens.len()` or was not built with `layout`.
    pub fn insert(&mut self, tokens: Vec<u32>, layout: LayoutKey, cache: ModelCache) -> Result<()> {
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
        layout.check(&cache)?;
        if tokens.is_empty() {
            return Ok(());
        }
        let floor = floor(&cache, tokens.len());
        self.tick += 1;
        // An entry the new state covers (a prefix of it, cut back to at no loss) goes; an entry
        // that covers the new state makes it redundant.
        let mut i = 0;
        while i < self.entries.len() {
            let e = &mut self.entries[i];
            if e.layout == layout {
                if is_prefix(&tokens, &e.tokens) && e.floor <= floor {
                    e.used = self.tick;
                    return Ok(());
                }
                if is_prefix(&e.tokens, &tokens) && floor <= e.floor {
                    self.remove(i);
                    continue;
                }
            }
            i += 1;
        }
        let bytes = cache.memory_bytes();
        self.bytes += bytes;
        self.entries.push(Entry {
            tokens,
            layout,
            cache,
            floor,
            bytes,
            used: self.tick,
        });
        self.evict();
        Ok(())
    }

    /// Bytes of K/V held by every entry.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }

    fn remove(&mut self, i: usize) -> Entry {
        let e = self.entries.swap_remove(i);
        self.bytes -= e.bytes;
        e
    }

    /// Evicts least recently used entries until the total fits the budget.
    fn evict(&mut self) {
        while self.bytes > self.budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    self.remove(i);
                }
                None => break,
            }
        }
    }
}

/// The fewest tokens `cache`, holding `n`, can be cut back to: what every layer can roll back,
/// and never below `start` for a packed quantized layer with a nonzero `start`.
fn floor(cache: &ModelCache, n: usize) -> usize {
    let packed_start = cache
        .layers
        .iter()
        .flatten()
        .filter_map(|c| match c {
            LayerCache::Quantized(q) if q.is_packed() => Some(q.quant().start),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    n.saturating_sub(cache.trimmable()).max(packed_start.min(n))
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Whether `a` is a prefix of `b`.
fn is_prefix(a: &[u32], b: &[u32]) -> bool {
    a.len() <= b.len() && a == &b[..a.len()]
}
