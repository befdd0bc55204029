//! The residual add + norm folded into a product's last block (`last_block_add_norm` in
//! `norm_tail.cuh`): the dense and packed matvec kernels with a `_norm` tail store their
//! product, and the block that finishes last adds the residual and writes the norms. This
//! module checks the operands, allocates the outputs and pushes the tail's arguments.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::{DType, Result, Tensor};

use super::device::{check_dtype, wrap};
use super::layer_ops::AddNormExtra;
use super::scratch::with_kept;

/// Widest output row whose folded add + norm keeps its elements in registers
/// (`last_block_add_norm`'s fast path); wider rows take its plain loop, which is slower folded
/// than apart.
pub const FOLD_MAX_WIDTH: usize = 4096;

/// The sum of a residual add + norm and the norms of it asked for.
pub type AddNormOut = (Tensor, Option<Tensor>, Option<Tensor>);

/// The residual add + norm folded into a product: `add_norm_ext(res, y, w, eps, extra)` of
/// its output `y`.
pub(crate) struct NormFuse<'a> {
    /// The residual.
    pub(crate) res: &'a Tensor,
    /// The norm's weight.
    pub(crate) w: &'a Tensor,
    /// The norm's epsilon.
    pub(crate) eps: f64,
    /// The scalar, the next norms and the second branch.
    pub(crate) extra: &'a AddNormExtra<'a>,
}

impl NormFuse<'_> {
    /// Checks the residual, the norm weights and their dtype against the product's output
    /// `shape` (last axis the output width) and `dtype`; `what` names the caller in the error.
    pub(super) fn check(&self, shape: &[usize], dtype: DType, what: &str) -> Result<()> {
        let e = self.extra;
        let mut ts = vec![self.res, self.w];
        ts.extend(e.scalar);
        ts.extend(e.next);
        ts.extend(e.next2);
        check_dtype(&ts, dtype)?;
        let width = [shape.last().copied().unwrap_or(0)];
        if self.res.dims() != shape
            || self.w.dims() != width
            || e.next.is_some_and(|t| t.dims() != width)
            || e.next2.is_some_and(|t| t.dims() != width)
            || (e.next2.is_some() && e.next.is_none())
        {
            candle_core::bail!(
                "{what}: residual {:?}, output {shape:?}, norm weight {:?}",
                self.res.dims(),
                self.w.dims()
            );
        }
        Ok(())
    }

    /// The tail's `MvNormParams`: which of the scalar and the next norms it applies.
    pub(super) fn params(&self) -> MvNormParams {
        let e = self.extra;
        MvNormParams {
            flags: u32::from(e.scalar.is_some())
                | (u32::from(e.next.is_some()) << 1)
                | (u32::from(e.next2.is_some()) << 2),
            eps: self.eps as f32,
        }
    }
}

/// What a norm tail writes: the sum, and the norms of it asked for (`n` elements each).
pub(super) struct NormOutputs<E> {
    pub(super) out: CudaSlice<E>,
    pub(super) out2: Option<CudaSlice<E>>,
    pub(super) out3: Option<CudaSlice<E>>,
}

impl<E: DeviceRepr + candle_core::cuda_backend::CudaDType> NormOutputs<E> {
    /// Uninitialised outputs for `nf`.
    pub(super) fn alloc(
        dev: &candle_core::CudaDevice,
        n: usize,
        nf: &NormFuse<'_>,
    ) -> Result<Self> {
        // SAFETY: the last block writes every element of each output asked for.
        unsafe {
            Ok(Self {
                out: dev.alloc::<E>(n)?,
                out2: nf.extra.next.map(|_| dev.alloc::<E>(n)).transpose()?,
                out3: nf.extra.next2.map(|_| dev.alloc::<E>(n)).transpose()?,
            })
        }
    }

    /// The outputs as tensors of `shape`.
    pub(super) fn wrap(self, dev: &candle_core::CudaDevice, shape: &[usize]) -> AddNormOut {
        (
            wrap(self.out, dev, shape),
            self.out2.map(|o| wrap(o, dev, shape)),
            self.out3.map(|o| wrap(o, dev, shape)),
        )
    }
}

/// Pushes a norm tail's arguments (`DMV_NORM_ARGS` in `dense_matvec.cu`) after the product's
/// output on the launch `$b`, then any `$more`, then launches it under `$cfg`. The argument views are bound here, at the
/// call site, so that they live until the launch.
macro_rules! launch_with_norm_tail {
    ($b:ident, $nf:expr, $res:expr, $nw:expr, $outs:expr, $counter:expr, $ty:ty, $cfg:expr
     $(, $more:expr)*) => {{
        let e = $nf.extra;
        $crate::kernels::cuda::device::bind!(rv, $res, $ty);
        $crate::kernels::cuda::device::bind!(nwv, $nw, $ty);
        let sc = e.scalar.unwrap_or(&$nw);
        $crate::kernels::cuda::device::bind!(sv, sc, $ty);
        let n1 = e.next.unwrap_or(&$nw);
        $crate::kernels::cuda::device::bind!(n1v, n1, $ty);
        let n2 = e.next2.unwrap_or(&$nw);
        $crate::kernels::cuda::device::bind!(n2v, n2, $ty);
        let np = $nf.params();
        $b.arg(&rv);
        $b.arg(&nwv);
        $b.arg(&sv);
        $b.arg(&n1v);
        $b.arg(&n2v);
        $b.arg(&mut $outs.out);
        match $outs.out2.as_mut() {
            Some(o) => $b.arg(o),
            None => $b.arg(&rv),
        };
        match $outs.out3.as_mut() {
            Some(o) => $b.arg(o),
            None => $b.arg(&rv),
        };
        $b.arg($counter);
        $b.arg(&np);
        $($b.arg($more);)*
        // SAFETY: the caller pushed the product's arguments in the kernel's order; these follow
        // DMV_NORM_ARGS, then any further arguments the kernel takes (`$more`, a peer tail's);
        // the counter is zero between launches.
        unsafe { $b.launch($cfg) }.w()?;
    }};
}
pub(super) use launch_with_norm_tail;

/// `struct MvNormParams` in `norm_tail.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct MvNormParams {
    flags: u32,
    eps: f32,
}

// SAFETY: `#[repr(C)]` plain integer and float, read by the kernels with the same layout.
unsafe impl DeviceRepr for MvNormParams {}

/// Runs `f` with the launch counter of the folded add + norm (this thread's, on `dev`): one
/// `u32`, zero between launches (the last block of each launch resets it; launches on one
/// stream do not overlap).
pub(super) fn with_norm_counter<R>(
    dev: &candle_core::CudaDevice,
    f: impl FnOnce(&mut CudaSlice<u32>) -> Result<R>,
) -> Result<R> {
    with_kept::<u32, R>(dev, "norm_counter", 1, f)
}
