//! CUDA launchers for the fused decoder-layer kernels in `fused.cu`: residual add with RMS norm,
//! GeGLU, the per-head q/k/v norm + RoPE + layout step, and the routed-expert products of the MoE
//! block. Each takes the place of a chain of candle ops on CUDA; `crate::gemma4::fused` picks
//! between them and the candle chain, which stays the reference on every other device.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::graph;
use super::kernel_cache::load_kernel;
use super::launch::{contiguous_aligned16, cuda_dev, cuda_storage, kname, sm_count, view, wrap};
use super::scratch::{with_kept, with_scratch};
use crate::kernels::qmatmul::PackedWeight;

/// The kernels' image (machine code for the build's compute capability, plus PTX), built by
/// `build.rs` from `fused.cu`.
const IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fused.fatbin"));
/// Name under which the loaded module is cached.
const MODULE: &str = "candle_gemma_fused";
/// Threads of the norm kernels (`NORM_THREADS`).
const NORM_THREADS: u32 = 256;
/// Threads of the residual add + norm kernel (`ADD_NORM_THREADS`).
const ADD_NORM_THREADS: u32 = 1024;
/// Widest row [`add_norm`] takes (`ADD_NORM_PER_THREAD * ADD_NORM_THREADS`: each thread keeps its
/// elements in registers); wider rows take the candle ops.
pub const ADD_NORM_MAX_WIDTH: usize = 8 * ADD_NORM_THREADS as usize;
/// Activation rows the dense matvec kernel takes (the mma's N).
pub const DENSE_MV_MAX_ROWS: usize = 8;
/// Warps per grouped-matvec block (`GMV_WARPS`).
const GMV_WARPS: usize = 8;
/// Output rows a warp of the packed grouped matvec computes (`R` in `GROUPED_QMV_INST`).
const GMV_PACKED_ROWS: usize = 4;
/// Experts per lane of the router kernel (`ROUTE_MAX_PER_LANE`): at most 512 experts.
const ROUTE_MAX_PER_LANE: usize = 16;

/// A grid-stride launch over `n` elements: 256 threads a block, at most 8 blocks per
/// multiprocessor of an H100-sized device.
fn grid_stride(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 132 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernel-name suffix of a dtype.
fn tn(dtype: DType) -> Result<&'static str> {
    kname(dtype).map_err(candle_core::Error::wrap)
}

/// `struct AddNormParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct AddNormParams {
    rows: u32,
    dim: u32,
    eps: f32,
    flags: u32,
}

/// `struct GeluMulParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct GeluMulParams {
    rows: u32,
    width: u32,
    a_stride: u32,
    b_stride: u32,
}

/// `struct QkvPrepParams` in `fused.cu`.
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

/// `struct DenseMvParams` in `fused.cu`.
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

/// `struct RouteParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct RouteParams {
    tokens: u32,
    experts: u32,
    top_k: u32,
    pad_: u32,
}

/// `struct GroupedMvParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct GroupedMvParams {
    pairs: u32,
    top_k: u32,
    out_dim: u32,
    in_dim: u32,
    expert_stride: u64,
    x_per_token: u32,
    experts: u32,
    by_slot: u32,
    x_stride: u32,
    b_stride: u32,
    group_size: u32,
    pad1: u32,
    pad2: u32,
}

// SAFETY: `#[repr(C)]` plain integers and floats, passed by value, read by the kernels with the
// same field layout.
unsafe impl DeviceRepr for AddNormParams {}
unsafe impl DeviceRepr for GeluMulParams {}
unsafe impl DeviceRepr for QkvPrepParams {}
unsafe impl DeviceRepr for RouteParams {}
unsafe impl DeviceRepr for DenseMvParams {}
unsafe impl DeviceRepr for GroupedMvParams {}

fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} {x} exceeds u32")))
}

/// Binds a CUDA view of tensor `$t` (element type `$ty`) to `$name`, keeping its storage guard
/// alive in the enclosing scope.
macro_rules! bind {
    ($name:ident, $t:expr, $ty:ty) => {
        let guard = $t.storage_and_layout();
        let $name = view::<$ty>(cuda_storage(&guard.0)?, guard.1)?;
    };
}

/// Runs `$body` with `$ty` bound to the Rust element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $ty:ident, $body:block) => {
        match $dtype {
            DType::F32 => {
                type $ty = f32;
                $body
            }
            DType::F16 => {
                type $ty = half::f16;
                $body
            }
            _ => {
                type $ty = half::bf16;
                $body
            }
        }
    };
}

/// `t` (rank >= 1) as rows of its last axis: `(tensor, rows, width, row stride)`. The tensor is
/// `t` itself when its last axis is dense and its rows are evenly spaced (a narrow of the last
/// axis qualifies), else a contiguous copy.
fn as_rows(t: &Tensor) -> Result<(Tensor, usize, usize, usize)> {
    let dims = t.dims();
    let st = t.stride();
    let n = dims.len();
    let width = dims.last().copied().unwrap_or(1);
    let rows = t.elem_count() / width.max(1);
    if n >= 1 && st[n - 1] == 1 {
        let row_stride = if n >= 2 { st[n - 2] } else { width };
        // Leading axes must step by whole multiples of the row stride, like one flat row axis.
        let mut expect = row_stride;
        let mut uniform = true;
        for i in (0..n.saturating_sub(1)).rev() {
            if dims[i] > 1 && st[i] != expect {
                uniform = false;
                break;
            }
            expect *= dims[i];
        }
        if uniform {
            return Ok((t.clone(), rows, width, row_stride));
        }
    }
    Ok((t.contiguous()?, rows, width, width))
}

