//! The launch plan shared by the CUDA and Metal launchers, under its former path: see
//! [`crate::kernels::plan`].

pub use crate::kernels::plan::*;
