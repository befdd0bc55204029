//! Host-side helpers every CUDA launcher shares: a tensor's device, storage and buffer views,
//! wrapping fresh buffers as tensors, kernel-name suffixes of dtypes, launch shapes, and the
//! device facts (multiprocessor count) the launch plans read.

use candle_core::cuda_backend::cudarc::driver::{
    sys::CUdevice_attribute, CudaSlice, CudaStream, CudaView, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Result, Storage, Tensor};

use crate::kernels::plan::{QmatParams, QsdpaParams};
use crate::kernels::KernelError;

// SAFETY: both structs are `#[repr(C)]`, plain integers and floats, passed by value and read
// by the kernels with the same field layout.
unsafe impl DeviceRepr for QsdpaParams {}
unsafe impl DeviceRepr for QmatParams {}

/// The kernel-name suffix of a query or activation dtype (`f32`, `f16`, `bf16`).
///
/// # Errors
/// [`KernelError::DType`] for any other dtype.
pub(super) fn kname(dtype: DType) -> std::result::Result<&'static str, KernelError> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        found => Err(KernelError::DType {
            what: "queries for the CUDA quantized kernels",
            expected: DType::BF16,
            found,
        }),
    }
}

/// The CUDA device `t` lives on.
pub(super) fn cuda_dev(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => candle_core::bail!("expected a CUDA tensor"),
    }
}

/// The CUDA storage behind `s`.
pub(super) fn cuda_storage(s: &Storage) -> Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("expected CUDA storage"),
    }
}

/// A view of `t`'s buffer from its layout's start offset.
pub(super) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    layout: &Layout,
) -> Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(layout.start_offset()..))
}

/// Wraps a freshly written device buffer as a contiguous tensor.
pub(super) fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: &[usize]) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Multiprocessors of the device (132 on an H100 SXM), read once per process.
pub(super) fn sm_count(dev: &CudaDevice) -> usize {
    static SMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SMS.get_or_init(|| {
        dev.cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |n| n.max(1) as usize)
    })
}

/// Compute capability major of `stream`'s device (9 on an H100; 0 if unreadable), read once
/// per process: the dependent-launch and warpgroup-product decisions both key on it.
pub(super) fn compute_major(stream: &CudaStream) -> i32 {
    static MAJOR: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *MAJOR.get_or_init(|| {
        stream
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .unwrap_or(0)
    })
}

/// `t` itself when contiguous and starting on a 16-byte boundary, else a copy into a fresh
/// buffer (`contiguous` alone keeps a contiguous view's start).
pub(super) fn contiguous_aligned16(t: &Tensor) -> Result<Tensor> {
    let aligned = (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16);
    if t.is_contiguous() && aligned {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
}

/// A grid-stride launch over `n` elements: 256 threads a block, at most 8 blocks per
/// multiprocessor of an H100-sized device.
pub(super) fn grid_stride(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 132 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernel-name suffix of a dtype.
pub(super) fn tn(dtype: DType) -> Result<&'static str> {
    kname(dtype).map_err(candle_core::Error::wrap)
}

/// `x` as `u32`; `what` names it in the error.
pub(super) fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} {x} exceeds u32")))
}

/// Binds a CUDA view of tensor `$t` (element type `$ty`) to `$name`, keeping its storage guard
/// alive in the enclosing scope.
macro_rules! bind {
    ($name:ident, $t:expr, $ty:ty) => {
        let guard = $t.storage_and_layout();
        let $name = $crate::kernels::cuda::device::view::<$ty>(
            $crate::kernels::cuda::device::cuda_storage(&guard.0)?,
            guard.1,
        )?;
    };
}
pub(super) use bind;

/// Runs `$body` with `$ty` bound to the Rust element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $ty:ident, $body:block) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $ty = f32;
                $body
            }
            candle_core::DType::F16 => {
                type $ty = half::f16;
                $body
            }
            _ => {
                type $ty = half::bf16;
                $body
            }
        }
    };
}
pub(super) use by_dtype;

/// `t` (rank >= 1) as rows of its last axis: `(tensor, rows, width, row stride)`. The tensor is
/// `t` itself when its last axis is dense and its rows are evenly spaced (a narrow of the last
/// axis qualifies), else a contiguous copy.
pub(super) fn as_rows(t: &Tensor) -> Result<(Tensor, usize, usize, usize)> {
    let dims = t.dims();
    let st = t.stride();
    let n = dims.len();
    let width = dims.last().copied().unwrap_or(1);
    let rows = t.elem_count() / width.max(1);
    if n >= 1 && st[n - 1] == 1 {
        let row_stride = if n >= 2 { st[n - 2] } else { width };
        // Leading axes must step by whole multiples of the row stride, like one flat row axis.
        let mut expect = row_stride;
        let mut uniform = true;
        for i in (0..n.saturating_sub(1)).rev() {
            if dims[i] > 1 && st[i] != expect {
                uniform = false;
                break;
            }
            expect *= dims[i];
        }
        if uniform {
            return Ok((t.clone(), rows, width, row_stride));
        }
    }
    Ok((t.contiguous()?, rows, width, width))
}

/// Checks that every tensor of `ts` has `dtype`, one the kernels are built for.
pub(super) fn check_dtype(ts: &[&Tensor], dtype: DType) -> Result<()> {
    tn(dtype)?;
    for t in ts {
        if t.dtype() != dtype {
            candle_core::bail!("fused kernel: expected {dtype:?}, found {:?}", t.dtype());
        }
    }
    Ok(())
}
