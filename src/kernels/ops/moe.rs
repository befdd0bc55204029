//! Mixture of experts: routing (top-k of the router logits, softmax over the picks, a scale per
//! expert) and the routed GeGLU expert products, summed with the routing weights.
//!
//! With the fused CUDA kernels the routing stays on the device and the experts run grouped by
//! expert (each picked expert's rows read once per call), or, for many tokens, sorted by expert
//! into batched tensor-core matmuls. On Metal with the crate's kernels, routing, grouping by
//! expert and the routed products run as the `moe_*` kernels, nothing read back. Elsewhere the
//! routing is read back to the host and each expert runs one matmul over the tokens routed to
//! it, which is the reference.

use candle_core::{DType, Tensor};

use super::geglu::gelu_mul;
use super::Result;
use super::{matvec, Norm, Weight};
use crate::kernels::cpu::moe_route_row;
use crate::kernels::qmatmul::{qmatmul, MATVEC_MAX_ROWS};
use crate::kernels::PackedAffine;

/// One stack of expert matrices `[E, out, in]`: dense, or MLX-packed and kept packed.
#[derive(Debug, Clone)]
pub(crate) enum ExpertWeights {
    /// `[E, out, in]` in the model's dtype.
    Dense(Tensor),
    /// `[E * out, in]` packed: expert `e` owns rows `e * out ..`.
    Packed {
        /// The stacked rows.
        weight: PackedAffine,
        /// `E`.
        experts: usize,
    },
}

impl ExpertWeights {
    /// The number of experts `E`.
    ///
    /// # Errors
    /// A dense stack that is not 3-D.
    pub(crate) fn count(&self) -> Result<usize> {
        match self {
            ExpertWeights::Dense(t) => Ok(t.dim(0)?),
            ExpertWeights::Packed { experts, .. } => Ok(*experts),
        }
    }

    /// Expert `e`'s product `x · W_eᵀ`: `x` `[n, in]` → `[n, out]`.
    fn product(&self, e: usize, x: &Tensor) -> Result<Tensor> {
        match self {
            ExpertWeights::Dense(t) => Ok(x.matmul(&t.get(e)?.t()?)?),
            ExpertWeights::Packed { weight, experts } => {
                let w = expert_rows(weight, *experts, e)?;
                // One expert's prefill rows on CUDA: past `MATVEC_MAX_ROWS`, dequantize-then-GEMM
                // even where `qmatmul` would take `qmv_tc4x` (up to 32 rows), which ran these
                // small products slower (26B-A4B, 4-bit experts, 512-token prefill).
                if x.device().is_cuda() && x.dim(0)? > MATVEC_MAX_ROWS {
                    return Ok(x.matmul(&w.dequantize(x.dtype())?.t()?)?);
                }
                // A test switch: the expert's rows as `Q4_1` blocks, on candle's CPU matmul.
                let w = if x.device().is_cpu()
                    && crate::kernels::policy::current().candle_qmatmul_on_cpu
                {
                    w.with_candle_q4_1()
                } else {
                    w
                };
                Ok(qmatmul(x, &w)?)
            }
        }
    }

    /// The routed products on the device (see `grouped_matvec`).
    #[cfg(feature = "cuda")]
    fn grouped(&self, idx: &Tensor, x: &Tensor, x_per_token: bool) -> Result<Tensor> {
        use crate::kernels::cuda::moe::{grouped_matvec, grouped_qmatvec};
        Ok(match self {
            ExpertWeights::Dense(t) => grouped_matvec(t, idx, x, x_per_token)?,
            ExpertWeights::Packed { weight, experts } => {
                grouped_qmatvec(weight, *experts, idx, x, x_per_token)?
            }
        })
    }

    /// The routed products over `gelu_tanh(a) * b`, the gate inside the kernel where it fits.
    #[cfg(feature = "cuda")]
    fn grouped_gated(&self, idx: &Tensor, a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
        use crate::kernels::cuda::moe::{grouped_matvec_gated, grouped_qmatvec_gated};
        Ok(match self {
            ExpertWeights::Dense(t) => grouped_matvec_gated(t, idx, a, b)?,
            ExpertWeights::Packed { weight, experts } => {
                grouped_qmatvec_gated(weight, *experts, idx, a, b)?
            }
        })
    }

