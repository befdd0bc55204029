//! The collectives of a tensor-parallel model: the all-reduce of a row-parallel product's
//! partial sums (each GPU holds some of the product's input columns) and the all-gather of a
//! vocabulary-parallel head's logits, across the GPUs of one host.
//!
//! [`Collective`] is one rank's handle on its group. The default handle is a group of one,
//! whose sum is the identity, so a single-device model carries one at no cost. Groups of
//! several ranks are built by [`group`] over NCCL (`nccl` feature, [`crate::kernels::cuda`]'s
//! `nccl` module); without the feature [`group`] refuses more than one device.
//!
//! Ranks on the CPU sum through the host instead ([`HostGroup`]: each rank leaves its part in
//! a slot, the last to arrive adds them in rank order): the same sharded forward as on GPUs,
//! which the CPU tests compare with the whole model.
//!
//! Failure: a rank that fails marks its group failed ([`GroupHandle::abort`]); every later sum
//! on every rank returns [`KernelError::Collective`] without entering NCCL, and the aborted
//! communicators release any peer that waits in a collective already enqueued.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use candle_core::{Device, Tensor};

use super::Result;
use crate::kernels::KernelError;

/// What the ranks of one group share.
#[derive(Debug, Default)]
struct GroupState {
    /// Set once any rank failed: no sum enters NCCL afterwards.
    failed: AtomicBool,
    /// Ranks arrived at the current meeting ([`GroupState::meet`]).
    arrived: AtomicUsize,
    /// Meetings every rank has reached.
    round: AtomicUsize,
    /// The latest agreement's highest vote: `(agreement + 1) << 8 | vote`
    /// ([`Collective::agree_max`]).
    verdict: AtomicU64,
}

