//! Kernel handles looked up once per process, and their launches.
//!
//! The crate's modules are loaded here from the fatbins `build.rs` embeds (machine code, so no
//! JIT compilation at first use on the GPU they were built for), and every function handle is
//! kept: candle's `get_or_load_custom_func` asks the driver for the function by name on every
//! call (a noticeable share of a small kernel's launch cost), and a decode step of a small model
//! launches several hundred of our kernels.
//!
//! Launches use programmatic dependent launch on devices of compute capability 9.0 and up: a
//! kernel's blocks may be scheduled while the previous kernel on the stream still runs, and wait
//! for it (`griddepcontrol.wait`, `pdl_entry` in `common.cuh`) before touching memory. Every
//! kernel launched here starts with that wait, so the order of effects is the stream's; what is
//! saved is the launch latency and the block-scheduling ramp between kernels. A kernel that
//! issues loads before its wait (settled weights or keys) must read everything else through
//! loads the compilers keep after it: reads of `const __restrict__` pointers become read-only
//! loads that they may move above the wait (`ld_after_wait4` in `common.cuh`).
//! `scripts/check_pdl_order.py` checks a build's machine code for this.
//! [`LaunchPolicy::dependent_launch`](crate::kernels::policy::LaunchPolicy::dependent_launch)
//! off launches plainly.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DriverError, LaunchConfig,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, DeviceId};

/// A loaded kernel and the device's stream it launches on.
pub(crate) struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    /// A launch of this kernel on the device's stream.
    pub(crate) fn builder(&self) -> Launch<'_> {
        Launch {
            kernel: self,
            args: Vec::with_capacity(16),
        }
    }

    /// Blocks of `threads` threads one multiprocessor holds at once (the driver's occupancy
    /// query, asked once per kernel handle and block size), or `None` when the query fails.
    pub(crate) fn resident_blocks(&self, threads: u32) -> Option<usize> {
        self.resident_blocks_with(threads, 0)
    }

    /// As [`Kernel::resident_blocks`], for blocks that also take `smem` bytes of dynamic
    /// shared memory. Above the default 48 KiB a block, the kernel is first allowed that much
    /// (`None` if the device refuses).
    pub(crate) fn resident_blocks_with(&self, threads: u32, smem: u32) -> Option<usize> {
        static SEEN: OnceLock<Mutex<Occupancy>> = OnceLock::new();
        let seen = SEEN.get_or_init(Mutex::default);
        let key = (self.func.cu_function() as usize, threads, smem);
        if let Some(n) = seen.lock().ok().and_then(|m| m.get(&key).copied()) {
            return n;
        }
        let allowed = smem <= 48 * 1024
            || self
                .func
                .set_attribute(
                    sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .is_ok();
        let n = allowed
            .then(|| {
                self.func
                    .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
                    .ok()
            })
            .flatten()
            .filter(|&n| n > 0)
            .map(|n| n as usize);
        if let Ok(mut m) = seen.lock() {
            m.insert(key, n);
        }
        n
    }
}

/// A fatbin `build.rs` compiled from one `.cu` file, and the name its loaded module is cached
/// under.
pub(crate) struct Module {
    name: &'static str,
    image: &'static [u8],
}

/// Declares the crate's modules: `NAME = "file"` embeds `$OUT_DIR/file.fatbin`, built from
/// `src/kernels/cuda/file.cu`.
macro_rules! modules {
    ($($(#[$doc:meta])* $name:ident = $file:literal;)*) => {$(
        $(#[$doc])*
        pub(crate) const $name: Module = Module {
            name: concat!("candle_gemma_", $file),
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $file, ".fatbin")),
        };
    )*};
}

modules! {
    /// Fused attention on CUDA cores, and the split combine.
    ATTENTION = "attention";
    /// Fused attention on the tensor cores.
    ATTENTION_TC = "attention_tc";
    /// Packed-weight matrix-vector products.
    MATVEC = "matvec";
    /// Packed 4-bit products of 9..=32 activation rows.
    MATVEC_BATCH = "matvec_batch";
    /// Affine quantization, dequantization and quantized K/V writes.
    QUANTIZE = "quantize";
    /// Add-norm, GeGLU, q/k/v prep and the dense K/V write.
    LAYER_OPS = "layer_ops";
    /// MoE routing, grouped expert products and the mix.
    MOE = "moe";
    /// Masked softmax, row argmax and tempered draws.
    REDUCE = "reduce";
    /// Each row's best logits for sampling.
    TOP_K = "top_k";
    /// Flash attention over long query blocks (prefill).
    PREFILL_ATTENTION = "prefill_attention";
    /// Dense-weight decode products.
    DENSE_MATVEC = "dense_matvec";
    /// Bench helpers: the copy kernel and the GPU spin.
    DIAGNOSTICS = "diagnostics";
    /// The one-shot all-reduce over peer memory.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    PEER_REDUCE = "peer_reduce";
}

/// Resident blocks per multiprocessor by (kernel handle, threads a block, dynamic shared
/// memory a block).
type Occupancy = HashMap<(usize, u32, u32), Option<usize>>;

