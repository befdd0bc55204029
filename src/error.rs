//! The crate's error type: every failure names what was wrong (file, tensor, layer, expected vs
//! found) so that a bad checkpoint or a misuse is diagnosed from the message alone.

use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong when loading or running a Gemma 4 model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config, index, golden) could not be parsed.
    #[error("cannot parse {path}: {reason}")]
    Json {
        /// The file that failed.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// A config field is missing, has the wrong type, or names an unknown value.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// The field, dotted (`text_config.layer_types[3]`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A safetensors file is malformed or truncated.
    #[error("safetensors file {path}: {reason}")]
    Safetensors {
        /// The file that failed.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("missing tensor `{name}`{}", layer_suffix(*.layer))]
    MissingTensor {
        /// The logical name that was looked up (without the layout prefix).
        name: String,
        /// The decoder layer it belongs to, if any.
        layer: Option<usize>,
    },
    /// A tensor has an unexpected shape.
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The tensor's name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the checkpoint.
        found: Vec<usize>,
    },
    /// A tensor has a dtype the loader cannot use.
    #[error("tensor `{tensor}` has dtype {found}, expected {expected}")]
    DType {
        /// The tensor's name.
        tensor: String,
        /// What was expected.
        expected: String,
        /// What was found.
        found: String,
    },
    /// An MLX-quantized tensor whose codes, scales and biases do not fit the expected shape.
    #[error("quantized tensor `{tensor}`: {reason}")]
    Quantized {
        /// The codes tensor's name.
        tensor: String,
        /// What does not fit.
        reason: String,
    },
    /// The input to a forward pass or a generation is invalid.
    #[error("invalid input: {0}")]
    Input(String),
    /// A token id is outside the vocabulary.
    #[error("token id {id} at position {position} is outside the vocabulary of {vocab_size}")]
    TokenOutOfVocab {
        /// The offending id.
        id: u32,
        /// Its index in the prompt.
        position: usize,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A sequence would exceed the model's context length.
    #[error("sequence of {length} tokens exceeds max_position_embeddings {max}")]
    ContextTooLong {
        /// Tokens the sequence would hold.
        length: usize,
        /// The model's `max_position_embeddings`.
        max: usize,
    },
    /// A KV cache misuse or mismatch.
    #[error(transparent)]
    Cache(#[from] crate::kv::CacheError),
    /// Operands a kernel cannot take (shapes, dtypes or packing that do not fit it).
    #[error(transparent)]
    Kernel(crate::kernels::KernelError),
    /// Chat template rendering or output parsing failed.
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Hub download failed.
    #[error("hub: repo `{repo}`, file `{file}`: {reason}")]
    Hub {
        /// The repo id.
        repo: String,
        /// The file that was being fetched.
        file: String,
        /// Why it failed.
        reason: String,
    },
    /// An error raised by candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl From<crate::kernels::KernelError> for Error {
    /// Packed tensors that do not fit read as [`Error::Quantized`] and candle errors as
    /// [`Error::Candle`], as from the loader; everything else as [`Error::Kernel`].
    fn from(e: crate::kernels::KernelError) -> Self {
        use crate::kernels::KernelError;
        match e {
            KernelError::Packed { what, reason } => Error::Quantized {
                tensor: what.to_string(),
                reason,
            },
            KernelError::Candle(e) => Error::Candle(e),
            other => Error::Kernel(other),
        }
    }
}

fn layer_suffix(layer: Option<usize>) -> String {
    match layer {
        Some(l) => format!(" (layer {l})"),
        None => String::new(),
    }
}
