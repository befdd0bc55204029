//! RMSNorm and the residual adds around it: `res + norm(y)` with the norms of the sum the next
//! step needs, and the product `y = x · Wᵀ` folded into the same launch where a kernel serves.
//!
//! On CUDA with the fused kernels on, each entry point is one launch; elsewhere it runs the
//! candle ops below, which are the reference.

use candle_core::Tensor;

use super::Result;
use super::{matvec, Norm, Weight};

/// `x * (mean(x²) + eps)^-½ * w` over the last axis, computed by candle in f32 (the reference
/// every fused norm is tested against).
///
/// # Errors
/// Last axis not equal to the weight's length.
pub(crate) fn rms_norm(x: &Tensor, n: Norm<'_>) -> candle_core::Result<Tensor> {
    let x = x.contiguous()?;
    candle_nn::ops::rms_norm(&x, &n.weight.to_dtype(x.dtype())?, n.eps as f32)
}

/// Whether the fused CUDA residual add + norm takes `res` normed by `n`: CUDA with the fused
/// kernels on, a norm weight of the activation dtype, rows at most `max_width` wide.
#[cfg(feature = "cuda")]
fn cuda_add_norm_applies(res: &Tensor, n: Norm<'_>, max_width: usize) -> bool {
    super::fused(res.device())
        && n.weight.dtype() == res.dtype()
        && n.weight.elem_count() <= max_width
}

/// `res + norm(y)`, times `scalar` when given; with `next` also `next(result)`.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn add_norm(
    res: &Tensor,
    y: &Tensor,
    norm: Norm<'_>,
    scalar: Option<&Tensor>,
    next: Option<Norm<'_>>,
) -> Result<(Tensor, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if cuda_add_norm_applies(
        res,
        norm,
        crate::kernels::cuda::layer_ops::ADD_NORM_MAX_WIDTH,
    ) {
        return Ok(crate::kernels::cuda::layer_ops::add_norm(
            res,
            y,
            norm.weight,
            norm.eps,
            scalar,
            next.map(|n| n.weight),
        )?);
    }
    let mut x = (res + rms_norm(y, norm)?)?;
    if let Some(s) = scalar {
        x = x.broadcast_mul(s)?;
    }
    let n = match next {
        Some(n) => Some(rms_norm(&x, n)?),
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
    norm: Norm<'_>,
    next: Norm<'_>,
    next2: Norm<'_>,
) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if cuda_add_norm_applies(
        res,
        norm,
        crate::kernels::cuda::layer_ops::ADD_NORM_MAX_WIDTH,
    ) {
        let extra = crate::kernels::cuda::layer_ops::AddNormExtra {
            next: Some(next.weight),
            next2: Some(next2.weight),
            ..Default::default()
        };
        let (x, n1, n2) =
            crate::kernels::cuda::layer_ops::add_norm_ext(res, y, norm.weight, norm.eps, &extra)?;
        if let (Some(n1), Some(n2)) = (n1, n2) {
            return Ok((x, n1, n2));
        }
    }
    let x = (res + rms_norm(y, norm)?)?;
    let (n1, n2) = (rms_norm(&x, next)?, rms_norm(&x, next2)?);
    Ok((x, n1, n2))
}

/// The two-branch layer end (26B-A4B): `res + norm(norm_a(a) + norm_b(b))`, times `scalar`
/// when given, with `next(result)` when asked, in one launch on CUDA.
///
/// # Errors
/// Shape mismatch.
pub(crate) fn add_two_branch_norm(
    res: &Tensor,
    (a, norm_a): (&Tensor, Norm<'_>),
    (b, norm_b): (&Tensor, Norm<'_>),
    norm: Norm<'_>,
    scalar: Option<&Tensor>,
    next: Option<Norm<'_>>,
) -> Result<(Tensor, Option<Tensor>)> {
    #[cfg(feature = "cuda")]
    if let Some(extra) = two_branch_extra(res, (b, norm_a, norm_b), norm, scalar, next) {
        let (x, n1, _) =
            crate::kernels::cuda::layer_ops::add_norm_ext(res, a, norm.weight, norm.eps, &extra)?;
        return Ok((x, n1));
    }
    let y = (rms_norm(a, norm_a)? + rms_norm(b, norm_b)?)?;
    add_norm(res, &y, norm, scalar, next)
}

/// The extras of the CUDA two-branch add-norm (`b` with both branches' norms), when its kernel
/// takes `res` and `norm`; `None` where the candle ops run instead.
#[cfg(feature = "cuda")]
fn two_branch_extra<'a>(
    res: &Tensor,
    (b, norm_a, norm_b): (&'a Tensor, Norm<'a>, Norm<'a>),
    norm: Norm<'_>,
    scalar: Option<&'a Tensor>,
    next: Option<Norm<'a>>,
) -> Option<crate::kernels::cuda::layer_ops::AddNormExtra<'a>> {
    cuda_add_norm_applies(
        res,
        norm,
        crate::kernels::cuda::layer_ops::MOE_ADD_NORM_MAX_WIDTH,
    )
    .then(|| crate::kernels::cuda::layer_ops::AddNormExtra {
        scalar,
        next: next.map(|n| n.weight),
        next2: None,
        second_branch: Some((b, norm_a.weight, norm_b.weight)),
    })
}

/// What [`product_add_norm`] adds and normalises.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProductAddNorm<'a> {
    /// The residual.
    pub res: &'a Tensor,
    /// The norm of the product before the add.
    pub norm: Norm<'a>,
    /// Multiplies the sum.
    pub scalar: Option<&'a Tensor>,
    /// A norm of the sum, returned second.
    pub next: Option<Norm<'a>>,
    /// Another norm of the sum (with `next`), returned third.
    pub next2: Option<Norm<'a>>,
}

