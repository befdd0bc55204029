//! CUDA launchers for the fused decoder-layer kernels in `fused.cu`: residual add with RMS norm,
//! GeGLU, the per-head q/k/v norm + RoPE + layout step, and the routed-expert products of the MoE
//! block. Each takes the place of a chain of candle ops on CUDA; [`crate::gemma4::fused`] picks
//! between them and the candle chain, which stays the reference on every other device.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::launch::{cuda_dev, cuda_storage, kname, view, wrap};

/// The kernels' PTX, built by `build.rs` from `fused.cu`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
/// Module name under which candle caches the loaded PTX.
const MODULE: &str = "candle_gemma_fused";
/// Threads of the norm kernels (`NORM_THREADS`).
const NORM_THREADS: u32 = 256;
/// Output rows per gather-matvec block (`GMV_WARPS`).
const GMV_WARPS: usize = 8;

/// `struct AddNormParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AddNormParams {
    rows: u32,
    dim: u32,
    eps: f32,
    flags: u32,
}

/// `struct GeluMulParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GeluMulParams {
    rows: u32,
    width: u32,
    a_stride: u32,
    b_stride: u32,
}

/// `struct QkvPrepParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct QkvPrepParams {
    batch: u32,
    seq_len: u32,
    n_heads: u32,
    kv_heads: u32,
    head_dim: u32,
    q_stride: u32,
    k_stride: u32,
    v_stride: u32,
    eps: f32,
    pad_: u32,
}

/// `struct GatherMvParams` in `fused.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GatherMvParams {
    tokens: u32,
    top_k: u32,
    out_dim: u32,
    in_dim: u32,
    expert_stride: u64,
}

// SAFETY: `#[repr(C)]` plain integers and floats, passed by value, read by the kernels with the
// same field layout.
unsafe impl DeviceRepr for AddNormParams {}
unsafe impl DeviceRepr for GeluMulParams {}
unsafe impl DeviceRepr for QkvPrepParams {}
unsafe impl DeviceRepr for GatherMvParams {}

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

fn check_dtype(ts: &[&Tensor], dtype: DType) -> Result<()> {
    kname(dtype).map_err(candle_core::Error::wrap)?;
    for t in ts {
        if t.dtype() != dtype {
            candle_core::bail!("fused kernel: expected {dtype:?}, found {:?}", t.dtype());
        }
    }
    Ok(())
}

