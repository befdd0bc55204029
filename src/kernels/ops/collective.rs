//! The all-reduce of a tensor-parallel model: the partial sums of a row-parallel product (each
//! GPU holds some of the product's input columns) summed across the GPUs of one host.
//!
//! [`Collective`] is one rank's handle on its group. The default handle is a group of one,
//! whose sum is the identity, so a single-device model carries one at no cost. Groups of
//! several ranks are built by [`group`] over NCCL (`nccl` feature, [`crate::kernels::cuda`]'s
//! `nccl` module); without the feature [`group`] refuses more than one device.
//!
//! Failure: a rank that fails marks its group failed ([`GroupHandle::abort`]); every later sum
//! on every rank returns [`KernelError::Collective`] without entering NCCL, and the aborted
//! communicators release any peer that waits in a collective already enqueued.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use super::Result;
use crate::kernels::KernelError;

/// What the ranks of one group share.
#[derive(Debug, Default)]
struct GroupState {
    /// Set once any rank failed: no sum enters NCCL afterwards.
    failed: AtomicBool,
}

/// One rank of a group of several.
struct RankComm {
    rank: usize,
    world: usize,
    group: Arc<GroupState>,
    /// Sums run so far (the all-reduces a step takes are read from it).
    calls: AtomicUsize,
    /// The NCCL communicator; `None` once aborted. The mutex keeps one thread inside NCCL per
    /// communicator at a time.
    #[cfg(feature = "nccl")]
    comm: Mutex<Option<crate::kernels::cuda::nccl::RankComm>>,
    #[cfg(not(feature = "nccl"))]
    comm: Mutex<Option<()>>,
}

impl std::fmt::Debug for RankComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RankComm({} of {})", self.rank, self.world)
    }
}

/// One rank's handle on its tensor-parallel group (cheap to clone: every layer holds one).
#[derive(Debug, Clone, Default)]
pub struct Collective(Option<Arc<RankComm>>);

/// Aborts a whole group (held by whoever supervises the ranks).
#[derive(Debug, Clone, Default)]
pub struct GroupHandle(Vec<Arc<RankComm>>);

impl Collective {
    /// This rank's index (0 in a group of one).
    pub fn rank(&self) -> usize {
        self.0.as_ref().map_or(0, |r| r.rank)
    }

    /// Ranks in the group (1 for the default handle).
    pub fn world(&self) -> usize {
        self.0.as_ref().map_or(1, |r| r.world)
    }

    /// Sums run so far by this rank.
    pub fn calls(&self) -> usize {
        self.0
            .as_ref()
            .map_or(0, |r| r.calls.load(Ordering::Relaxed))
    }

    /// The elementwise sum of `x` over every rank of the group (`x` itself in a group of one).
    /// Every rank must call it, in the same order, with tensors of one shape and dtype.
    ///
    /// # Errors
    /// [`KernelError::Collective`] when a rank of the group failed or NCCL reports an error.
    pub fn sum(&self, x: &Tensor) -> Result<Tensor> {
        let Some(r) = &self.0 else {
            return Ok(x.clone());
        };
        if r.group.failed.load(Ordering::Acquire) {
            return Err(peer_failed(r.rank));
        }
        let guard = r.comm.lock().map_err(|_| peer_failed(r.rank))?;
        let Some(comm) = guard.as_ref() else {
            return Err(peer_failed(r.rank));
        };
        r.calls.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "nccl")]
        {
            crate::kernels::cuda::nccl::all_reduce_sum(comm, x)
        }
        #[cfg(not(feature = "nccl"))]
        {
            let _ = comm;
            Err(KernelError::Collective {
                reason: "built without the `nccl` feature".to_string(),
            })
        }
    }

    /// `a` and `b` (of one dtype, equal leading dims) summed over the group in one all-reduce:
    /// joined along the last axis, summed, split again.
    ///
    /// # Errors
    /// As [`Collective::sum`].
    pub fn sum_pair(&self, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.0.is_none() {
            return Ok((a.clone(), b.clone()));
        }
        let last = a.rank() - 1;
        let wa = a.dim(last)?;
        let wb = b.dim(last)?;
        let s = self.sum(&Tensor::cat(&[a, b], last)?)?;
        Ok((s.narrow(last, 0, wa)?, s.narrow(last, wa, wb)?))
    }

    /// Seconds one sum of a `[rows, width]` tensor of `x`'s dtype takes on this group, the mean
    /// of `reps` after one warm-up (every rank must call it at once). 0 in a group of one.
    ///
    /// # Errors
    /// As [`Collective::sum`].
    pub fn time_sum(&self, like: &Tensor, reps: usize) -> Result<f64> {
        if self.0.is_none() {
            return Ok(0.0);
        }
        let x = like.zeros_like()?;
        let dev = x.device().clone();
        drop(self.sum(&x)?);
        dev.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            drop(self.sum(&x)?);
        }
        dev.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / reps.max(1) as f64)
    }
}

