//! candle-gemma: run Google's Gemma 4 language models locally on Candle.

pub mod chat;
pub mod config;
mod error;
pub mod gemma4;
pub mod generate;
#[cfg(feature = "hub")]
pub mod hub;
pub mod kernels;
pub mod kv;
mod model;
pub mod weights;

pub use error::{Error, Result};
pub use generate::{FinishReason, GenOptions, Generator, Output, StepOutput};
pub use kv::{CacheConfig, KvCache};
pub use model::{Model, ModelBuilder};