/// `out = (res + rms_norm(y) * w) [* scalar]`, and with `next` also `rms_norm(out) * next`.
/// `res` and `y` have the same shape, last axis `w.len()`; `scalar` is a one-element tensor.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn add_norm(
    res: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f64,
    scalar: Option<&Tensor>,
    next: Option<&Tensor>,
) -> Result<(Tensor, Option<Tensor>)> {
    let dtype = res.dtype();
    let dim = w.dim(0)?;
    if res.dims() != y.dims() || res.dims().last() != Some(&dim) {
        candle_core::bail!(
            "add_norm: residual {:?}, branch {:?}, weight [{dim}]",
            res.dims(),
            y.dims()
        );
    }
    let mut ts = vec![res, y, w];
    ts.extend(scalar);
    ts.extend(next);
    check_dtype(&ts, dtype)?;
    let rows = res.elem_count() / dim.max(1);
    let dev = cuda_dev(res)?;
    let (res, y, w) = (res.contiguous()?, y.contiguous()?, w.contiguous()?);
    let params = AddNormParams {
        rows: u32_of(rows, "rows")?,
        dim: u32_of(dim, "width")?,
        eps: eps as f32,
        flags: u32::from(scalar.is_some()) | (u32::from(next.is_some()) << 1),
    };
    let func = dev.get_or_load_custom_func(
        &format!(
            "add_norm_{}",
            kname(dtype).map_err(candle_core::Error::wrap)?
        ),
        MODULE,
        PTX,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (params.rows, 1, 1),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: (dim * 4) as u32,
    };
    let shape = res.dims().to_vec();
    by_dtype!(dtype, E, {
        // SAFETY: every element is written by the kernel (one block per row, all columns).
        let mut out = unsafe { dev.alloc::<E>(rows * dim)? };
        let mut out2 = match next {
            // SAFETY: as above.
            Some(_) => Some(unsafe { dev.alloc::<E>(rows * dim)? }),
            None => None,
        };
        {
            bind!(rv, res, E);
            bind!(yv, y, E);
            bind!(wv, w, E);
            let sc = scalar.unwrap_or(&w);
            bind!(sv, sc, E);
            let nx = next.unwrap_or(&w);
            bind!(nv, nx, E);
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
            // SAFETY: arguments match the kernel's signature; one block per row of `dim`.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((wrap(out, &dev, &shape), out2.map(|o| wrap(o, &dev, &shape))))
    })
}

/// `gelu_tanh(a) * b` for 2-D `a`, `b` `[rows, width]` whose rows may be strided (e.g. the two
/// halves of a fused gate/up product); returns a dense `[rows, width]`.
///
/// # Errors
/// Shapes or dtypes that disagree, CUDA errors.
pub fn gelu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dtype = a.dtype();
    check_dtype(&[a, b], dtype)?;
    let (rows, width) = a.dims2()?;
    if b.dims2()? != (rows, width) {
        candle_core::bail!("gelu_mul: {:?} vs {:?}", a.dims(), b.dims());
    }
    let rowwise = |t: &Tensor| -> Result<(Tensor, usize)> {
        let st = t.stride();
        if st[1] == 1 {
            Ok((t.clone(), st[0]))
        } else {
            let t = t.contiguous()?;
            Ok((t, width))
        }
    };
    let (a, sa) = rowwise(a)?;
    let (b, sb) = rowwise(b)?;
    let dev = cuda_dev(&a)?;
    let params = GeluMulParams {
        rows: u32_of(rows, "rows")?,
        width: u32_of(width, "width")?,
        a_stride: u32_of(sa, "stride")?,
        b_stride: u32_of(sb, "stride")?,
    };
    let n = rows * width;
    let func = dev.get_or_load_custom_func(
        &format!(
            "gelu_mul_{}",
            kname(dtype).map_err(candle_core::Error::wrap)?
        ),
        MODULE,
        PTX,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 132 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
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
        Ok(wrap(out, &dev, &[rows, width]))
    })
}

/// The sources and weights of [`qkv_prep`].
pub struct QkvSources<'a> {
    /// `[tokens, n_heads * head_dim]`, rows possibly strided.
    pub q: &'a Tensor,
    /// `[tokens, kv_heads * head_dim]` with `k_norm`'s weight, for a KV-owning layer.
    pub k: Option<(&'a Tensor, &'a Tensor)>,
    /// `[tokens, kv_heads * head_dim]` (the raw K again on k_eq_v layers).
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
        let (r, _) = t.dims2()?;
        if r != tokens {
            candle_core::bail!("qkv_prep: {r} rows, expected {tokens}");
        }
        let st = t.stride();
        if st[1] == 1 {
            Ok((t.clone(), st[0]))
        } else {
            let c = t.contiguous()?;
            let w = c.dim(1)?;
            Ok((c, w))
        }
    };
    let (q, qs) = rowwise(src.q)?;
    let n_heads = q.dim(1)? / head_dim;
    let (k, ks, kw, kv_heads) = match src.k {
        Some((k, kw)) => {
            let (k, ks) = rowwise(k)?;
            let kvh = k.dim(1)? / head_dim;
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
        pad_: 0,
    };
    let func = dev.get_or_load_custom_func(
        &format!(
            "qkv_prep_{}",
            kname(dtype).map_err(candle_core::Error::wrap)?
        ),
        MODULE,
        PTX,
    )?;
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
        let (mut qo, mut ko, mut vo) = unsafe {
            (
                dev.alloc::<E>(q_len.max(1))?,
                dev.alloc::<E>(kv_len)?,
                dev.alloc::<E>(kv_len)?,
            )
        };
        if tokens > 0 {
            bind!(qv, q, E);
            bind!(kv, k, E);
            bind!(vv, v, E);
            bind!(qwv, qw, E);
            bind!(kwv, kw, E);
            bind!(cv, cos, E);
            bind!(sv, sin, E);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&qv);
            b.arg(&kv);
            b.arg(&vv);
            b.arg(&qwv);
            b.arg(&kwv);
            b.arg(&cv);
            b.arg(&sv);
            b.arg(&mut qo);
            b.arg(&mut ko);
            b.arg(&mut vo);
            // SAFETY: arguments match the kernel's signature; rows and strides checked above.
            unsafe { b.launch(cfg) }.w()?;
        }
        let q = wrap(qo, &dev, &[batch, n_heads, seq_len, head_dim]);
        let kv = if kv_heads > 0 {
            let shape = [batch, kv_heads, seq_len, head_dim];
            Some((wrap(ko, &dev, &shape), wrap(vo, &dev, &shape)))
        } else {
            None
        };
        Ok((q, kv))
    })
}

