//! The decoder layer's fusable steps, each with two implementations: a fused CUDA kernel
//! (`cuda` feature, CUDA tensors) and the chain of candle ops it replaces, which runs everywhere
//! else and is the reference the kernels are checked against.
//!
//! [`crate::kernels::fused_enabled`] decides which runs (`CANDLE_GEMMA_UNFUSED=1` forces the
//! candle chains on CUDA too).

use candle_core::Tensor;

use super::norm::RmsNorm;
use super::{rope, Linear};
use crate::error::{Error, Result};

/// Whether the fused CUDA residual add + norm takes `res` normed by `norm`: CUDA with the fused
/// kernels on, a norm weight of the activation dtype, rows at most `max_width` wide.
#[cfg(feature = "cuda")]
fn cuda_add_norm_applies(res: &Tensor, norm: &RmsNorm, max_width: usize) -> bool {
    crate::kernels::fused_enabled(res.device())
        && norm.weight().dtype() == res.dtype()
        && norm.weight().elem_count() <= max_width
}

/// `res + norm(y)`, times `scalar` when given; with `next` also `next(result)`.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn add_norm(
    res: &Tensor,
    y: &Tensor,
    norm: &RmsNorm,
    scalar: Option<&Tensor>,
    next: Option<&RmsNorm>,
) -> Result<(Tensor, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if cuda_add_norm_applies(res, norm, crate::kernels::cuda::fused::ADD_NORM_MAX_WIDTH) {
        return Ok(crate::kernels::cuda::fused::add_norm(
            res,
            y,
            norm.weight(),
            norm.eps(),
            scalar,
            next.map(RmsNorm::weight),
        )?);
    }
    let mut x = (res + norm.forward(y)?)?;
    if let Some(s) = scalar {
        x = x.broadcast_mul(s)?;
    }
    let n = match next {
        Some(n) => Some(n.forward(&x)?),
        None => None,
    };
    Ok((x, n))
}

/// `res + norm(y)` and two norms of the result (`next`, `next2`), in one launch on CUDA.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn add_norm_two_next(
    res: &Tensor,
    y: &Tensor,
    norm: &RmsNorm,
    next: &RmsNorm,
    next2: &RmsNorm,
) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if cuda_add_norm_applies(res, norm, crate::kernels::cuda::fused::ADD_NORM_MAX_WIDTH) {
        let extra = crate::kernels::cuda::fused::AddNormExtra {
            next: Some(next.weight()),
            next2: Some(next2.weight()),
            ..Default::default()
        };
        let (x, n1, n2) =
            crate::kernels::cuda::fused::add_norm_ext(res, y, norm.weight(), norm.eps(), &extra)?;
        if let (Some(n1), Some(n2)) = (n1, n2) {
            return Ok((x, n1, n2));
        }
    }
    let x = (res + norm.forward(y)?)?;
    let (n1, n2) = (next.forward(&x)?, next2.forward(&x)?);
    Ok((x, n1, n2))
}

/// The 26B-A4B layer end: `res + norm(norm_a(a) + norm_b(b))`, times `scalar` when given, with
/// `next(result)` when asked, in one launch on CUDA.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn add_two_branch_norm(
    res: &Tensor,
    (a, norm_a): (&Tensor, &RmsNorm),
    (b, norm_b): (&Tensor, &RmsNorm),
    norm: &RmsNorm,
    scalar: Option<&Tensor>,
    next: Option<&RmsNorm>,
) -> Result<(Tensor, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if cuda_add_norm_applies(
        res,
        norm,
        crate::kernels::cuda::fused::MOE_ADD_NORM_MAX_WIDTH,
    ) {
        let extra = crate::kernels::cuda::fused::AddNormExtra {
            scalar,
            next: next.map(RmsNorm::weight),
            second_branch: Some((b, norm_a.weight(), norm_b.weight())),
            ..Default::default()
        };
        let (x, n1, _) =
            crate::kernels::cuda::fused::add_norm_ext(res, a, norm.weight(), norm.eps(), &extra)?;
        return Ok((x, n1));
    }
    let y = (norm_a.forward(a)? + norm_b.forward(b)?)?;
    add_norm(res, &y, norm, scalar, next)
}

/// What [`product_add_norm`] adds and normalises.
pub(crate) struct ProductAddNorm<'a> {
    /// The residual.
    pub res: &'a Tensor,
    /// The norm of the product before the add.
    pub norm: &'a RmsNorm,
    /// Multiplies the sum.
    pub scalar: Option<&'a Tensor>,
    /// A norm of the sum, returned second.
    pub next: Option<&'a RmsNorm>,
    /// Another norm of the sum (with `next`), returned third.
    pub next2: Option<&'a RmsNorm>,
}

