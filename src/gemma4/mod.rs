//! The Gemma 4 text decoder: one model type for E2B, E4B, 26B-A4B and 31B. Each layer decides
//! its shape once, from its [`crate::config::LayerPlan`]; forwards only match on that decision.

pub mod attention;
pub(crate) mod fused;
#[cfg(feature = "cuda")]
pub(crate) mod graph;
pub mod layer;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod ple;
pub mod rope;
pub mod step;

pub use attention::{Attention, KvInput};
pub use layer::{DecoderLayer, LayerOutput};
pub use model::TextModel;
pub use step::Step;

use candle_core::{DType, Module, Tensor};

use crate::kernels::qmatmul::PackedWeight;
use crate::weights::LoadedMatrix;

/// A bias-free linear layer over a `[out, in]` weight: dense, or MLX-quantized and kept packed
/// (the product reads the 4/8-bit codes directly, see [`crate::kernels::qmatmul`]).
#[derive(Debug, Clone)]
pub enum Linear {
    /// A dense weight.
    Dense(candle_nn::Linear),
    /// A packed affine-quantized weight.
    Packed(PackedWeight),
}

impl Linear {
    /// Wraps a dense `[out, in]` weight.
    pub fn new(weight: Tensor) -> Self {
        Linear::Dense(candle_nn::Linear::new(weight, None))
    }

    /// Wraps what the weight store loaded, keeping a packed weight packed.
    pub fn from_loaded(m: LoadedMatrix) -> Self {
        match m {
            LoadedMatrix::Dense(w) => Self::new(w),
            LoadedMatrix::Packed(p) => Linear::Packed(p),
        }
    }

    /// `x · Wᵀ` over the last axis of `x`, in `x`'s dtype.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward(&self, x: &Tensor) -> crate::Result<Tensor> {
        match self {
            Linear::Dense(l) => match dense_decode_product(x, l.weight())? {
                Some(y) => Ok(y),
                None => Ok(l.forward(x)?),
            },
            Linear::Packed(p) => Ok(crate::kernels::qmatmul::qmatmul(x, p)?),
        }
    }
}

impl Linear {
    /// The weight of a dense layer (`None` when packed).
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match self {
            Linear::Dense(l) => Some(l.weight()),
            Linear::Packed(_) => None,
        }
    }

    /// `(gelu_tanh(a) * b) · Wᵀ` for `a`, `b` of one shape: the gated input of the MLP's down
    /// projection and of the PLE projection. On CUDA decode with a dense weight the gate is
    /// computed inside the product (one launch instead of two, or three with cuBLAS's split-K
    /// reduce); elsewhere the gate runs on its own, then [`Linear::forward`].
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward_gated(&self, a: &Tensor, b: &Tensor) -> crate::Result<Tensor> {
        if let Linear::Dense(l) = self {
            if let Some(y) = gated_decode_product(a, b, l.weight())? {
                return Ok(y);
            }
        }
        self.forward(&fused::gelu_mul(a, b)?)
    }
}

/// Activation rows of `x` (`[.., in]`).
#[cfg(feature = "cuda")]
pub(crate) fn rows_of(x: &Tensor) -> usize {
    x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1)
}

#[cfg(feature = "cuda")]
fn gated_decode_product(a: &Tensor, b: &Tensor, w: &Tensor) -> crate::Result<Option<Tensor>> {
    use crate::kernels::cuda::fused;
    if !crate::kernels::fused_enabled(a.device())
        || !fused::gated_matvec_wanted(tensor_bytes(w), rows_of(a))
    {
        return Ok(None);
    }
    Ok(fused::dense_matvec_gated(a, b, w)?)
}

#[cfg(not(feature = "cuda"))]
fn gated_decode_product(_a: &Tensor, _b: &Tensor, _w: &Tensor) -> crate::Result<Option<Tensor>> {
    Ok(None)
}

/// `x · Wᵀ` through the crate's matrix-vector kernels when `x` has few rows (decode) on CUDA
/// with an f16/bf16 weight: one row with any weight, up to eight with a small one (on large
/// weights cuBLAS is faster there, see [`crate::kernels::cuda::fused::DENSE_MV_MAX_BYTES`]);
/// `None` where the general matmul applies.
#[cfg(feature = "cuda")]
fn dense_decode_product(x: &Tensor, w: &Tensor) -> crate::Result<Option<Tensor>> {
    use crate::kernels::cuda::fused;
    if !crate::kernels::fused_enabled(x.device())
        || !fused::dense_matvec_wanted(tensor_bytes(w), rows_of(x))
    {
        return Ok(None);
    }
    Ok(fused::dense_matvec(x, w)?)
}

#[cfg(not(feature = "cuda"))]
fn dense_decode_product(_x: &Tensor, _w: &Tensor) -> crate::Result<Option<Tensor>> {
    Ok(None)
}

/// Bytes a tensor holds.
pub(crate) fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl Linear {
    /// Bytes of resident weight (packed codes, scales and biases for a packed one).
    pub fn resident_bytes(&self) -> usize {
        match self {
            Linear::Dense(l) => tensor_bytes(l.weight()),
            Linear::Packed(p) => p.packed_bytes(),
        }
    }
}

impl Embedding {
    /// Bytes of resident table.
    pub fn resident_bytes(&self) -> usize {
        match self {
            Embedding::Dense(t) => tensor_bytes(t),
            Embedding::Packed(p) => p.packed_bytes(),
        }
    }
}

/// A token embedding table `[vocab, width]`, dense or packed; with tied embeddings it is also
/// the head.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// A dense table.
    Dense(Tensor),
    /// A packed affine-quantized table (rows are dequantized only when looked up).
    Packed(PackedWeight),
}

impl Embedding {
    /// Wraps what the weight store loaded.
    pub fn from_loaded(m: LoadedMatrix) -> Self {
        match m {
            LoadedMatrix::Dense(w) => Embedding::Dense(w),
            LoadedMatrix::Packed(p) => Embedding::Packed(p),
        }
    }

    /// Rows of `ids` (`[n]`, u32) → `[n, width]` in `dtype`.
    ///
    /// # Errors
    /// Ids outside the table.
    pub fn lookup(&self, ids: &Tensor, dtype: DType) -> crate::Result<Tensor> {
        match self {
            Embedding::Dense(t) => Ok(t.index_select(ids, 0)?),
            Embedding::Packed(p) => Ok(crate::kernels::qmatmul::qembedding(ids, p, dtype)?),
        }
    }

    /// [`Embedding::lookup`] of ids already checked against the vocabulary (the model checks
    /// them on the host before the forward): packed tables gather on the device without
    /// reading the ids back.
    ///
    /// # Errors
    /// Candle errors.
    pub(crate) fn lookup_checked_ids(&self, ids: &Tensor, dtype: DType) -> crate::Result<Tensor> {
        match self {
            Embedding::Dense(t) => Ok(t.index_select(ids, 0)?),
            Embedding::Packed(p) => Ok(crate::kernels::qmatmul::qembedding_checked_ids(
                ids, p, dtype,
            )?),
        }
    }

    /// `x · Tableᵀ` (the tied head): `[.., width] → [.., vocab]`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn as_head(&self, x: &Tensor) -> crate::Result<Tensor> {
        match self {
            Embedding::Dense(t) => match dense_decode_product(x, t)? {
                Some(y) => Ok(y),
                None => Ok(x.broadcast_matmul(&t.t()?)?),
            },
            Embedding::Packed(p) => Ok(crate::kernels::qmatmul::qmatmul(x, p)?),
        }
    }
}
