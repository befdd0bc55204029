//! What a cache update hands to attention: dense or packed K/V plus the absolute position of
//! every key, so masks are built from positions and a ring buffer needs no reordering.

use super::KeyPositions;
use candle_core::Tensor;

/// Bit width of a packed (affine-quantized) K/V cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantBits {
    /// 4 bits per element, 8 elements per `u32` word.
    Four,
    /// 8 bits per element, 4 elements per `u32` word.
    Eight,
}

impl QuantBits {
    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            QuantBits::Four => 4,
            QuantBits::Eight => 8,
        }
    }

    /// Parses 4 or 8.
    ///
    /// # Errors
    /// [`super::CacheError::UnsupportedBits`] for any other value.
    pub fn from_bits(bits: usize) -> Result<Self, super::CacheError> {
        match bits {
            4 => Ok(QuantBits::Four),
            8 => Ok(QuantBits::Eight),
            _ => Err(super::CacheError::UnsupportedBits { bits }),
        }
    }
}

/// One packed tensor in MLX's affine layout, groups running along the head dimension:
/// `x[.., g*G + i] ≈ scales[.., g] * code[.., g*G + i] + biases[.., g]`, codes stored as a
/// little-endian bit stream in `u32` words (element 0 in the lowest bits of word 0).
#[derive(Debug, Clone)]
pub struct PackedKv {
    /// `[batch, kv_heads, tokens, head_dim * bits / 32]`, `u32`.
    pub codes: Tensor,
    /// `[batch, kv_heads, tokens, head_dim / group_size]`, activation dtype.
    pub scales: Tensor,
    /// `[batch, kv_heads, tokens, head_dim / group_size]`, activation dtype.
    pub biases: Tensor,
    /// Bit width of the codes.
    pub bits: QuantBits,
    /// Elements per scale/bias group (32, 64 or 128).
    pub group_size: usize,
}

/// K/V of one sequence as attention must read them.
#[derive(Debug, Clone)]
pub enum KvData {
    /// Plain tensors `[1, kv_heads, keys, head_dim]`.
    Dense {
        /// Keys, already normed and rotated.
        k: Tensor,
        /// Values, already normed.
        v: Tensor,
    },
    /// Affine-quantized keys and values; read them with the quantized attention.
    Packed {
        /// Packed keys.
        k: PackedKv,
        /// Packed values.
        v: PackedKv,
    },
}

/// The result of a cache update: what attention needs for the tokens just appended.
///
/// The tensors read the cache's storage in place (no copy per step), so a view is valid until
/// the next `update`, `trim` or `reset` of the cache that returned it: use it within the step
/// (the layer and its KV-shared consumers), never keep it across steps.
#[derive(Debug, Clone)]
pub enum KvView {
    /// One sequence: its K/V and the absolute position of each key, in storage order (a ring
    /// buffer's keys are not sorted; softmax does not care and the mask is built from positions).
    Single {
        /// Dense or packed K/V.
        data: KvData,
        /// The absolute token index of each key, in storage order.
        positions: KeyPositions,
    },
    /// One view per sequence of a batch, in batch order.
    Batch(Vec<KvView>),
}

impl KvView {
    /// The view with every sequence's keys below its offset before the update (`offsets`, one
    /// per sequence in batch order, as [`crate::kv::KvCache::offsets`] gave them) marked
    /// settled ([`KeyPositions::settled_below`]).
    pub(crate) fn settled_below(self, offsets: &[usize]) -> Self {
        match self {
            KvView::Single { data, positions } => KvView::Single {
                data,
                positions: match offsets.first() {
                    Some(&o) => positions.settled_below(o),
                    None => positions,
                },
            },
            KvView::Batch(views) => KvView::Batch(
                views
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| v.settled_below(offsets.get(i..i + 1).unwrap_or(&[])))
                    .collect(),
            ),
        }
    }
}