    /// Bytes of resident weights (packed experts at their packed size).
    pub(crate) fn resident_bytes(&self) -> usize {
        match self {
            ExpertWeights::Dense(t) => super::tensor_bytes(t),
            ExpertWeights::Packed { weight, .. } => weight.packed_bytes(),
        }
    }
}

/// Expert `e`'s rows of a packed stack of `experts` (`[E * out, in]`).
fn expert_rows(weight: &PackedAffine, experts: usize, e: usize) -> Result<PackedAffine> {
    let out = weight.out_dim() / experts;
    weight.narrow_rows(e * out, out)
}

/// The router: `softmax` over the top-k logits of `norm(x) · projᵀ`, times `per_expert_scale`
/// (softmax over the selected logits equals the renormalised full softmax).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Router<'a> {
    /// `[E, H]`.
    pub proj: &'a Weight,
    /// The router's input norm (scale and `H^-½` folded into its weight).
    pub norm: Norm<'a>,
    /// `[E]` host copy.
    pub per_expert_scale: &'a [f32],
    /// `[E]` f32 on the model's device (for routing without a host round trip).
    #[cfg_attr(not(any(feature = "cuda", feature = "metal")), allow(dead_code))]
    pub per_expert_scale_dev: &'a Tensor,
    /// Picks per token.
    pub top_k: usize,
}

/// The expert weights, gate and up stacked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Experts<'a> {
    /// `[E, 2I, H]`: gate rows, then up rows.
    pub gate_up: &'a ExpertWeights,
    /// `[E, H, I]`.
    pub down: &'a ExpertWeights,
    /// `I`.
    pub width: usize,
}

/// The routed experts' output of one token: the picked experts' rows and their weights, not
/// summed yet, so that a tensor-parallel rank's sum over the ranks can weigh and add them in
/// its own launch ([`crate::kernels::ops::norm::reduce_add_two_branch_norm`]).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct ExpertRows {
    /// `[top_k, H]`, pick order.
    pub rows: Tensor,
    /// `[1, top_k]` f32 routing weights.
    pub mix: Tensor,
}

impl ExpertRows {
    /// The weighted sum `[1, H]`, as [`moe`] returns it.
    ///
    /// # Errors
    /// Device errors.
    pub(crate) fn mixed(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        return Ok(crate::kernels::cuda::moe::moe_mix(&self.rows, &self.mix)?);
        #[cfg(not(feature = "cuda"))]
        Err(crate::kernels::KernelError::Config {
            field: "expert rows",
            reason: "made and mixed on CUDA only".to_string(),
        })
    }
}

/// [`moe`] of one token, with the fused CUDA kernels: the picked experts' rows and weights
/// before their weighted sum; `None` elsewhere, or for more tokens (the caller runs [`moe`]).
///
/// # Errors
/// As [`moe`].
pub(crate) fn moe_rows(
    router_input: &Tensor,
    x: &Tensor,
    router: &Router<'_>,
    experts: &Experts<'_>,
) -> Result<Option<ExpertRows>> {
    #[cfg(feature = "cuda")]
    if super::fused(x.device())
        && x.dim(0)? == 1
        && crate::kernels::policy::current().moe_grouped_max_tokens >= 1
        && router.top_k <= crate::kernels::cuda::moe::GROUPED_MAX_PAIRS
    {
        let logits = matvec::normed_matmul(router_input, router.norm, router.proj)?;
        return Ok(Some(grouped_rows(x, &logits, router, experts)?));
    }
    let _ = (router_input, x, router, experts);
    Ok(None)
}