fn check_dtype(ts: &[&Tensor], dtype: DType) -> Result<()> {
    tn(dtype)?;
    for t in ts {
        if t.dtype() != dtype {
            candle_core::bail!("fused kernel: expected {dtype:?}, found {:?}", t.dtype());
        }
    }
    Ok(())
}

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
/// (A 256-thread variant for rows up to 3072 measured slower under ncu on an H100: 8.8 against
/// 5.8 us a call on E4B.)
pub const MOE_ADD_NORM_MAX_WIDTH: usize = 4 * ADD_NORM_THREADS as usize;

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
    let dtype = res.dtype();
    let dim = w.dim(0)?;
    let branch_ok = extra.second_branch.map_or(true, |(b, wa, wb)| {
        b.dims() == y.dims() && wa.dims() == [dim] && wb.dims() == [dim]
    });
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
    let dev = cuda_dev(res)?;
    let (res, y, w) = (res.contiguous()?, y.contiguous()?, w.contiguous()?);
    let branch = match extra.second_branch {
        Some((b, wa, wb)) => Some((b.contiguous()?, wa.contiguous()?, wb.contiguous()?)),
        None => None,
    };
    let params = AddNormParams {
        rows: u32_of(rows, "rows")?,
        dim: u32_of(dim, "width")?,
        eps: eps as f32,
        flags: u32::from(extra.scalar.is_some())
            | (u32::from(extra.next.is_some()) << 1)
            | (u32::from(extra.next2.is_some()) << 2),
    };
    let kernel = if branch.is_some() {
        "moe_add_norm"
    } else {
        "add_norm"
    };
    let func = load_kernel(&dev, &format!("{kernel}_{}", tn(dtype)?), MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (params.rows, 1, 1),
        block_dim: (ADD_NORM_THREADS, 1, 1),
        shared_mem_bytes: 0,
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
    let func = load_kernel(&dev, &format!("gelu_mul_{}", tn(dtype)?), MODULE, IMAGE)?;
    let cfg = grid_stride(n);
    by_dtype!(dtype, E, {
        // SAFETY: grid-stride loop writes every element.
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
        Some((kd, vd)) => graph::record(graph::Slot::KvDestination, &kv_destination(kd, vd)?)?,
        None => None,
    };
    let name = match recorded {
        Some(_) => format!("qkv_prep_dyn_{}", tn(dtype)?),
        None => format!("qkv_prep_{}", tn(dtype)?),
    };
    let func = load_kernel(&dev, &name, MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (
            params.batch * params.seq_len,
            params.n_heads + 2 * params.kv_heads,
            1,
        ),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: (head_dim * 4) as u32,
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

/// Whether `t` is a cache's slots for `n` tokens as the kernels write them:
/// `[1, kv_heads, n, head_dim]` in `dtype`, a head's tokens contiguous.
fn fits_kv_slots(t: &Tensor, kv_heads: usize, n: usize, head_dim: usize, dtype: DType) -> bool {
    let st = t.stride();
    t.dims() == [1, kv_heads, n, head_dim]
        && t.dtype() == dtype
        && st[3] == 1
        && (n == 1 || st[2] == head_dim)
}

/// `struct QkvDst` in `fused.cu`: where a captured step's K and V go.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct QkvDst {
    k: u64,
    v: u64,
    kv_head_stride: u32,
    pad_: u32,
}

/// The [`QkvDst`] of destinations `kd`, `vd` (`[1, kv_heads, n, head_dim]` views, heads equally
/// spaced, as [`qkv_prep_into`] takes them).
///
/// # Errors
/// Views of another layout, or not on a CUDA device.
pub(crate) fn kv_destination(kd: &Tensor, vd: &Tensor) -> Result<QkvDst> {
    let (ks, vs) = (kd.stride(), vd.stride());
    if ks.len() != 4 || ks != vs || ks[3] != 1 || kd.dtype() != vd.dtype() {
        candle_core::bail!(
            "qkv_prep: destinations with strides {ks:?} / {vs:?} cannot be written in place"
        );
    }
    let dev = cuda_dev(kd)?;
    Ok(QkvDst {
        k: super::batched::address(kd, &dev)?,
        v: super::batched::address(vd, &dev)?,
        kv_head_stride: u32_of(ks[1], "kv head stride")?,
        pad_: 0,
    })
}

/// Sequences one `kv_scatter_batch` launch takes (`KV_BATCH` in `fused.cu`).
pub(crate) const KV_BATCH: usize = 16;

/// `struct KvBatchDst` in `fused.cu`: the K/V slots of up to [`KV_BATCH`] sequences, by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KvBatchDst {
    d: [QkvDst; KV_BATCH],
}

/// `struct KvScatterParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvScatterParams {
    kv_heads: u32,
    n: u32,
    head_dim: u32,
    pad_: u32,
}

