//! KV caches: one [`KvCache`] trait, four implementations ([`SimpleCache`], [`RotatingCache`],
//! [`QuantizedCache`], [`BatchCache`]) and the [`LayerCache`] enum that dispatches them.
//!
//! Every update returns a [`KvView`] that says whether K/V are dense or packed, so attention
//! matches on the form it was given and a packed cache can never reach the dense kernel. A
//! KV-consumer layer receives its producer's view of the current step unchanged, whatever its
//! form.
//!
//! Shapes: a single-sequence cache takes `[1, kv_heads, tokens, head_dim]`; a batch cache takes
//! `[batch, kv_heads, tokens, head_dim]` and returns one view per sequence.
//!
//! The views and their parts ([`KvView`], [`KvData`], [`PackedAffine`], [`KeyPositions`],
//! [`QuantBits`]) are the kernels' operand types, re-exported here; kernel errors reach cache
//! users as [`CacheError`]s.

mod batch;
mod buffer;
mod config;
mod error;
mod layer;
mod model_cache;
mod prompt;
mod quantized;
mod rotating;
mod simple;

pub use batch::BatchCache;
pub(crate) use config::layer_cache_specs;
pub use config::{CacheConfig, CacheMode, LayerCacheSpec, QuantSpec};
pub use error::CacheError;
pub(crate) use layer::CacheMark;
pub use layer::{CacheKind, LayerCache};
pub use model_cache::ModelCache;
pub use prompt::{CacheMeta, PromptCache};
pub use quantized::QuantizedCache;
pub use rotating::RotatingCache;
pub use simple::SimpleCache;

pub use crate::kernels::{
    KernelError, KeyPositions, KvData, KvView, PackedAffine, PositionRun, QuantBits,
};
use candle_core::Tensor;

/// The operations every cache supports. No method traps: an operation a cache cannot honour
/// returns a [`CacheError`] naming the reason.
pub trait KvCache {
    /// Appends `k`, `v` (`[batch, kv_heads, tokens, head_dim]`, keys already normed and
    /// rotated) and returns what attention reads for these tokens: every key that any of the
    /// new queries may see (and possibly older ones, which the position mask hides).
    ///
    /// # Errors
    /// Shape or dtype disagreeing with the cache's geometry, or a batch size mismatch.
    fn update(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView, CacheError>;

    /// Tokens seen so far by each sequence (one entry for a single-sequence cache). This is the
    /// absolute position of the next token; read it *before* [`KvCache::update`].
    fn offsets(&self) -> Vec<usize>;

    /// Rolls every sequence back by `n` tokens.
    ///
    /// # Errors
    /// [`CacheError::CannotTrim`] when the tokens needed after the rollback were already
    /// dropped (a ring buffer that wrapped) or `n` exceeds the tokens held.
    fn trim(&mut self, n: usize) -> Result<(), CacheError>;

    /// Bytes of K/V storage in use (packed codes, scales and biases included).
    fn memory_bytes(&self) -> usize;

    /// Forgets every token, keeping the configuration.
    fn reset(&mut self);
}

#[cfg(test)]
mod tests;