/// The routed expert sum of `x` `[tokens, H]`, routed by `router_input` `[tokens, H]`:
/// `[tokens, H]`.
///
/// # Errors
/// Shape mismatch; [`KernelError::Config`] for a routing outside the experts.
pub(crate) fn moe(
    router_input: &Tensor,
    x: &Tensor,
    router: &Router<'_>,
    experts: &Experts<'_>,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::fused(x.device()) {
        return on_device(router_input, x, router, experts);
    }
    #[cfg(feature = "metal")]
    if let Some(y) = on_metal(router_input, x, router, experts)? {
        return Ok(y);
    }
    let routes = route_on_host(router_input, router)?;
    grouped_on_host(x, &routes, experts)
}

/// The routed expert sum of `x` `[tokens, H]` for `routes` (per token, `(expert, weight)`
/// pairs): tokens grouped by expert on the host, one matmul per expert over its tokens.
fn grouped_on_host(
    x: &Tensor,
    routes: &[Vec<(usize, f32)>],
    experts: &Experts<'_>,
) -> Result<Tensor> {
    let n_experts = experts.gate_up.count()?;
    // Group tokens by expert so each expert runs one matmul over its tokens.
    let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); n_experts];
    for (token, picks) in routes.iter().enumerate() {
        for &(e, w) in picks {
            by_expert[e].0.push(token as u32);
            by_expert[e].1.push(w);
        }
    }
    let width = experts.width;
    let mut out = Tensor::zeros(x.dims(), x.dtype(), x.device())?;
    for (e, (tokens, weights)) in by_expert.into_iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let n = tokens.len();
        let idx = Tensor::from_vec(tokens, n, x.device())?;
        let xe = x.index_select(&idx, 0)?;
        let gu = experts.gate_up.product(e, &xe)?;
        let hidden = gelu_mul(&gu.narrow(1, 0, width)?, &gu.narrow(1, width, width)?)?;
        let y = experts.down.product(e, &hidden)?;
        let w = Tensor::from_vec(weights, (n, 1), x.device())?.to_dtype(y.dtype())?;
        out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
    }
    Ok(out)
}

/// Routing and experts on a Metal device without a host round trip: the router's top-k, the
/// pairs grouped by expert and both expert products run as the `moe_*` kernels
/// (`kernels::metal::route::moe`), the GeGLU and the weighted sum over each token's picks as
/// candle's ops. `None` off Metal, with the crate's kernels off, or for operands no kernel
/// takes (the host routing then runs).
#[cfg(feature = "metal")]
fn on_metal(
    router_input: &Tensor,
    x: &Tensor,
    r: &Router<'_>,
    experts: &Experts<'_>,
) -> Result<Option<Tensor>> {
    use crate::kernels::metal::launch::{moe_product, moe_route, MoeExperts};
    use crate::kernels::metal::route::{self, Family, Route};
    use crate::kernels::metal::{format_of, kernels_on};
    if !x.device().is_metal() {
        return Ok(None);
    }
    fn operand(w: &ExpertWeights) -> MoeExperts<'_> {
        match w {
            ExpertWeights::Dense(t) => MoeExperts::Dense(t),
            ExpertWeights::Packed { weight, experts } => MoeExperts::Packed {
                weight,
                experts: *experts,
            },
        }
    }
    let format = |w: &ExpertWeights| match w {
        ExpertWeights::Dense(_) => None,
        ExpertWeights::Packed { weight, .. } => Some(format_of(weight)),
    };
    let routed = route::moe(
        x.dtype(),
        format(experts.gate_up),
        format(experts.down),
        kernels_on(),
    );
    if routed != Route::Kernel(Family::Moe) {
        return Ok(None);
    }
    let logits = matvec::normed_matmul(router_input, r.norm, r.proj)?;
    let Some(routing) = moe_route(&logits, r.per_expert_scale_dev, r.top_k)? else {
        return Ok(None);
    };
    routed_layer(x, &routing.weights, r.top_k, experts, |x, per_token, w| {
        moe_product(&routing, x, per_token, operand(w))
    })
}

