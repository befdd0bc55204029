//! Backend-neutral operations: one entry point per operation the model runs.
//!
//! Each entry point takes tensors and kernel operand types ([`Weight`], [`Norm`], a packed
//! weight, a cache view) and picks the backend itself: the fused CUDA kernel where the `cuda`
//! feature is built, the tensors live on a CUDA device and the launch policy has the fused
//! kernels on ([`fused`]); otherwise the chain of candle ops the kernel replaces, which runs on
//! every device and is the reference the kernels are tested against.
//!
//! | file | operations |
//! |---|---|
//! | [`norm`] | RMSNorm, residual add + norm, and the product + add + norm folding |
//! | [`matvec`] | the dense or packed product `x · Wᵀ` (plain, gated, normed, tied head) |
//! | [`geglu`] | `gelu_tanh(a) * b`, and the MLP's gate/up product with the gate inside |
//! | [`qkv`] | q/k/v norms, RoPE and the K/V write into a cache's slots |
//! | [`moe`] | MoE routing and the routed expert products |
//! | [`argmax`] | greedy token choice on the device |
//! | [`candidates`] | each row's best logits for the host samplers |
//! | [`collective`] | the all-reduce of a tensor-parallel group (NCCL) |
//! | [`memory`] | the device choice and the memory pool |
//! | [`graph`] | decode-step capture and replay (CUDA graphs; unavailable elsewhere) |

pub(crate) mod argmax;
pub(crate) mod candidates;
pub mod collective;
pub(crate) mod geglu;
pub(crate) mod graph;
pub(crate) mod matvec;
pub(crate) mod memory;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod qkv;

pub(crate) use matvec::Weight;

/// What every operation returns.
pub(crate) type Result<T> = std::result::Result<T, crate::kernels::KernelError>;

use candle_core::{Device, Tensor};

/// An RMSNorm operand: the `[dim]` scale and the epsilon added to the mean square.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Norm<'a> {
    /// `[dim]` scale (all ones for a norm without a learned scale).
    pub weight: &'a Tensor,
    /// Added to the mean square before the inverse square root.
    pub eps: f64,
}

/// Whether the fused CUDA kernels run on `device`: the `cuda` feature is built, the device is a
/// CUDA device and [`crate::kernels::policy::LaunchPolicy::fused`] is on. The first `true` also
/// on a device lets its memory pool keep freed blocks (every forward reallocates the same sizes).
pub(crate) fn fused(device: &Device) -> bool {
    let on = cfg!(feature = "cuda") && device.is_cuda() && crate::kernels::policy::current().fused;
    #[cfg(feature = "cuda")]
    if on {
        // Once per device (a tensor-parallel model runs on several).
        static POOLS: std::sync::Mutex<Vec<candle_core::cuda_backend::DeviceId>> =
            std::sync::Mutex::new(Vec::new());
        if let (Device::Cuda(d), Ok(mut seen)) = (device, POOLS.lock()) {
            if !seen.contains(&d.id()) {
                seen.push(d.id());
                // Best effort: without it the pool only regrows more often.
                let _ = crate::kernels::cuda::pool::retain_pool_memory(d);
                crate::kernels::cuda::pool::skip_event_tracking(d);
            }
        }
    }
    on
}

/// Bytes a tensor holds.
pub(crate) fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Activation rows of `x` (`[.., in]`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn rows_of(x: &Tensor) -> usize {
    x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1)
}