#[cfg(feature = "cuda")]
impl ProductAddNorm<'_> {
    /// The scalar and next norms as the CUDA add-norm kernels take them (no second branch).
    fn extra(&self) -> crate::kernels::cuda::layer_ops::AddNormExtra<'_> {
        crate::kernels::cuda::layer_ops::AddNormExtra {
            scalar: self.scalar,
            next: self.next.map(|n| n.weight),
            next2: self.next2.map(|n| n.weight),
            second_branch: None,
        }
    }

    /// Whether a product's last block can run this add + norm: the norm weight in the
    /// residual's dtype, and a second next norm only with a first.
    fn foldable(&self) -> bool {
        self.norm.weight.dtype() == self.res.dtype()
            && (self.next.is_some() || self.next2.is_none())
    }
}

/// The sum and the norms of it that [`product_add_norm`] was asked for.
pub(crate) type AddNormOut = (Tensor, Option<Tensor>, Option<Tensor>);

/// `res + norm(x · Wᵀ)` (with `gate`: `(gelu_tanh(x) * gate) · Wᵀ`), times `scalar`, and the
/// norms of the sum asked for. On CUDA decode the product, the add and the norms are one launch
/// where a kernel serves (see `folded`).
///
/// # Errors
/// Shape mismatch.
pub(crate) fn product_add_norm(
    w: &Weight,
    x: &Tensor,
    gate: Option<&Tensor>,
    a: &ProductAddNorm<'_>,
) -> Result<AddNormOut> {
    #[cfg(feature = "cuda")]
    if let Some(out) = folded(w, x, gate, a)? {
        return Ok(out);
    }
    let y = match gate {
        Some(g) => matvec::matmul_gated(x, g, w)?,
        None => matvec::matmul(x, w)?,
    };
    add_norms(&y, a)
}

/// [`product_add_norm`] of a row-parallel product: each rank's partial `x · Wᵀ` (its columns
/// of `W`) is summed over the group by `sum` before the add and the norms. In a group of one
/// it is [`product_add_norm`] itself.
///
/// # Errors
/// Shape mismatch; [`crate::kernels::KernelError::Collective`].
pub(crate) fn product_reduce_add_norm(
    w: &Weight,
    x: &Tensor,
    gate: Option<&Tensor>,
    a: &ProductAddNorm<'_>,
    sum: &super::collective::Collective,
) -> Result<AddNormOut> {
    if sum.world() == 1 {
        return product_add_norm(w, x, gate, a);
    }
    #[cfg(feature = "nccl")]
    if let Some(out) = peer_product_add_norm(w, x, gate, a, sum)? {
        return Ok(out);
    }
    let y = match gate {
        Some(g) => matvec::matmul_gated(x, g, w)?,
        None => matvec::matmul(x, w)?,
    };
    #[cfg(feature = "nccl")]
    if cuda_add_norm_applies(
        a.res,
        a.norm,
        crate::kernels::cuda::layer_ops::ADD_NORM_MAX_WIDTH,
    ) && (a.next.is_some() || a.next2.is_none())
    {
        let extra = a.extra();
        if let Some(out) = sum.sum_add_norm(a.res, &y, a.norm.weight, a.norm.eps, &extra, None)? {
            return Ok(out);
        }
    }
    add_norms(&sum.sum(&y)?, a)
}

/// The product, its sum over `sum`'s group and the add + norms in one launch, where the
/// weight is dense, there is no gate and [`super::collective::Collective::product_sum_add_norm`]
/// serves; `None` otherwise.
#[cfg(feature = "nccl")]
fn peer_product_add_norm(
    w: &Weight,
    x: &Tensor,
    gate: Option<&Tensor>,
    a: &ProductAddNorm<'_>,
    sum: &super::collective::Collective,
) -> Result<Option<AddNormOut>> {
    let Weight::Dense(l) = w else {
        return Ok(None);
    };
    if gate.is_some() || !super::fused(x.device()) || !a.foldable() {
        return Ok(None);
    }
    let extra = a.extra();
    let fuse = crate::kernels::cuda::norm_tail::NormFuse {
        res: a.res,
        w: a.norm.weight,
        eps: a.norm.eps,
        extra: &extra,
    };
    sum.product_sum_add_norm(x, l.weight(), &fuse)
}

