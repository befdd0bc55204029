//! The one-shot all-reduce over peer memory (`peer_reduce.cu`) for the GPUs of one process:
//! each GPU's receive buffer, which every other GPU of the group writes into, and the sum of
//! a tensor through them. A decode step's sums are a few KiB to a few hundred KiB,
//! where NCCL's fixed latency is most of the time; this kernel reads the peers' parts over
//! NVLink directly. Larger sums (prefill) stay on NCCL ([`PeerSum::sum`] declines them).
//!
//! The buffers come from `cuMemAlloc`, not from the stream-ordered pool candle allocates from:
//! pool memory is not reachable by peers without further setup, while plain allocations are
//! once peer access is on between the two devices.

use std::ffi::c_void;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    result, sys, CudaContext, CudaStream, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Result, Tensor};

use super::device::{bind, by_dtype, cuda_dev, tn, u32_of, wrap};
use super::kernel_cache::{load_kernel, Arg, Kernel, LaunchArg, PEER_REDUCE};
use super::layer_ops::{add_norm_params, AddNormExtra, ADD_NORM_THREADS};
use super::norm_tail::NormFuse;

/// Most GPUs a group may have (`PEER_MAX_RANKS` in `peer_reduce.cu`).
pub(crate) const MAX_RANKS: usize = 8;
/// Blocks of every plain sum (`PEER_MAX_BLOCKS`): every such call runs all of them.
const BLOCKS: u32 = 32;
const THREADS: u32 = 256;
/// Most words a sender's slot of the fused (one-block) kernels' region holds: two rows of two
/// branches 8192 wide in f32.
const FUSED_WORDS: usize = 32 << 10;

/// `struct PeerArgs` in `peer_reduce.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerArgs {
    recv: [u64; MAX_RANKS],
    rank: u32,
    world: u32,
    n: u32,
    cap: u32,
    fcap: u32,
    pad: u32,
}

// SAFETY: `#[repr(C)]` integers, read by the kernel with the same layout.
unsafe impl DeviceRepr for PeerArgs {}

impl PeerArgs {
    fn new(world: u32, cap: u32, fcap: u32) -> Self {
        Self {
            recv: [0; MAX_RANKS],
            rank: 0,
            world,
            n: 0,
            cap,
            fcap,
            pad: 0,
        }
    }

    fn of_rank(mut self, rank: u32) -> Self {
        self.rank = rank;
        self
    }
}

impl<'a> LaunchArg<'a> for &'a PeerArgs {
    fn push(self, args: &mut Vec<Arg>, _: &CudaStream) {
        args.push(Arg::Value(self as *const PeerArgs as *mut c_void));
    }
}

