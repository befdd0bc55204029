//! [`KernelError`]: what a kernel entry point reports when its operands do not fit it.
//!
//! The callers convert it upwards: `kv::CacheError: From<KernelError>` and
//! `crate::Error: From<KernelError>` live with those types.

use candle_core::DType;

/// Operands a kernel cannot take, named by what is wrong with them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A packed tensor was asked for a bit width other than 4 or 8.
    #[error("unsupported affine quantization bit width {bits} (expected 4 or 8)")]
    UnsupportedBits {
        /// The bit width asked for.
        bits: usize,
    },
    /// The quantization group size is not 32, 64 or 128, or does not divide the quantized
    /// axis.
    #[error("quantization group size {group_size} is not one of 32, 64, 128 dividing {dim}")]
    BadGroupSize {
        /// The group size asked for.
        group_size: usize,
        /// Length of the axis the groups run along (a head dimension, a matrix's inputs).
        dim: usize,
    },
    /// An operand has the wrong shape.
    #[error("{what} has shape {found:?}, expected {expected}")]
    Shape {
        /// Which operand.
        what: &'static str,
        /// The expected shape, in words (`[1, 4, tokens, 256]`).
        expected: String,
        /// The shape found.
        found: Vec<usize>,
    },
    /// An operand has a dtype the kernel does not take.
    #[error("{what} has dtype {found:?}, expected {expected:?}")]
    DType {
        /// Which operand.
        what: &'static str,
        /// The dtype expected.
        expected: DType,
        /// The dtype found.
        found: DType,
    },
    /// The batch dimension of the queries disagrees with the sequences of the K/V operand.
    #[error("batch size {found}, but the operand holds {expected} sequences")]
    BatchSize {
        /// Sequences of the K/V operand.
        expected: usize,
        /// Batch dimension of the queries.
        found: usize,
    },
    /// Codes, scales and biases that do not describe an MLX affine-packed tensor.
    #[error("packed tensor `{what}`: {reason}")]
    Packed {
        /// Which tensor (`packed weight`, `codes`, ...).
        what: &'static str,
        /// What does not fit.
        reason: String,
    },
    /// A launch parameter the kernel or the device cannot honour (shared memory beyond the
    /// device's limit, a call made outside the context it needs).
    #[error("invalid kernel parameter `{field}`: {reason}")]
    Config {
        /// The parameter.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The all-reduce of a tensor-parallel group failed: a peer rank failed, the group was
    /// aborted, NCCL reported an error, or the build has no NCCL.
    #[error("tensor-parallel all-reduce: {reason}")]
    Collective {
        /// What went wrong.
        reason: String,
    },
    /// An error raised by candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}
