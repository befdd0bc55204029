//! Device buffers a launch needs only while it runs (the product a folded norm reads back, the
//! partial sums of split attention), kept per host thread and reused by the next launch instead
//! of being allocated and freed around each one: an allocation and its free cost more host
//! time than a small kernel's launch, and a batch-1 decode step needs a couple of hundred such
//! buffers.
//!
//! Per thread because candle's device launches on the calling thread's default stream: launches
//! of one thread run in order, so a buffer is free again for the thread's next launch (with
//! dependent launches too: a kernel touches memory only after the kernel before it finished),
//! while another thread's stream could run at the same time.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::{CudaDevice, DeviceId};

/// This thread's buffers by (device, name); each a `CudaSlice` of its element type.
type Buffers = HashMap<(DeviceId, &'static str), Box<dyn Any>>;

thread_local! {
    static BUFFERS: RefCell<Buffers> = RefCell::new(HashMap::new());
    static GENERATION: Cell<u64> = const { Cell::new(0) };
}

/// How many times this thread has allocated or replaced a kept buffer. A CUDA graph holds the
/// addresses of the buffers its capture used, so it must not replay once this has moved on: a
/// replaced buffer is freed, and its memory may already hold a cache or another tensor.
pub(crate) fn generation() -> u64 {
    GENERATION.with(|g| g.get())
}

/// Runs `f` with this thread's scratch buffer `key` on `dev`: at least `len` elements of `E`
/// whose contents are undefined (the caller writes before it reads).
///
/// # Errors
/// Allocation failure, or `f`'s error.
pub(crate) fn with_scratch<E, R>(
    dev: &CudaDevice,
    key: &'static str,
    len: usize,
    f: impl FnOnce(&mut CudaSlice<E>) -> candle_core::Result<R>,
) -> candle_core::Result<R>
where
    E: DeviceRepr + ValidAsZeroBits + 'static,
{
    with_kept(dev, key, len, f)
}

/// Runs `f` with this thread's buffer `key` on `dev`: at least `len` elements of `E`, zero when
/// first allocated and holding whatever the previous user left (a launch counter that every
/// launch leaves at zero). A buffer that is too short is replaced by one of twice the length
/// asked (its free is ordered on the stream after the launches that used it).
///
/// # Errors
/// Allocation failure, or `f`'s error.
pub(crate) fn with_kept<E, R>(
    dev: &CudaDevice,
    key: &'static str,
    len: usize,
    f: impl FnOnce(&mut CudaSlice<E>) -> candle_core::Result<R>,
) -> candle_core::Result<R>
where
    E: DeviceRepr + ValidAsZeroBits + 'static,
{
    let k = (dev.id(), key);
    // Taken out of the map while `f` runs, so that `f` may use other buffers.
    let held = BUFFERS.with(|b| b.borrow_mut().remove(&k));
    let mut buf = match held.and_then(|b| b.downcast::<CudaSlice<E>>().ok()) {
        Some(b) if b.len() >= len.max(1) => b,
        // Memory allocated while a graph is captured belongs to the graph: a buffer kept past
        // the capture would be freed under the thread.
        _ if super::graph::recording() => candle_core::bail!(
            "scratch buffer `{key}` would grow during a CUDA graph capture ({len} elements)"
        ),
        _ => {
            GENERATION.with(|g| g.set(g.get() + 1));
            Box::new(dev.alloc_zeros::<E>(len.max(1) * 2)?)
        }
    };
    let out = f(&mut buf);
    BUFFERS.with(|b| b.borrow_mut().insert(k, buf));
    out
}
