//! Which cache each layer gets: [`CacheConfig`] (chosen per generation) applied to a
//! [`LayerCacheSpec`] (the layer's geometry, from the model).

use candle_core::{DType, Device};

use super::{CacheError, LayerCache, QuantBits, QuantizedCache, RotatingCache, SimpleCache};
use crate::config::{Config, KvSource, LayerKind};
use crate::kernels::AffineSpec;

/// Affine K/V quantization parameters (MLX's format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    /// Bits per element.
    pub bits: QuantBits,
    /// Elements per scale/bias group along the head dimension: 32, 64 or 128, dividing the
    /// head dimension of every layer.
    pub group_size: usize,
    /// Tokens kept dense before the cache converts to packed form (0: packed from the first
    /// token). mlx-lm's `quantized_kv_start`.
    pub start: usize,
}

impl QuantSpec {
    /// The packing the kernels see: bits and group size.
    pub fn affine(&self) -> AffineSpec {
        AffineSpec {
            bits: self.bits,
            group_size: self.group_size,
        }
    }
}

impl Default for QuantSpec {
    /// 8 bits, group 64, packed from the first token.
    fn default() -> Self {
        Self {
            bits: QuantBits::Eight,
            group_size: 64,
            start: 0,
        }
    }
}

/// The cache family used for a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// A [`SimpleCache`] on every layer (sliding layers keep every token; the window mask
    /// hides the old ones). Memory grows with the sequence on every layer.
    Simple,
    /// A [`RotatingCache`] of W slots on sliding layers, a [`SimpleCache`] on full layers.
    #[default]
    Rotating,
    /// A [`QuantizedCache`] on every layer: a ring of W slots on sliding layers, growing on full
    /// layers.
    Quantized(QuantSpec),
}

/// Cache configuration for one generation.
///
/// ```
/// # use candle_core::{DType, Device};
/// # use candle_gemma::kv::{CacheConfig, CacheMode, LayerCacheSpec, QuantBits, QuantSpec};
/// let config = CacheConfig { mode: CacheMode::Quantized(QuantSpec { bits: QuantBits::Four, group_size: 64, start: 0 }) };
/// let sliding = LayerCacheSpec { kv_heads: 1, head_dim: 256, window: Some(512) };
/// let cache = config.build(&sliding, DType::BF16, &Device::Cpu)?;
/// # Ok::<(), candle_gemma::kv::CacheError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheConfig {
    /// Which cache each layer gets.
    pub mode: CacheMode,
}

/// The geometry of one KV-owning layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerCacheSpec {
    /// KV heads of the layer.
    pub kv_heads: usize,
    /// Head dimension of the layer (256 sliding, 512 full on Gemma 4).
    pub head_dim: usize,
    /// `Some(W)` for a sliding layer (W keys visible, the current one included), `None` for a
    /// full-attention layer.
    pub window: Option<usize>,
}

impl CacheConfig {
    /// Builds the cache of one layer.
    ///
    /// `device` is where the cache will live; storage is allocated on the first update (on the
    /// device of its tensors), so an unused cache costs nothing.
    ///
    /// # Errors
    /// [`CacheError::Config`] for zero heads/head dimension or a window of 0;
    /// [`CacheError::BadGroupSize`] when the group size does not divide `head_dim`;
    /// [`CacheError::DType`] when quantizing a non-float dtype.
    pub fn build(
        &self,
        spec: &LayerCacheSpec,
        dtype: DType,
        device: &Device,
    ) -> Result<LayerCache, CacheError> {
        let _ = device;
        if spec.kv_heads == 0 || spec.head_dim == 0 {
            return Err(CacheError::Config {
                field: "kv_heads/head_dim",
                reason: format!(
                    "must be positive, got {} heads of {}",
                    spec.kv_heads, spec.head_dim
                ),
            });
        }
        Ok(match (self.mode, spec.window) {
            (CacheMode::Simple, _) | (CacheMode::Rotating, None) => {
                LayerCache::Simple(SimpleCache::new(spec, dtype))
            }
            (CacheMode::Rotating, Some(_)) => {
                LayerCache::Rotating(RotatingCache::new(spec, dtype)?)
            }
            (CacheMode::Quantized(q), _) => {
                LayerCache::Quantized(QuantizedCache::new(spec, &q, dtype)?)
            }
        })
    }
}

/// What each layer of `config` must cache; `None` for KV-shared layers, which own no cache.
pub(crate) fn layer_cache_specs(config: &Config) -> Vec<Option<LayerCacheSpec>> {
    config
        .layers
        .iter()
        .map(|l| match l.kv {
            KvSource::Shared { .. } => None,
            KvSource::Own => Some(LayerCacheSpec {
                kv_heads: l.kv_heads,
                head_dim: l.head_dim,
                window: match l.kind {
                    LayerKind::Sliding => Some(config.sliding_window),
                    LayerKind::Full => None,
                },
            }),
        })
        .collect()
}
