//! One step's q/k/v before attention: per-head RMS norms, rotary embedding (RoPE, rotate-half
//! layout), the `[B, heads, S, D]` layout, and on CUDA the write of K and V straight into a
//! cache's next slots.

use candle_core::Tensor;

use super::norm::rms_norm;
use super::Norm;
use super::Result;
use crate::kernels::KernelError;

/// One step's raw q/k/v and what [`qkv_prep`] applies to them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvInput<'a> {
    /// `[B, S, n_heads * D]`.
    pub q: &'a Tensor,
    /// `[B, S, kv_heads * D]` and k_norm, on KV-owning layers.
    pub k: Option<(&'a Tensor, Norm<'a>)>,
    /// `[B, S, kv_heads * D]` (raw K on k_eq_v layers) and v_norm, on KV-owning layers.
    pub v: Option<(&'a Tensor, Norm<'a>)>,
    /// q_norm (its epsilon serves the k and v norms too on CUDA).
    pub q_norm: Norm<'a>,
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

/// Normed, rotated q `[B, n_heads, S, D]`; normed, rotated k and normed v
/// `[B, kv_heads, S, D]` on KV-owning layers (when not written to destinations).
pub(crate) type QkvOutput = (Tensor, Option<(Tensor, Tensor)>);

/// Whether [`qkv_prep`] writes k and v straight into destinations ([`QkvInput::kv_dst`]) for
/// these projections: the fused CUDA kernel, q_norm in q's dtype, a batch of one.
pub(crate) fn writes_kv_in_place(q: &Tensor, q_norm: Norm<'_>) -> bool {
    cfg!(feature = "cuda")
        && super::fused(q.device())
        && q_norm.weight.dtype() == q.dtype()
        && q.dim(0).is_ok_and(|b| b == 1)
}

/// `x * cos + rotate_half(x) * sin` for `x` `[B, heads, S, D]` and tables `[B, S, D / 2]`.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin)
}

/// Runs [`QkvInput`] through the norms and RoPE.
///
/// # Errors
/// Shape mismatch; [`KernelError::Config`] for destinations where the fused kernel does not run.
pub(crate) fn qkv_prep(inp: &QkvInput<'_>) -> Result<QkvOutput> {
    let (b, s, _) = inp.q.dims3()?;
    let hd = inp.head_dim;
    #[cfg(feature = "cuda")]
    if super::fused(inp.q.device()) && inp.q_norm.weight.dtype() == inp.q.dtype() {
        let src = crate::kernels::cuda::layer_ops::QkvSources {
            q: inp.q,
            k: inp.k.map(|(k, n)| (k, n.weight)),
            v: inp.v.map(|(v, _)| v),
            q_norm: inp.q_norm.weight,
            cos: inp.cos,
            sin: inp.sin,
        };
        return Ok(crate::kernels::cuda::layer_ops::qkv_prep_into(
            &src,
            b,
            s,
            hd,
            inp.q_norm.eps,
            inp.kv_dst,
        )?);
    }
    if inp.kv_dst.is_some() {
        return Err(KernelError::Config {
            field: "kv_dst",
            reason: "k/v destinations are written by the CUDA kernel only (see writes_kv_in_place)"
                .to_string(),
        });
    }
    let heads = |t: &Tensor| -> Result<Tensor> {
        let n = t.dim(2)? / hd;
        Ok(t.reshape((b, s, n, hd))?)
    };
    let q = rms_norm(&heads(inp.q)?, inp.q_norm)?.transpose(1, 2)?;
    let q = rope(&q, inp.cos, inp.sin)?;
    let kv = match (inp.k, inp.v) {
        (Some((k, k_norm)), Some((v, v_norm))) => {
            let k = rms_norm(&heads(k)?, k_norm)?.transpose(1, 2)?;
            let k = rope(&k, inp.cos, inp.sin)?;
            let v = rms_norm(&heads(v)?, v_norm)?
                .transpose(1, 2)?
                .contiguous()?;
            Some((k, v))
        }
        _ => None,
    };
    Ok((q, kv))
}
