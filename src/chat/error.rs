//! Errors of chat-template loading and rendering and of tool-call parsing.

use std::path::PathBuf;

/// A chat template or output-parsing failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// A template file (or `tokenizer_config.json`) could not be read.
    #[error("cannot read chat template {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON, or its `chat_template` has an unusable shape.
    #[error("chat template in {path}: {reason}")]
    Config {
        /// The file that failed.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The template source does not compile.
    #[error("chat template `{name}` does not compile: {reason}")]
    Syntax {
        /// Where the template came from (`builtin`, a file name, ...).
        name: String,
        /// The template engine's message, with line information.
        reason: String,
    },
    /// Rendering failed: an undefined function or filter, a type error, or a
    /// `raise_exception(...)` call from the template itself.
    #[error("chat template `{name}` failed to render: {reason}")]
    Render {
        /// Where the template came from.
        name: String,
        /// The template engine's message.
        reason: String,
    },
    /// The rendered prompt has a `<bos>` token somewhere other than its start (usually a
    /// message whose content contains the literal text of the token).
    #[error("rendered prompt contains the BOS token `{bos}` at byte {position}; it may only start the prompt")]
    MisplacedBos {
        /// The BOS token text.
        bos: String,
        /// Byte offset of the stray occurrence.
        position: usize,
    },
    /// A tool declaration is not a JSON object with a function name.
    #[error("tool #{index}: {reason}")]
    Tool {
        /// Position of the tool in `RenderOptions::tools`.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A forced tool choice that cannot be held ([`super::tool_call_constraint`]): no tools,
    /// a named tool that is not declared, or a tokenizer without Gemma 4's tool-call tokens.
    #[error("tool choice: {reason}")]
    ToolChoice {
        /// What is wrong.
        reason: String,
    },
    /// Tool-call text in Gemma syntax (`call:NAME{key:value}`) could not be parsed.
    #[error("tool call syntax at byte {position}: {reason}")]
    ToolCallSyntax {
        /// Byte offset in the tool-call text where parsing stopped.
        position: usize,
        /// What was expected.
        reason: String,
    },
}
