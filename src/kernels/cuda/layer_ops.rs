//! The decoder layer's small fused ops on CUDA (`layer_ops.cu`), each in place of a chain of
//! candle ops: the residual add with RMS norm (and the next norms of its sum), GeGLU
//! (`gelu_tanh(a) * b`), and the per-head q/k/v norm + RoPE + head-major layout step, which
//! can write K and V straight into a cache's slots.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::device::{
    as_rows, bind, by_dtype, check_dtype, cuda_dev, cuda_storage, grid_stride, tn, u32_of, view,
    wrap,
};
use super::graph;
use super::kernel_cache::{load_kernel, LAYER_OPS};
use super::kv_write::{fits_kv_slots, kv_destination};

/// Threads of the norm kernels (`NORM_THREADS`).
pub(super) const NORM_THREADS: u32 = 256;
/// Threads of the residual add + norm kernel (`ADD_NORM_THREADS`).
pub(super) const ADD_NORM_THREADS: u32 = 1024;
/// Widest row [`add_norm`] takes (`ADD_NORM_PER_THREAD * ADD_NORM_THREADS`: each thread keeps its
/// elements in registers); wider rows take the candle ops.
pub const ADD_NORM_MAX_WIDTH: usize = 8 * ADD_NORM_THREADS as usize;

/// `struct AddNormParams` in `norm_tail.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct AddNormParams {
    pub(super) rows: u32,
    pub(super) dim: u32,
    eps: f32,
    flags: u32,
}

/// `struct GeluMulParams` in `layer_ops.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct GeluMulParams {
    pub(super) rows: u32,
    pub(super) width: u32,
    pub(super) a_stride: u32,
    pub(super) b_stride: u32,
}

/// `struct QkvPrepParams` in `layer_ops.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct QkvPrepParams {
    batch: u32,
    seq_len: u32,
    n_heads: u32,
    kv_heads: u32,
    head_dim: u32,
    q_stride: u32,
    k_stride: u32,
    v_stride: u32,
    eps: f32,
    kv_head_stride: u32,
}

// SAFETY: `#[repr(C)]` plain integers and floats, passed by value, read by the kernels with the
// same field layout.
unsafe impl DeviceRepr for AddNormParams {}
unsafe impl DeviceRepr for GeluMulParams {}
unsafe impl DeviceRepr for QkvPrepParams {}

/// `out = (res + rms_norm(y) * w) [* scalar]`, and with `next` also `rms_norm(out) * next`.
/// `res` and `y` have the same shape, last axis `w.len()` (at most [`ADD_NORM_MAX_WIDTH`]);
/// `scalar` is a one-element tensor.
///
/// # Errors
/// Shapes or dtypes that disagree, rows wider than [`ADD_NORM_MAX_WIDTH`], CUDA errors.
pub fn add_norm(
    res: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f64,
    scalar: Option<&Tensor>,
    next: Option<&Tensor>,
) -> Result<(Tensor, Option<Tensor>)> {
    let extra = AddNormExtra {
        scalar,
        next,
        ..Default::default()
    };
    let (out, n1, _) = add_norm_ext(res, y, w, eps, &extra)?;
    Ok((out, n1))
}

/// What [`add_norm_ext`] computes besides `res + rms_norm(y) * w`.
#[derive(Debug, Default, Clone, Copy)]
pub struct AddNormExtra<'a> {
    /// Multiplies the sum (one element).
    pub scalar: Option<&'a Tensor>,
    /// Weight of a norm of the result, returned second.
    pub next: Option<&'a Tensor>,
    /// Weight of another norm of the result (needs `next`), returned third.
    pub next2: Option<&'a Tensor>,
    /// `(b, wa, wb)`: the branch becomes `rms_norm(y) * wa + rms_norm(b) * wb` (rows of at most
    /// [`MOE_ADD_NORM_MAX_WIDTH`]).
    pub second_branch: Option<(&'a Tensor, &'a Tensor, &'a Tensor)>,
}

/// Widest row of [`add_norm_ext`] with a second branch (`MOE_ADD_NORM_PER_THREAD * 1024`).
pub const MOE_ADD_NORM_MAX_WIDTH: usize = 4 * ADD_NORM_THREADS as usize;