/// The layer around routed expert products in pair order (`[tokens * top_k, out]`, pair
/// `t * top_k + j` = token `t`'s pick `j`): the gate/up product of each pair's token, the
/// GeGLU, the down product of each pair's hidden row, and each token's products weighted by
/// `weights` `[tokens, top_k]` (f32) and summed. `product(x, per_token, stack)` gives `None`
/// where it does not apply, and so does this.
#[cfg_attr(not(feature = "metal"), allow(dead_code))]
fn routed_layer(
    x: &Tensor,
    weights: &Tensor,
    top_k: usize,
    experts: &Experts<'_>,
    product: impl Fn(&Tensor, bool, &ExpertWeights) -> Result<Option<Tensor>>,
) -> Result<Option<Tensor>> {
    let Some(gu) = product(x, true, experts.gate_up)? else {
        return Ok(None);
    };
    let width = experts.width;
    let hidden = gelu_mul(&gu.narrow(1, 0, width)?, &gu.narrow(1, width, width)?)?;
    let Some(y) = product(&hidden, false, experts.down)? else {
        return Ok(None);
    };
    // Each token's picks, weighted and summed: `[tokens, top_k, H]` → `[tokens, H]`.
    let (tokens, h) = x.dims2()?;
    let w = weights.to_dtype(y.dtype())?.reshape((tokens, top_k, 1))?;
    Ok(Some(
        y.reshape((tokens, top_k, h))?.broadcast_mul(&w)?.sum(1)?,
    ))
}

/// Routes `x` `[tokens, H]` on the host: for each token, `(expert, weight)` pairs.
fn route_on_host(x: &Tensor, r: &Router<'_>) -> Result<Vec<Vec<(usize, f32)>>> {
    let logits = matvec::normed_matmul(x, r.norm, r.proj)?;
    let logits = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(logits
        .iter()
        .map(|row| moe_route_row(row, r.top_k, r.per_expert_scale))
        .collect())
}

/// Routing and experts without a host round trip (CUDA): top-k on the device, then the routed
/// expert products grouped by expert, so each picked expert's rows are read once per call. Long
/// inputs run in slices of at most `GROUPED_MAX_PAIRS / top_k` tokens; more tokens than
/// [`crate::kernels::policy::LaunchPolicy::moe_grouped_max_tokens`] take the sorted path.
#[cfg(feature = "cuda")]
fn on_device(
    router_input: &Tensor,
    x: &Tensor,
    r: &Router<'_>,
    experts: &Experts<'_>,
) -> Result<Tensor> {
    use crate::kernels::cuda::moe::{moe_mix, moe_route, GROUPED_MAX_PAIRS};
    let logits = matvec::normed_matmul(router_input, r.norm, r.proj)?;
    let tokens = logits.dim(0)?;
    if tokens > crate::kernels::policy::current().moe_grouped_max_tokens {
        let (idx, mix) = moe_route(&logits, r.per_expert_scale_dev, r.top_k)?;
        let idx = spread_for_bench(idx, experts.gate_up.count()?)?;
        return sorted(x, &idx, &mix, experts);
    }
    let slice = (GROUPED_MAX_PAIRS / r.top_k).max(1);
    let mut outs = Vec::with_capacity(tokens.div_ceil(slice));
    for start in (0..tokens).step_by(slice) {
        let n = slice.min(tokens - start);
        let part = grouped_rows(
            &x.narrow(0, start, n)?,
            &logits.narrow(0, start, n)?,
            r,
            experts,
        )?;
        outs.push(moe_mix(&part.rows, &part.mix)?);
    }
    Ok(if outs.len() == 1 {
        outs.remove(0)
    } else {
        Tensor::cat(&outs, 0)?
    })
}

