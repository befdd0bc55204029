//! The Gemma 4 text decoder: one model type for E2B, E4B, 26B-A4B and 31B. Each layer decides
//! its shape once, from its [`crate::config::LayerPlan`]; forwards only match on that decision.

pub mod attention;
pub(crate) mod graph;
pub mod layer;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod ple;
pub mod rope;
pub(crate) mod routing;
pub mod step;

pub use attention::KvInput;
pub use model::TextModel;

use candle_core::{DType, Tensor};

use crate::kernels::ops::{self, matvec, Weight};
use crate::kernels::PackedAffine;
use crate::weights::LoadedMatrix;

/// A bias-free linear layer over a `[out, in]` weight: dense, or MLX-quantized and kept packed
/// (the product reads the 4/8-bit codes directly, see [`crate::kernels::qmatmul`]).
#[derive(Debug, Clone)]
pub struct Linear(Weight);

impl Linear {
    /// Wraps a dense `[out, in]` weight.
    pub fn new(weight: Tensor) -> Self {
        Linear(Weight::dense(weight))
    }

    /// Wraps what the weight store loaded, keeping a packed weight packed.
    pub fn from_loaded(m: LoadedMatrix) -> Self {
        match m {
            LoadedMatrix::Dense(w) => Self::new(w),
            LoadedMatrix::Packed(p) => Linear(Weight::Packed(p.with_candle_q4_1())),
        }
    }

    /// The weight, as the kernels take it.
    pub(crate) fn weight(&self) -> &Weight {
        &self.0
    }

    /// `x · Wᵀ` over the last axis of `x`, in `x`'s dtype.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward(&self, x: &Tensor) -> crate::Result<Tensor> {
        Ok(matvec::matmul(x, &self.0)?)
    }

    /// `(gelu_tanh(a) * b) · Wᵀ` for `a`, `b` of one shape: the gated input of the MLP's down
    /// projection and of the PLE projection (see `kernels::ops::matvec::matmul_gated`).
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward_gated(&self, a: &Tensor, b: &Tensor) -> crate::Result<Tensor> {
        Ok(matvec::matmul_gated(a, b, &self.0)?)
    }

    /// Bytes of resident weight (packed codes, scales and biases for a packed one).
    pub fn resident_bytes(&self) -> usize {
        self.0.resident_bytes()
    }
}

impl Embedding {
    /// Bytes of resident table.
    pub fn resident_bytes(&self) -> usize {
        match self {
            Embedding::Dense(t) => ops::tensor_bytes(t),
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
    Packed(PackedAffine),
}

impl Embedding {
    /// Wraps what the weight store loaded.
    pub fn from_loaded(m: LoadedMatrix) -> Self {
        match m {
            LoadedMatrix::Dense(w) => Embedding::Dense(w),
            LoadedMatrix::Packed(p) => Embedding::Packed(p.with_candle_q4_1()),
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

    /// Rows `start .. start + len` of the table as a table of their own (copied, so the
    /// products read it from its start): one rank's part of a vocabulary-parallel head.
    ///
    /// # Errors
    /// Rows outside the table.
    pub(crate) fn rows(&self, start: usize, len: usize) -> crate::Result<Self> {
        Ok(match self {
            Embedding::Dense(t) => Embedding::Dense(t.narrow(0, start, len)?.copy()?),
            Embedding::Packed(p) => {
                let part = p.narrow_rows(start, len)?;
                let settled = part.is_settled();
                let copied = PackedAffine::new(
                    part.codes.copy()?,
                    part.scales.copy()?,
                    part.biases.copy()?,
                    len,
                    part.in_dim(),
                )?;
                Embedding::Packed(if settled { copied.settled() } else { copied })
            }
        })
    }

    /// `x · Tableᵀ` (the tied head): `[.., width] → [.., vocab]`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn as_head(&self, x: &Tensor) -> crate::Result<Tensor> {
        match self {
            Embedding::Dense(t) => Ok(matvec::matmul_table(x, t)?),
            Embedding::Packed(p) => Ok(crate::kernels::qmatmul::qmatmul(x, p)?),
        }
    }
}
