//! Helpers for the benches, not used by the model (`diagnostics.cu`): an SM copy kernel (the
//! bandwidth reference), a kernel that keeps the stream busy so events time the GPU alone, and
//! a probe of the host cost of a small launch's pieces.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Result, Tensor};

use super::device::{as_rows, bind, by_dtype, cuda_dev, grid_stride, tn, u32_of, wrap};
use super::kernel_cache::{load_kernel, DIAGNOSTICS, LAYER_OPS};
use super::layer_ops::GeluMulParams;

/// Copies `src` into `dst` (same byte size, contiguous, a multiple of 16 bytes) with an SM copy
/// kernel: the bandwidth reference of the benches.
///
/// # Errors
/// Sizes that disagree, CUDA errors.
pub fn device_copy(src: &Tensor, dst: &Tensor) -> Result<()> {
    let bytes = src.elem_count() * src.dtype().size_in_bytes();
    if bytes != dst.elem_count() * dst.dtype().size_in_bytes()
        || !bytes.is_multiple_of(16)
        || src.dtype() != DType::F32
        || dst.dtype() != DType::F32
        || !src.is_contiguous()
        || !dst.is_contiguous()
    {
        candle_core::bail!("device_copy: two contiguous f32 tensors of one size (x16 bytes)");
    }
    let dev = cuda_dev(src)?;
    let func = load_kernel(&dev, "copy_u4", &DIAGNOSTICS)?;
    let n = (bytes / 16) as u64;
    let cfg = LaunchConfig {
        grid_dim: (132 * 16, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    bind!(sv, src, f32);
    bind!(dv, dst, f32);
    let mut b = func.builder();
    b.arg(&sv);
    b.arg(&dv);
    b.arg(&n);
    // SAFETY: both buffers hold `n` 16-byte chunks from their (16-byte aligned) starts.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Occupies the device's stream for `ns` nanoseconds (one spinning thread). A benchmark that
/// enqueues work behind it sees that work run back to back on the GPU, so events around the
/// work time the GPU alone, not the host's enqueue.
///
/// # Errors
/// CUDA errors (loading or launching the kernel).
pub fn gpu_spin(dev: &CudaDevice, ns: u64) -> Result<()> {
    let func = load_kernel(dev, "gpu_spin", &DIAGNOSTICS)?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    b.arg(&ns);
    // SAFETY: the kernel takes one u64 and touches no memory.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Host microseconds per call of the pieces of one small-kernel launch, each timed over `n`
/// calls (no synchronisation in the timed loops): `(what, microseconds)`. A diagnostic for
/// the `cuda_kernels` bench (`--launch-floor`), not part of the model's API.
///
/// # Errors
/// CUDA errors, or a tensor not on a CUDA device.
#[doc(hidden)]
pub fn probe_host_costs(x: &Tensor, n: usize) -> Result<Vec<(&'static str, f64)>> {
    let dev = cuda_dev(x)?;
    let n = n.max(1);
    let dtype = x.dtype();
    let name = format!("gelu_mul_{}", tn(dtype)?);
    let per = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let mut out = Vec::new();
    let t = std::time::Instant::now();
    for _ in 0..n {
        // SAFETY: never read.
        drop(unsafe { dev.alloc::<u16>(x.elem_count())? });
    }
    out.push(("alloc_and_free", per(t)));
    let t = std::time::Instant::now();
    for _ in 0..n {
        load_kernel(&dev, &name, &LAYER_OPS)?;
    }
    out.push(("function_lookup_cached", per(t)));
    let func = load_kernel(&dev, &name, &LAYER_OPS)?;
    let (xc, rows, width, stride) = as_rows(x)?;
    let params = GeluMulParams {
        rows: u32_of(rows, "rows")?,
        width: u32_of(width, "width")?,
        a_stride: u32_of(stride, "stride")?,
        b_stride: u32_of(stride, "stride")?,
    };
    let cfg = grid_stride(rows * width);
    by_dtype!(dtype, E, {
        // SAFETY: written by every launch below before anything reads it (nothing does).
        let mut y = unsafe { dev.alloc::<E>((rows * width).max(1))? };
        let t = std::time::Instant::now();
        for _ in 0..n {
            bind!(av, xc, E);
            let mut bl = func.builder();
            bl.arg(&params);
            bl.arg(&av);
            bl.arg(&av);
            bl.arg(&mut y);
            // SAFETY: arguments match gelu_mul's signature.
            unsafe { bl.launch(cfg) }.w()?;
        }
        out.push(("launch_preallocated", per(t)));
        let t = std::time::Instant::now();
        for _ in 0..n {
            let _ = wrap(dev.alloc_zeros::<E>(1)?, &dev, &[1]);
        }
        out.push(("tensor_wrap_with_memset", per(t)));
        Ok::<(), candle_core::Error>(())
    })?;
    candle_core::backend::BackendDevice::synchronize(&dev)?;
    Ok(out)
}