/// The routing of router `logits` `[tokens, E]` and the picked experts' products of `x`
/// `[tokens, H]`, one row a pick, grouped by expert (at most `GROUPED_MAX_PAIRS` picks).
#[cfg(feature = "cuda")]
fn grouped_rows(
    x: &Tensor,
    logits: &Tensor,
    r: &Router<'_>,
    experts: &Experts<'_>,
) -> Result<ExpertRows> {
    use crate::kernels::cuda::moe::moe_route;
    let width = experts.width;
    let (idx, mix) = moe_route(logits, r.per_expert_scale_dev, r.top_k)?;
    let idx = spread_for_bench(idx, experts.gate_up.count()?)?;
    let gu = experts.gate_up.grouped(&idx, x, true)?;
    let (gate, up) = (gu.narrow(1, 0, width)?, gu.narrow(1, width, width)?);
    // The gate inside the down product where its rows fit the kernel's shared memory.
    let rows = match experts.down.grouped_gated(&idx, &gate, &up)? {
        Some(y) => y,
        None => {
            let hidden = gelu_mul(&gate, &up)?;
            experts.down.grouped(&idx, &hidden, false)?
        }
    };
    Ok(ExpertRows { rows, mix })
}

/// With [`crate::kernels::policy::LaunchPolicy::bench_spread_routing`] (a benchmark switch),
/// the router's picks `idx` `[tokens, top_k]` replaced by picks spread over all `experts`: token
/// `t` takes `(h(t) + j * experts / top_k) % experts` for `j < top_k`, `h` a hash. Random
/// weights route most tokens to a few experts, which real routers do not; this gives the
/// products the load of a spread routing. Otherwise `idx` itself.
#[cfg(feature = "cuda")]
fn spread_for_bench(idx: Tensor, experts: usize) -> Result<Tensor> {
    if !crate::kernels::policy::current().bench_spread_routing {
        return Ok(idx);
    }
    let (tokens, k) = idx.dims2()?;
    let step = (experts / k.max(1)).max(1);
    let picks: Vec<u32> = (0..tokens)
        .flat_map(|t| {
            let h = (t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            (0..k).map(move |j| ((h as usize + j * step) % experts) as u32)
        })
        .collect();
    Ok(Tensor::from_vec(picks, (tokens, k), idx.device())?)
}

/// Many tokens (prefill): the picks are grouped by expert on the host (one copy of the routing
/// per layer), and each pair's token row is gathered into expert order.
///
/// - Packed experts of which at least half are picked (a trained router's prefill chunk picks
///   nearly all) are dequantized whole (two launches; 26B-A4B: about 1.5 GB of bf16 a layer,
///   which the device's memory pool keeps for the next layer); fewer picked, each picked
///   expert is dequantized alone.
/// - Dense (or wholly dequantized) experts whose groups padded to the longest come to at most
///   [`crate::kernels::policy::LaunchPolicy::moe_padded_max_pct`] percent of the pairs run as
///   one `[experts, longest group, hidden]` block padded with row 0, both products as one
///   batched matmul each (padding rows are computed and dropped).
/// - Else, where cuBLAS has grouped products ([`crate::kernels::cuda::grouped_gemm`]), gate/up
///   and down each run as one grouped product over the picked experts, every expert at its own
///   row count.
/// - Else dense experts run padded, and packed experts of which fewer than half are picked run
///   one product per picked expert.
///
/// The weighted sum reads each pair's output row where the products left it.
#[cfg(feature = "cuda")]
fn sorted(x: &Tensor, idx: &Tensor, mix: &Tensor, experts: &Experts<'_>) -> Result<Tensor> {
    use crate::kernels::cuda::grouped_gemm::{grouped_matmul, BlockWeights};
    use crate::kernels::cuda::moe::{gather_rows, moe_mix_rows};
    use crate::kernels::KernelError;
    // Row gathers 16 bytes at a time where rows allow (candle's `index_select` copies element
    // by element: it was a quarter of a 26B-A4B prefill).
    let gather = |src: &Tensor, rows: Tensor| -> Result<Tensor> {
        match gather_rows(src, &rows)? {
            Some(t) => Ok(t),
            None => Ok(src.index_select(&rows, 0)?),
        }
    };
    let (_, k) = idx.dims2()?;
    let picks = idx.flatten_all()?.to_vec1::<u32>()?;
    let n_experts = experts.gate_up.count()?;
    let mut groups: Vec<Vec<u32>> = vec![Vec::new(); n_experts];
    for (p, &e) in picks.iter().enumerate() {
        let e = e as usize;
        if e >= n_experts {
            return Err(KernelError::Config {
                field: "expert",
                reason: format!("router picked expert {e} of {n_experts}"),
            });
        }
        groups[e].push(p as u32);
    }
    let dev = x.device();
    let h = x.dim(1)?;
    let width = experts.width;
    let gelu_halves = |gu: &Tensor, dim: usize| -> Result<Tensor> {
        gelu_mul(&gu.narrow(dim, 0, width)?, &gu.narrow(dim, width, width)?)
    };
    let u32s = |v: Vec<u32>| -> Result<Tensor> {
        let n = v.len();
        Ok(Tensor::from_vec(v, n, dev)?)
    };
    // Output rows in some slot order, and the slot of each pair for the way back.
    let mut slot_of = vec![0u32; picks.len()];
    // Packed stacks of which at least half the experts are picked are dequantized whole, two
    // launches, and take the dense experts' padded products: the product per picked expert
    // costs about eight launches an expert, which leaves a prefill bound by the host.
    let picked = groups.iter().filter(|g| !g.is_empty()).count();
    let whole = |w: &ExpertWeights| -> Result<Option<Tensor>> {
        match w {
            ExpertWeights::Packed { weight, experts: e } if 2 * picked >= n_experts => {
                let out = weight.out_dim() / e;
                let dense = weight.dequantize(x.dtype())?;
                Ok(Some(dense.reshape((*e, out, weight.in_dim()))?))
            }
            _ => Ok(None),
        }
    };
    let dequantized = match (whole(experts.gate_up)?, whole(experts.down)?) {
        (Some(g), Some(d)) => Some((ExpertWeights::Dense(g), ExpertWeights::Dense(d))),
        _ => None,
    };
    let (gate_up_w, down_w) = match &dequantized {
        Some((g, d)) => (g, d),
        None => (experts.gate_up, experts.down),
    };
    // Dense stacks whose padding to the longest group stays small run padded: cuBLAS's strided
    // batched product is faster per row than its grouped one.
    let longest = groups.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let dense = matches!(
        (gate_up_w, down_w),
        (ExpertWeights::Dense(_), ExpertWeights::Dense(_))
    );
    let pad_pct = crate::kernels::policy::current().moe_padded_max_pct;
    let padded = dense && n_experts * longest * 100 <= pad_pct * picks.len().max(1);
    if !padded && crate::kernels::cuda::grouped_gemm::available() {
        let mut rows = Vec::with_capacity(picks.len());
        let (mut sizes, mut picked_experts) = (Vec::new(), Vec::new());
        for (e, g) in groups.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            for &p in g {
                slot_of[p as usize] = rows.len() as u32;
                rows.push(p / k as u32);
            }
            sizes.push(g.len());
            picked_experts.push(e);
        }
        let xs = gather(x, u32s(rows)?)?;
        let product = |x: &Tensor, w: &ExpertWeights| -> Result<Option<Tensor>> {
            Ok(match w {
                ExpertWeights::Dense(stack) => {
                    let weights = BlockWeights::Stack {
                        stack,
                        experts: &picked_experts,
                    };
                    grouped_matmul(x, &sizes, weights)?
                }
                ExpertWeights::Packed { weight, experts } => {
                    let each = picked_experts
                        .iter()
                        .map(|&e| expert_rows(weight, *experts, e)?.dequantize(x.dtype()))
                        .collect::<Result<Vec<_>>>()?;
                    grouped_matmul(x, &sizes, BlockWeights::Each(&each))?
                }
            })
        };
        if let Some(gu) = product(&xs, gate_up_w)? {
            if let Some(y) = product(&gelu_halves(&gu, 1)?, down_w)? {
                return Ok(moe_mix_rows(&y, &u32s(slot_of)?, mix)?);
            }
        }
    }
    let stacked = match (gate_up_w, down_w) {
        (ExpertWeights::Dense(gate_up), ExpertWeights::Dense(down)) => {
            // Row of each padded slot (token of the pair, or 0 for padding).
            let mut rows = vec![0u32; n_experts * longest];
            for (e, g) in groups.iter().enumerate() {
                for (i, &p) in g.iter().enumerate() {
                    rows[e * longest + i] = p / k as u32;
                    slot_of[p as usize] = (e * longest + i) as u32;
                }
            }
            let n_slots = rows.len();
            let x_pad = gather(x, u32s(rows)?)?.reshape((n_experts, longest, h))?;
            let gu = x_pad.matmul(&gate_up.transpose(1, 2)?)?; // [E, L, 2I]
            let y_pad = gelu_halves(&gu, 2)?.matmul(&down.transpose(1, 2)?)?; // [E, L, H]
            y_pad.reshape((n_slots, h))?
        }
        _ => {
            let mut ys = Vec::new();
            let mut slot = 0u32;
            for (e, g) in groups.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
                let rows: Vec<u32> = g.iter().map(|&p| p / k as u32).collect();
                let xe = gather(x, u32s(rows)?)?;
                let gu = gate_up_w.product(e, &xe)?;
                ys.push(down_w.product(e, &gelu_halves(&gu, 1)?)?);
                for &p in g {
                    slot_of[p as usize] = slot;
                    slot += 1;
                }
            }
            Tensor::cat(&ys, 0)?
        }
    };
    // The mix reads each pair's row where the products left it.
    Ok(moe_mix_rows(&stacked.contiguous()?, &u32s(slot_of)?, mix)?)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// The composition the Metal path runs around its routed products (pair order, weighted
    /// sum per token) equals the host path's grouping by expert, with the products taken from
    /// the host path's per-expert product pair by pair.
    #[test]
    fn the_device_composition_equals_the_host_grouping() -> Result<()> {
        let (n_experts, top_k, hidden, width, tokens) = (8, 3, 64, 16, 5);
        let dev = Device::Cpu;
        let gate_up = ExpertWeights::Dense(Tensor::randn(
            0f32,
            0.2,
            (n_experts, 2 * width, hidden),
            &dev,
        )?);
        let down =
            ExpertWeights::Dense(Tensor::randn(0f32, 0.2, (n_experts, hidden, width), &dev)?);
        let experts = Experts {
            gate_up: &gate_up,
            down: &down,
            width,
        };
        let x = Tensor::randn(0f32, 1.0, (tokens, hidden), &dev)?;
        let logits = Tensor::randn(0f32, 1.0, (tokens, n_experts), &dev)?.to_vec2::<f32>()?;
        let scale: Vec<f32> = (0..n_experts).map(|e| 0.5 + e as f32 / 8.0).collect();
        let routes: Vec<Vec<(usize, f32)>> = logits
            .iter()
            .map(|row| moe_route_row(row, top_k, &scale))
            .collect();
        let want = grouped_on_host(&x, &routes, &experts)?;

        let pairs: Vec<(usize, f32)> = routes.concat();
        let w: Vec<f32> = pairs.iter().map(|&(_, w)| w).collect();
        let weights = Tensor::from_vec(w, (tokens, top_k), &dev)?;
        let product = |x: &Tensor, per_token: bool, stack: &ExpertWeights| {
            let rows = pairs
                .iter()
                .enumerate()
                .map(|(p, &(e, _))| {
                    let row = if per_token { p / top_k } else { p };
                    stack.product(e, &x.narrow(0, row, 1)?)
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Some(Tensor::cat(&rows, 0)?))
        };
        let got = routed_layer(&x, &weights, top_k, &experts, product)?.ok_or(
            crate::kernels::KernelError::Config {
                field: "test",
                reason: "no product".into(),
            },
        )?;
        let diff = (got - &want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let size = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(
            diff <= 1e-5 * size.max(1.0),
            "diff {diff} (output max {size})"
        );
        Ok(())
    }
}
