//! Kernel handles looked up once per process.
//!
//! candle's `get_or_load_custom_func` asks the driver for the function by name on every call
//! (about 0.9 us of host time on the H100 machine, `bench_kernels --launch-floor`); a decode
//! step of a small model launches several hundred of our kernels, so the handles are kept here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaStream, LaunchArgs};
use candle_core::cuda_backend::{CudaDevice, DeviceId};

/// A loaded kernel and the device's stream it launches on.
pub(crate) struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    /// A launch of this kernel on the device's stream.
    pub(crate) fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// Blocks of `threads` threads one multiprocessor holds at once (the driver's occupancy
    /// query, asked once per kernel name and block size), or `None` when the query fails.
    pub(crate) fn resident_blocks(&self, name: &str, threads: u32) -> Option<usize> {
        static SEEN: OnceLock<Mutex<Occupancy>> = OnceLock::new();
        let seen = SEEN.get_or_init(Mutex::default);
        let key = (name.to_string(), threads);
        if let Some(&n) = seen.lock().ok().and_then(|m| m.get(&key).copied()).as_ref() {
            return n;
        }
        let n = self
            .func
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .ok()
            .map(|n| n as usize);
        if let Ok(mut m) = seen.lock() {
            m.insert(key, n);
        }
        n
    }
}

/// Resident blocks per multiprocessor by (kernel name, threads a block).
type Occupancy = HashMap<(String, u32), Option<usize>>;

type Handles = HashMap<(DeviceId, &'static str), HashMap<String, CudaFunction>>;

/// `name` from the PTX module `module` (loaded on first use), as [`Kernel`].
///
/// # Errors
/// The module does not load or has no such function.
pub(crate) fn load_kernel(
    dev: &CudaDevice,
    name: &str,
    module: &'static str,
    ptx: &'static str,
) -> candle_core::Result<Kernel> {
    static HANDLES: OnceLock<Mutex<Handles>> = OnceLock::new();
    let handles = HANDLES.get_or_init(Mutex::default);
    let key = (dev.id(), module);
    let cached = handles
        .lock()
        .ok()
        .and_then(|h| h.get(&key).and_then(|m| m.get(name)).cloned());
    let func = match cached {
        Some(f) => f,
        None => {
            let f = (*dev.get_or_load_custom_func(name, module, ptx)?).clone();
            if let Ok(mut h) = handles.lock() {
                h.entry(key)
                    .or_default()
                    .insert(name.to_string(), f.clone());
            }
            f
        }
    };
    Ok(Kernel {
        func,
        stream: dev.cuda_stream(),
    })
}