/// The second branch of [`reduce_add_two_branch_norm`]: a tensor, or the picked experts' rows
/// of one token, which a fused sum weighs and adds in its own launch (else they are mixed
/// first).
#[derive(Debug, Clone)]
pub(crate) enum TwoBranch {
    /// The branch itself.
    Sum(Tensor),
    /// The expert rows and their weights.
    Rows(super::moe::ExpertRows),
}

/// [`add_two_branch_norm`] of the two branches' sums over `sum`'s group (row-parallel partial
/// sums, e.g. 26B-A4B's dense and expert outputs): the sums and the add in one launch where
/// the group sums through peer memory, else one sum of both and the add.
///
/// # Errors
/// Shape mismatch; [`crate::kernels::KernelError::Collective`].
pub(crate) fn reduce_add_two_branch_norm(
    res: &Tensor,
    (a, norm_a): (&Tensor, Norm<'_>),
    (b, norm_b): (&TwoBranch, Norm<'_>),
    norm: Norm<'_>,
    scalar: Option<&Tensor>,
    next: Option<Norm<'_>>,
    sum: &super::collective::Collective,
) -> Result<(Tensor, Option<Tensor>)> {
    #[cfg(feature = "nccl")]
    {
        let (bt, mix) = match b {
            TwoBranch::Sum(t) => (t, None),
            TwoBranch::Rows(r) => (&r.rows, Some(&r.mix)),
        };
        if let Some(extra) = two_branch_extra(res, (bt, norm_a, norm_b), norm, scalar, next) {
            let out = sum.sum_add_norm(res, a, norm.weight, norm.eps, &extra, mix)?;
            if let Some((x, n1, _)) = out {
                return Ok((x, n1));
            }
        }
    }
    let b = match b {
        TwoBranch::Sum(t) => t.clone(),
        TwoBranch::Rows(r) => r.mixed()?.reshape(a.dims())?,
    };
    let (a, b) = sum.sum_pair(a, &b)?;
    add_two_branch_norm(res, (&a, norm_a), (&b, norm_b), norm, scalar, next)
}

/// `a.res + a.norm(y)` (times the scalar) and the norms of the sum `a` asks for.
fn add_norms(y: &Tensor, a: &ProductAddNorm<'_>) -> Result<AddNormOut> {
    match (a.next, a.next2) {
        (Some(n1), Some(n2)) if a.scalar.is_none() => {
            let (s, o1, o2) = add_norm_two_next(a.res, y, a.norm, n1, n2)?;
            Ok((s, Some(o1), Some(o2)))
        }
        (n1, n2) => {
            let (s, o1) = add_norm(a.res, y, a.norm, a.scalar, n1)?;
            let o2 = match n2 {
                Some(n) => Some(rms_norm(&s, n)?),
                None => None,
            };
            Ok((s, o1, o2))
        }
    }
}

/// The product, the add and the norms in one launch where a kernel serves: a dense weight
/// (`dense_mv_norm`), or a packed 4-bit one at one row (`qmv_row4_norm`; a gated input is
/// computed first, by [`super::geglu::gelu_mul`]). `None`: the caller runs them apart.
#[cfg(feature = "cuda")]
fn folded(
    w: &Weight,
    x: &Tensor,
    gate: Option<&Tensor>,
    a: &ProductAddNorm<'_>,
) -> Result<Option<AddNormOut>> {
    if !super::fused(x.device()) || !a.foldable() {
        return Ok(None);
    }
    let rows = super::rows_of(x);
    let extra = a.extra();
    let (norm_w, eps) = (a.norm.weight, a.norm.eps);
    match w {
        Weight::Dense(l) => {
            // One row only: the kernel declines more (`dense_matvec::folds_into_matvec`).
            Ok(crate::kernels::cuda::dense_matvec::dense_matvec_add_norm(
                x,
                gate,
                l.weight(),
                a.res,
                norm_w,
                eps,
                &extra,
            )?)
        }
        Weight::Packed(p) => {
            if !crate::kernels::cuda::matvec::packed_matvec_folds_norm(x.dtype(), rows, p) {
                return Ok(None);
            }
            let gated;
            let input = match gate {
                Some(g) => {
                    gated = super::geglu::gelu_mul(x, g)?;
                    &gated
                }
                None => x,
            };
            Ok(crate::kernels::cuda::matvec::packed_matvec_add_norm(
                input, p, a.res, norm_w, eps, &extra,
            )?)
        }
    }
}
