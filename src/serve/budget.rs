//! KV memory of a request before it runs: bytes per token of a cache layout, from the model's
//! layer geometry and the layout's storage format.

use crate::kv::{CacheConfig, CacheMode};
use crate::model::Model;

/// K/V bytes one sequence of layout `cache` holds after `tokens` tokens, summed over the
/// KV-owning layers: dense layers store K and V in the model's dtype; quantized layers store
/// `bits`-bit codes plus one scale and one bias (model dtype) per group of each K and V row.
/// Sliding layers with a ring (rotating or quantized layouts) hold at most their window.
/// Growing buffers allocate ahead in steps, so a live cache may hold more than this.
pub fn kv_bytes_for(model: &Model, cache: &CacheConfig, tokens: usize) -> usize {
    let elem = model.dtype().size_in_bytes();
    model
        .text_model()
        .cache_specs()
        .iter()
        .flatten()
        .map(|spec| {
            let (held, per_row) = match cache.mode {
                CacheMode::Simple => (tokens, spec.head_dim * elem),
                CacheMode::Rotating => (
                    spec.window.map_or(tokens, |w| tokens.min(w)),
                    spec.head_dim * elem,
                ),
                CacheMode::Quantized(q) => {
                    let groups = spec.head_dim.div_ceil(q.group_size.max(1));
                    (
                        spec.window.map_or(tokens, |w| tokens.min(w)),
                        spec.head_dim * q.bits.bits() / 8 + 2 * groups * elem,
                    )
                }
            };
            2 * spec.kv_heads * per_row * held
        })
        .sum()
}

/// K/V bytes per token of layout `cache` while no sliding window is full (every layer grows
/// by one token): the figure to multiply by a short sequence's length.
pub fn kv_bytes_per_token(model: &Model, cache: &CacheConfig) -> usize {
    kv_bytes_for(model, cache, 1)
}
