//! Packed-weight matrix-vector products on CUDA (decode: at most 8 activation rows, 32 with
//! 4-bit weights whose scales have the activations' dtype): the
//! kernel `matvec_plan` chooses, and the product with the residual add + norm folded
//! into its last block (`qmv_row4_norm`). Kernels in `matvec.cu`.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::device::{
    bind, by_dtype, contiguous_aligned16, cuda_dev, cuda_storage, kname, tn, u32_of, view, wrap,
};
use super::kernel_cache::{load_kernel, MATVEC};
use super::layer_ops::AddNormExtra;
pub(crate) use super::matvec_plan::qmatvec_max_rows;
use super::matvec_plan::{
    choose, dequantizes_before_mma, loads_early, row_matvec_variant, takes_row_matvec,
    MatvecKernel, QMATVEC_ROWS, QMATVEC_ROW_WARPS, QMATVEC_TC4X_ROWS,
};
use super::norm_tail::{
    launch_with_norm_tail, with_norm_counter, AddNormOut, NormFuse, NormOutputs,
};
use super::scratch::with_scratch;
use crate::kernels::plan::QmatParams;
use crate::kernels::PackedAffine;

/// Quantized `x · Wᵀ` for up to 8 activation rows (decode), or up to 32 for the weights
/// [`qmatvec_max_rows`] names (4-bit, scales in the activations' dtype): `x` `[rows, in]`
/// contiguous, `codes` `[out, in*bits/32]`, `scales`/`biases` `[out, in/group]`. Returns
/// `[rows, out]`.
/// `settled`: the weight is
/// [`PackedAffine::settled`](crate::kernels::PackedAffine::settled) (see
/// `row_matvec_variant`).
///
/// # Errors
/// More rows than [`qmatvec_max_rows`], CUDA errors.
pub(crate) fn qmatvec(
    x: &Tensor,
    codes: &Tensor,
    scales: &Tensor,
    biases: &Tensor,
    bits: usize,
    group_size: usize,
    settled: bool,
) -> Result<Tensor> {
    let (rows, in_dim) = x.dims2()?;
    let (out_dim, _) = codes.dims2()?;
    let dev = cuda_dev(x)?;
    let tn = kname(x.dtype()).map_err(candle_core::Error::wrap)?;
    let sn = kname(scales.dtype()).map_err(candle_core::Error::wrap)?;
    let most = if dequantizes_before_mma(
        x.dtype(),
        scales.dtype(),
        biases.dtype(),
        bits,
        group_size,
        in_dim,
    ) {
        QMATVEC_TC4X_ROWS
    } else {
        QMATVEC_ROWS
    };
    if rows == 0 || rows > most {
        candle_core::bail!("qmatvec takes 1..={most} rows here, got {rows}");
    }
    let params = QmatParams {
        rows: rows as u32,
        out_dim: out_dim as u32,
        in_dim: in_dim as u32,
        group_size: group_size as u32,
    };
    let MatvecKernel {
        name,
        module,
        rows_per_block,
        warps,
        split,
    } = choose(
        &dev,
        x.dtype(),
        scales.dtype(),
        biases.dtype(),
        rows,
        out_dim,
        in_dim,
        bits,
        group_size,
        loads_early(settled),
        (tn, sn),
    )?;
    let func = load_kernel(&dev, &name, module)?;
    let cfg = LaunchConfig {
        grid_dim: (out_dim.div_ceil(rows_per_block) as u32, 1, 1),
        block_dim: ((warps * 32) as u32, split as u32, 1),
        shared_mem_bytes: 0,
    };
    // The kernels read x and the codes 16 bytes at a time: views starting elsewhere are copied.
    let (x, codes) = (contiguous_aligned16(x)?, contiguous_aligned16(codes)?);
    let (scales, biases) = (scales.contiguous()?, biases.contiguous()?);
    macro_rules! go {
        ($t:ty, $s:ty) => {{
            // SAFETY: fully written by either kernel (every output row of every activation row).
            let mut y = unsafe { dev.alloc::<$t>(rows * out_dim)? };
            {
                let (x_s, x_l) = x.storage_and_layout();
                let (c_s, c_l) = codes.storage_and_layout();
                let (s_s, s_l) = scales.storage_and_layout();
                let (b_s, b_l) = biases.storage_and_layout();
                let xv = view::<$t>(cuda_storage(&x_s)?, x_l)?;
                let cv = view::<u32>(cuda_storage(&c_s)?, c_l)?;
                let sv = view::<$s>(cuda_storage(&s_s)?, s_l)?;
                let bv = view::<$s>(cuda_storage(&b_s)?, b_l)?;
                let mut b = func.builder();
                b.arg(&params);
                b.arg(&xv);
                b.arg(&cv);
                b.arg(&sv);
                b.arg(&bv);
                b.arg(&mut y);
                // SAFETY: arguments match the kernel signature; shapes checked by the caller.
                unsafe { b.launch(cfg) }.w()?;
            }
            wrap(y, &dev, &[rows, out_dim])
        }};
    }
    macro_rules! by_scale {
        ($t:ty) => {
            match scales.dtype() {
                DType::F32 => go!($t, f32),
                DType::F16 => go!($t, half::f16),
                _ => go!($t, half::bf16),
            }
        };
    }
    Ok(match x.dtype() {
        DType::F32 => by_scale!(f32),
        DType::F16 => by_scale!(half::f16),
        _ => by_scale!(half::bf16),
    })
}