/// `res + norm(lin(x))` (with `gate`: `lin(gelu_tanh(x) * gate)`), times `scalar`, and the norms
/// of the sum asked for. On CUDA decode with a dense weight the product, the add and the norms
/// are one launch (`CANDLE_GEMMA_FOLD_NORM=0` keeps them apart, for comparison).
///
/// # Errors
/// Shape mismatch.
pub(crate) fn product_add_norm(
    lin: &Linear,
    x: &Tensor,
    gate: Option<&Tensor>,
    a: &ProductAddNorm<'_>,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if let Some(out) = folded_product_add_norm(lin, x, gate, a)? {
        return Ok(out);
    }
    let y = match gate {
        Some(g) => lin.forward_gated(x, g)?,
        None => lin.forward(x)?,
    };
    match (a.next, a.next2) {
        (Some(n1), Some(n2)) if a.scalar.is_none() => {
            let (s, o1, o2) = add_norm_two_next(a.res, &y, a.norm, n1, n2)?;
            Ok((s, Some(o1), Some(o2)))
        }
        (n1, n2) => {
            let (s, o1) = add_norm(a.res, &y, a.norm, a.scalar, n1)?;
            let o2 = match n2 {
                Some(n) => Some(n.forward(&s)?),
                None => None,
            };
            Ok((s, o1, o2))
        }
    }
}

#[cfg(feature = "cuda")]
use crate::kernels::cuda::fused as k;

/// The product, the add and the norms in one launch where a kernel serves: a dense weight
/// (`dense_mv_norm`), or a packed 4-bit one at one row (`qmv_row4_norm`; a gated input is
/// computed first, by `gelu_mul`). `CANDLE_GEMMA_FOLD_NORM=0` keeps both apart,
/// `CANDLE_GEMMA_PACKED_FOLD=0` only packed products.
#[cfg(feature = "cuda")]
fn folded_product_add_norm(
    lin: &Linear,
    x: &Tensor,
    gate: Option<&Tensor>,
    a: &ProductAddNorm<'_>,
) -> Result<Option<k::AddNormOut>> {
    fn env_off(cell: &'static std::sync::OnceLock<bool>, var: &str) -> bool {
        *cell.get_or_init(|| std::env::var(var).is_ok_and(|v| v == "0"))
    }
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    static PACKED_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if env_off(&OFF, "CANDLE_GEMMA_FOLD_NORM")
        || !crate::kernels::fused_enabled(x.device())
        || a.norm.weight().dtype() != a.res.dtype()
        || (a.next2.is_some() && a.next.is_none())
    {
        return Ok(None);
    }
    let rows = super::rows_of(x);
    let extra = k::AddNormExtra {
        scalar: a.scalar,
        next: a.next.map(RmsNorm::weight),
        next2: a.next2.map(RmsNorm::weight),
        second_branch: None,
    };
    let (norm_w, eps) = (a.norm.weight(), a.norm.eps());
    match lin {
        Linear::Dense(l) => {
            let w = l.weight();
            let bytes = super::tensor_bytes(w);
            let wanted = match gate {
                Some(_) => k::gated_matvec_wanted(bytes, rows),
                None => k::dense_matvec_wanted(bytes, rows),
            };
            if !wanted {
                return Ok(None);
            }
            Ok(k::dense_matvec_add_norm(
                x, gate, w, a.res, norm_w, eps, &extra,
            )?)
        }
        Linear::Packed(w) => {
            if env_off(&PACKED_OFF, "CANDLE_GEMMA_PACKED_FOLD")
                || !k::packed_matvec_folds_norm(x.dtype(), rows, w)
            {
                return Ok(None);
            }
            let gated;
            let input = match gate {
                Some(g) => {
                    gated = gelu_mul(x, g)?;
                    &gated
                }
                None => x,
            };
            Ok(k::packed_matvec_add_norm(
                input, w, a.res, norm_w, eps, &extra,
            )?)
        }
    }
}

/// `lin(norm(x))`: on CUDA decode with a dense weight the norm is computed inside the product
/// (one launch instead of two).
///
/// # Errors
/// Shape mismatch.
pub(crate) fn normed_product(lin: &Linear, x: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(w) = lin.dense_weight() {
        if crate::kernels::fused_enabled(x.device())
            && k::dense_matvec_wanted(super::tensor_bytes(w), super::rows_of(x))
            && norm.weight().dtype() == x.dtype()
        {
            if let Some(y) = k::dense_matvec_normed(x, norm.weight(), norm.eps(), w)? {
                return Ok(y);
            }
        }
    }
    lin.forward(&norm.forward(x)?)
}

