//! Prompt caches: a model cache together with the tokens it holds, saved to one safetensors
//! file or deep-copied in memory, and checked against the configuration it is restored into.
//!
//! File layout: tensors `layers.{l}.k` / `layers.{l}.v` (dense) or `layers.{l}.{k,v}.{codes,
//! scales,biases}` (packed), each `[1, kv_heads, tokens, ...]` in *position order* (a ring is
//! unrotated on save and re-rotated on load, so slot order never leaks into the file), and a
//! JSON document under the `__metadata__` key `candle_gemma.prompt_cache` with the tokens, the
//! [`CacheMeta`] and per-layer geometry and first position.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{
    CacheConfig, CacheError, CacheKind, KvCache, LayerCache, LayerCacheSpec, ModelCache, QuantBits,
    QuantSpec, QuantizedCache, RotatingCache, SimpleCache,
};

/// Metadata key of the JSON document in the safetensors header.
const META_KEY: &str = "candle_gemma.prompt_cache";
/// Version of the file layout.
const VERSION: u32 = 1;

/// What a prompt cache was made with: compared on restore so that a cache is never restored
/// into another kind, bit width, dtype or model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheMeta {
    /// Kind of each layer's cache, `None` for KV-consumer layers.
    pub kinds: Vec<Option<CacheKind>>,
    /// Activation dtype (`"bf16"`, `"f16"`, `"f32"`).
    pub dtype: String,
    /// A string identifying the model (e.g. repo id and revision, or a weights hash), supplied
    /// by the caller.
    pub fingerprint: String,
}

impl CacheMeta {
    /// The metadata a fresh cache built from `config` and `specs` would have.
    ///
    /// # Errors
    /// Any [`CacheConfig::build`] error.
    pub fn new(
        config: &CacheConfig,
        specs: &[Option<LayerCacheSpec>],
        dtype: DType,
        fingerprint: impl Into<String>,
    ) -> Result<Self, CacheError> {
        // Building allocates nothing (storage comes with the first update).
        let cache = ModelCache::new(config, specs, dtype, &Device::Cpu)?;
        Ok(Self::of(&cache, dtype, fingerprint))
    }

    /// The metadata of an existing cache.
    pub fn of(cache: &ModelCache, dtype: DType, fingerprint: impl Into<String>) -> Self {
        let kinds = cache
            .layers
            .iter()
            .map(|c| c.as_ref().map(LayerCache::kind))
            .collect();
        Self {
            kinds,
            dtype: dtype.as_str().to_string(),
            fingerprint: fingerprint.into(),
        }
    }

    /// Checks that a cache saved with `self` may be restored where `expected` is wanted.
    ///
    /// # Errors
    /// [`CacheError::Mismatch`] naming the first difference: `fingerprint`, `dtype`,
    /// `layer count`, `kind of layer N`, `bits of layer N`, `group size of layer N`,
    /// `start of layer N`, `window of layer N`.
    pub fn check(&self, expected: &CacheMeta) -> Result<(), CacheError> {
        let mismatch = |field: String, saved: String, requested: String| {
            Err(CacheError::Mismatch {
                field,
                saved,
                requested,
            })
        };
        if self.fingerprint != expected.fingerprint {
            return mismatch(
                "fingerprint".into(),
                self.fingerprint.clone(),
                expected.fingerprint.clone(),
            );
        }
        if self.dtype != expected.dtype {
            return mismatch("dtype".into(), self.dtype.clone(), expected.dtype.clone());
        }
        if self.kinds.len() != expected.kinds.len() {
            return mismatch(
                "layer count".into(),
                self.kinds.len().to_string(),
                expected.kinds.len().to_string(),
            );
        }
        let show = |k: &Option<CacheKind>| {
            k.as_ref()
                .map_or("none (KV consumer)".to_string(), |k| k.to_string())
        };
        for (l, (s, e)) in self.kinds.iter().zip(&expected.kinds).enumerate() {
            if s == e {
                continue;
            }
            use CacheKind::*;
            match (s, e) {
                (
                    Some(Quantized {
                        bits: b1,
                        group_size: g1,
                        start: s1,
                        window: w1,
                    }),
                    Some(Quantized {
                        bits: b2,
                        group_size: g2,
                        start: s2,
                        window: w2,
                    }),
                ) => {
                    let (field, a, b) = if b1 != b2 {
                        ("bits", b1.to_string(), b2.to_string())
                    } else if g1 != g2 {
                        ("group size", g1.to_string(), g2.to_string())
                    } else if s1 != s2 {
                        ("start", s1.to_string(), s2.to_string())
                    } else {
                        ("window", format!("{w1:?}"), format!("{w2:?}"))
                    };
                    return mismatch(format!("{field} of layer {l}"), a, b);
                }
                (Some(Rotating { window: w1, .. }), Some(Rotating { window: w2, .. }))
                    if w1 != w2 =>
                {
                    return mismatch(
                        format!("window of layer {l}"),
                        w1.to_string(),
                        w2.to_string(),
                    );
                }
                _ => return mismatch(format!("kind of layer {l}"), show(s), show(e)),
            }
        }
        Ok(())
    }
}

