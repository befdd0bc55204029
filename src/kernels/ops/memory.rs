//! The device the build runs on, and what its memory pool holds.

use candle_core::Device;

use super::Result;

/// The first GPU the build supports (CUDA, then Metal); the CPU when no GPU feature is built.
///
/// # Errors
/// The GPU could not be opened.
pub(crate) fn best_gpu() -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        return Ok(Device::new_cuda(0)?);
    }
    #[cfg(all(feature = "metal", not(feature = "cuda")))]
    {
        return Ok(Device::new_metal(0)?);
    }
    #[allow(unreachable_code)]
    Ok(Device::Cpu)
}

/// Bytes of device memory in use on `device` by every process (total minus free, after the
/// memory pool returned its unused blocks), or `None` where the backend does not report it
/// (the CPU, Metal).
pub(crate) fn device_memory_in_use(device: &Device) -> Option<usize> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        device.synchronize().ok()?;
        // Freed blocks the pool keeps for reuse are not in use.
        crate::kernels::cuda::pool::trim_pool(d).ok()?;
        let (free, total) = d.cuda_stream().context().mem_get_info().ok()?;
        return Some(total - free);
    }
    let _ = device;
    None
}