/// Copies sequence `b` of `k`, `v` (`[batch, kv_heads, n, head_dim]`) into `dst[b]` (its
/// cache's reserved slots, `[1, kv_heads, n, head_dim]` views with a head's tokens contiguous
/// and K and V heads equally spaced), [`KV_BATCH`] sequences a launch. `Ok(false)` without
/// writing when a destination has another shape, dtype or layout, or while a step is captured.
///
/// # Errors
/// CUDA errors.
pub(crate) fn kv_scatter_batch(k: &Tensor, v: &Tensor, dst: &[(Tensor, Tensor)]) -> Result<bool> {
    let (batch, kv_heads, n, head_dim) = k.dims4()?;
    let dtype = k.dtype();
    let Ok(name) = tn(dtype) else {
        return Ok(false);
    };
    if batch != dst.len() || v.dims() != k.dims() || v.dtype() != dtype || graph::recording() {
        return Ok(false);
    }
    let fits = |t: &Tensor| fits_kv_slots(t, kv_heads, n, head_dim, dtype);
    let mut blocks = Vec::with_capacity(batch);
    for (kd, vd) in dst {
        if !fits(kd) || !fits(vd) || kd.stride()[1] != vd.stride()[1] {
            return Ok(false);
        }
        blocks.push(kv_destination(kd, vd)?);
    }
    let per_seq = kv_heads * n * head_dim;
    if per_seq == 0 || batch == 0 {
        return Ok(true);
    }
    let dev = cuda_dev(k)?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let params = KvScatterParams {
        kv_heads: u32_of(kv_heads, "kv heads")?,
        n: u32_of(n, "tokens")?,
        head_dim: u32_of(head_dim, "head dim")?,
        pad_: 0,
    };
    let func = load_kernel(&dev, &format!("kv_scatter_batch_{name}"), MODULE, IMAGE)?;
    for (c, chunk) in blocks.chunks(KV_BATCH).enumerate() {
        let mut table = KvBatchDst::default();
        table.d[..chunk.len()].copy_from_slice(chunk);
        let cfg = LaunchConfig {
            grid_dim: (per_seq.div_ceil(256).min(64) as u32, 2, chunk.len() as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (first, len) = (c * KV_BATCH * per_seq, chunk.len() * per_seq);
        by_dtype!(dtype, E, {
            bind!(kv_, k, E);
            bind!(vv_, v, E);
            let (kv_, vv_) = (kv_.slice(first..first + len), vv_.slice(first..first + len));
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&table);
            b.arg(&kv_);
            b.arg(&vv_);
            // SAFETY: arguments match the kernel's signature; every destination was checked
            // above to hold kv_heads heads of n tokens at its head stride.
            unsafe { b.launch(cfg) }.w()?;
            Ok::<(), candle_core::Error>(())
        })?;
    }
    Ok(true)
}

/// Router top-k on the device: for each row of `logits` `[tokens, E]`, the `top_k` largest
/// (ties: lower expert first) as u32 `idx` `[tokens, top_k]`, and `mix` f32 `[tokens, top_k]`:
/// the softmax over the picked logits times `scale[e]` (f32 `[E]`) of each pick.
///
/// # Errors
/// More than 512 experts or more than 32 picks, dtype mismatch, CUDA errors.
pub fn moe_route(logits: &Tensor, scale: &Tensor, top_k: usize) -> Result<(Tensor, Tensor)> {
    let dtype = logits.dtype();
    check_dtype(&[logits], dtype)?;
    let (tokens, experts) = logits.dims2()?;
    if experts > 32 * ROUTE_MAX_PER_LANE || top_k == 0 || top_k > 32.min(experts) {
        candle_core::bail!("moe_route: {experts} experts, top {top_k}");
    }
    let dev = cuda_dev(logits)?;
    let logits = logits.contiguous()?;
    let scale = scale.to_dtype(DType::F32)?.contiguous()?;
    let params = RouteParams {
        tokens: u32_of(tokens, "tokens")?,
        experts: u32_of(experts, "experts")?,
        top_k: u32_of(top_k, "top_k")?,
        pad_: 0,
    };
    let func = load_kernel(&dev, &format!("moe_route_{}", tn(dtype)?), MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (params.tokens.max(1), 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let n = (tokens * top_k).max(1);
    // SAFETY: one warp per token writes all its picks.
    let (mut idx, mut mix) = unsafe { (dev.alloc::<u32>(n)?, dev.alloc::<f32>(n)?) };
    if tokens > 0 {
        by_dtype!(dtype, E, {
            bind!(lv, logits, E);
            bind!(sv, scale, f32);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&lv);
            b.arg(&sv);
            b.arg(&mut idx);
            b.arg(&mut mix);
            // SAFETY: arguments match the kernel's signature; experts bounded above.
            unsafe { b.launch(cfg) }.w()?;
        })
    }
    Ok((
        wrap(idx, &dev, &[tokens, top_k]),
        wrap(mix, &dev, &[tokens, top_k]),
    ))
}

/// Most (token, pick) pairs one [`grouped_matvec`] call takes (`GMV_MAX_PAIRS`).
pub const GROUPED_MAX_PAIRS: usize = 4096;

/// Routed expert products grouped by expert (each picked expert's rows are read once per call):
/// `weights` `[E, out, in]` (contiguous), `idx` u32 `[tokens, top_k]`; `x` is `[tokens, in]`
/// when `x_per_token` (every pick of a token reads its row) or `[tokens * top_k, in]`.
/// Returns `[tokens * top_k, out]`, row `t * top_k + j` through expert `idx[t, j]`.
///
/// # Errors
/// Shapes or dtypes that disagree (`in` must be a multiple of 8), more than
/// [`GROUPED_MAX_PAIRS`] pairs, CUDA errors.
pub fn grouped_matvec(
    weights: &Tensor,
    idx: &Tensor,
    x: &Tensor,
    x_per_token: bool,
) -> Result<Tensor> {
    grouped_mv(ExpertStack::Dense(weights), idx, x, None, x_per_token)?
        .ok_or_else(|| candle_core::Error::Msg("grouped_matvec: not applicable".into()))
}

/// [`grouped_matvec`] over MLX-packed experts: `weights` is the stack `[E, out, in]` flattened to
/// `[E * out, in]` (expert `e` owns rows `e * out ..`), read packed (4 or 8 bits).
///
/// # Errors
/// As [`grouped_matvec`], and when `weights` does not split into `experts` equal stacks.
pub fn grouped_qmatvec(
    weights: &PackedWeight,
    experts: usize,
    idx: &Tensor,
    x: &Tensor,
    x_per_token: bool,
) -> Result<Tensor> {
    let stack = ExpertStack::Packed(weights, experts);
    grouped_mv(stack, idx, x, None, x_per_token)?
        .ok_or_else(|| candle_core::Error::Msg("grouped_qmatvec: not applicable".into()))
}

/// [`grouped_matvec_gated`] over MLX-packed experts (see [`grouped_qmatvec`]).
///
/// # Errors
/// As [`grouped_matvec_gated`].
pub fn grouped_qmatvec_gated(
    weights: &PackedWeight,
    experts: usize,
    idx: &Tensor,
    a: &Tensor,
    b: &Tensor,
) -> Result<Option<Tensor>> {
    grouped_mv(
        ExpertStack::Packed(weights, experts),
        idx,
        a,
        Some(b),
        false,
    )
}

/// The expert weights of a grouped product.
#[derive(Clone, Copy)]
enum ExpertStack<'a> {
    /// `[E, out, in]` in the activations' dtype.
    Dense(&'a Tensor),
    /// `[E * out, in]` packed, and `E`.
    Packed(&'a PackedWeight, usize),
}

impl ExpertStack<'_> {
    /// Output rows one warp computes (`Rows::R` of the kernel's row reader).
    fn rows_per_warp(&self) -> usize {
        match self {
            ExpertStack::Dense(_) => 1,
            ExpertStack::Packed(..) => GMV_PACKED_ROWS,
        }
    }

    /// `(experts, out, in)`.
    fn dims(&self) -> Result<(usize, usize, usize)> {
        match *self {
            ExpertStack::Dense(w) => w.dims3(),
            ExpertStack::Packed(w, e) => {
                if e == 0 || w.out_dim() % e != 0 {
                    candle_core::bail!("{} packed rows do not split into {e} experts", w.out_dim());
                }
                Ok((e, w.out_dim() / e, w.in_dim()))
            }
        }
    }

    /// The kernel's name for activations of `dtype`.
    fn kernel(&self, gated: bool, dtype: DType) -> Result<String> {
        let g = if gated { "_gated" } else { "" };
        let t = tn(dtype)?;
        Ok(match *self {
            ExpertStack::Dense(_) => format!("grouped_mv{g}_{t}"),
            ExpertStack::Packed(w, _) => {
                let s = tn(w.scales.dtype())?;
                let r = GMV_PACKED_ROWS;
                format!("grouped_qmv{g}_{t}_{s}_{}_r{r}", w.bits.bits())
            }
        })
    }
}

/// Most bytes of gated rows one [`grouped_matvec_gated`] block keeps in shared memory (its
/// pairs times `in` elements; a block's pairs are at most the tokens), beside the 16 KB pair
/// list.
pub const GROUPED_GATED_MAX_SMEM: usize = 24 << 10;

/// [`grouped_matvec`] over the rows `gelu_tanh(a) * b` (pair rows, `[tokens * top_k, in]`
/// each, rows possibly strided: the halves of the gate/up output), the gate computed inside
/// the product; `None` for f32, when tokens times `in` elements exceed
/// [`GROUPED_GATED_MAX_SMEM`], or when a row is not 16-byte aligned.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn grouped_matvec_gated(
    weights: &Tensor,
    idx: &Tensor,
    a: &Tensor,
    b: &Tensor,
) -> Result<Option<Tensor>> {
    grouped_mv(ExpertStack::Dense(weights), idx, a, Some(b), false)
}

fn grouped_mv(
    weights: ExpertStack<'_>,
    idx: &Tensor,
    x: &Tensor,
    gate: Option<&Tensor>,
    x_per_token: bool,
) -> Result<Option<Tensor>> {
    let dtype = x.dtype();
    if let Some(g) = gate {
        if g.dims() != x.dims() {
            candle_core::bail!("grouped_matvec gated: {:?} vs {:?}", x.dims(), g.dims());
        }
    }
    let mut ts = vec![x];
    ts.extend(gate);
    if let ExpertStack::Dense(w) = weights {
        ts.push(w);
    }
    check_dtype(&ts, dtype)?;
    let (experts, out_dim, in_dim) = weights.dims()?;
    let (tokens, top_k) = idx.dims2()?;
    let pairs = tokens * top_k;
    let x_rows = if x_per_token { tokens } else { pairs };
    if x.dims2()? != (x_rows, in_dim)
        || in_dim % 8 != 0
        || idx.dtype() != DType::U32
        || pairs > GROUPED_MAX_PAIRS
    {
        candle_core::bail!(
            "grouped_matvec: x {:?}, weights {experts}x{out_dim}x{in_dim}, idx {:?} {:?}",
            x.dims(),
            idx.dims(),
            idx.dtype()
        );
    }
    let dev = cuda_dev(x)?;
    let smem = tokens * in_dim * dtype.size_in_bytes();
    // Gated rows stay as given (strided); plain rows are made contiguous.
    let rows_of = |t: &Tensor| -> Result<Option<(Tensor, usize)>> {
        let (t, _, _, stride) = as_rows(t)?;
        Ok((t.layout().start_offset() % 8 == 0 && stride % 8 == 0).then_some((t, stride)))
    };
    let (x, gate) = match gate {
        Some(g) => {
            // The gate works on 16-byte chunks of eight 16-bit elements.
            if smem > GROUPED_GATED_MAX_SMEM || !matches!(dtype, DType::BF16 | DType::F16) {
                return Ok(None);
            }
            match (rows_of(x)?, rows_of(g)?) {
                (Some(xs), Some(gs)) => (xs, Some(gs)),
                _ => return Ok(None),
            }
        }
        // The packed rows read x 16 bytes at a time from the row's first element.
        None => ((contiguous_aligned16(x)?, in_dim), None),
    };
    let idx = idx.contiguous()?;
    // Fewer pairs than experts (decode): one block column per pair slot instead of one per
    // expert, so the grid holds no blocks for experts nobody picked.
    let by_slot = pairs < experts;
    let params = GroupedMvParams {
        pairs: u32_of(pairs, "pairs")?,
        top_k: u32_of(top_k, "top_k")?,
        out_dim: u32_of(out_dim, "rows")?,
        in_dim: u32_of(in_dim, "columns")?,
        expert_stride: (out_dim * in_dim) as u64,
        x_per_token: u32::from(x_per_token),
        experts: u32_of(experts, "experts")?,
        by_slot: u32::from(by_slot),
        x_stride: u32_of(x.1, "row stride")?,
        b_stride: u32_of(gate.as_ref().map_or(x.1, |g| g.1), "row stride")?,
        group_size: match weights {
            ExpertStack::Packed(w, _) => u32_of(w.group_size, "group size")?,
            ExpertStack::Dense(_) => 0,
        },
        pad1: 0,
        pad2: 0,
    };
    let func = load_kernel(&dev, &weights.kernel(gate.is_some(), dtype)?, MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (
            u32_of(if by_slot { pairs } else { experts }, "experts")?,
            out_dim.div_ceil(GMV_WARPS * weights.rows_per_warp()) as u32,
            1,
        ),
        block_dim: ((GMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: if gate.is_some() { smem as u32 } else { 0 },
    };
    let x = x.0;
    // Packed codes are read 16 bytes at a time; scales and biases one element at a time.
    enum WeightArgs {
        Dense(Tensor),
        Packed(Tensor, Tensor, Tensor),
    }
    let weight_args = match weights {
        ExpertStack::Dense(w) => WeightArgs::Dense(w.contiguous()?),
        ExpertStack::Packed(w, _) => WeightArgs::Packed(
            contiguous_aligned16(&w.codes)?,
            w.scales.contiguous()?,
            w.biases.contiguous()?,
        ),
    };
    by_dtype!(dtype, E, {
        // SAFETY: every pair has one expert, whose block writes its whole output row.
        let mut y = unsafe { dev.alloc::<E>((pairs * out_dim).max(1))? };
        if pairs > 0 {
            bind!(iv, idx, u32);
            bind!(xv, x, E);
            let gt = gate.as_ref().map_or(&x, |g| &g.0);
            bind!(gv, gt, E);
            // The arguments after the weights, then the launch.
            macro_rules! finish {
                ($b:ident) => {{
                    $b.arg(&iv);
                    $b.arg(&xv);
                    if gate.is_some() {
                        $b.arg(&gv);
                    }
                    $b.arg(&mut y);
                    // SAFETY: arguments match the kernel's signature; expert ids that are not
                    // below E match no block and are the router's to avoid (moe_route only
                    // emits valid ones).
                    unsafe { $b.launch(cfg) }.w()?;
                }};
            }
            let mut b = func.builder();
            b.arg(&params);
            match &weight_args {
                WeightArgs::Dense(w) => {
                    bind!(wv, w, E);
                    b.arg(&wv);
                    finish!(b);
                }
                WeightArgs::Packed(c, s, bi) => {
                    bind!(cv, c, u32);
                    by_dtype!(s.dtype(), S, {
                        bind!(sv, s, S);
                        bind!(bv, bi, S);
                        b.arg(&cv);
                        b.arg(&sv);
                        b.arg(&bv);
                        finish!(b);
                    });
                }
            }
        }
        Ok(Some(wrap(y, &dev, &[pairs, out_dim])))
    })
}

/// `out[t] = sum_j mix[t, j] * y[t * top_k + j]`: `y` `[tokens * top_k, out]`, `mix` f32
/// `[tokens, top_k]`; returns `[tokens, out]`.
///
/// # Errors
/// Shapes that disagree, CUDA errors.
pub fn moe_mix(y: &Tensor, mix: &Tensor) -> Result<Tensor> {
    let dtype = y.dtype();
    check_dtype(&[y], dtype)?;
    let (tokens, top_k) = mix.dims2()?;
    let (pairs, out_dim) = y.dims2()?;
    if pairs != tokens * top_k {
        candle_core::bail!("moe_mix: y {:?}, mix {:?}", y.dims(), mix.dims());
    }
    let dev = cuda_dev(y)?;
    let (y, mix) = (y.contiguous()?, mix.to_dtype(DType::F32)?.contiguous()?);
    let params = GroupedMvParams {
        pairs: u32_of(pairs, "pairs")?,
        top_k: u32_of(top_k, "top_k")?,
        out_dim: u32_of(out_dim, "rows")?,
        in_dim: 0,
        expert_stride: 0,
        x_per_token: 0,
        experts: 0,
        by_slot: 0,
        x_stride: 0,
        b_stride: 0,
        group_size: 0,
        pad1: 0,
        pad2: 0,
    };
    let n = tokens * out_dim;
    let func = load_kernel(&dev, &format!("moe_mix_{}", tn(dtype)?), MODULE, IMAGE)?;
    let cfg = grid_stride(n);
    by_dtype!(dtype, E, {
        // SAFETY: grid-stride loop writes every element.
        let mut out = unsafe { dev.alloc::<E>(n.max(1))? };
        if n > 0 {
            bind!(yv, y, E);
            bind!(mv, mix, f32);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&yv);
            b.arg(&mv);
            b.arg(&mut out);
            // SAFETY: arguments match the kernel's signature.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(wrap(out, &dev, &[tokens, out_dim]))
    })
}

/// `struct SoftmaxParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SoftmaxParams {
    rows: u32,
    keys: u32,
    q_len: u32,
    q_offset: u32,
    window: u32,
    pos_mode: u32,
    pos_base: u32,
    pos_split: u32,
    pos_base2: u32,
    scale: f32,
}

// SAFETY: as above.
unsafe impl DeviceRepr for SoftmaxParams {}

/// Softmax over the last axis of attention scores `[.., rows, keys]` (row `r` is query
/// `r % q_len` of its head, at position `q_offset + r % q_len`) with the causal / sliding mask
/// built from `positions[j]` inside the kernel: no mask tensor, one pass in, one out, in the
/// scores' dtype. `scale` multiplies the scores first.
///
/// # Errors
/// Positions beyond `u32`, CUDA errors.
pub fn masked_softmax(
    scores: &Tensor,
    positions: &[usize],
    q_offset: usize,
    q_len: usize,
    window: Option<usize>,
    scale: f64,
) -> Result<Tensor> {
    use super::params::{PositionCode, QsdpaParams};
    let dtype = scores.dtype();
    check_dtype(&[scores], dtype)?;
    let keys = positions.len();
    let dims = scores.dims().to_vec();
    if dims.last() != Some(&keys) || q_len == 0 {
        candle_core::bail!("masked_softmax: scores {dims:?} for {keys} keys");
    }
    let rows = scores.elem_count() / keys.max(1);
    let code = PositionCode::encode(positions)
        .ok_or_else(|| candle_core::Error::Msg("key position beyond u32".into()))?;
    let mut qp = QsdpaParams::default();
    let table = code.apply(&mut qp).map(<[u32]>::to_vec);
    let params = SoftmaxParams {
        rows: u32_of(rows, "rows")?,
        keys: u32_of(keys, "keys")?,
        q_len: u32_of(q_len, "q_len")?,
        q_offset: u32_of(q_offset, "q_offset")?,
        window: u32_of(window.unwrap_or(0), "window")?,
        pos_mode: qp.pos_mode,
        pos_base: qp.pos_base,
        pos_split: qp.pos_split,
        pos_base2: qp.pos_base2,
        scale: scale as f32,
    };
    let dev = cuda_dev(scores)?;
    let scores = scores.contiguous()?;
    let table = match table {
        Some(t) => Some(dev.clone_htod(&t)?),
        None => None,
    };
    let func = load_kernel(
        &dev,
        &format!("masked_softmax_{}", tn(dtype)?),
        MODULE,
        IMAGE,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (params.rows.max(1), 1, 1),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(dtype, E, {
        // SAFETY: one block per row writes every key of its row.
        let mut out = unsafe { dev.alloc::<E>((rows * keys).max(1))? };
        if rows * keys > 0 {
            bind!(sv, scores, E);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&sv);
            match &table {
                Some(t) => b.arg(t),
                None => b.arg(&sv),
            };
            b.arg(&mut out);
            // SAFETY: arguments match the kernel's signature; the table, when read, has `keys`
            // entries.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(wrap(out, &dev, &dims))
    })
}

/// Copies `src` into `dst` (same byte size, contiguous, a multiple of 16 bytes) with an SM copy
/// kernel: the bandwidth reference of the benches.
///
/// # Errors
/// Sizes that disagree, CUDA errors.
pub fn device_copy(src: &Tensor, dst: &Tensor) -> Result<()> {
    let bytes = src.elem_count() * src.dtype().size_in_bytes();
    if bytes != dst.elem_count() * dst.dtype().size_in_bytes()
        || bytes % 16 != 0
        || src.dtype() != DType::F32
        || dst.dtype() != DType::F32
        || !src.is_contiguous()
        || !dst.is_contiguous()
    {
        candle_core::bail!("device_copy: two contiguous f32 tensors of one size (x16 bytes)");
    }
    let dev = cuda_dev(src)?;
    let func = load_kernel(&dev, "copy_u4", MODULE, IMAGE)?;
    let n = (bytes / 16) as u64;
    let cfg = LaunchConfig {
        grid_dim: (132 * 16, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    bind!(sv, src, f32);
    bind!(dv, dst, f32);
    let mut b = func.builder();
    b.arg(&sv);
    b.arg(&dv);
    b.arg(&n);
    // SAFETY: both buffers hold `n` 16-byte chunks from their (16-byte aligned) starts.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Index of the largest value of each row of f32 `[rows, cols]` (ties: lowest index), as u32
/// `[rows]`: greedy decoding without copying the logits to the host.
///
/// # Errors
/// Non-f32 input, CUDA errors.
pub fn argmax_rows(x: &Tensor) -> Result<Tensor> {
    let (rows, cols) = x.dims2()?;
    if x.dtype() != DType::F32 {
        candle_core::bail!("argmax_rows: f32 expected, found {:?}", x.dtype());
    }
    let dev = cuda_dev(x)?;
    let x = x.contiguous()?;
    let func = load_kernel(&dev, "argmax_rows_f32", MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (u32_of(rows, "rows")?.max(1), 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let cols32 = u32_of(cols, "columns")?;
    // SAFETY: one block per row writes its index.
    let mut out = unsafe { dev.alloc::<u32>(rows.max(1))? };
    if rows > 0 {
        bind!(xv, x, f32);
        let mut b = func.builder();
        b.arg(&xv);
        b.arg(&cols32);
        b.arg(&mut out);
        // SAFETY: arguments match the kernel's signature.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(wrap(out, &dev, &[rows]))
}

/// Weights up to this size take [`dense_matvec`] for decode products of 2 to 8 rows; larger
/// ones stay on cuBLAS (one row takes the one-row kernels at any size). Measured on an H100 at
/// 8 rows (`bench_kernels --dense-only`): the tensor-core kernel is 1.6x faster than cuBLAS on
/// E4B's 16 MB q/k/v weight, but cuBLAS streams the 31B gate/up and head weights at 0.94-0.95
/// of the copy bandwidth against the kernel's 0.81-0.85.
pub const DENSE_MV_MAX_BYTES: usize = 24 << 20;

/// Weights up to this size take [`dense_matvec_gated`] for gated decode products. Larger than
/// [`DENSE_MV_MAX_BYTES`] because the gated kernel also saves the gate's own launch (and
/// cuBLAS's split-K reduce): on E4B's 52 MB down projection the plain kernel measured 25.1 us
/// against cuBLAS's 24.6 us (`bench_kernels --dense-only`, H100), less than a launch apart.
pub const GATED_MV_MAX_BYTES: usize = 64 << 20;

fn dense_mv_mode() -> Option<bool> {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("CANDLE_GEMMA_DENSE_MV").as_deref() {
        Ok("cublas") => Some(false),
        Ok("all") => Some(true),
        _ => None,
    })
}

/// Whether a gated decode product of `rows` rows with a dense weight of `bytes` takes
/// [`dense_matvec_gated`]: one row always, else under [`GATED_MV_MAX_BYTES`] by default;
/// `CANDLE_GEMMA_DENSE_MV` as for [`dense_matvec_wanted`]
/// (`cublas`: the gate runs on its own, then cuBLAS).
pub fn gated_matvec_wanted(bytes: usize, rows: usize) -> bool {
    dense_mv_mode().unwrap_or(bytes <= GATED_MV_MAX_BYTES || one_row_kernel(rows))
}

/// Whether a product of `rows` activation rows takes the one-row (`_sv`) kernels, which stream
/// weights of any size faster than cuBLAS (measured on an H100 with `bench_kernels --dense-only`:
/// 1.00-1.06 of the copy bandwidth on the 31B and E4B gate/up and head weights, cuBLAS
/// 0.94-0.95).
fn one_row_kernel(rows: usize) -> bool {
    rows == 1 && simt_rows_per_warp().is_some()
}

/// Whether a decode product of `rows` rows with a dense f16/bf16 `[out, in]` weight of `bytes`
/// takes [`dense_matvec`]: one row always, else under [`DENSE_MV_MAX_BYTES`] by default;
/// `CANDLE_GEMMA_DENSE_MV=cublas` never, `=all` always (for comparison).
pub fn dense_matvec_wanted(bytes: usize, rows: usize) -> bool {
    dense_mv_mode().unwrap_or(bytes <= DENSE_MV_MAX_BYTES || one_row_kernel(rows))
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

/// Most bytes of gated input rows [`dense_matvec_gated`] keeps in shared memory (rows times
/// `in` elements): within the 48 KB a block gets without opting in, beside the epilogue's 8 KB.
pub const GATED_MV_MAX_SMEM: usize = 40 << 10;

/// `(gelu_tanh(a) * b) · Wᵀ`, the gate computed inside the product (no launch of its own);
/// `a` and `b` have one shape `[.., in]` and may have strided rows (the two halves of a stacked
/// gate/up product). `None` where [`dense_matvec`] would not apply or the gated rows exceed
/// [`GATED_MV_MAX_SMEM`].
///
/// # Errors
/// Shapes that disagree, CUDA errors.
pub fn dense_matvec_gated(a: &Tensor, b: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if a.dims() != b.dims() {
        candle_core::bail!("dense_matvec_gated: {:?} vs {:?}", a.dims(), b.dims());
    }
    Ok(dense_mv(a, Some(b), w, None)?.map(|r| r.0))
}

/// `add_norm_ext(res, y, norm_w, eps, extra)` of the product `y = x · Wᵀ` (with `gate`, the
/// gated product of [`dense_matvec_gated`]) in one launch: the block that finishes last adds
/// and normalises the rows once every block has stored its outputs. Returns the sum and the
/// norms asked for; `None` where the product kernels do not apply (or `extra` has a second
/// branch), so the caller runs the product and the add + norm apart.
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

/// The sum of a residual add + norm and the norms of it asked for.
pub type AddNormOut = (Tensor, Option<Tensor>, Option<Tensor>);

/// The residual add + norm folded into a product.
struct NormFuse<'a> {
    res: &'a Tensor,
    w: &'a Tensor,
    eps: f64,
    extra: &'a AddNormExtra<'a>,
}

impl NormFuse<'_> {
    /// Checks the residual, the norm weights and their dtype against the product's output
    /// `shape` (last axis the output width) and `dtype`; `what` names the caller in the error.
    fn check(&self, shape: &[usize], dtype: DType, what: &str) -> Result<()> {
        let e = self.extra;
        let mut ts = vec![self.res, self.w];
        ts.extend(e.scalar);
        ts.extend(e.next);
        ts.extend(e.next2);
        check_dtype(&ts, dtype)?;
        let width = [shape.last().copied().unwrap_or(0)];
        if self.res.dims() != shape
            || self.w.dims() != width
            || e.next.is_some_and(|t| t.dims() != width)
            || e.next2.is_some_and(|t| t.dims() != width)
            || (e.next2.is_some() && e.next.is_none())
        {
            candle_core::bail!(
                "{what}: residual {:?}, output {shape:?}, norm weight {:?}",
                self.res.dims(),
                self.w.dims()
            );
        }
        Ok(())
    }

    /// The tail's `MvNormParams`: which of the scalar and the next norms it applies.
    fn params(&self) -> MvNormParams {
        let e = self.extra;
        MvNormParams {
            flags: u32::from(e.scalar.is_some())
                | (u32::from(e.next.is_some()) << 1)
                | (u32::from(e.next2.is_some()) << 2),
            eps: self.eps as f32,
        }
    }
}

/// What a norm tail writes: the sum, and the norms of it asked for (`n` elements each).
struct NormOutputs<E> {
    out: CudaSlice<E>,
    out2: Option<CudaSlice<E>>,
    out3: Option<CudaSlice<E>>,
}

impl<E: DeviceRepr + candle_core::cuda_backend::CudaDType> NormOutputs<E> {
    /// Uninitialised outputs for `nf`.
    fn alloc(dev: &candle_core::CudaDevice, n: usize, nf: &NormFuse<'_>) -> Result<Self> {
        // SAFETY: the last block writes every element of each output asked for.
        unsafe {
            Ok(Self {
                out: dev.alloc::<E>(n)?,
                out2: nf.extra.next.map(|_| dev.alloc::<E>(n)).transpose()?,
                out3: nf.extra.next2.map(|_| dev.alloc::<E>(n)).transpose()?,
            })
        }
    }

    /// The outputs as tensors of `shape`.
    fn wrap(self, dev: &candle_core::CudaDevice, shape: &[usize]) -> AddNormOut {
        (
            wrap(self.out, dev, shape),
            self.out2.map(|o| wrap(o, dev, shape)),
            self.out3.map(|o| wrap(o, dev, shape)),
        )
    }
}

/// Pushes a norm tail's arguments (`DMV_NORM_ARGS` in fused.cu) after the product's output on
/// the launch `$b`, then launches it under `$cfg`. The argument views are bound here, at the
/// call site, so that they live until the launch.
macro_rules! launch_with_norm_tail {
    ($b:ident, $nf:expr, $res:expr, $nw:expr, $outs:expr, $counter:expr, $ty:ty, $cfg:expr) => {{
        let e = $nf.extra;
        bind!(rv, $res, $ty);
        bind!(nwv, $nw, $ty);
        let sc = e.scalar.unwrap_or(&$nw);
        bind!(sv, sc, $ty);
        let n1 = e.next.unwrap_or(&$nw);
        bind!(n1v, n1, $ty);
        let n2 = e.next2.unwrap_or(&$nw);
        bind!(n2v, n2, $ty);
        let np = $nf.params();
        $b.arg(&rv);
        $b.arg(&nwv);
        $b.arg(&sv);
        $b.arg(&n1v);
        $b.arg(&n2v);
        $b.arg(&mut $outs.out);
        match $outs.out2.as_mut() {
            Some(o) => $b.arg(o),
            None => $b.arg(&rv),
        };
        match $outs.out3.as_mut() {
            Some(o) => $b.arg(o),
            None => $b.arg(&rv),
        };
        $b.arg($counter);
        $b.arg(&np);
        // SAFETY: the caller pushed the product's arguments in the kernel's order; these follow
        // DMV_NORM_ARGS; the counter is zero between launches.
        unsafe { $b.launch($cfg) }.w()?;
    }};
}

/// `struct MvNormParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct MvNormParams {
    flags: u32,
    eps: f32,
}

// SAFETY: `#[repr(C)]` plain integer and float, read by the kernels with the same layout.
unsafe impl DeviceRepr for MvNormParams {}

/// Runs `f` with the launch counter of the folded add + norm (this thread's, on `dev`): one
/// `u32`, zero between launches (the last block of each launch resets it; launches on one
/// stream do not overlap).
fn with_norm_counter<R>(
    dev: &candle_core::CudaDevice,
    f: impl FnOnce(&mut candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>) -> Result<R>,
) -> Result<R> {
    with_kept::<u32, R>(dev, "norm_counter", 1, f)
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
    Ok(dense_mv_with(x, None, Some(&normed), w, None)?.map(|r| r.0))
}

/// Warps a block of the one-row (`_sv`) dense kernels (`SV_WARPS` in `fused.cu`).
const SV_WARPS: usize = 8;

/// Output rows per warp of the one-row dense kernels, or `None` for the tensor-core kernel.
/// `CANDLE_GEMMA_DENSE_SV`: `0` never, `1`/`2`/`4` that many rows a warp; two by default, the
/// best of the three in GPU time per decode step on an H100 (ncu, `gpuab` phase): E4B 5.56 ms
/// against 5.88 (one) and 5.80 (four), 26B-A4B 5.01 against 5.08 and 5.17, E2B 3.54 against
/// 3.52 and 3.80.
fn simt_rows_per_warp() -> Option<usize> {
    static MODE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *MODE.get_or_init(|| {
        std::env::var("CANDLE_GEMMA_DENSE_SV")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|v| matches!(v, 0 | 1 | 2 | 4))
    });
    match forced {
        Some(0) => None,
        Some(r) => Some(r),
        None => Some(2),
    }
}

/// `gelu_tanh(x · gateᵀ) * (x · upᵀ)` for one activation row (`[.., in]`, decode) and a
/// stacked `[gate; up]` f16/bf16 weight (`[2 * width, in]`) in one launch, returning
/// `[.., width]` rounded as the separate product and gate would round it; the down projection
/// then reads it without a gate of its own. `None` where it does not apply (more rows, another
/// dtype, `in` not a multiple of 8, unaligned views, `CANDLE_GEMMA_DENSE_SV=0`), so the caller
/// runs the product and the gate apart.
///
/// # Errors
/// CUDA errors.
pub fn dense_matvec_geglu(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let (stacked, in_dim) = w.dims2()?;
    let dtype = x.dtype();
    let Some(rpw) = simt_rows_per_warp() else {
        return Ok(None);
    };
    let aligned = |t: &Tensor| t.layout().start_offset() % 8 == 0;
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
    let rpw = rpw.max(2);
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
        MODULE,
        IMAGE,
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

fn dense_mv(
    x: &Tensor,
    gate: Option<&Tensor>,
    w: &Tensor,
    norm: Option<&NormFuse<'_>>,
) -> Result<Option<AddNormOut>> {
    dense_mv_with(x, gate, None, w, norm)
}

/// The dense matvec launcher: `gate` for the gated input, `normed` (weight, eps) for the
/// RMS-normed input, `norm` for the folded residual add + norm of the output.
fn dense_mv_with(
    x: &Tensor,
    gate: Option<&Tensor>,
    normed: Option<&(Tensor, f64)>,
    w: &Tensor,
    norm: Option<&NormFuse<'_>>,
) -> Result<Option<AddNormOut>> {
    let (out_dim, in_dim) = w.dims2()?;
    let dtype = x.dtype();
    let rows = x.elem_count() / in_dim.max(1);
    let aligned = |t: &Tensor| t.layout().start_offset() % 8 == 0;
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
    // are enough rows to keep two waves of blocks on the device; below one such wave, 16 warps
    // split each tile's input instead of 8 (more loads in flight).
    let sms = sm_count(&dev);
    let simt_rows = if rows == 1 {
        simt_rows_per_warp()
    } else {
        None
    };
    let (tiles, warps) = if out_dim >= 32 * 2 * sms {
        (2, 8)
    } else if out_dim >= 16 * 2 * sms {
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
    let func = load_kernel(&dev, &name, MODULE, IMAGE)?;
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

/// Widest output [`packed_matvec_add_norm`] takes: the norm tail's register path at 128
/// threads (`last_block_add_norm`). Wider rows go through the tail's plain loop, which made
/// 31B 4-bit decode (hidden 5376) slower folded than apart on the H100: 70.9 against
/// 105.5 tok/s (`bench-results/h100-s10-packed-fold-ab.jsonl`).
pub const PACKED_FOLD_MAX_WIDTH: usize = 4096;

/// Whether [`packed_matvec_add_norm`] serves `rows` activation rows of `x_dtype` through `w`.
pub fn packed_matvec_folds_norm(x_dtype: DType, rows: usize, w: &PackedWeight) -> bool {
    rows == 1 && w.out_dim() <= PACKED_FOLD_MAX_WIDTH && super::launch::takes_row_matvec(x_dtype, w)
}

/// [`dense_matvec_add_norm`] over a packed 4-bit weight: one activation row through
/// `qmv_row4`, whose last block adds the residual and writes the norms asked for (one launch
/// instead of the product's and the add + norm's). `None` where `qmv_row4` would not serve
/// (more rows, 8 bits, other dtypes) or the extra asks for a second branch.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn packed_matvec_add_norm(
    x: &Tensor,
    w: &PackedWeight,
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
    let params = super::params::QmatParams {
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
            super::launch::row_matvec_variant(1, in_dim, w.is_settled(), false)
        ),
        super::launch::MODULE,
        super::launch::IMAGE,
    )?;
    // Two output rows a warp (`qmv_row4_body`), QROW_NORM_WARPS warps a block (the norm tail
    // is compiled for that block size).
    let warps = super::params::QMATVEC_ROW_WARPS;
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

/// Host microseconds per call of the pieces of one small-kernel launch, each timed over `n`
/// calls (no synchronisation in the timed loops): `(what, microseconds)`. A diagnostic for
/// `bench_kernels --launch-floor`, not part of the model's API.
///
/// # Errors
/// CUDA errors, or a tensor not on a CUDA device.
#[doc(hidden)]
pub fn probe_host_costs(x: &Tensor, n: usize) -> Result<Vec<(&'static str, f64)>> {
    let dev = cuda_dev(x)?;
    let n = n.max(1);
    let dtype = x.dtype();
    let name = format!("gelu_mul_{}", tn(dtype)?);
    let per = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let mut out = Vec::new();
    let t = std::time::Instant::now();
    for _ in 0..n {
        // SAFETY: never read.
        drop(unsafe { dev.alloc::<u16>(x.elem_count())? });
    }
    out.push(("alloc_and_free", per(t)));
    let t = std::time::Instant::now();
    for _ in 0..n {
        load_kernel(&dev, &name, MODULE, IMAGE)?;
    }
    out.push(("function_lookup_cached", per(t)));
    let func = load_kernel(&dev, &name, MODULE, IMAGE)?;
    let (xc, rows, width, stride) = as_rows(x)?;
    let params = GeluMulParams {
        rows: u32_of(rows, "rows")?,
        width: u32_of(width, "width")?,
        a_stride: u32_of(stride, "stride")?,
        b_stride: u32_of(stride, "stride")?,
    };
    let cfg = grid_stride(rows * width);
    by_dtype!(dtype, E, {
        // SAFETY: written by every launch below before anything reads it (nothing does).
        let mut y = unsafe { dev.alloc::<E>((rows * width).max(1))? };
        let t = std::time::Instant::now();
        for _ in 0..n {
            bind!(av, xc, E);
            let mut bl = func.builder();
            bl.arg(&params);
            bl.arg(&av);
            bl.arg(&av);
            bl.arg(&mut y);
            // SAFETY: arguments match gelu_mul's signature.
            unsafe { bl.launch(cfg) }.w()?;
        }
        out.push(("launch_preallocated", per(t)));
        let t = std::time::Instant::now();
        for _ in 0..n {
            let _ = wrap(dev.alloc_zeros::<E>(1)?, &dev, &[1]);
        }
        out.push(("tensor_wrap_with_memset", per(t)));
        Ok::<(), candle_core::Error>(())
    })?;
    candle_core::backend::BackendDevice::synchronize(&dev)?;
    Ok(out)
}