/// Routed expert products. `weights` `[E, out, in]` (contiguous), `idx` u32 `[tokens, top_k]`.
/// Without `mix`: `x` `[tokens, in]` → `[tokens * top_k, out]`, row `t * top_k + j` through
/// expert `idx[t, j]`. With `mix` (f32 `[tokens, top_k]`): `x` `[tokens * top_k, in]` →
/// `[tokens, out]`, the mix-weighted sum over each token's picks.
///
/// # Errors
/// Shapes or dtypes that disagree (`in` must be a multiple of 8), CUDA errors.
pub fn gather_matvec(
    weights: &Tensor,
    idx: &Tensor,
    x: &Tensor,
    mix: Option<&Tensor>,
) -> Result<Tensor> {
    let dtype = x.dtype();
    check_dtype(&[weights, x], dtype)?;
    let (_, out_dim, in_dim) = weights.dims3()?;
    let (tokens, top_k) = idx.dims2()?;
    let x_rows = if mix.is_some() {
        tokens * top_k
    } else {
        tokens
    };
    if x.dims2()? != (x_rows, in_dim) || in_dim % 8 != 0 || idx.dtype() != DType::U32 {
        candle_core::bail!(
            "gather_matvec: x {:?}, weights {:?}, idx {:?} {:?}",
            x.dims(),
            weights.dims(),
            idx.dims(),
            idx.dtype()
        );
    }
    let dev = cuda_dev(x)?;
    let (weights, idx, x) = (weights.contiguous()?, idx.contiguous()?, x.contiguous()?);
    let mix = match mix {
        Some(m) => Some(m.to_dtype(DType::F32)?.contiguous()?),
        None => None,
    };
    let params = GatherMvParams {
        tokens: u32_of(tokens, "tokens")?,
        top_k: u32_of(top_k, "top_k")?,
        out_dim: u32_of(out_dim, "rows")?,
        in_dim: u32_of(in_dim, "columns")?,
        expert_stride: (out_dim * in_dim) as u64,
    };
    let out_rows = if mix.is_some() {
        tokens
    } else {
        tokens * top_k
    };
    let func = dev.get_or_load_custom_func(
        &format!(
            "gather_mv_{}",
            kname(dtype).map_err(candle_core::Error::wrap)?
        ),
        MODULE,
        PTX,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (
            out_dim.div_ceil(GMV_WARPS) as u32,
            u32_of(out_rows, "rows")?,
            1,
        ),
        block_dim: ((GMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(dtype, E, {
        // SAFETY: one warp writes each output element.
        let mut y = unsafe { dev.alloc::<E>((out_rows * out_dim).max(1))? };
        if out_rows > 0 {
            bind!(wv, weights, E);
            bind!(iv, idx, u32);
            bind!(xv, x, E);
            let null = 0u64;
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&wv);
            b.arg(&iv);
            b.arg(&xv);
            let mg = mix.as_ref().map(|m| m.storage_and_layout());
            let mv = match &mg {
                Some((s, l)) => Some(view::<f32>(cuda_storage(s)?, l)?),
                None => None,
            };
            match &mv {
                Some(m) => b.arg(m),
                None => b.arg(&null),
            };
            b.arg(&mut y);
            // SAFETY: arguments match the kernel's signature; expert ids come from the router's
            // top-k over `E` logits, so they index `weights`.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(wrap(y, &dev, &[out_rows, out_dim]))
    })
}
