//! Errors of the KV cache family: every misuse or mismatch is a typed value naming what was
//! wrong, never a panic.

use std::path::PathBuf;

use crate::kernels::KernelError;

/// A KV cache misuse or mismatch, returned instead of a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// A quantized cache was asked for a bit width other than 4 or 8.
    #[error("unsupported KV quantization bit width {bits} (expected 4 or 8)")]
    UnsupportedBits {
        /// The bit width asked for.
        bits: usize,
    },
    /// The quantization group size is not 32, 64 or 128, or does not divide the head dimension.
    #[error("KV quantization group size {group_size} is not one of 32, 64, 128 dividing head_dim {head_dim}")]
    BadGroupSize {
        /// The group size asked for.
        group_size: usize,
        /// The head dimension of the layer.
        head_dim: usize,
    },
    /// A cache geometry parameter (window, heads, head dimension) is invalid.
    #[error("invalid cache parameter `{field}`: {reason}")]
    Config {
        /// The parameter.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor handed to a cache or kernel has the wrong shape.
    #[error("{what} has shape {found:?}, expected {expected}")]
    Shape {
        /// Which tensor.
        what: &'static str,
        /// The expected shape, in words (`[1, 4, tokens, 256]`).
        expected: String,
        /// The shape found.
        found: Vec<usize>,
    },
    /// A tensor handed to a cache has a dtype other than the cache's.
    #[error("{what} has dtype {found:?}, expected {expected:?}")]
    DType {
        /// Which tensor.
        what: &'static str,
        /// The cache's dtype.
        expected: candle_core::DType,
        /// The dtype found.
        found: candle_core::DType,
    },
    /// A rollback the cache cannot honour.
    #[error("cannot trim {requested} tokens ({available} available): {reason}")]
    CannotTrim {
        /// Tokens asked to drop.
        requested: usize,
        /// Tokens the cache could drop.
        available: usize,
        /// Why the rollback is impossible.
        reason: String,
    },
    /// A batched update whose batch dimension disagrees with the number of sequences held.
    #[error("batch size {found}, but the cache holds {expected} sequences")]
    BatchSize {
        /// Sequences held by the cache.
        expected: usize,
        /// Batch dimension of the input.
        found: usize,
    },
    /// A sequence index outside the batch.
    #[error("sequence index {index} out of range for a batch of {len}")]
    SequenceIndex {
        /// The index asked for.
        index: usize,
        /// Sequences in the batch.
        len: usize,
    },
    /// A batch operation on a cache that is not batched.
    #[error("this cache is not batched")]
    NotBatched,
    /// A batch cache was put inside another batch cache.
    #[error("a batch cache cannot hold another batch cache")]
    NestedBatch,
    /// The operation needs single-sequence caches (e.g. saving a prompt cache).
    #[error("{what} needs a single-sequence cache, found a batch of {batch}")]
    Batched {
        /// The operation.
        what: &'static str,
        /// Sequences in the batch.
        batch: usize,
    },
    /// Caches combined into a batch, or a prompt cache restored into a model, disagree on their
    /// layer structure.
    #[error("layer {layer}: {reason}")]
    Layout {
        /// The layer index.
        layer: usize,
        /// What differs.
        reason: String,
    },
    /// A saved prompt cache was made with another configuration than the one requested.
    #[error("prompt cache mismatch on {field}: saved {saved}, requested {requested}")]
    Mismatch {
        /// What differs (`kind of layer 3`, `bits`, `dtype`, `fingerprint`, ...).
        field: String,
        /// The saved value.
        saved: String,
        /// The requested value.
        requested: String,
    },
    /// A prompt cache file could not be read or written.
    #[error("prompt cache file {path}: {reason}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the I/O layer said.
        reason: String,
    },
    /// A prompt cache file is malformed (bad safetensors, metadata or tensor set).
    #[error("prompt cache file {path} is malformed: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// An error raised by candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl From<KernelError> for CacheError {
    /// Keeps the variant where the cache has the same one (a bad group size reads as the cache
    /// configuration error it is); a kernel-only failure becomes [`CacheError::Config`].
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::UnsupportedBits { bits } => CacheError::UnsupportedBits { bits },
            KernelError::BadGroupSize { group_size, dim } => CacheError::BadGroupSize {
                group_size,
                head_dim: dim,
            },
            KernelError::Shape {
                what,
                expected,
                found,
            } => CacheError::Shape {
                what,
                expected,
                found,
            },
            KernelError::DType {
                what,
                expected,
                found,
            } => CacheError::DType {
                what,
                expected,
                found,
            },
            KernelError::BatchSize { expected, found } => CacheError::BatchSize { expected, found },
            KernelError::Config { field, reason } => CacheError::Config { field, reason },
            KernelError::Candle(e) => CacheError::Candle(e),
            other => CacheError::Config {
                field: "kernel operand",
                reason: other.to_string(),
            },
        }
    }
}
