//! The NCCL all-reduce (`nccl` feature): communicators for the GPUs of one host, built in one
//! call (`ncclCommInitAll`), and the sum and the gather of a candle tensor as custom ops on the
//! device's own stream, so they are ordered with the kernels around them. Sums up to
//! [`crate::kernels::policy::LaunchPolicy::peer_all_reduce_max_bytes`] (and gathers of that
//! size) take the crate's peer-memory kernels instead ([`super::peer_reduce`]) where the GPUs
//! reach each other's memory.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{CustomOp1, DType, Device, Layout, Shape, Tensor};
use half::{bf16, f16};

use super::peer_reduce::{peer_sums, PeerSum};
use crate::kernels::KernelError;

/// A communicator that may move to the thread of its rank, and its peer-memory sum.
pub(crate) struct RankComm {
    comm: Comm,
    peer: Option<PeerSum>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads use it at
// once; `ops::collective` keeps it behind a mutex. Dropping it aborts it (`ncclCommAbort`).
unsafe impl Send for RankComm {}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Collective {
        reason: format!("{what}: {e:?}"),
    }
}

/// One communicator per device, rank `i` on `devices[i]`, each on its device's stream.
///
/// # Errors
/// A device that is not a CUDA device; NCCL's own errors.
pub(crate) fn comms(devices: &[Device]) -> Result<Vec<RankComm>, KernelError> {
    let cuda = devices
        .iter()
        .map(|d| match d {
            Device::Cuda(c) => Ok(c.clone()),
            other => Err(KernelError::Collective {
                reason: format!("tensor parallelism runs on CUDA devices, not {other:?}"),
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let streams = cuda.iter().map(|c| c.cuda_stream()).collect();
    let comms = Comm::from_devices(streams).map_err(|e| nccl_err("ncclCommInitAll", e))?;
    let max_bytes = crate::kernels::policy::current().peer_all_reduce_max_bytes;
    let mut peers = match peer_sums(&cuda, max_bytes)? {
        Some(p) => p.into_iter().map(Some).collect(),
        None => Vec::new(),
    };
    peers.resize_with(comms.len(), || None);
    Ok(comms
        .into_iter()
        .zip(peers)
        .map(|(comm, peer)| RankComm { comm, peer })
        .collect())
}

/// The sum of `x` over every rank of `comm`'s group, in a new tensor.
///
/// # Errors
/// A tensor off CUDA or of a dtype other than f32, f16 and bf16; NCCL's errors.
pub(crate) fn all_reduce_sum(comm: &RankComm, x: &Tensor) -> Result<Tensor, KernelError> {
    if let Some(y) = comm.peer.as_ref().map(|p| p.sum(x)).transpose()?.flatten() {
        return Ok(y);
    }
    let x = x.contiguous()?;
    Ok(x.apply_op1_no_bwd(&NcclOp {
        comm: &comm.comm,
        kind: Call::Sum,
    })?)
}

/// The rank's peer-memory sums ([`PeerSum`]: the fused sum + add-norm launches); `None` where
/// the group has no peer access.
pub(crate) fn peer(comm: &RankComm) -> Option<&PeerSum> {
    comm.peer.as_ref()
}

/// Every rank's `x` (flattened), rank order, in one `[world * elements]` tensor: through peer
/// memory where [`PeerSum::gather`] takes it (a decode step's logits), else NCCL.
///
/// # Errors
/// As [`all_reduce_sum`].
pub(crate) fn all_gather(comm: &RankComm, x: &Tensor) -> Result<Tensor, KernelError> {
    if let Some(y) = comm
        .peer
        .as_ref()
        .map(|p| p.gather(x))
        .transpose()?
        .flatten()
    {
        return Ok(y);
    }
    let x = x.contiguous()?;
    Ok(x.apply_op1_no_bwd(&NcclOp {
        comm: &comm.comm,
        kind: Call::Gather,
    })?)
}

/// The NCCL collectives the ops below run.
#[derive(Clone, Copy)]
enum Call {
    /// Every rank's tensor summed elementwise (`ncclAllReduce`).
    Sum,
    /// Every rank's tensor, rank order, in one (`ncclAllGather`).
    Gather,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Sum => "all-reduce",
            Call::Gather => "all-gather",
        }
    }
}

/// One NCCL collective as a candle custom op on the device's stream.
struct NcclOp<'a> {
    comm: &'a Comm,
    kind: Call,
}

impl NcclOp<'_> {
    fn run<T: CudaDType + DeviceRepr + NcclType>(
        &self,
        s: &CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let n = l.shape().elem_count();
        let start = l.start_offset();
        let src = s.as_cuda_slice::<T>()?.slice(start..start + n);
        let dev = s.device.clone();
        let out = match self.kind {
            Call::Sum => n,
            Call::Gather => n * self.comm.world_size(),
        };
        // SAFETY: the collective writes all `out` elements before any reader on this stream.
        let mut dst = unsafe { dev.alloc::<T>(out) }?;
        match self.kind {
            Call::Sum => self.comm.all_reduce(&src, &mut dst, &ReduceOp::Sum),
            Call::Gather => self.comm.all_gather(&src, &mut dst),
        }
        .map_err(|e| candle_core::Error::Msg(format!("NCCL {}: {e:?}", self.kind.name())))?;
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for NcclOp<'_> {
    fn name(&self) -> &'static str {
        match self.kind {
            Call::Sum => "nccl-all-reduce",
            Call::Gather => "nccl-all-gather",
        }
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the NCCL {} runs on CUDA tensors only", self.kind.name())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        if !l.is_contiguous() {
            candle_core::bail!("the NCCL {} takes a contiguous tensor", self.kind.name());
        }
        let out = match s.dtype() {
            DType::F32 => self.run::<f32>(s, l)?,
            DType::BF16 => self.run::<bf16>(s, l)?,
            DType::F16 => self.run::<f16>(s, l)?,
            other => candle_core::bail!("the NCCL {} does not take {other:?}", self.kind.name()),
        };
        let shape = match self.kind {
            Call::Sum => l.shape().clone(),
            Call::Gather => Shape::from(l.shape().elem_count() * self.comm.world_size()),
        };
        Ok((out, shape))
    }
}