fn peer_failed(rank: usize) -> KernelError {
    KernelError::Collective {
        reason: format!("rank {rank}: another rank of the tensor-parallel group failed"),
    }
}

impl GroupHandle {
    /// Marks the group failed and aborts every communicator (NCCL's `ncclCommAbort`), so a rank
    /// waiting in an enqueued collective is released. The group cannot sum again.
    pub fn abort(&self) {
        for r in &self.0 {
            r.group.failed.store(true, Ordering::Release);
        }
        for r in &self.0 {
            // A poisoned lock still holds the communicator; dropping it aborts it.
            let mut guard = match r.comm.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            drop(guard.take());
        }
    }

    /// Whether a rank failed.
    pub fn failed(&self) -> bool {
        self.0
            .first()
            .is_some_and(|r| r.group.failed.load(Ordering::Acquire))
    }
}

/// One [`Collective`] per device (rank `i` on `devices[i]`, all GPUs of this host) and the
/// handle that aborts them. One device gives the default handle.
///
/// # Errors
/// [`KernelError::Collective`] without the `nccl` feature (for several devices), for devices
/// that are not CUDA devices, or when NCCL cannot set the group up.
pub fn group(devices: &[Device]) -> Result<(Vec<Collective>, GroupHandle)> {
    if devices.len() <= 1 {
        return Ok((
            vec![Collective::default(); devices.len()],
            GroupHandle::default(),
        ));
    }
    #[cfg(feature = "nccl")]
    let comms = crate::kernels::cuda::nccl::comms(devices)?;
    #[cfg(not(feature = "nccl"))]
    let comms: Vec<()> = {
        return Err(KernelError::Collective {
            reason: format!(
                "{} devices asked for, but tensor parallelism needs the `nccl` feature",
                devices.len()
            ),
        });
    };
    #[allow(unreachable_code)]
    {
        let state = Arc::new(GroupState::default());
        let world = devices.len();
        let ranks: Vec<Arc<RankComm>> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                Arc::new(RankComm {
                    rank,
                    world,
                    group: state.clone(),
                    calls: AtomicUsize::new(0),
                    comm: Mutex::new(Some(comm)),
                })
            })
            .collect();
        Ok((
            ranks.iter().cloned().map(|r| Collective(Some(r))).collect(),
            GroupHandle(ranks),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_of_one_sums_to_itself() {
        let x = Tensor::arange(0f32, 6.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let (c, handle) = group(&[Device::Cpu]).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].rank(), c[0].world()), (0, 1));
        let s = c[0].sum(&x).unwrap();
        assert_eq!(s.to_vec2::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
        let (a, b) = c[0].sum_pair(&x, &x).unwrap();
        assert_eq!(a.dims(), b.dims());
        assert!(!handle.failed());
    }

    #[test]
    fn several_cpu_devices_are_refused_with_a_typed_error() {
        let err = group(&[Device::Cpu, Device::Cpu]).unwrap_err();
        assert!(matches!(err, KernelError::Collective { .. }), "{err}");
    }
}