/// Loaded modules by (device, module name), and their functions by name.
type Handles = HashMap<(DeviceId, &'static str), LoadedModule>;

/// A module loaded on one device and the functions looked up in it so far.
struct LoadedModule {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// `name` from `module` (loaded from its fatbin on first use), as [`Kernel`].
///
/// The image carries machine code for the build's compute capability, so a matching GPU loads
/// it without compiling anything, and PTX, which the driver compiles for other GPUs on first
/// load (it keeps the result in its own cache for later runs).
///
/// # Errors
/// The module does not load on this device (no code for its architecture and PTX newer than
/// its driver) or has no such function.
pub(crate) fn load_kernel(
    dev: &CudaDevice,
    name: &str,
    module: &'static Module,
) -> candle_core::Result<Kernel> {
    let &Module {
        name: module,
        image,
    } = module;
    static HANDLES: OnceLock<Mutex<Handles>> = OnceLock::new();
    let handles = HANDLES.get_or_init(Mutex::default);
    let mut handles = handles
        .lock()
        .map_err(|_| candle_core::Error::Msg("kernel handle cache poisoned".into()))?;
    let loaded = match handles.entry((dev.id(), module)) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => {
            let ctx = dev.cuda_stream().context().clone();
            let module = ctx
                .load_module(Ptx::from_binary(image.to_vec()))
                .map_err(|err| {
                    candle_core::Error::Msg(format!(
                        "cannot load the CUDA module {module} ({} bytes) on device {}: {err} \
                         (machine code for compute capability {}; set CUDA_COMPUTE_CAP \
                         to the GPU's when building)",
                        image.len(),
                        ctx.ordinal(),
                        env!("CANDLE_GEMMA_CUDA_CAP")
                    ))
                })?;
            e.insert(LoadedModule {
                module,
                functions: HashMap::new(),
            })
        }
    };
    let func = match loaded.functions.get(name) {
        Some(f) => f.clone(),
        None => {
            let f = loaded.module.load_function(name).map_err(|err| {
                candle_core::Error::Msg(format!("no kernel {name} in module {module}: {err}"))
            })?;
            loaded.functions.insert(name.to_string(), f.clone());
            f
        }
    };
    Ok(Kernel {
        func,
        stream: dev.cuda_stream(),
    })
}

/// One kernel argument as the driver takes it: the address of a value the caller keeps alive
/// until the launch, or a device address held here.
pub(crate) enum Arg {
    Value(*mut c_void),
    Device(sys::CUdeviceptr),
}

/// Arguments of a [`Launch`]: parameter blocks and scalars by reference, device buffers by
/// their address.
pub(crate) trait LaunchArg<'a> {
    /// Appends the argument.
    fn push(self, args: &mut Vec<Arg>, stream: &CudaStream);
}

macro_rules! value_args {
    ($($t:ty),* $(,)?) => {$(
        impl<'a> LaunchArg<'a> for &'a $t {
            fn push(self, args: &mut Vec<Arg>, _: &CudaStream) {
                args.push(Arg::Value(self as *const $t as *mut c_void));
            }
        }
    )*};
}
value_args!(
    u32,
    u64,
    i32,
    f32,
    crate::kernels::plan::QsdpaParams,
    crate::kernels::plan::QmatParams,
    super::kv_write::KvqBatch,
    super::kv_write::KvBatchDst,
    super::kv_write::KvScatterParams,
    super::kv_write::TokenRowsParams,
    super::attention::batched::QsdpaSeq,
    super::layer_ops::AddNormParams,
    super::layer_ops::GeluMulParams,
    super::layer_ops::QkvPrepParams,
    super::moe::RouteParams,
    super::dense_matvec::DenseMvParams,
    super::moe::GroupedMvParams,
    super::reduce::SoftmaxParams,
    super::attention::prefill::PrefillParams,
    super::norm_tail::MvNormParams,
);

impl<'a, T> LaunchArg<'a> for &'a CudaSlice<T> {
    fn push(self, args: &mut Vec<Arg>, stream: &CudaStream) {
        args.push(Arg::Device(self.device_ptr(stream).0));
    }
}
impl<'a, T> LaunchArg<'a> for &'a mut CudaSlice<T> {
    fn push(self, args: &mut Vec<Arg>, stream: &CudaStream) {
        args.push(Arg::Device(self.device_ptr_mut(stream).0));
    }
}
impl<'a, 'b: 'a, T> LaunchArg<'a> for &'a CudaView<'b, T> {
    fn push(self, args: &mut Vec<Arg>, stream: &CudaStream) {
        args.push(Arg::Device(self.device_ptr(stream).0));
    }
}
impl<'a, 'b: 'a, T> LaunchArg<'a> for &'a mut CudaViewMut<'b, T> {
    fn push(self, args: &mut Vec<Arg>, stream: &CudaStream) {
        args.push(Arg::Device(self.device_ptr_mut(stream).0));
    }
}

/// A kernel launch being assembled: [`Launch::arg`] in the kernel's parameter order, then
/// [`Launch::launch`].
pub(crate) struct Launch<'a> {
    kernel: &'a Kernel,
    args: Vec<Arg>,
}

impl<'a> Launch<'a> {
    /// Appends the next argument.
    pub(crate) fn arg<A: LaunchArg<'a>>(&mut self, a: A) -> &mut Self {
        a.push(&mut self.args, &self.kernel.stream);
        self
    }

    /// Queues the kernel on the device's stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and the
    /// buffers must cover what the kernel reads and writes under `cfg`.
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let stream = &self.kernel.stream;
        stream.context().bind_to_thread()?;
        // Device addresses are passed by the address of their copy in `self.args`.
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| match a {
                Arg::Value(v) => *v,
                Arg::Device(d) => d as *const sys::CUdeviceptr as *mut c_void,
            })
            .collect();
        // SAFETY: a zeroed attribute is valid; id and value are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let pdl = dependent_launch(stream);
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `params` holds one pointer per kernel parameter (the caller's contract),
        // each valid until this call returns (`self.args` and the borrowed values outlive it).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.kernel.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

/// Whether launches on `stream`'s device may overlap the previous kernel's tail: compute
/// capability 9.0 or more (`griddepcontrol`), unless the launch policy turns dependent launches
/// off.
fn dependent_launch(stream: &CudaStream) -> bool {
    crate::kernels::policy::current().dependent_launch && super::device::compute_major(stream) >= 9
}
