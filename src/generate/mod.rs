//! Generation: options, the single-sequence [`Generator`] (with prompt-cache reuse across
//! calls), the continuous-batching [`BatchSession`], sampling, stop strings and streaming
//! detokenization.

mod batch;
pub(crate) mod choose;
pub mod constraint;
pub mod detok;
mod generator;
mod logprobs;
mod lookahead;
pub mod noise;
mod penalties;
pub mod sampling;
pub mod stop;
mod types;
pub use types::*;

pub use batch::{BatchSession, Finished, SeqId};
pub use constraint::{Constraint, ConstraintCompiler, TokenConstraint};
pub use generator::{Generator, Stream};
pub use sampling::{DeviceDraw, Sampler, SamplingOptions};
