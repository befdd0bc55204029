//! Batched model caches whose sequences have different layouts: a dense, a rotating, an 8-bit
//! and a 4-bit sequence side by side in one [`ModelCache`].
//!
//! [`ModelCache::batch`] and [`ModelCache::push_sequence`] insist that every sequence of a
//! layer has the same cache kind. A [`BatchCache`] itself has no such need: each sequence keeps
//! its own storage and gets its own attention view (dense or packed), and the batched kernels
//! fall back to one launch per sequence where kinds differ. These helpers build such batches;
//! the only thing they require is that the sequences agree on which layers own a cache (true of
//! any two caches of one model).

use crate::error::Result;
use crate::kv::{BatchCache, CacheError, LayerCache, ModelCache};

/// Adds `seq` (a single-sequence cache) at the end of `batch`, creating the batch when it is
/// `None`.
///
/// # Errors
/// [`CacheError::NestedBatch`] when `seq` is batched; [`CacheError::Layout`] when it disagrees
/// with the batch on which layers own a cache (nothing is added then).
pub(super) fn push(batch: &mut Option<ModelCache>, seq: ModelCache) -> Result<()> {
    if seq.is_batched() {
        return Err(CacheError::NestedBatch.into());
    }
    let Some(batch) = batch.as_mut() else {
        let layers = seq
            .layers
            .into_iter()
            .map(|c| {
                c.map(|c| BatchCache::new(vec![c]).map(LayerCache::Batch))
                    .transpose()
            })
            .collect::<std::result::Result<_, _>>()?;
        *batch = Some(ModelCache { layers });
        return Ok(());
    };
    let agree =
        batch.layers.len() == seq.layers.len()
            && batch.layers.iter().zip(&seq.layers).all(|(b, s)| {
                matches!((b, s), (Some(LayerCache::Batch(_)), Some(_)) | (None, None))
            });
    if !agree {
        let layer = batch
            .layers
            .iter()
            .zip(&seq.layers)
            .position(|(b, s)| b.is_some() != s.is_some())
            .unwrap_or(batch.layers.len().min(seq.layers.len()));
        return Err(CacheError::Layout {
            layer,
            reason: "the sequence disagrees with the batch on which layers own a cache".into(),
        }
        .into());
    }
    for (mine, theirs) in batch.layers.iter_mut().zip(seq.layers) {
        if let (Some(LayerCache::Batch(b)), Some(c)) = (mine, theirs) {
            b.push(c)?;
        }
    }
    Ok(())
}

/// Splits a batched cache back into its single-sequence caches, in batch order.
///
/// # Errors
/// [`CacheError::NotBatched`] when `batch` is not batched.
pub(super) fn split(mut batch: ModelCache) -> Result<Vec<ModelCache>> {
    let n = batch.batch_size();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(batch.remove_sequence(0)?);
    }
    Ok(out)
}
