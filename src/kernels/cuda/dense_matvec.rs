//! Dense-weight decode products on CUDA (`dense_matvec.cu`): `x · Wᵀ` for at most
//! [`DENSE_MV_MAX_ROWS`] rows of f16/bf16 on the tensor cores, or one row on CUDA cores (the
//! `_sv` kernels, two output rows a warp); the gated (`gelu_tanh(a) * b`), RMS-normed and
//! stacked GeGLU inputs computed inside the product, and the residual add + norm folded into
//! its last block ([`super::norm_tail`]). Each returns `None` where it does not apply, so the
//! caller runs the general matmul.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::device::{as_rows, bind, by_dtype, cuda_dev, sm_count, tn, u32_of, wrap};
use super::kernel_cache::{load_kernel, DENSE_MATVEC};
use super::layer_ops::AddNormExtra;
use super::norm_tail::{
    launch_with_norm_tail, with_norm_counter, AddNormOut, NormFuse, NormOutputs,
};
#[cfg(feature = "nccl")]
use super::peer_reduce::PeerTail;
use super::scratch::with_scratch;

/// Without the `nccl` feature no product sums over a group (no value of this type exists).
#[cfg(not(feature = "nccl"))]
enum PeerTail {}

/// Activation rows the dense matvec kernel takes (the mma's N).
pub const DENSE_MV_MAX_ROWS: usize = 8;

/// `struct DenseMvParams` in `dense_matvec.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct DenseMvParams {
    rows: u32,
    out_dim: u32,
    in_dim: u32,
    x_stride: u32,
    b_stride: u32,
    eps: f32,
}

// SAFETY: `#[repr(C)]` plain integers and a float, read by the kernels with the same layout.
unsafe impl DeviceRepr for DenseMvParams {}

/// Weights up to this size take [`dense_matvec`] for decode products of 2 to 8 rows; larger
/// ones stay on cuBLAS, which streams large weights closer to the copy bandwidth than the
/// tensor-core kernel (one row takes the one-row kernels at any size).
pub const DENSE_MV_MAX_BYTES: usize = 24 << 20;

/// Whether a decode product of `rows` rows computes its gated input ([`dense_matvec_gated`])
/// or folds in the residual add + norm of its output ([`dense_matvec_add_norm`]): one row only.
/// Past one row every block of the tensor-core kernel would gate all the rows again, and the
/// folded add + norm's single last block normalises the rows one after another; the separate
/// gate and `add_norm` launches (a block a row) measured faster at 2-8 rows (E2B batch 8
/// +12%, E4B +9%, 26B-A4B +2%; `docs/performance.md`).
pub fn folds_into_matvec(rows: usize) -> bool {
    one_row_kernel(rows)
}

/// Whether a product of `rows` activation rows takes the one-row (`_sv`) kernels, which stream
/// weights of any size at the copy bandwidth, faster than cuBLAS.
fn one_row_kernel(rows: usize) -> bool {
    rows == 1
}

/// Whether a decode product of `rows` rows with a dense f16/bf16 `[out, in]` weight of `bytes`
/// takes [`dense_matvec`]: one row always, else up to [`DENSE_MV_MAX_BYTES`].
pub fn dense_matvec_wanted(bytes: usize, rows: usize) -> bool {
    bytes <= DENSE_MV_MAX_BYTES || one_row_kernel(rows)
}

/// `x · Wᵀ` for a dense `[out, in]` f16/bf16 weight and at most [`DENSE_MV_MAX_ROWS`] rows of
/// `x` (`[.., in]`), on the tensor cores, returning `[.., out]`; `None` when the kernel does
/// not apply (another dtype, more rows, `in` not a multiple of 8, a weight view that is not
/// 16-byte aligned), so the caller falls back to the general matmul.
///
/// # Errors
/// CUDA errors.
pub fn dense_matvec(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    Ok(dense_mv(x, None, w, None)?.map(|r| r.0))
}

/// Most bytes of staged input rows a dense matvec keeps in shared memory (rows times `in`
/// elements: [`dense_matvec_gated`]'s one row, [`dense_matvec_normed`]'s up to eight): within
/// the 48 KB a block gets without opting in, beside the epilogue's 8 KB and the norm tail's few
/// reduction words.
pub const GATED_MV_MAX_SMEM: usize = (40 << 10) - 256;