/// Zeroed device memory from `cuMemAlloc` on one GPU, freed on drop.
struct Raw {
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl Raw {
    fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().w()?;
        // SAFETY: a fresh allocation of `bytes`, zeroed before any use.
        let ptr = unsafe { result::malloc_sync(bytes) }.w()?;
        let raw = Self {
            ptr,
            ctx: ctx.clone(),
        };
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.w()?;
        Ok(raw)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_sync` in this context; no launch that reads it is
            // left once every rank's handle is gone (the ranks share these buffers).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A sum's device, arguments, kernel and launch shape ([`PeerSum::prepare`]).
struct Prepared {
    dev: CudaDevice,
    args: PeerArgs,
    func: Kernel,
    cfg: LaunchConfig,
}

/// What a product with a peer tail (`last_block_peer_add_norm` in `peer.cuh`) takes after its
/// norm tail's arguments: the call's arguments and this rank's epochs.
pub(super) struct PeerTail {
    pub(super) args: PeerArgs,
    pub(super) epochs: u64,
    /// The product's own output (this rank's part, then the sum): `2 * fcap` 16-bit elements,
    /// this rank's for good, so a graph capture never meets a buffer that has to grow.
    pub(super) product: u64,
    /// The product's launch-wide counter (zero between launches).
    pub(super) counter: u64,
}

/// One rank's side of the peer-memory all-reduce.
pub(crate) struct PeerSum {
    args: PeerArgs,
    /// This rank's epochs: one per block of the plain sums, then the fused kernels' one.
    epochs: u64,
    /// This rank's product buffer and counter of [`PeerSum::product_add_norm`] (`4 * fcap`
    /// bytes, then 4).
    tail: u64,
    dev: CudaDevice,
    /// Every rank's buffers, kept alive until the last rank's handle is dropped.
    _buffers: Arc<Vec<Raw>>,
}

impl std::fmt::Debug for PeerSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerSum({} of {})", self.args.rank, self.args.world)
    }
}

/// Whether every ordered pair of `devices` can reach the other's memory; turns that access on.
fn enable_peer_access(devices: &[CudaDevice]) -> Result<bool> {
    let ctxs: Vec<Arc<CudaContext>> = devices
        .iter()
        .map(|d| d.cuda_stream().context().clone())
        .collect();
    for (i, a) in ctxs.iter().enumerate() {
        for (j, b) in ctxs.iter().enumerate() {
            if i == j {
                continue;
            }
            let mut can = 0;
            // SAFETY: two valid device handles and an out-parameter.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                .result()
                .w()?;
            if can == 0 {
                return Ok(false);
            }
            a.bind_to_thread().w()?;
            // SAFETY: `b`'s context is valid; access from the current context (`a`) is asked.
            match unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                other => return other.result().w().map(|()| false),
            }
        }
    }
    Ok(true)
}

/// One [`PeerSum`] per device (rank `i` on `devices[i]`) for sums of up to `max_bytes`, or
/// `None` when the group cannot use peer memory (a pair without peer access, more than
/// [`MAX_RANKS`] devices, or `max_bytes` 0).
///
/// # Errors
/// CUDA errors of the allocations and of turning peer access on.
pub(crate) fn peer_sums(devices: &[CudaDevice], max_bytes: usize) -> Result<Option<Vec<PeerSum>>> {
    let world = devices.len();
    // Whole 16-byte units (counted in 4-byte words by the kernel).
    let max_bytes = max_bytes.min(u32::MAX as usize) / 16 * 16;
    if !(2..=MAX_RANKS).contains(&world) || max_bytes == 0 || !enable_peer_access(devices)? {
        return Ok(None);
    }
    let mut buffers = Vec::with_capacity(2 * world);
    let (cap, fcap) = (max_bytes / 4, (max_bytes / 4).min(FUSED_WORDS));
    let mut args = PeerArgs::new(
        u32_of(world, "ranks")?,
        u32_of(cap, "receive words")?,
        u32_of(fcap, "receive words")?,
    );
    for (r, d) in devices.iter().enumerate() {
        // Two halves of one slot per sender in each region (the plain sums', then the fused
        // kernels'), each word 8 bytes (its data and the epoch).
        let recv = Raw::zeroed(d.cuda_stream().context(), 2 * world * (cap + fcap) * 8)?;
        args.recv[r] = recv.ptr;
        buffers.push(recv);
    }
    let epochs = devices
        .iter()
        // Each block's epoch, then the fused kernels' epoch.
        .map(|d| Raw::zeroed(d.cuda_stream().context(), (BLOCKS as usize + 1) * 4))
        .collect::<Result<Vec<_>>>()?;
    let epoch_ptrs: Vec<u64> = epochs.iter().map(|e| e.ptr).collect();
    buffers.extend(epochs);
    let tails = devices
        .iter()
        .map(|d| Raw::zeroed(d.cuda_stream().context(), 4 * fcap + 16))
        .collect::<Result<Vec<_>>>()?;
    let tail_ptrs: Vec<u64> = tails.iter().map(|t| t.ptr).collect();
    buffers.extend(tails);
    let buffers = Arc::new(buffers);
    Ok(Some(
        devices
            .iter()
            .zip(epoch_ptrs.into_iter().zip(tail_ptrs))
            .enumerate()
            .map(|(r, (d, (epochs, tail)))| PeerSum {
                args: args.of_rank(r as u32),
                epochs,
                tail,
                dev: d.clone(),
                _buffers: buffers.clone(),
            })
            .collect(),
    ))
}

impl PeerSum {
    /// What both sums check and set up for `elements` elements of `t`'s dtype on `t`'s device:
    /// the call's arguments and `kernel`'s launch of `blocks` blocks of `threads`. `None` when
    /// the elements exceed their region of the receive buffers (`fused`: the one-block
    /// kernels' region).
    fn prepare(
        &self,
        t: &Tensor,
        elements: usize,
        kernel: &str,
        (blocks, threads): (u32, u32),
        fused: bool,
    ) -> Result<Option<Prepared>> {
        let Some((dev, args)) = self.args_for(t, elements, fused)? else {
            return Ok(None);
        };
        let dtype = t.dtype();
        let func = load_kernel(&dev, &format!("{kernel}_{}", tn(dtype)?), &PEER_REDUCE)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok(Some(Prepared {
            dev,
            args,
            func,
            cfg,
        }))
    }

    /// The device and the call's arguments for a sum of `elements` elements of `t`'s dtype on
    /// `t`'s device; `None` when they exceed their region of the receive buffers (`fused`: the
    /// fused calls' region).
    fn args_for(
        &self,
        t: &Tensor,
        elements: usize,
        fused: bool,
    ) -> Result<Option<(CudaDevice, PeerArgs)>> {
        let dtype = t.dtype();
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            candle_core::bail!("the peer all-reduce does not take {dtype:?}");
        }
        let words = (elements * dtype.size_in_bytes()).div_ceil(4);
        let cap = if fused { self.args.fcap } else { self.args.cap };
        if words > cap as usize {
            return Ok(None);
        }
        let dev = cuda_dev(t)?;
        if dev.id() != self.dev.id() {
            candle_core::bail!("the peer all-reduce got a tensor of another device");
        }
        let mut args = self.args;
        args.n = u32_of(elements, "elements")?;
        Ok(Some((dev, args)))
    }

    /// The add + norm `fuse` of `Σ x · Wᵀ` for one row `x` of a row-parallel dense weight `w`
    /// (this rank's input columns) in one launch: the product's blocks send
    /// their outputs to the peers as they store them, and its last block sums over the ranks
    /// and adds ([`super::dense_matvec::dense_matvec_peer_add_norm`]). `None` where that kernel
    /// does not serve (more rows, another dtype, an odd width, outputs beyond the fused region);
    /// the caller then runs the product and [`PeerSum::sum_add_norm`]. Every rank must call it
    /// as it calls [`PeerSum::sum`].
    ///
    /// # Errors
    /// As [`super::dense_matvec::dense_matvec_add_norm`].
    pub(crate) fn product_add_norm(
        &self,
        x: &Tensor,
        w: &Tensor,
        fuse: &NormFuse<'_>,
    ) -> Result<Option<super::norm_tail::AddNormOut>> {
        let res = fuse.res;
        if !matches!(res.dtype(), DType::F16 | DType::BF16) || !res.elem_count().is_multiple_of(2) {
            return Ok(None);
        }
        let Some((_, args)) = self.args_for(res, res.elem_count(), true)? else {
            return Ok(None);
        };
        let tail = PeerTail {
            args,
            epochs: self.epochs,
            product: self.tail,
            counter: self.tail + 4 * u64::from(self.args.fcap),
        };
        super::dense_matvec::dense_matvec_peer_add_norm(x, w, fuse, &tail)
    }

    /// The sum of `x` over every rank, in a new tensor; `None` when `x` is larger than the
    /// receive buffer (the caller then sums through NCCL). Every rank must call it with a tensor of
    /// the same shape and dtype, in the same order as its other sums.
    ///
    /// # Errors
    /// A tensor off this rank's device or of a dtype other than f32, f16 and bf16; CUDA
    /// errors.
    pub(crate) fn sum(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let dtype = x.dtype();
        let Some(Prepared {
            dev,
            args,
            func,
            cfg,
        }) = self.prepare(
            x,
            x.elem_count(),
            "peer_all_reduce",
            (BLOCKS, THREADS),
            false,
        )?
        else {
            return Ok(None);
        };
        let x = x.contiguous()?;
        by_dtype!(dtype, E, {
            // SAFETY: the kernel writes every element before any reader on this stream.
            let mut out = unsafe { dev.alloc::<E>(x.elem_count().max(1))? };
            bind!(xv, x, E);
            let mut b = func.builder();
            b.arg(&args);
            b.arg(&xv);
            b.arg(&mut out);
            b.arg(&self.epochs);
            // SAFETY: arguments match the kernel's signature; `x` and `out` hold `n` elements
            // (at most `cap` words), every rank's receive buffer `2 * world * cap` words.
            unsafe { b.launch(cfg) }.w()?;
            Ok(Some(wrap(out, &dev, x.dims())))
        })
    }

    /// Every rank's `x` (flattened), rank order, in one `[world * elements]` tensor, as NCCL's
    /// all-gather returns it; `None` when `x` is larger than the receive buffer or not whole
    /// 4-byte words (the caller then gathers through NCCL). Every rank must call it as it calls
    /// [`PeerSum::sum`].
    ///
    /// # Errors
    /// As [`PeerSum::sum`].
    pub(crate) fn gather(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let dtype = x.dtype();
        let elems = x.elem_count();
        if !(elems * dtype.size_in_bytes()).is_multiple_of(4) {
            return Ok(None);
        }
        let Some(Prepared {
            dev,
            args,
            func,
            cfg,
        }) = self.prepare(x, elems, "peer_all_gather", (BLOCKS, THREADS), false)?
        else {
            return Ok(None);
        };
        let x = x.contiguous()?;
        let all = self.args.world as usize * elems;
        by_dtype!(dtype, E, {
            // SAFETY: the kernel writes every rank's part of the output before any reader on
            // this stream.
            let mut out = unsafe { dev.alloc::<E>(all.max(1))? };
            bind!(xv, x, E);
            let mut b = func.builder();
            b.arg(&args);
            b.arg(&xv);
            b.arg(&mut out);
            b.arg(&self.epochs);
            // SAFETY: arguments match the kernel's signature; `x` holds `n` elements (whole
            // words, at most `cap`), `out` `world * n`, every rank's receive buffer
            // `2 * world * cap` words in its plain region.
            unsafe { b.launch(cfg) }.w()?;
            Ok(Some(wrap(out, &dev, &[all])))
        })
    }

    /// `add_norm_ext(res, Σ y, w, eps, extra)`, with the second branch of `extra` summed as well,
    /// in one launch of one block: the sum, then the residual add and norms (the sums and the
    /// add-norm were two launches, plus a copy joining the two branches). `None` where the
    /// fused kernel does not serve (more than [`PEER_ADD_NORM_MAX_ROWS`] rows, which the block
    /// would walk one after another; sums beyond its region of the buffers; an odd 16-bit first
    /// branch): the caller sums and adds apart. Every rank must call it as it calls
    /// [`PeerSum::sum`].
    ///
    /// With `mix` (f32 `[1, k]`, one row only), the second branch of `extra` is the `[k, width]`
    /// rows of the picked experts, mixed with those weights in the same launch, before the sum
    /// (the expert mix was a launch of its own).
    ///
    /// # Errors
    /// As `add_norm_ext` and [`PeerSum::sum`]; `mix` without a second branch, or of another
    /// shape than its rows.
    pub(crate) fn sum_add_norm(
        &self,
        res: &Tensor,
        y: &Tensor,
        w: &Tensor,
        eps: f64,
        extra: &AddNormExtra<'_>,
        mix: Option<&Tensor>,
    ) -> Result<Option<super::norm_tail::AddNormOut>> {
        // The rows to mix stand in for the second branch: its shape is checked against them.
        let checked = AddNormExtra {
            second_branch: match (extra.second_branch, mix) {
                (Some((_, wa, wb)), Some(_)) => Some((y, wa, wb)),
                (branch, _) => branch,
            },
            ..*extra
        };
        let params = add_norm_params(res, y, w, eps, &checked)?;
        let dtype = res.dtype();
        let elems = y.elem_count();
        let mix = match (mix, extra.second_branch) {
            (None, _) => None,
            (Some(m), Some((rows, _, _))) => {
                let k = m.elem_count();
                if m.dtype() != DType::F32 || rows.dims() != [k, elems] || params.rows != 1 {
                    candle_core::bail!(
                        "peer mix: rows {:?} and weights {:?} {:?} for a branch of {elems}",
                        rows.dims(),
                        m.dims(),
                        m.dtype()
                    );
                }
                Some((m.contiguous()?, u32_of(k, "experts")?))
            }
            (Some(_), None) => candle_core::bail!("peer mix: no second branch to mix"),
        };
        let parts = if extra.second_branch.is_some() { 2 } else { 1 };
        if params.rows as usize > PEER_ADD_NORM_MAX_ROWS
            || (dtype.size_in_bytes() == 2 && !elems.is_multiple_of(2))
        {
            return Ok(None);
        }
        let kernel = match (&mix, extra.second_branch) {
            (Some(_), _) => "peer_moe_mix_add_norm",
            (None, Some(_)) => "peer_moe_add_norm",
            (None, None) => "peer_add_norm",
        };
        let Some(Prepared {
            dev,
            args,
            func,
            cfg,
        }) = self.prepare(res, parts * elems, kernel, (1, ADD_NORM_THREADS), true)?
        else {
            return Ok(None);
        };
        let (res, y, w) = (res.contiguous()?, y.contiguous()?, w.contiguous()?);
        let branch = match extra.second_branch {
            Some((b, wa, wb)) => Some((b.contiguous()?, wa.contiguous()?, wb.contiguous()?)),
            None => None,
        };
        let shape = res.dims().to_vec();
        // Kernels without a mix take no weights: a placeholder fills the binding.
        let (mix_w, k) = match &mix {
            Some((m, k)) => (m.clone(), *k),
            None => (Tensor::zeros(1, DType::F32, res.device())?, 0),
        };
        by_dtype!(dtype, E, {
            // SAFETY: the kernel writes every element of the sums and of each output asked for
            // before any reader on this stream.
            let mut sums = unsafe { dev.alloc::<E>(parts * elems)? };
            let mut out = unsafe { dev.alloc::<E>(elems)? };
            let mut out2 = match extra.next {
                Some(_) => Some(unsafe { dev.alloc::<E>(elems)? }),
                None => None,
            };
            let mut out3 = match extra.next2 {
                Some(_) => Some(unsafe { dev.alloc::<E>(elems)? }),
                None => None,
            };
            {
                bind!(rv, res, E);
                bind!(yv, y, E);
                bind!(wv, w, E);
                let sc = extra.scalar.unwrap_or(&w);
                bind!(sv, sc, E);
                let nx = extra.next.unwrap_or(&w);
                bind!(nv, nx, E);
                let nx2 = extra.next2.unwrap_or(&w);
                bind!(n2v, nx2, E);
                let (bt, wat, wbt) = match &branch {
                    Some((bb, wa, wb)) => (bb, wa, wb),
                    None => (&y, &w, &w),
                };
                bind!(bv, bt, E);
                bind!(wav, wat, E);
                bind!(wbv, wbt, E);
                let (mut ya, mut yb) = sums.split_at_mut(elems);
                bind!(mv, mix_w, f32);
                let mut b = func.builder();
                b.arg(&args);
                b.arg(&yv);
                if mix.is_some() {
                    b.arg(&bv);
                    b.arg(&mv);
                    b.arg(&k);
                    b.arg(&mut ya);
                    b.arg(&mut yb);
                } else if branch.is_some() {
                    b.arg(&bv);
                    b.arg(&mut ya);
                    b.arg(&mut yb);
                } else {
                    b.arg(&mut ya);
                }
                b.arg(&self.epochs);
                b.arg(&params);
                b.arg(&rv);
                b.arg(&wv);
                b.arg(&sv);
                b.arg(&nv);
                b.arg(&mut out);
                match out2.as_mut() {
                    Some(o2) => b.arg(o2),
                    None => b.arg(&rv),
                };
                b.arg(&n2v);
                match out3.as_mut() {
                    Some(o3) => b.arg(o3),
                    None => b.arg(&rv),
                };
                if branch.is_some() {
                    b.arg(&wav);
                    b.arg(&wbv);
                }
                // SAFETY: arguments match the kernel's signature; the sums hold `parts * elems`
                // elements (at most `cap` words), every output `elems`, every rank's receive
                // buffer `2 * world * (cap + fcap)` words, and the epochs buffer the plain sums'
                // epochs and the fused kernels' after them.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok(Some((
                wrap(out, &dev, &shape),
                out2.map(|o| wrap(o, &dev, &shape)),
                out3.map(|o| wrap(o, &dev, &shape)),
            )))
        })
    }
}

/// Most rows [`PeerSum::sum_add_norm`] takes: its epilogue runs in one block, one row after
/// another, where the add-norm kernel runs a block a row.
pub(crate) const PEER_ADD_NORM_MAX_ROWS: usize = 2;
