//! The serve example's HTTP server, started on `127.0.0.1:0` over a CPU fixture and driven
//! with a real HTTP client (reqwest): both OpenAI endpoints and Anthropic Messages, streaming
//! and not; greedy ids against the library's single-sequence decode; concurrency across KV
//! layouts; prefix reuse; cancellation; every bad input; the API key; a load of 200 requests;
//! a teacher-forced streaming tool call; structured output; and a model sharded over two CPU
//! ranks. Every server stops when its test ends.

#[path = "../common/mod.rs"]
mod common;
#[allow(dead_code)]
#[path = "../../examples/serve/server/mod.rs"]
mod server;

mod harness;

mod basic;
mod cancel;
mod concurrency;
mod errors;
mod forced_tools;
mod load;
mod logprobs;
mod reuse;
mod sharded;
mod structured;
mod tool_stream;