/// `(gelu_tanh(a) * b) · Wᵀ` for one row, the gate computed inside the product (no launch of
/// its own); `a` and `b` have one shape `[.., in]` and may have strided rows (the two halves of
/// a stacked gate/up product). `None` for more rows ([`folds_into_matvec`]), where
/// [`dense_matvec`] would not apply, or where the gated row exceeds [`GATED_MV_MAX_SMEM`].
///
/// # Errors
/// Shapes that disagree, CUDA errors.
pub fn dense_matvec_gated(a: &Tensor, b: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if a.dims() != b.dims() {
        candle_core::bail!("dense_matvec_gated: {:?} vs {:?}", a.dims(), b.dims());
    }
    Ok(dense_mv(a, Some(b), w, None)?.map(|r| r.0))
}

/// `add_norm_ext(res, y, norm_w, eps, extra)` of the one-row product `y = x · Wᵀ` (with
/// `gate`, the gated product of [`dense_matvec_gated`]) in one launch: the block that finishes
/// last adds and normalises the row once every block has stored its outputs. Returns the sum
/// and the norms asked for; `None` for more rows ([`folds_into_matvec`]), where the product
/// kernels do not apply, or where `extra` has a second branch, so the caller runs the product
/// and the add + norm apart.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn dense_matvec_add_norm(
    x: &Tensor,
    gate: Option<&Tensor>,
    w: &Tensor,
    res: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    extra: &AddNormExtra<'_>,
) -> Result<Option<AddNormOut>> {
    if extra.second_branch.is_some() {
        return Ok(None);
    }
    if let Some(g) = gate {
        if g.dims() != x.dims() {
            candle_core::bail!("dense_matvec_add_norm: {:?} vs {:?}", x.dims(), g.dims());
        }
    }
    let fuse = NormFuse {
        res,
        w: norm_w,
        eps,
        extra,
    };
    dense_mv(x, gate, w, Some(&fuse))
}

/// `rms_norm(x) * norm_w` then `· Wᵀ`, the norm computed inside the product (the MoE router's
/// input norm); `None` where [`dense_matvec`] would not apply or the rows exceed
/// [`GATED_MV_MAX_SMEM`].
///
/// # Errors
/// A norm weight that is not `[in]`, CUDA errors.
pub fn dense_matvec_normed(
    x: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    w: &Tensor,
) -> Result<Option<Tensor>> {
    let in_dim = w.dim(1)?;
    if norm_w.dims() != [in_dim] || norm_w.dtype() != x.dtype() {
        candle_core::bail!(
            "dense_matvec_normed: norm weight {:?} {:?} for input width {in_dim}",
            norm_w.dims(),
            norm_w.dtype()
        );
    }
    let normed = (norm_w.contiguous()?, eps);
    Ok(dense_mv_with(x, None, Some(&normed), w, None, None)?.map(|r| r.0))
}

/// Warps a block of the one-row (`_sv`) dense kernels (`SV_WARPS` in `fused.cu`).
const SV_WARPS: usize = 8;

/// Output rows a warp of the one-row dense kernels computes (`_sv2`).
const SV_ROWS_PER_WARP: usize = 2;

