//! Stand-in for the prefix store (`prefix.rs`) with the same interface: it holds nothing, so
//! every lookup misses.

use candle_core::DType;

use crate::error::Result;
use crate::kv::{CacheConfig, ModelCache};

/// What a cached K/V state is compatible with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutKey {
    cache: CacheConfig,
    dtype: DType,
}

impl LayoutKey {
    /// The key of caches of layout `cache` in `dtype`.
    pub fn new(cache: &CacheConfig, dtype: DType) -> Self {
        Self {
            cache: *cache,
            dtype,
        }
    }
}

/// A store that keeps nothing.
#[derive(Debug, Default)]
pub struct PrefixStore;

impl PrefixStore {
    /// An empty store.
    pub fn new(budget_bytes: usize) -> Self {
        let _ = budget_bytes;
        Self
    }

    /// Always a miss.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        layout: &LayoutKey,
    ) -> Result<Option<(ModelCache, usize)>> {
        let _ = (tokens, layout);
        Ok(None)
    }

    /// Drops `cache`.
    pub fn insert(&mut self, tokens: Vec<u32>, layout: LayoutKey, cache: ModelCache) -> Result<()> {
        let _ = (tokens, layout, cache);
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        0
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        0
    }
}
