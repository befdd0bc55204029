//! Chat: rendering conversations into Gemma 4 prompts ([`ChatTemplate`]) and parsing the
//! model's output back into thinking, text and tool calls ([`OutputParser`]).
//!
//! Gemma 4's format (SPEC §5): turns are `<|turn>ROLE\n…<turn|>\n` with roles `system`,
//! `user` and `model`; thinking is `<|channel>thought\n…<channel|>`; tools are declared as
//! `<|tool>declaration:…<tool|>`, called as `<|tool_call>call:NAME{…}<tool_call|>` and
//! answered as `<|tool_response>response:NAME{…}<tool_response|>`, with `<|"|>` quoting
//! strings inside.

mod error;
pub(crate) mod parser;
mod pycompat;
mod session;
mod syntax;
mod template;
mod tool_grammar;

pub use error::ChatError;
pub use parser::{OutputEvent, OutputParser};
pub use session::{hidden_token_ids, ChatSession, Reply};
pub use syntax::{declaration, parse_tool_call, parse_tool_calls, parse_value, to_gemma, QUOTE};
pub use template::{ChatTemplate, Message, RenderOptions, Role, ToolCall};
pub use tool_grammar::{tool_call_constraint, ForcedToolCall};