/// `gelu_tanh(x · gateᵀ) * (x · upᵀ)` for one activation row (`[.., in]`, decode) and a
/// stacked `[gate; up]` f16/bf16 weight (`[2 * width, in]`) in one launch, returning
/// `[.., width]` rounded as the separate product and gate would round it; the down projection
/// then reads it without a gate of its own. `None` where it does not apply (more rows, another
/// dtype, `in` not a multiple of 8, unaligned views), so the caller runs the product and the
/// gate apart.
///
/// # Errors
/// CUDA errors.
pub fn dense_matvec_geglu(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let (stacked, in_dim) = w.dims2()?;
    let dtype = x.dtype();
    let aligned = |t: &Tensor| t.layout().start_offset().is_multiple_of(8);
    if !matches!(dtype, DType::BF16 | DType::F16)
        || w.dtype() != dtype
        || x.dims().last() != Some(&in_dim)
        || x.elem_count() != in_dim
        || in_dim % 8 != 0
        || stacked == 0
        || stacked % 2 != 0
        || !w.is_contiguous()
        || !aligned(w)
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    if !aligned(&x) {
        return Ok(None);
    }
    let dev = cuda_dev(&x)?;
    let width = stacked / 2;
    let rpw = SV_ROWS_PER_WARP;
    let params = DenseMvParams {
        rows: 1,
        out_dim: u32_of(stacked, "output width")?,
        in_dim: u32_of(in_dim, "input width")?,
        x_stride: u32_of(in_dim, "row stride")?,
        b_stride: u32_of(in_dim, "row stride")?,
        eps: 0.0,
    };
    let func = load_kernel(
        &dev,
        &format!("dense_mv_geglu_{}_sv{rpw}", tn(dtype)?),
        &DENSE_MATVEC,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (u32_of(width.div_ceil(SV_WARPS * rpw / 2), "blocks")?, 1, 1),
        block_dim: ((SV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut shape = x.dims().to_vec();
    if let Some(l) = shape.last_mut() {
        *l = width;
    }
    by_dtype!(dtype, E, {
        // SAFETY: every output is written by the warp owning it.
        let mut y = unsafe { dev.alloc::<E>(width)? };
        bind!(xv, x, E);
        bind!(wv, w, E);
        let mut b = func.builder();
        b.arg(&params);
        b.arg(&xv);
        b.arg(&wv);
        b.arg(&mut y);
        // SAFETY: arguments match the kernel's signature; widths checked above.
        unsafe { b.launch(cfg) }.w()?;
        drop(b);
        Ok(Some(wrap(y, &dev, &shape)))
    })
}

/// [`dense_matvec_add_norm`] (the add + norm `fuse`) of one row `x` and a row-parallel weight
/// `w` (this rank's input columns), its output summed over the ranks of `peer`'s group before
/// the add: each block
/// sends its outputs to the peers as it stores them, and the last block sums and adds
/// (`dense_mv_peer_norm`). `None` where it does not apply (more rows, a gate, an odd output
/// width or one over [`super::norm_tail::FOLD_MAX_WIDTH`], or where [`dense_matvec_add_norm`]
/// would not apply).
///
/// # Errors
/// As [`dense_matvec_add_norm`].
#[cfg(feature = "nccl")]
pub(super) fn dense_matvec_peer_add_norm(
    x: &Tensor,
    w: &Tensor,
    fuse: &NormFuse<'_>,
    peer: &PeerTail,
) -> Result<Option<AddNormOut>> {
    let (out_dim, in_dim) = w.dims2()?;
    if fuse.extra.second_branch.is_some()
        || out_dim % 2 != 0
        || out_dim > super::norm_tail::FOLD_MAX_WIDTH
        || x.elem_count() != in_dim
    {
        return Ok(None);
    }
    dense_mv_with(x, None, None, w, Some(fuse), Some(peer))
}

fn dense_mv(
    x: &Tensor,
    gate: Option<&Tensor>,
    w: &Tensor,
    norm: Option<&NormFuse<'_>>,
) -> Result<Option<AddNormOut>> {
    dense_mv_with(x, gate, None, w, norm, None)
}

/// The dense matvec launcher: `gate` for the gated input, `normed` (weight, eps) for the
/// RMS-normed input, `norm` for the folded residual add + norm of the output, `peer` for its
/// sum over a tensor-parallel group first (one row, with `norm`, no gate).
fn dense_mv_with(
    x: &Tensor,
    gate: Option<&Tensor>,
    normed: Option<&(Tensor, f64)>,
    w: &Tensor,
    norm: Option<&NormFuse<'_>>,
    peer: Option<&PeerTail>,
) -> Result<Option<AddNormOut>> {
    let (out_dim, in_dim) = w.dims2()?;
    let dtype = x.dtype();
    let rows = x.elem_count() / in_dim.max(1);
    let aligned = |t: &Tensor| t.layout().start_offset().is_multiple_of(8);
    if !matches!(dtype, DType::BF16 | DType::F16)
        || w.dtype() != dtype
        || gate.is_some_and(|g| g.dtype() != dtype)
        || x.dims().last() != Some(&in_dim)
        || rows == 0
        || rows > DENSE_MV_MAX_ROWS
        || in_dim % 8 != 0
        || out_dim == 0
        || !w.is_contiguous()
        || !aligned(w)
    {
        return Ok(None);
    }
    let dev = cuda_dev(x)?;
    // Rows may be strided; each row must start 16-byte aligned, else the caller's general
    // path runs.
    let rows_of = |t: &Tensor| -> Result<Option<(Tensor, usize)>> {
        let (t, _, _, stride) = as_rows(t)?;
        Ok((aligned(&t) && stride % 8 == 0).then_some((t, stride)))
    };
    // The gated and normed kernels keep their input rows in shared memory, next to the
    // epilogue's 8 KB.
    let staged = gate.is_some() || normed.is_some();
    let gate_smem = rows * in_dim * dtype.size_in_bytes();
    if (staged && gate_smem > GATED_MV_MAX_SMEM)
        || (normed.is_some() && (gate.is_some() || norm.is_some()))
    {
        return Ok(None);
    }
    if (gate.is_some() || norm.is_some()) && !folds_into_matvec(rows) {
        return Ok(None);
    }
    if peer.is_some() && !(gate.is_none() && norm.is_some()) {
        return Ok(None);
    }
    let Some((xc, x_stride)) = rows_of(x)? else {
        return Ok(None);
    };
    let gc = match gate.map(rows_of).transpose()? {
        Some(None) => return Ok(None),
        g => g.flatten(),
    };
    let params = DenseMvParams {
        rows: rows as u32,
        out_dim: u32_of(out_dim, "output width")?,
        in_dim: u32_of(in_dim, "input width")?,
        x_stride: u32_of(x_stride, "row stride")?,
        b_stride: u32_of(gc.as_ref().map_or(x_stride, |g| g.1), "row stride")?,
        eps: normed.map_or(0.0, |n| n.1 as f32),
    };
    // Two 16-row tiles a block share each x fragment (half the activation traffic) once there
    // are enough rows to keep two waves of blocks on the device. Up to one 16-row tile a
    // multiprocessor, 16 warps split each tile's input instead of 8 (more loads in flight);
    // past that 8, since the 16-warp kernels' registers leave room for one block a
    // multiprocessor and a second wave of blocks would run on a fraction of them.
    let sms = sm_count(&dev);
    let simt_rows = one_row_kernel(rows).then_some(SV_ROWS_PER_WARP);
    let (tiles, warps) = if out_dim >= 32 * 2 * sms {
        (2, 8)
    } else if out_dim > 16 * sms {
        (1, 8)
    } else {
        (1, 16)
    };
    let mut shape = x.dims().to_vec();
    if let Some(l) = shape.last_mut() {
        *l = out_dim;
    }
    if let Some(n) = norm {
        n.check(&shape, dtype, "dense_matvec_add_norm")?;
    }
    let kind = match (gc.is_some(), normed.is_some(), norm.is_some()) {
        _ if peer.is_some() => "dense_mv_peer_norm",
        (_, true, _) => "dense_mv_normed",
        (false, false, false) => "dense_mv",
        (true, false, false) => "dense_mv_gated",
        (false, false, true) => "dense_mv_norm",
        (true, false, true) => "dense_mv_gated_norm",
    };
    let (name, rows_per_block, threads) = match simt_rows {
        Some(rpw) => (
            format!("{kind}_{}_sv{rpw}", tn(dtype)?),
            SV_WARPS * rpw,
            SV_WARPS * 32,
        ),
        None => (
            format!("{kind}_{}_{tiles}_{warps}", tn(dtype)?),
            16 * tiles,
            warps as usize * 32,
        ),
    };
    let func = load_kernel(&dev, &name, &DENSE_MATVEC)?;
    let cfg = LaunchConfig {
        grid_dim: (u32_of(out_dim.div_ceil(rows_per_block), "blocks")?, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: if staged { gate_smem as u32 } else { 0 },
    };
    by_dtype!(dtype, E, {
        let n = rows * out_dim;
        let Some(nf) = norm else {
            // SAFETY: every (row, output) pair is written by the block owning the output.
            let mut y = unsafe { dev.alloc::<E>(n)? };
            bind!(xv, xc, E);
            let gt = match (&gc, normed) {
                (Some(g), _) => &g.0,
                (None, Some(n)) => &n.0,
                (None, None) => &xc,
            };
            bind!(gv, gt, E);
            bind!(wv, w, E);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&xv);
            if staged {
                b.arg(&gv);
            }
            b.arg(&wv);
            b.arg(&mut y);
            // SAFETY: arguments match the kernel's signature; rows and widths checked above.
            unsafe { b.launch(cfg) }.w()?;
            drop(b);
            return Ok(Some((wrap(y, &dev, &shape), None, None)));
        };
        let mut outs = NormOutputs::<E>::alloc(&dev, n, nf)?;
        let res = nf.res.contiguous()?;
        let nw = nf.w.contiguous()?;
        #[cfg(feature = "nccl")]
        if let Some(t) = peer {
            bind!(xv, xc, E);
            bind!(wv, w, E);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&xv);
            b.arg(&wv);
            b.arg(&t.product);
            launch_with_norm_tail!(b, nf, res, nw, outs, &t.counter, E, cfg, &t.args, &t.epochs);
            return Ok(Some(outs.wrap(&dev, &shape)));
        }
        // The product itself is only read back by the last block: a scratch buffer.
        with_scratch::<E, _>(&dev, "norm_product", n, |y| {
            with_norm_counter(&dev, |counter| {
                bind!(xv, xc, E);
                let gt = gc.as_ref().map_or(&xc, |g| &g.0);
                bind!(gv, gt, E);
                bind!(wv, w, E);
                let mut b = func.builder();
                b.arg(&params);
                b.arg(&xv);
                if gc.is_some() {
                    b.arg(&gv);
                }
                b.arg(&wv);
                b.arg(y);
                launch_with_norm_tail!(b, nf, res, nw, outs, counter, E, cfg);
                Ok(())
            })
        })?;
        Ok(Some(outs.wrap(&dev, &shape)))
    })
}