/// `gelu_tanh(a) * b` for `a`, `b` of one shape (`[.., width]`; rows may be strided).
///
/// # Errors
/// Shape mismatch.
pub(crate) fn gelu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::kernels::fused_enabled(a.device()) {
        return Ok(crate::kernels::cuda::fused::gelu_mul(a, b)?);
    }
    // candle's `gelu` is the tanh approximation (`gelu_pytorch_tanh`).
    Ok((a.gelu()? * b)?)
}

/// One step's q/k/v before attention: per-head norms, RoPE, `[B, heads, S, D]` layout.
pub(crate) struct QkvInput<'a> {
    /// `[B, S, n_heads * D]`.
    pub q: &'a Tensor,
    /// `[B, S, kv_heads * D]` and k_norm, on KV-owning layers.
    pub k: Option<(&'a Tensor, &'a RmsNorm)>,
    /// `[B, S, kv_heads * D]` (raw K on k_eq_v layers) and v_norm, on KV-owning layers.
    pub v: Option<(&'a Tensor, &'a RmsNorm)>,
    /// q_norm.
    pub q_norm: &'a RmsNorm,
    /// RoPE tables `[B, S, D / 2]`.
    pub cos: &'a Tensor,
    /// See `cos`.
    pub sin: &'a Tensor,
    /// Head dimension.
    pub head_dim: usize,
    /// Where k and v go when given (a cache's next slots, see [`writes_kv_in_place`]): then
    /// the output's k/v are `None`.
    pub kv_dst: Option<(&'a Tensor, &'a Tensor)>,
}

/// Whether [`qkv_prep`] writes k and v straight into destinations (`QkvInput::kv_dst`) for
/// these projections: the CUDA kernel, batch of one; `CANDLE_GEMMA_KV_IN_PLACE=0` turns it off
/// (the cache then copies them in, for comparison).
pub(crate) fn writes_kv_in_place(q: &Tensor, q_norm: &RmsNorm) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    cfg!(feature = "cuda")
        && *ON.get_or_init(|| std::env::var("CANDLE_GEMMA_KV_IN_PLACE").map_or(true, |v| v != "0"))
        && crate::kernels::fused_enabled(q.device())
        && q_norm.weight().dtype() == q.dtype()
        && q.dim(0).is_ok_and(|b| b == 1)
}

/// Normed, rotated q `[B, n_heads, S, D]`; normed, rotated k and normed v
/// `[B, kv_heads, S, D]` on KV-owning layers.
pub(crate) type QkvOutput = (Tensor, Option<(Tensor, Tensor)>);

/// Runs [`QkvInput`] through the norms and RoPE.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn qkv_prep(inp: &QkvInput<'_>) -> Result<QkvOutput> {
    let (b, s, _) = inp.q.dims3()?;
    let hd = inp.head_dim;
    #[cfg(feature = "cuda")]
    if crate::kernels::fused_enabled(inp.q.device()) && inp.q_norm.weight().dtype() == inp.q.dtype()
    {
        let (q, k, v) = (inp.q, inp.k.map(|(k, _)| k), inp.v.map(|(v, _)| v));
        let src = crate::kernels::cuda::fused::QkvSources {
            q,
            k: k.zip(inp.k.map(|(_, n)| n.weight())),
            v,
            q_norm: inp.q_norm.weight(),
            cos: inp.cos,
            sin: inp.sin,
        };
        return Ok(crate::kernels::cuda::fused::qkv_prep_into(
            &src,
            b,
            s,
            hd,
            inp.q_norm.eps(),
            inp.kv_dst,
        )?);
    }
    if inp.kv_dst.is_some() {
        return Err(Error::Input(
            "k/v destinations are written by the CUDA kernel only (see writes_kv_in_place)"
                .to_string(),
        ));
    }
    let heads = |t: &Tensor| -> Result<Tensor> {
        let n = t.dim(2)? / hd;
        Ok(t.reshape((b, s, n, hd))?)
    };
    let q = inp.q_norm.forward(&heads(inp.q)?)?.transpose(1, 2)?;
    let q = rope::apply(&q, inp.cos, inp.sin)?;
    let kv = match (inp.k, inp.v) {
        (Some((k, k_norm)), Some((v, v_norm))) => {
            let k = k_norm.forward(&heads(k)?)?.transpose(1, 2)?;
            let k = rope::apply(&k, inp.cos, inp.sin)?;
            let v = v_norm.forward(&heads(v)?)?.transpose(1, 2)?.contiguous()?;
            Some((k, v))
        }
        _ => None,
    };
    Ok((q, kv))
}
