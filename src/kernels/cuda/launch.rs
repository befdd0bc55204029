//! The quantized-kernel launchers under one path, for callers written against it; each lives
//! in the module of its concept.

pub use super::attention::launch::*;
pub use super::diagnostics::gpu_spin;
pub(crate) use super::kv_write::{kvq_destination, quantize_kv_into, quantize_kv_into_batch};
pub(crate) use super::matvec::qmatvec;
pub use super::pool::*;
pub use super::quantize::*;