/// The checked parameters of [`add_norm_ext`] (also those of the peer sum that runs it as its
/// epilogue).
///
/// # Errors
/// As [`add_norm_ext`].
pub(super) fn add_norm_params(
    res: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f64,
    extra: &AddNormExtra<'_>,
) -> Result<AddNormParams> {
    let dtype = res.dtype();
    let dim = w.dim(0)?;
    let branch_ok = extra
        .second_branch
        .is_none_or(|(b, wa, wb)| b.dims() == y.dims() && wa.dims() == [dim] && wb.dims() == [dim]);
    if res.dims() != y.dims() || res.dims().last() != Some(&dim) || !branch_ok {
        candle_core::bail!(
            "add_norm: residual {:?}, branch {:?}, weight [{dim}], second branch {:?}",
            res.dims(),
            y.dims(),
            extra.second_branch.map(|(b, _, _)| b.dims().to_vec())
        );
    }
    if extra.next2.is_some() && extra.next.is_none() {
        candle_core::bail!("add_norm: a second next norm needs the first");
    }
    let mut ts = vec![res, y, w];
    ts.extend(extra.scalar);
    ts.extend(extra.next);
    ts.extend(extra.next2);
    if let Some((b, wa, wb)) = extra.second_branch {
        ts.extend([b, wa, wb]);
    }
    check_dtype(&ts, dtype)?;
    let max = if extra.second_branch.is_some() {
        MOE_ADD_NORM_MAX_WIDTH
    } else {
        ADD_NORM_MAX_WIDTH
    };
    if dim > max {
        candle_core::bail!("add_norm: width {dim} above {max}");
    }
    let rows = res.elem_count() / dim.max(1);
    Ok(AddNormParams {
        rows: u32_of(rows, "rows")?,
        dim: u32_of(dim, "width")?,
        eps: eps as f32,
        flags: u32::from(extra.scalar.is_some())
            | (u32::from(extra.next.is_some()) << 1)
            | (u32::from(extra.next2.is_some()) << 2),
    })
}

/// Rows a block of the many-row add + norm (`ADD_NORM_ROWS_WARPS`, one warp a row).
const ADD_NORM_ROWS_WARPS: u32 = 8;
/// Rows from which the add + norm runs a warp a row instead of a block a row.
const ADD_NORM_ROWS_MIN: usize = 64;

/// Whether the add + norm of `rows` rows of `dim` takes the many-row form: enough rows, a
/// 2-byte dtype, rows of whole 16-byte chunks, every operand starting on a 16-byte boundary.
fn rows_form(rows: usize, dim: usize, dtype: DType, ts: [Option<&Tensor>; 5]) -> bool {
    rows >= ADD_NORM_ROWS_MIN
        && matches!(dtype, DType::BF16 | DType::F16)
        && dim.is_multiple_of(8)
        && ts
            .iter()
            .flatten()
            .all(|t| t.layout().start_offset() % 8 == 0)
}