/// Geometry and live range of one saved layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedLayer {
    kv_heads: usize,
    head_dim: usize,
    /// Position of the first saved token.
    first: usize,
    /// Tokens saved.
    tokens: usize,
    /// Whether the tensors are packed.
    packed: bool,
}

/// The JSON document stored in the header.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedDoc {
    version: u32,
    tokens: Vec<u32>,
    meta: CacheMeta,
    layers: Vec<Option<SavedLayer>>,
}

/// A model cache and the tokens it was fed, ready to be reused by a later prompt that starts
/// with the same tokens. Single-sequence only.
#[derive(Debug)]
pub struct PromptCache {
    /// Every token the cache has seen, in order (`tokens.len()` equals the cache offset).
    pub tokens: Vec<u32>,
    /// The caches.
    pub cache: ModelCache,
    /// What the cache was made with.
    pub meta: CacheMeta,
}

const DENSE_NAMES: [&str; 2] = ["k", "v"];
const PACKED_NAMES: [&str; 6] = [
    "k.codes", "k.scales", "k.biases", "v.codes", "v.scales", "v.biases",
];

/// Geometry of a layer cache as saved.
fn layer_state(c: &LayerCache) -> Result<(SavedLayer, Vec<Tensor>), CacheError> {
    let (parts, first, packed) = match c {
        LayerCache::Simple(s) => (s.kv()?.map(|(k, v)| vec![k, v]), 0, false),
        LayerCache::Rotating(r) => match r.live()? {
            Some((k, v, first)) => (Some(vec![k, v]), first, false),
            None => (None, r.offsets().first().copied().unwrap_or(0), false),
        },
        LayerCache::Quantized(q) => match q.live()? {
            Some((parts, first)) => (Some(parts), first, q.is_packed()),
            None => (
                None,
                q.offsets().first().copied().unwrap_or(0),
                q.is_packed(),
            ),
        },
        LayerCache::Batch(b) => {
            return Err(CacheError::Batched {
                what: "saving a prompt cache",
                batch: b.len(),
            })
        }
    };
    let (kv_heads, head_dim) = c.geometry();
    let tokens = match &parts {
        Some(p) => p[0].dim(2)?,
        None => 0,
    };
    Ok((
        SavedLayer {
            kv_heads,
            head_dim,
            first,
            tokens,
            packed,
        },
        parts.unwrap_or_default(),
    ))
}

impl PromptCache {
    /// Bundles a cache with its tokens and metadata.
    pub fn new(tokens: Vec<u32>, cache: ModelCache, meta: CacheMeta) -> Self {
        Self {
            tokens,
            cache,
            meta,
        }
    }

