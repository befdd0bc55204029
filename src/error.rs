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
    /// A generation option has a value that cannot be honoured (a NaN temperature, `top_p`
    /// outside (0, 1], a zero `max_tokens`, ...).
    #[error("invalid option `{field}`: {reason}")]
    InvalidOption {
        /// The option's field name (`temperature`, `top_p`, `max_tokens`, `cache.group_size`).
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// A generation's output constraint cannot run: it does not compile, the tokenizer cannot
    /// spell it, or its parser failed ([`crate::generate::Constraint`]).
    #[error("output constraint: {0}")]
    Constraint(String),
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
    /// A rank of a tensor-parallel model failed to load or run; every rank's work was
    /// stopped (see [`crate::ShardedModel`]).
    #[error("tensor-parallel rank {rank}: {reason}")]
    Rank {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        reason: String,
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
    /// A hub checkpoint could not be found, downloaded or verified.
    #[error("hub: repo `{repo}`{}: {cause}", file_suffix(file))]
    Hub {
        /// The repo id (`org/name`).
        repo: String,
        /// The file that was being resolved (empty when the failure concerns the whole repo).
        file: String,
        /// What went wrong.
        cause: HubError,
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

/// Why a hub checkpoint could not be resolved: the cause inside [`Error::Hub`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// The hub refused access (HTTP 401 or 403): the repo is gated or private and no token,
    /// or a token without access to it, was sent.
    #[error("{}", unauthorized(*.token_sent, *.gated))]
    Unauthorized {
        /// Whether a token was sent with the request.
        token_sent: bool,
        /// Whether the hub said the repo is gated (its terms must be accepted on the web page).
        gated: bool,
    },
    /// No repo has this id (or it is private and the token cannot see it).
    #[error("repository not found (check the id; a private repo needs a token)")]
    RepoNotFound,
    /// The repo has no such branch, tag or commit.
    #[error("revision `{revision}` not found")]
    RevisionNotFound {
        /// The revision asked for.
        revision: String,
    },
    /// The repo has no such file at this revision.
    #[error("file not found at revision `{revision}`")]
    FileNotFound {
        /// The revision (a commit hash once resolved).
        revision: String,
    },
    /// The hub kept answering with a server error (5xx or 429) until the retries ran out.
    #[error("server error {status} after {attempts} attempts")]
    Server {
        /// The last HTTP status.
        status: u16,
        /// Requests made, the first included.
        attempts: u32,
    },
    /// The hub answered with an HTTP status the client does not expect.
    #[error("unexpected HTTP status {status}")]
    Status {
        /// The HTTP status.
        status: u16,
    },
    /// The connection failed or broke until the retries ran out.
    #[error("network error after {attempts} attempts: {reason}")]
    Network {
        /// Requests made, the first included.
        attempts: u32,
        /// The last transport error.
        reason: String,
    },
    /// The downloaded file does not have the size the hub announced; it was discarded.
    #[error("size mismatch: the hub announced {expected} bytes, the download has {found}")]
    SizeMismatch {
        /// Bytes announced (`X-Linked-Size` or `Content-Length`).
        expected: u64,
        /// Bytes received.
        found: u64,
    },
    /// The downloaded bytes do not hash to the hub's sha256; the file was discarded.
    #[error("sha256 mismatch: expected {expected}, got {found}")]
    HashMismatch {
        /// The hash the hub announced (`X-Linked-Etag`).
        expected: String,
        /// The hash of the received bytes.
        found: String,
    },
    /// A hub response lacks a header or has a body the client cannot use.
    #[error("malformed hub response: {reason}")]
    BadResponse {
        /// What is missing or malformed.
        reason: String,
    },
    /// `model.safetensors.index.json` is malformed.
    #[error("malformed index: {reason}")]
    BadIndex {
        /// What is wrong with it.
        reason: String,
    },
    /// Offline, and the file is not in the local cache.
    #[error("not in the local cache at {} (offline)", .cache.display())]
    NotCached {
        /// The hub cache folder that was searched.
        cache: PathBuf,
    },
    /// The cached files belong to different snapshots of the repo (offline).
    #[error("cached files belong to different snapshots (offline); download again online")]
    MixedSnapshots,
    /// There is no home directory to put the default cache in.
    #[error("no home directory for the hub cache; set a cache dir on the builder")]
    NoCacheDir,
    /// A file of the cache could not be read, written, linked or locked.
    #[error("cache file {}: {source}", .path.display())]
    Io {
        /// The file or folder that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Another thread or process holds the file's download lock, and its download made no
    /// progress (its `blobs/<etag>.incomplete` did not grow) for the wait's bound
    /// (`HubOptions::lock_timeout`): that download hangs, or its process is stopped. A process
    /// that exits, killed or not, releases its locks.
    #[error("the download lock {} is held, and that download made no progress for {} s", .lock.display(), .idle.as_secs())]
    LockTimeout {
        /// The lock file.
        lock: PathBuf,
        /// How long the wait saw no progress.
        idle: std::time::Duration,
    },
    /// The crate was built without the `hub` feature.
    #[error("this build has no `hub` feature; download the folder and use .path()")]
    Disabled,
}

fn unauthorized(token_sent: bool, gated: bool) -> &'static str {
    match (token_sent, gated) {
        (false, true) => "gated repository: accept its terms on the hub, then pass a token",
        (true, true) => "gated repository: the token's account has not been granted access",
        (false, false) => "unauthorized: the repository needs a token",
        (true, false) => "unauthorized: the token was refused or has no access",
    }
}

fn file_suffix(file: &str) -> String {
    match file {
        "" => String::new(),
        f => format!(", file `{f}`"),
    }
}

fn layer_suffix(layer: Option<usize>) -> String {
    match layer {
        Some(l) => format!(" (layer {l})"),
        None => String::new(),
    }
}