/// [`add_norm`] with the extras of [`AddNormExtra`], in one launch. Returns the sum and the
/// norms asked for.
///
/// # Errors
/// Shapes or dtypes that disagree, rows wider than the kernel takes, `next2` without `next`,
/// CUDA errors.
pub fn add_norm_ext(
    res: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f64,
    extra: &AddNormExtra<'_>,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let params = add_norm_params(res, y, w, eps, extra)?;
    let dtype = res.dtype();
    let dim = params.dim as usize;
    let rows = res.elem_count() / dim.max(1);
    let dev = cuda_dev(res)?;
    let (res, y, w) = (res.contiguous()?, y.contiguous()?, w.contiguous()?);
    let branch = match extra.second_branch {
        Some((b, wa, wb)) => Some((b.contiguous()?, wa.contiguous()?, wb.contiguous()?)),
        None => None,
    };
    let warp_rows = branch.is_none()
        && rows_form(
            rows,
            dim,
            dtype,
            [Some(&res), Some(&y), Some(&w), extra.next, extra.next2],
        );
    let kernel = match (branch.is_some(), warp_rows) {
        (true, _) => "moe_add_norm",
        (false, true) => "add_norm_rows",
        (false, false) => "add_norm",
    };
    let func = load_kernel(&dev, &format!("{kernel}_{}", tn(dtype)?), &LAYER_OPS)?;
    let cfg = if warp_rows {
        LaunchConfig {
            grid_dim: (params.rows.div_ceil(ADD_NORM_ROWS_WARPS), 1, 1),
            block_dim: (ADD_NORM_ROWS_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        }
    } else {
        LaunchConfig {
            grid_dim: (params.rows, 1, 1),
            block_dim: (ADD_NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    };
    let shape = res.dims().to_vec();
    by_dtype!(dtype, E, {
        // SAFETY: every element is written by the kernel (one block per row, all columns).
        let mut out = unsafe { dev.alloc::<E>(rows * dim)? };
        // SAFETY: as above, for each norm asked for.
        let mut out2 = match extra.next {
            Some(_) => Some(unsafe { dev.alloc::<E>(rows * dim)? }),
            None => None,
        };
        // SAFETY: as above.
        let mut out3 = match extra.next2 {
            Some(_) => Some(unsafe { dev.alloc::<E>(rows * dim)? }),
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
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&rv);
            b.arg(&yv);
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
            let (bt, wat, wbt) = match &branch {
                Some((bb, wa, wb)) => (bb, wa, wb),
                None => (&y, &w, &w),
            };
            bind!(bv, bt, E);
            bind!(wav, wat, E);
            bind!(wbv, wbt, E);
            if branch.is_some() {
                b.arg(&bv);
                b.arg(&wav);
                b.arg(&wbv);
            }
            // SAFETY: arguments match the kernel's signature; one block per row of `dim`.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            wrap(out, &dev, &shape),
            out2.map(|o| wrap(o, &dev, &shape)),
            out3.map(|o| wrap(o, &dev, &shape)),
        ))
    })
}

/// `gelu_tanh(a) * b` for `a`, `b` of one shape `[.., width]` whose rows may be strided (e.g.
/// the two halves of a fused gate/up product); returns a dense tensor of that shape.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn gelu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dtype = a.dtype();
    check_dtype(&[a, b], dtype)?;
    if a.dims() != b.dims() {
        candle_core::bail!("gelu_mul: {:?} vs {:?}", a.dims(), b.dims());
    }
    let out_shape = a.dims().to_vec();
    let (a, rows, width, sa) = as_rows(a)?;
    let (b, _, _, sb) = as_rows(b)?;
    let dev = cuda_dev(&a)?;
    let params = GeluMulParams {
        rows: u32_of(rows, "rows")?,
        width: u32_of(width, "width")?,
        a_stride: u32_of(sa, "stride")?,
        b_stride: u32_of(sb, "stride")?,
    };
    let n = rows * width;
    // Eight 16-bit elements a thread where every row starts on 16 bytes (`gelu_mul8`).
    let on16 = |t: &Tensor, stride: usize| {
        t.layout().start_offset().is_multiple_of(8)
            && stride.is_multiple_of(8)
            && dtype.size_in_bytes() == 2
    };
    let by8 = width % 8 == 0 && on16(&a, sa) && on16(&b, sb) && rows <= 65_535;
    let (name, cfg) = if by8 {
        let threads = 256u32;
        let chunks = u32_of(width / 8, "width")?;
        let cfg = LaunchConfig {
            grid_dim: (chunks.div_ceil(threads), u32_of(rows.max(1), "rows")?, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        ("gelu_mul8", cfg)
    } else {
        ("gelu_mul", grid_stride(n))
    };
    let func = load_kernel(&dev, &format!("{name}_{}", tn(dtype)?), &LAYER_OPS)?;
    by_dtype!(dtype, E, {
        // SAFETY: the grid-stride loop, or a thread per 8-element chunk of every row, writes
        // every element.
        let mut out = unsafe { dev.alloc::<E>(n.max(1))? };
        if n > 0 {
            bind!(av, a, E);
            bind!(bv, b, E);
            let mut bl = func.builder();
            bl.arg(&params);
            bl.arg(&av);
            bl.arg(&bv);
            bl.arg(&mut out);
            // SAFETY: arguments match the kernel's signature; strides checked above.
            unsafe { bl.launch(cfg) }.w()?;
        }
        Ok(wrap(out, &dev, &out_shape))
    })
}

/// The sources and weights of [`qkv_prep`].
pub struct QkvSources<'a> {
    /// `[.., n_heads * head_dim]` (tokens along the leading axes), rows possibly strided.
    pub q: &'a Tensor,
    /// `[.., kv_heads * head_dim]` with `k_norm`'s weight, for a KV-owning layer.
    pub k: Option<(&'a Tensor, &'a Tensor)>,
    /// `[.., kv_heads * head_dim]` (the raw K again on k_eq_v layers).
    pub v: Option<&'a Tensor>,
    /// q_norm's weight `[head_dim]`.
    pub q_norm: &'a Tensor,
    /// RoPE tables `[batch, seq_len, head_dim / 2]`.
    pub cos: &'a Tensor,
    /// See `cos`.
    pub sin: &'a Tensor,
}

/// Normed, rotated q `[batch, n_heads, seq_len, head_dim]`, and for a KV-owning layer normed,
/// rotated k and normed v `[batch, kv_heads, seq_len, head_dim]`.
pub type QkvPrepared = (Tensor, Option<(Tensor, Tensor)>);

/// Per-head RMS norms, RoPE and the head-major layout of one step's q/k/v in one launch.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn qkv_prep(
    src: &QkvSources<'_>,
    batch: usize,
    seq_len: usize,
    head_dim: usize,
    eps: f64,
) -> Result<QkvPrepared> {
    qkv_prep_into(src, batch, seq_len, head_dim, eps, None)
}