impl GroupState {
    /// Waits on the host until every rank of `world` reached this point. Each NCCL call is
    /// enqueued between two such meetings, so no rank's NCCL kernel waits for a peer's while
    /// that peer's thread is in a call that synchronizes with the first rank's device (or
    /// holds the driver lock that the other's launch needs). With peer access on (NCCL turns it
    /// on between the GPUs of one process), allocations and module loads of one device wait
    /// for the other devices' running kernels: a lazily loaded kernel or a cuBLAS workspace on
    /// one rank, while the other's all-reduce kernel already waits for it, never returns.
    fn meet(&self, rank: usize, world: usize) -> Result<()> {
        let round = self.round.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == world {
            self.arrived.store(0, Ordering::Release);
            self.round.fetch_add(1, Ordering::AcqRel);
            return Ok(());
        }
        let mut spins = 0u32;
        while self.round.load(Ordering::Acquire) == round {
            if self.failed.load(Ordering::Acquire) {
                return Err(peer_failed(rank));
            }
            spins = spins.saturating_add(1);
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}

/// How a rank sums with its peers.
enum Backend {
    /// NCCL (`nccl` feature, CUDA devices).
    #[cfg(feature = "nccl")]
    Nccl(crate::kernels::cuda::nccl::RankComm),
    /// Through the host (CPU ranks).
    Host(Arc<HostGroup>),
}

/// The sum of CPU ranks: a slot per rank, filled in each round; the last rank to arrive adds
/// the slots in rank order (so every run sums alike) and wakes the others.
#[derive(Default)]
struct HostGroup {
    state: Mutex<HostState>,
    woken: Condvar,
}

#[derive(Default)]
struct HostState {
    round: u64,
    slots: Vec<Option<Tensor>>,
    /// The last round's sum.
    sum: Option<Tensor>,
}

impl HostGroup {
    /// Leaves `x` in this rank's slot; the last rank to arrive joins the slots (rank order) with
    /// `join`, and every rank returns that.
    fn exchange(
        &self,
        rank: usize,
        x: &Tensor,
        failed: &AtomicBool,
        join: impl FnOnce(Vec<Tensor>) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        let lost = || peer_failed(rank);
        let mut st = self.state.lock().map_err(|_| lost())?;
        let round = st.round;
        st.slots[rank] = Some(x.clone());
        if st.slots.iter().all(Option::is_some) {
            let parts = st
                .slots
                .iter_mut()
                .map(|s| s.take().ok_or_else(lost))
                .collect::<Result<Vec<_>>>()?;
            let total = Some(join(parts)?);
            st.sum = total;
            st.round += 1;
            self.woken.notify_all();
            return st.sum.clone().ok_or_else(lost);
        }
        loop {
            let (next, _) = self
                .woken
                .wait_timeout(st, Duration::from_millis(20))
                .map_err(|_| lost())?;
            st = next;
            if st.round != round {
                return st.sum.clone().ok_or_else(lost);
            }
            if failed.load(Ordering::Acquire) {
                return Err(lost());
            }
        }
    }
}

/// One rank of a group of several.
struct RankComm {
    rank: usize,
    world: usize,
    group: Arc<GroupState>,
    /// Sums run so far (the all-reduces a step takes are read from it).
    calls: AtomicUsize,
    /// Agreements this rank has taken part in ([`Collective::agree_max`]).
    agreements: AtomicU64,
    /// How this rank sums; `None` once aborted. The mutex keeps one thread inside NCCL per
    /// communicator at a time.
    comm: Mutex<Option<Backend>>,
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

    /// Collectives run so far by this rank, the ones inside replayed graphs included.
    pub fn calls(&self) -> usize {
        self.0
            .as_ref()
            .map_or(0, |r| r.calls.load(Ordering::Relaxed))
    }

    /// Counts `n` collectives that ran without a call to [`Collective::sum`] or
    /// [`Collective::gather_last`]: those captured in a graph, at each of its replays.
    pub fn count_replayed(&self, n: usize) {
        if let Some(r) = &self.0 {
            r.calls.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The highest of every rank's `vote` (0..=255), agreed on the host: the ranks decide
    /// together whether to launch work that holds collectives without entering
    /// [`Collective::sum`] (a replayed or just-captured graph), so that no rank launches while
    /// a peer takes another path, whose collectives would not pair with its own. It also holds
    /// every rank until the last arrives, for the reason given at `GroupState::meet`: no
    /// rank's enqueued all-reduce may wait for a peer whose thread is still in a call that
    /// synchronizes with this rank's device. `vote` itself in a group of one.
    ///
    /// # Errors
    /// [`KernelError::Collective`] when a rank of the group failed.
    pub fn agree_max(&self, vote: u8) -> Result<u8> {
        let Some(r) = &self.0 else {
            return Ok(vote);
        };
        if r.group.failed.load(Ordering::Acquire) {
            return Err(peer_failed(r.rank));
        }
        let tag = (r.agreements.fetch_add(1, Ordering::Relaxed) + 1) << 8;
        r.group
            .verdict
            .fetch_max(tag | u64::from(vote), Ordering::AcqRel);
        r.group.meet(r.rank, r.world)?;
        let verdict = r.group.verdict.load(Ordering::Acquire);
        // No rank votes in the next agreement before every rank has read this one.
        r.group.meet(r.rank, r.world)?;
        if verdict >> 8 != tag >> 8 {
            return Err(KernelError::Collective {
                reason: format!("rank {}: the ranks' agreements went out of step", r.rank),
            });
        }
        Ok((verdict & 0xff) as u8)
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
        match comm {
            #[cfg(feature = "nccl")]
            Backend::Nccl(c) => {
                r.group.meet(r.rank, r.world)?;
                let y = crate::kernels::cuda::nccl::all_reduce_sum(c, x)?;
                r.group.meet(r.rank, r.world)?;
                Ok(y)
            }
            Backend::Host(h) => h.exchange(r.rank, x, &r.group.failed, |parts| {
                let mut it = parts.into_iter();
                let first = it
                    .next()
                    .ok_or_else(|| candle_core::Error::Msg("no parts".into()))?;
                it.try_fold(first, |t, p| t + p)
            }),
        }
    }

    /// `add_norm_ext(res, Σ y, w, eps, extra)` with the second branch of `extra` summed too, in
    /// one launch where the group sums through peer memory and a decode graph is being
    /// captured; `None` in a group of one, on CPU ranks, in groups without peer access, in
    /// eager steps and for shapes that kernel does not take (the caller then sums and adds
    /// apart). With `mix` the second branch is the picked experts' rows, mixed with these
    /// weights in the same launch ([`crate::kernels::cuda::peer_reduce::PeerSum::sum_add_norm`]).
    /// Every rank must call it where it would call [`Collective::sum`].
    ///
    /// # Errors
    /// As [`Collective::sum`].
    #[cfg(feature = "nccl")]
    pub(crate) fn sum_add_norm(
        &self,
        res: &Tensor,
        y: &Tensor,
        w: &Tensor,
        eps: f64,
        extra: &crate::kernels::cuda::layer_ops::AddNormExtra<'_>,
        mix: Option<&Tensor>,
    ) -> Result<Option<crate::kernels::cuda::norm_tail::AddNormOut>> {
        let rows = y.elem_count() / w.elem_count().max(1);
        self.fused_peer_call(rows, |p| p.sum_add_norm(res, y, w, eps, extra, mix))
    }

    /// The add + norm `fuse` of `Σ x · Wᵀ` for one row `x` and this rank's columns `w` of a
    /// row-parallel dense weight: the product, the sum and the add in one launch, where
    /// [`Collective::sum_add_norm`] would take one launch for the sum and the add; `None` where
    /// it would decline, or the product kernel does not serve. Every rank must call it where it
    /// would call [`Collective::sum`].
    ///
    /// # Errors
    /// As [`Collective::sum`].
    #[cfg(feature = "nccl")]
    pub(crate) fn product_sum_add_norm(
        &self,
        x: &Tensor,
        w: &Tensor,
        fuse: &crate::kernels::cuda::norm_tail::NormFuse<'_>,
    ) -> Result<Option<crate::kernels::cuda::norm_tail::AddNormOut>> {
        let rows = fuse.res.elem_count() / fuse.w.elem_count().max(1);
        self.fused_peer_call(rows, |p| p.product_add_norm(x, w, fuse))
    }

    /// Runs `call` on this rank's peer-memory sums for a fused launch of `rows` rows, every rank
    /// between two meetings; counted as a sum when it launched. `None` (the caller sums and adds
    /// apart) in a group of one, on CPU ranks, without peer access, in eager steps, for more
    /// rows than the fused kernels take, or where `call` declines.
    #[cfg(feature = "nccl")]
    fn fused_peer_call<R>(
        &self,
        rows: usize,
        call: impl FnOnce(&crate::kernels::cuda::peer_reduce::PeerSum) -> candle_core::Result<Option<R>>,
    ) -> Result<Option<R>> {
        let Some(r) = &self.0 else {
            return Ok(None);
        };
        // Only inside a decode graph's capture (every rank captures the same step, so every
        // rank decides alike). Eager steps, which graphs leave to the first step at a batch
        // size, keep the sum and the add-norm apart: the fused launch saves microseconds that
        // only replays repeat.
        if rows > crate::kernels::cuda::peer_reduce::PEER_ADD_NORM_MAX_ROWS
            || !crate::kernels::cuda::graph::recording()
        {
            return Ok(None);
        }
        if r.group.failed.load(Ordering::Acquire) {
            return Err(peer_failed(r.rank));
        }
        let guard = r.comm.lock().map_err(|_| peer_failed(r.rank))?;
        let Some(comm) = guard.as_ref() else {
            return Err(peer_failed(r.rank));
        };
        let Backend::Nccl(c) = comm else {
            return Ok(None);
        };
        let Some(peer) = crate::kernels::cuda::nccl::peer(c) else {
            return Ok(None);
        };
        // Whether the fused kernel serves depends only on shapes every rank shares, so every
        // rank takes the same way.
        r.group.meet(r.rank, r.world)?;
        let out = call(peer).map_err(KernelError::from)?;
        r.group.meet(r.rank, r.world)?;
        if out.is_some() {
            r.calls.fetch_add(1, Ordering::Relaxed);
        }
        Ok(out)
    }

    /// `x` `[.., n]` of every rank joined along the last axis in rank order: `[.., world * n]`
    /// (the vocabulary-parallel head's logits). `x` itself in a group of one.
    ///
    /// # Errors
    /// As [`Collective::sum`].
    pub fn gather_last(&self, x: &Tensor) -> Result<Tensor> {
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
        // Every rank's block, rank order: `[world * elements]`.
        let blocks = match comm {
            #[cfg(feature = "nccl")]
            Backend::Nccl(c) => {
                r.group.meet(r.rank, r.world)?;
                let y = crate::kernels::cuda::nccl::all_gather(c, x)?;
                r.group.meet(r.rank, r.world)?;
                y
            }
            Backend::Host(h) => h.exchange(r.rank, x, &r.group.failed, |parts| {
                Tensor::cat(&parts, 0)?.flatten_all()
            })?,
        };
        let dims = x.dims();
        let last = dims.len().saturating_sub(1);
        let n = dims.get(last).copied().unwrap_or(1);
        let lead = x.elem_count() / n.max(1);
        let mut out = dims.to_vec();
        if let Some(d) = out.last_mut() {
            *d = n * r.world;
        }
        Ok(blocks
            .reshape((r.world, lead, n))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape(out)?)
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
/// that are not CUDA devices, or when NCCL cannot set the group up. CPU devices form a group
/// that sums through the host.
pub fn group(devices: &[Device]) -> Result<(Vec<Collective>, GroupHandle)> {
    if devices.len() <= 1 {
        return Ok((
            vec![Collective::default(); devices.len()],
            GroupHandle::default(),
        ));
    }
    let comms: Vec<Backend> = if devices.iter().all(Device::is_cpu) {
        let host = Arc::new(HostGroup::default());
        if let Ok(mut st) = host.state.lock() {
            st.slots = vec![None; devices.len()];
        }
        (0..devices.len())
            .map(|_| Backend::Host(host.clone()))
            .collect()
    } else {
        gpu_comms(devices)?
    };
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
                    agreements: AtomicU64::new(0),
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

/// NCCL communicators for GPU ranks.
#[cfg(feature = "nccl")]
fn gpu_comms(devices: &[Device]) -> Result<Vec<Backend>> {
    Ok(crate::kernels::cuda::nccl::comms(devices)?
        .into_iter()
        .map(Backend::Nccl)
        .collect())
}

/// Without NCCL there are no GPU groups.
#[cfg(not(feature = "nccl"))]
fn gpu_comms(devices: &[Device]) -> Result<Vec<Backend>> {
    Err(KernelError::Collective {
        reason: format!(
            "{} GPUs asked for, but tensor parallelism over GPUs needs the `nccl` feature",
            devices.len()
        ),
    })
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
    fn cpu_ranks_sum_in_rank_order_and_fail_together() {
        let (c, handle) = group(&[Device::Cpu, Device::Cpu, Device::Cpu]).unwrap();
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = c
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let x = Tensor::new(&[c.rank() as f32, 1.0], &Device::Cpu).unwrap();
                        // Two rounds: the second sees only the second round's parts.
                        drop(c.sum(&x).unwrap());
                        c.sum(&x).unwrap().to_vec1::<f32>().unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(sums.iter().all(|s| s == &[3.0, 3.0]), "{sums:?}");
        // The gather joins every rank's last axis in rank order, row by row.
        let gathered: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = c
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let x = Tensor::new(&[[r, r], [10.0 + r, 10.0 + r]], &Device::Cpu).unwrap();
                        c.gather_last(&x).unwrap().to_vec2::<f32>().unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want = vec![
            vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0],
            vec![10.0, 10.0, 11.0, 11.0, 12.0, 12.0],
        ];
        assert!(gathered.iter().all(|g| g == &want), "{gathered:?}");
        assert_eq!(c[0].calls(), 3);
        // A rank whose peers never arrive is released by the abort.
        let waiting = std::thread::spawn({
            let c0 = c[0].clone();
            move || c0.sum(&Tensor::new(&[1f32], &Device::Cpu).unwrap())
        });
        std::thread::sleep(Duration::from_millis(50));
        handle.abort();
        let err = waiting.join().unwrap().unwrap_err();
        assert!(matches!(err, KernelError::Collective { .. }), "{err}");
        assert!(handle.failed());
        assert!(c[1]
            .sum(&Tensor::new(&[1f32], &Device::Cpu).unwrap())
            .is_err());
    }

    #[test]
    fn ranks_agree_on_the_highest_vote_only_once_all_voted_and_replays_are_counted() {
        let (c, handle) = group(&[Device::Cpu, Device::Cpu, Device::Cpu]).unwrap();
        let passed = AtomicUsize::new(0);
        let votes: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = c
                .iter()
                .map(|c| {
                    let passed = &passed;
                    s.spawn(move || {
                        if c.rank() == 2 {
                            std::thread::sleep(Duration::from_millis(30));
                            assert_eq!(passed.load(Ordering::Acquire), 0, "a rank passed alone");
                        }
                        // Rounds with one dissenter, none, and the highest vote from another rank.
                        let mine = [[0, 1, 0], [0, 0, 0], [2, 0, 1]];
                        let out: Vec<u8> = mine
                            .iter()
                            .map(|round| c.agree_max(round[c.rank()]).unwrap())
                            .collect();
                        passed.fetch_add(1, Ordering::AcqRel);
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(votes.iter().all(|v| v == &[1, 0, 2]), "{votes:?}");
        c[0].count_replayed(5);
        assert_eq!((c[0].calls(), c[1].calls()), (5, 0));
        Collective::default().count_replayed(2);
        assert_eq!(Collective::default().agree_max(3).unwrap(), 3);
        // A rank waiting for its peers' votes is released with an error once the group fails.
        let waiting = std::thread::spawn({
            let c0 = c[0].clone();
            move || c0.agree_max(0)
        });
        std::thread::sleep(Duration::from_millis(30));
        handle.abort();
        assert!(waiting.join().unwrap().is_err());
        assert!(c[1].agree_max(0).is_err());
    }
}
