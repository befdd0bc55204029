//! The device's stream-ordered memory pool candle allocates from, and cudarc's per-buffer event
//! tracking: settings that cut the host time of every allocation, and trimming for memory
//! readings.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::CudaDevice;

/// The stream-ordered memory pool candle allocates from (the device's default pool).
fn default_pool(dev: &CudaDevice) -> candle_core::Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let cu_dev = dev.cuda_stream().context().cu_device();
    // SAFETY: writes one pool handle for a valid device ordinal.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev) }
        .result()
        .map_err(candle_core::Error::wrap)?;
    Ok(pool)
}

/// Lets the device's memory pool keep freed blocks for reuse instead of returning them to the
/// driver at every synchronisation (its default release threshold is 0): every forward frees
/// and reallocates the same activation sizes, and regrowing the pool each time costs host time.
/// Called once per process by the fused path.
///
/// # Errors
/// CUDA errors.
pub fn retain_pool_memory(dev: &CudaDevice) -> candle_core::Result<()> {
    let pool = default_pool(dev)?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the attribute takes a pointer to a u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(candle_core::Error::wrap)
}

/// Stops cudarc from creating two CUDA events for every buffer allocated from now on, unless
/// the context already runs several streams.
///
/// cudarc only consults those events to order work across streams; candle and this crate use one
/// stream per device, so on a single-stream context they are pure host cost: an event create and
/// destroy pair per buffer, paid on every op of every decode step. Buffers allocated after this
/// call carry no events, so an application that later moves them to another stream of the same
/// context must synchronise that stream itself.
pub fn skip_event_tracking(dev: &CudaDevice) {
    let ctx = dev.cuda_stream().context().clone();
    if !ctx.is_in_multi_stream_mode() {
        // SAFETY: with a single stream the events are never waited on (see above).
        unsafe { dev.disable_event_tracking() };
    }
}

/// Returns the pool's unused blocks to the driver (so a memory reading counts live tensors).
///
/// # Errors
/// CUDA errors.
pub fn trim_pool(dev: &CudaDevice) -> candle_core::Result<()> {
    let pool = default_pool(dev)?;
    // SAFETY: trims a valid pool handle down to its live allocations.
    unsafe { sys::cuMemPoolTrimTo(pool, 0) }
        .result()
        .map_err(candle_core::Error::wrap)
}