/// [`qkv_prep`] writing k and v into `kv_dst` (`[1, kv_heads, seq_len, head_dim]` views whose
/// tokens are contiguous within a head and whose heads are equally spaced, such as a cache's
/// next slots) instead of fresh tensors; then the returned k/v are `None`.
///
/// # Errors
/// As [`qkv_prep`], and destinations of another shape, dtype or layout.
pub fn qkv_prep_into(
    src: &QkvSources<'_>,
    batch: usize,
    seq_len: usize,
    head_dim: usize,
    eps: f64,
    kv_dst: Option<(&Tensor, &Tensor)>,
) -> Result<QkvPrepared> {
    let dtype = src.q.dtype();
    let mut ts = vec![src.q, src.q_norm, src.cos, src.sin];
    if let Some((k, kw)) = src.k {
        ts.push(k);
        ts.push(kw);
    }
    ts.extend(src.v);
    check_dtype(&ts, dtype)?;
    let tokens = batch * seq_len;
    let rowwise = |t: &Tensor| -> Result<(Tensor, usize)> {
        let (t, r, _, stride) = as_rows(t)?;
        if r != tokens {
            candle_core::bail!("qkv_prep: {r} rows, expected {tokens}");
        }
        Ok((t, stride))
    };
    let (q, qs) = rowwise(src.q)?;
    let width = |t: &Tensor| t.dims().last().copied().unwrap_or(0);
    let n_heads = width(&q) / head_dim;
    let (k, ks, kw, kv_heads) = match src.k {
        Some((k, kw)) => {
            let (k, ks) = rowwise(k)?;
            let kvh = width(&k) / head_dim;
            (k, ks, kw.contiguous()?, kvh)
        }
        None => (q.clone(), qs, src.q_norm.contiguous()?, 0),
    };
    let (v, vs) = match src.v {
        Some(v) => rowwise(v)?,
        None => (k.clone(), ks),
    };
    let (cos, sin) = (src.cos.contiguous()?, src.sin.contiguous()?);
    if cos.elem_count() != tokens * head_dim / 2 || sin.elem_count() != cos.elem_count() {
        candle_core::bail!("qkv_prep: rope tables {:?} for {tokens} tokens", cos.dims());
    }
    let qw = src.q_norm.contiguous()?;
    let dev = cuda_dev(&q)?;
    let params = QkvPrepParams {
        batch: u32_of(batch, "batch")?,
        seq_len: u32_of(seq_len, "seq_len")?,
        n_heads: u32_of(n_heads, "heads")?,
        kv_heads: u32_of(kv_heads, "kv heads")?,
        head_dim: u32_of(head_dim, "head_dim")?,
        q_stride: u32_of(qs, "stride")?,
        k_stride: u32_of(ks, "stride")?,
        v_stride: u32_of(vs, "stride")?,
        eps: eps as f32,
        kv_head_stride: u32_of(seq_len * head_dim, "kv head stride")?,
    };
    let mut params = params;
    // The destinations' layout: heads `stride[1]` apart, tokens `head_dim` apart.
    if let Some((kd, vd)) = kv_dst {
        let fits = |t: &Tensor| fits_kv_slots(t, kv_heads, seq_len, head_dim, dtype);
        if batch != 1 || kv_heads == 0 || !fits(kd) || !fits(vd) || kd.stride()[1] != vd.stride()[1]
        {
            candle_core::bail!(
                "qkv_prep: destinations {:?} / {:?} (strides {:?} / {:?}) for {kv_heads} heads, {seq_len} tokens of {head_dim}",
                kd.dims(),
                vd.dims(),
                kd.stride(),
                vd.stride()
            );
        }
        params.kv_head_stride = u32_of(kd.stride()[1], "kv head stride")?;
    }
    // A step being captured writes K and V where the parameter area says (the slot moves
    // from step to step; the graph does not). Without destinations it writes fresh buffers,
    // which a quantized cache then quantizes into its slots (the caches refuse any other
    // write during a capture).
    let recorded = match kv_dst {
        Some((kd, vd)) => graph::record(
            graph::Slot::KvDestination { seqs: 1 },
            &kv_destination(kd, vd)?,
        )?,
        None => None,
    };
    // 256- and 512-wide heads whose rows start 16 bytes aligned take a warp a head.
    let aligned = |t: &Tensor| t.layout().start_offset().is_multiple_of(8);
    let warp = matches!(head_dim, 256 | 512)
        && [qs, ks, vs, params.kv_head_stride as usize]
            .iter()
            .all(|st| st % 8 == 0)
        && [&q, &k, &v, &qw, &kw, &cos, &sin].into_iter().all(aligned)
        && kv_dst.is_none_or(|(kd, vd)| aligned(kd) && aligned(vd));
    let variant = if warp {
        format!("_w{}", head_dim / 32)
    } else {
        String::new()
    };
    let name = match recorded {
        Some(_) => format!("qkv_prep_dyn{variant}_{}", tn(dtype)?),
        None => format!("qkv_prep{variant}_{}", tn(dtype)?),
    };
    let func = load_kernel(&dev, &name, &LAYER_OPS)?;
    let slots = params.n_heads + 2 * params.kv_heads;
    let cfg = if warp {
        let heads = u32_of(tokens, "tokens")?.saturating_mul(slots);
        LaunchConfig {
            grid_dim: (heads.div_ceil(NORM_THREADS / 32).max(1), 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    } else {
        LaunchConfig {
            grid_dim: (params.batch * params.seq_len, slots, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: (head_dim * 4) as u32,
        }
    };
    let q_len = tokens * n_heads * head_dim;
    let kv_len = (tokens * kv_heads * head_dim).max(1);
    by_dtype!(dtype, E, {
        // SAFETY: every head slot of every token is written by its block.
        let mut qo = unsafe { dev.alloc::<E>(q_len.max(1))? };
        // Fresh k/v outputs unless the caller gave destinations.
        let mut fresh = match kv_dst {
            // SAFETY: as above.
            None => Some(unsafe { (dev.alloc::<E>(kv_len)?, dev.alloc::<E>(kv_len)?) }),
            Some(_) => None,
        };
        if tokens > 0 {
            bind!(qv, q, E);
            bind!(kv, k, E);
            bind!(vv, v, E);
            bind!(qwv, qw, E);
            bind!(kwv, kw, E);
            bind!(cv, cos, E);
            bind!(sv, sin, E);
            let dst_guard =
                kv_dst.map(|(kd, vd)| (kd.storage_and_layout(), vd.storage_and_layout()));
            let dst_views = match &dst_guard {
                Some(((ks_, kl), (vs_, vl))) => Some((
                    view::<E>(cuda_storage(ks_)?, kl)?,
                    view::<E>(cuda_storage(vs_)?, vl)?,
                )),
                None => None,
            };
            let mut b = func.builder();
            b.arg(&params);
            if let Some(at) = &recorded {
                b.arg(at);
            }
            b.arg(&qv);
            b.arg(&kv);
            b.arg(&vv);
            b.arg(&qwv);
            b.arg(&kwv);
            b.arg(&cv);
            b.arg(&sv);
            b.arg(&mut qo);
            match (&mut fresh, &dst_views) {
                // The recorded block holds the destinations.
                (None, Some(_)) if recorded.is_some() => {}
                (Some((ko, vo)), _) => {
                    b.arg(ko);
                    b.arg(vo);
                }
                (None, Some((kdv, vdv))) => {
                    b.arg(kdv);
                    b.arg(vdv);
                }
                (None, None) => candle_core::bail!("qkv_prep: no k/v output"),
            }
            // SAFETY: arguments match the kernel's signature; rows and strides checked above,
            // destinations cover kv_heads heads of seq_len tokens at their stride.
            unsafe { b.launch(cfg) }.w()?;
        }
        let q = wrap(qo, &dev, &[batch, n_heads, seq_len, head_dim]);
        let kv = match fresh {
            Some((ko, vo)) if kv_heads > 0 => {
                let shape = [batch, kv_heads, seq_len, head_dim];
                Some((wrap(ko, &dev, &shape), wrap(vo, &dev, &shape)))
            }
            _ => None,
        };
        Ok((q, kv))
    })
}
