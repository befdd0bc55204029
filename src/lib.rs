//! candle-gemma: run Google's Gemma 4 language models (E2B, E4B, 26B-A4B, 31B) locally on
//! [Candle](https://github.com/huggingface/candle), with a KV cache that fits the job.
//!
//! # Quick start
//!
//! Load a checkpoint folder (or, with the `hub` feature, a hub id through
//! [`ModelBuilder::repo`]), then stream a generation:
//!
//! ```
//! use candle_gemma::{GenOptions, Model};
//!
//! # fn main() -> candle_gemma::Result<()> {
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/e2b-hf");
//! let model = Model::builder().path(dir).build()?;
//! let prompt = model.encode("Hello", true)?;
//! let mut generator = model.generator(GenOptions { max_tokens: 8, ..Default::default() });
//! for step in generator.stream(&prompt)? {
//!     print!("{}", step?.text);
//! }
//! # Ok(()) }
//! ```
//!
//! Chat with the checkpoint's template, thinking and tool calls parsed for you:
//!
//! ```
//! use candle_gemma::chat::{ChatSession, OutputEvent};
//! use candle_gemma::{GenOptions, Model};
//!
//! # fn main() -> candle_gemma::Result<()> {
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/e2b-hf");
//! let model = Model::builder().path(dir).build()?;
//! let mut chat = ChatSession::new(&model, GenOptions { max_tokens: 8, ..Default::default() })?;
//! let reply = chat.send("Hi!", |event| {
//!     if let OutputEvent::Text(t) = event {
//!         print!("{t}");
//!     }
//!     true // keep going
//! })?;
//! println!("\n{} tokens", reply.stats.generated_tokens);
//! # Ok(()) }
//! ```
//!
//! # Caches
//!
//! [`GenOptions::cache`] picks the layout per generation ([`kv::CacheMode`]): rotating ring
//! buffers on sliding layers and growing caches on full ones by default, or simple everywhere,
//! or 4/8-bit quantized everywhere (sliding layers included). KV-shared layers own no cache and
//! read their producer's K/V, dense or packed. [`generate::BatchSession`] decodes several
//! sequences together, each with its own options and cache layout, with exactly the tokens of
//! single decode.
//!
//! # Serving
//!
//! [`serve::Engine`] serves many requests at once from a worker thread: a
//! [`serve::Scheduler`] admits them under a batch size and a KV-memory budget, prefills joining
//! prompts in chunks between decode steps, and reuses the K/V of earlier requests' prefixes.
//!
//! # Features
//!
//! | feature | default | |
//! |---|---|---|
//! | `hub` | yes | Hugging Face hub downloads (ureq with rustls; resumable, verified, the cache shared with huggingface_hub) |
//! | `cuda` | no | NVIDIA GPUs |
//! | `metal` | no | Apple GPUs |

pub mod chat;
pub mod config;
mod error;
#[doc(hidden)]
pub mod fuzz_api;
pub(crate) mod gemma4;
pub mod generate;
#[cfg(feature = "hub")]
pub mod hub;
#[doc(hidden)]
pub mod kernels;
pub mod kv;
mod model;
mod parallel;
pub mod serve;
pub mod shard;
pub(crate) mod weights;

pub use error::{Error, HubError, Result};
pub use gemma4::model::{PREFILL_CHUNK, PREFILL_CHUNK_FLASH};
pub use generate::{FinishReason, GenOptions, Generator, Output, StepOutput};
pub use kernels::policy::LaunchPolicy;
pub use kv::{CacheConfig, KvCache};
pub use model::{best_device, device_memory_in_use, Model, ModelBuilder};
pub use parallel::ShardedModel;