/// Widest output [`packed_matvec_add_norm`] takes: the norm tail's register path at 128
/// threads (`last_block_add_norm`). Wider rows go through the tail's plain loop, which made
/// wide rows slower folded than apart.
pub const PACKED_FOLD_MAX_WIDTH: usize = super::norm_tail::FOLD_MAX_WIDTH;

/// Whether [`packed_matvec_add_norm`] serves `rows` activation rows of `x_dtype` through `w`.
pub fn packed_matvec_folds_norm(x_dtype: DType, rows: usize, w: &PackedAffine) -> bool {
    rows == 1 && w.out_dim() <= PACKED_FOLD_MAX_WIDTH && takes_row_matvec(x_dtype, w)
}

/// [`super::dense_matvec::dense_matvec_add_norm`] over a packed 4-bit weight: one activation row through
/// `qmv_row4`, whose last block adds the residual and writes the norms asked for (one launch
/// instead of the product's and the add + norm's). `None` where `qmv_row4` would not serve
/// (more rows, 8 bits, other dtypes) or the extra asks for a second branch.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn packed_matvec_add_norm(
    x: &Tensor,
    w: &PackedAffine,
    res: &Tensor,
    norm_w: &Tensor,
    eps: f64,
    extra: &AddNormExtra<'_>,
) -> Result<Option<AddNormOut>> {
    let dtype = x.dtype();
    let (out_dim, in_dim) = (w.out_dim(), w.in_dim());
    let rows = x.elem_count() / in_dim.max(1);
    if extra.second_branch.is_some()
        || x.dims().last() != Some(&in_dim)
        || !packed_matvec_folds_norm(dtype, rows, w)
    {
        return Ok(None);
    }
    let mut shape = x.dims().to_vec();
    if let Some(l) = shape.last_mut() {
        *l = out_dim;
    }
    let nf = NormFuse {
        res,
        w: norm_w,
        eps,
        extra,
    };
    nf.check(&shape, dtype, "packed_matvec_add_norm")?;
    let dev = cuda_dev(x)?;
    let params = QmatParams {
        rows: 1,
        out_dim: u32_of(out_dim, "output width")?,
        in_dim: u32_of(in_dim, "input width")?,
        group_size: u32_of(w.group_size, "group size")?,
    };
    let func = load_kernel(
        &dev,
        &format!(
            "qmv_row4_norm_{}{}",
            tn(dtype)?,
            // At most PACKED_FOLD_MAX_WIDTH rows: less than a wave of `_u2` warps.
            row_matvec_variant(1, in_dim, loads_early(w.is_settled()), false)
        ),
        &MATVEC,
    )?;
    // Two output rows a warp (`qmv_row4_body`), QROW_NORM_WARPS warps a block (the norm tail
    // is compiled for that block size).
    let warps = QMATVEC_ROW_WARPS;
    let cfg = LaunchConfig {
        grid_dim: (u32_of(out_dim.div_ceil(2 * warps), "blocks")?, 1, 1),
        block_dim: ((warps * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (xc, codes) = (contiguous_aligned16(x)?, contiguous_aligned16(&w.codes)?);
    let (scales, biases) = (w.scales.contiguous()?, w.biases.contiguous()?);
    let (res, nw) = (res.contiguous()?, norm_w.contiguous()?);
    by_dtype!(dtype, E, {
        let mut outs = NormOutputs::<E>::alloc(&dev, out_dim, &nf)?;
        // The product goes to a scratch buffer that only the last block reads back.
        with_scratch::<E, _>(&dev, "norm_product", out_dim, |y| {
            with_norm_counter(&dev, |counter| {
                bind!(xv, xc, E);
                bind!(cv, codes, u32);
                bind!(sv, scales, E);
                bind!(bv, biases, E);
                let mut b = func.builder();
                b.arg(&params);
                b.arg(&xv);
                b.arg(&cv);
                b.arg(&sv);
                b.arg(&bv);
                b.arg(y);
                launch_with_norm_tail!(b, nf, res, nw, outs, counter, E, cfg);
                Ok(())
            })
        })?;
        Ok(Some(outs.wrap(&dev, &shape)))
    })
}