    /// Length of the longest common prefix of the cached tokens and `new_tokens`.
    pub fn common_prefix(&self, new_tokens: &[u32]) -> usize {
        self.tokens
            .iter()
            .zip(new_tokens)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Checks that this cache may be restored where `expected` is wanted (see
    /// [`CacheMeta::check`]).
    ///
    /// # Errors
    /// [`CacheError::Mismatch`] naming what differs.
    pub fn restore_check(&self, expected: &CacheMeta) -> Result<(), CacheError> {
        self.meta.check(expected)
    }

    /// Turns the prompt cache into a model cache ready for `new_tokens`: checks `expected`,
    /// rolls the cache back to the common prefix (keeping at least one token of `new_tokens`
    /// to feed, so the model produces logits), and returns it with the number of leading tokens
    /// of `new_tokens` already cached. The caller feeds `new_tokens[n..]`.
    ///
    /// # Errors
    /// [`CacheError::Mismatch`]; [`CacheError::CannotTrim`] when a ring buffer already dropped
    /// tokens the rollback needs (start from a fresh cache then).
    pub fn reuse(
        mut self,
        expected: &CacheMeta,
        new_tokens: &[u32],
    ) -> Result<(ModelCache, usize), CacheError> {
        self.restore_check(expected)?;
        let mut keep = self.common_prefix(new_tokens);
        if keep == new_tokens.len() {
            keep = keep.saturating_sub(1);
        }
        let offset = self.cache.offsets().first().copied().unwrap_or(0);
        if offset != self.tokens.len() {
            return Err(CacheError::Mismatch {
                field: "cached token count".into(),
                saved: self.tokens.len().to_string(),
                requested: offset.to_string(),
            });
        }
        self.cache.trim(offset - keep)?;
        Ok((self.cache, keep))
    }

    /// A deep copy (new tensor storage): the in-memory path, for keeping a prompt cache while
    /// a generation extends a copy of it.
    ///
    /// # Errors
    /// Candle errors while copying.
    pub fn deep_clone(&self) -> Result<Self, CacheError> {
        Ok(Self {
            tokens: self.tokens.clone(),
            cache: self.cache.deep_clone()?,
            meta: self.meta.clone(),
        })
    }

    /// Saves to one safetensors file.
    ///
    /// # Errors
    /// [`CacheError::Batched`] for a batched cache; [`CacheError::Io`] when writing fails.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), CacheError> {
        let path = path.as_ref();
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let mut layers = Vec::with_capacity(self.cache.layers.len());
        for (l, c) in self.cache.layers.iter().enumerate() {
            let Some(c) = c else {
                layers.push(None);
                continue;
            };
            let (saved, parts) = layer_state(c)?;
            let names: &[&str] = if saved.packed {
                &PACKED_NAMES
            } else {
                &DENSE_NAMES
            };
            for (name, t) in names.iter().zip(parts) {
                tensors.push((
                    format!("layers.{l}.{name}"),
                    t.to_device(&Device::Cpu)?.contiguous()?,
                ));
            }
            layers.push(Some(saved));
        }
        let doc = SavedDoc {
            version: VERSION,
            tokens: self.tokens.clone(),
            meta: self.meta.clone(),
            layers,
        };
        let json = serde_json::to_string(&doc).map_err(|e| CacheError::Format {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let info = HashMap::from([(META_KEY.to_string(), json)]);
        safetensors::serialize_to_file(tensors, Some(info), path).map_err(|e| CacheError::Io {
            path: path.into(),
            reason: e.to_string(),
        })
    }

    /// Loads a prompt cache saved by [`PromptCache::save`] onto `device`.
    ///
    /// # Errors
    /// [`CacheError::Io`] when the file cannot be read; [`CacheError::Format`] when it is not a
    /// prompt cache of this version or its tensors disagree with its metadata.
    pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<Self, CacheError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| CacheError::Io {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let format = |reason: String| CacheError::Format {
            path: path.into(),
            reason,
        };
        let (_, header) =
            safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| format(e.to_string()))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or_else(|| format(format!("no `{META_KEY}` metadata: not a prompt cache")))?;
        let doc: SavedDoc = serde_json::from_str(json).map_err(|e| format(e.to_string()))?;
        if doc.version != VERSION {
            return Err(format(format!(
                "version {} (this build reads {VERSION})",
                doc.version
            )));
        }
        if doc.layers.len() != doc.meta.kinds.len() {
            return Err(format(format!(
                "{} layer records for {} layer kinds",
                doc.layers.len(),
                doc.meta.kinds.len()
            )));
        }
        let dtype = parse_dtype(&doc.meta.dtype)
            .ok_or_else(|| format(format!("unknown dtype `{}`", doc.meta.dtype)))?;
        let mut tensors = candle_core::safetensors::load_buffer(&bytes, device)
            .map_err(|e| format(e.to_string()))?;
        let mut layers = Vec::with_capacity(doc.layers.len());
        for (l, (saved, kind)) in doc.layers.iter().zip(&doc.meta.kinds).enumerate() {
            let (saved, kind) = match (saved, kind) {
                (None, None) => {
                    layers.push(None);
                    continue;
                }
                (Some(s), Some(k)) => (s, k),
                _ => {
                    return Err(format(format!(
                        "layer {l}: geometry and kind disagree on whether it owns a cache"
                    )))
                }
            };
            let names: &[&str] = if saved.packed {
                &PACKED_NAMES
            } else {
                &DENSE_NAMES
            };
            let mut parts = Vec::new();
            if saved.tokens > 0 {
                for name in names {
                    let key = format!("layers.{l}.{name}");
                    parts.push(
                        tensors
                            .remove(&key)
                            .ok_or_else(|| format(format!("missing tensor `{key}`")))?,
                    );
                }
            }
            let cache = rebuild(kind, saved, dtype, &parts)
                .map_err(|e| format(format!("layer {l}: {e}")))?;
            layers.push(Some(cache));
        }
        let cache = ModelCache { layers };
        let offset = cache.offsets().first().copied().unwrap_or(doc.tokens.len());
        if offset != doc.tokens.len() {
            return Err(format(format!(
                "{} tokens recorded but the caches hold {offset}",
                doc.tokens.len()
            )));
        }
        Ok(Self {
            tokens: doc.tokens,
            cache,
            meta: doc.meta,
        })
    }
}

fn parse_dtype(s: &str) -> Option<DType> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .find(|d| d.as_str() == s)
}

/// Builds a layer cache of `kind` and fills it with saved parts.
fn rebuild(
    kind: &CacheKind,
    saved: &SavedLayer,
    dtype: DType,
    parts: &[Tensor],
) -> Result<LayerCache, CacheError> {
    let mut spec = LayerCacheSpec {
        kv_heads: saved.kv_heads,
        head_dim: saved.head_dim,
        window: None,
    };
    let empty = parts.is_empty();
    Ok(match kind {
        CacheKind::Simple => {
            let mut c = SimpleCache::new(&spec, dtype);
            if !empty {
                c.load(&parts[0], &parts[1])?;
            }
            LayerCache::Simple(c)
        }
        CacheKind::Rotating { window, slots } => {
            spec.window = Some(*window);
            let mut c = RotatingCache::with_slack(&spec, slots.saturating_sub(*window), dtype)?;
            if empty {
                c.restart_at(saved.first);
            } else {
                c.load(&parts[0], &parts[1], saved.first)?;
            }
            LayerCache::Rotating(c)
        }
        CacheKind::Quantized {
            bits,
            group_size,
            start,
            window,
        } => {
            spec.window = *window;
            let quant = QuantSpec {
                bits: QuantBits::from_bits(*bits)?,
                group_size: *group_size,
                start: *start,
            };
            let mut c = QuantizedCache::new(&spec, &quant, dtype)?;
            if empty {
                c.restart_at(saved.packed, saved.first)?;
            } else {
                c.load(saved.packed, parts, saved.first)?;
            }
            LayerCache::Quantized(c)
        }
        CacheKind::Batch { sequences } => {
            return Err(CacheError::Batched {
                what: "loading a prompt cache",
                batch: *sequences,
            });
        }
    })
}
