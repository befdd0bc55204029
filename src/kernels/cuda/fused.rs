//! The fused decoder-layer launchers under one path, for callers written against it; each
//! lives in the module of its concept.

pub use super::dense_matvec::*;
pub use super::diagnostics::{device_copy, probe_host_costs};
pub(crate) use super::kv_write::{kv_destination, kv_scatter_batch};
pub use super::layer_ops::*;
pub use super::matvec::{packed_matvec_add_norm, packed_matvec_folds_norm, PACKED_FOLD_MAX_WIDTH};
pub use super::moe::*;
pub use super::norm_tail::AddNormOut;
pub use super::reduce::*;
