//! Which implementation each Metal entry point picks for an operand, decided in one place and
//! free of Metal types: the dispatchers in [`super`] match on these routes, and the tests
//! enumerate them for every weight format, cache kind and query count
//! ([`decode_and_prefill_steps`]) to show that a Metal forward reads nothing back to the host
//! but what the sampler needs.

use candle_core::DType;

use super::plan::{type_name, MATVEC_ROW_VARIANTS, MAX_FUSED_Q_LEN};
use crate::kernels::qmatmul::MATVEC_MAX_ROWS;
use crate::kernels::QuantBits;

/// How one operation runs on a Metal device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// candle's `Q4_1` quantized matmul or row gather (an exactly-mapped 4-bit matrix).
    CandleQ4_1,
    /// One of the crate's kernels in `qkernels.metal`, possibly followed by candle's dense ops
    /// on the device.
    Kernel(Family),
    /// candle's own Metal ops only (dense weights and K/V).
    Candle,
    /// Reads device memory back to the host (the fallback with the crate's kernels off, or a
    /// dtype no kernel takes).
    Host,
}

/// The kernel families of `qkernels.metal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qmatvec_*`: packed matrix times up to 8 activation rows.
    Qmatvec,
    /// `dequant_*`: packed rows to dense ones (all rows, or rows by a device index), then
    /// candle's dense matmul or attention where a product follows.
    Dequant,
    /// `quant_*`: MLX affine quantization.
    Quant,
    /// `qsdpa_*` and `qsdpa_combine_*`: fused attention over packed K/V.
    Qsdpa,
    /// `moe_route_f32`, `moe_group`, `moe_qmatvec_*` and `moe_matvec_*`: the router's top-k,
    /// the pairs grouped by expert, and the routed expert products, all on the device.
    Moe,
}

/// A packed weight as the routes see it.
#[derive(Debug, Clone, Copy)]
pub struct WeightFormat {
    /// Bit width of the codes.
    pub bits: QuantBits,
    /// Whether the matrix carries an exact `Q4_1` form
    /// ([`crate::kernels::PackedAffine::with_candle_q4_1`]).
    pub q4_1: bool,
    /// The dtype of its scales and biases.
    pub scale_dtype: DType,
    /// Its input width.
    pub in_dim: usize,
}

/// `x` `[rows, in]` · `Wᵀ` for a packed `W` (see `super::qmatmul`).
///
/// An exactly-mapped 4-bit matrix takes candle's `Q4_1` matrix-vector kernel for up to
/// [`MATVEC_MAX_ROWS`] rows (f32 activations); more rows take the dequantize kernel and
/// candle's dense matmul like any packed matrix, because candle's tiled `Q4_1` GEMM stages
/// activations and weights in half precision (on the CPU, rounding both to f16 before the
/// products moves the fixtures' first-step log-probs by 0.08).
pub fn product(rows: usize, x_dtype: DType, w: WeightFormat, kernels_on: bool) -> Route {
    if w.q4_1 && rows <= MATVEC_MAX_ROWS {
        return Route::CandleQ4_1;
    }
    if !kernels_on || type_name(w.scale_dtype).is_none() || type_name(x_dtype).is_none() {
        return Route::Host;
    }
    let fits_matvec = rows > 0
        && MATVEC_ROW_VARIANTS.iter().any(|&r| r >= rows)
        && w.in_dim.is_multiple_of(128 / w.bits.bits());
    if fits_matvec {
        Route::Kernel(Family::Qmatvec)
    } else {
        Route::Kernel(Family::Dequant)
    }
}

/// Rows of a packed embedding table gathered by device ids (see `qembedding_checked_ids`).
pub fn gather(dtype: DType, w: WeightFormat, kernels_on: bool) -> Route {
    if w.q4_1 {
        Route::CandleQ4_1
    } else if kernels_on && type_name(w.scale_dtype).is_some() && type_name(dtype).is_some() {
        Route::Kernel(Family::Dequant)
    } else {
        Route::Host
    }
}

/// Attention of `q_len` queries over packed K/V (see `super::attend_packed`).
pub fn packed_attention(q_len: usize, dtype: DType, kernels_on: bool) -> Route {
    if !kernels_on || type_name(dtype).is_none() {
        Route::Host
    } else if q_len <= MAX_FUSED_Q_LEN {
        Route::Kernel(Family::Qsdpa)
    } else {
        Route::Kernel(Family::Dequant)
    }
}

/// New K/V quantized into a packed cache (see `super::quantize`).
pub fn kv_quantize(dtype: DType, kernels_on: bool) -> Route {
    if kernels_on && type_name(dtype).is_some() {
        Route::Kernel(Family::Quant)
    } else {
        Route::Host
    }
}

/// A MoE layer's routing and expert products (see `ops::moe`), for expert stacks in `gate_up`
/// and `down` (`None`: dense, in the activations' dtype): the `moe_*` kernels when the kernels
/// are on and take the dtypes and widths (input widths in whole 32-element steps), else the
/// host groups tokens by expert.
pub fn moe(
    dtype: DType,
    gate_up: Option<WeightFormat>,
    down: Option<WeightFormat>,
    kernels_on: bool,
) -> Route {
    let fits = |w: Option<WeightFormat>| {
        w.is_none_or(|w| type_name(w.scale_dtype).is_some() && w.in_dim % 32 == 0)
    };
    if kernels_on && type_name(dtype).is_some() && fits(gate_up) && fits(down) {
        Route::Kernel(Family::Moe)
    } else {
        Route::Host
    }
}

/// The KV cache kinds as the routes see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheKind {
    /// Dense K/V (the simple and rotating caches).
    Dense,
    /// Affine-quantized K/V of `bits` (the quantized cache once packed).
    Packed(QuantBits),
}

/// What a forward step's model looks like to the routes.
#[derive(Debug, Clone, Copy)]
pub struct StepModel {
    /// The packed weights' format (`None`: a dense checkpoint).
    pub weights: Option<WeightFormat>,
    /// Whether the model has per-layer embeddings (E2B, E4B).
    pub ple: bool,
    /// Whether the model has MoE experts (26B-A4B).
    pub moe: bool,
    /// The activation dtype.
    pub dtype: DType,
}

/// One operation of a forward step and its route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepOp {
    /// What the operation does (`"q/k/v product"`, `"attention"`, ...).
    pub op: &'static str,
    /// How it runs.
    pub route: Route,
}

/// The operations of one layer-by-layer forward of `q_len` tokens (a decode step at 1, a
/// prefill chunk beyond) on a Metal device, in order, with the route each takes. MoE routing
/// and expert products take [`moe`]; where that is the host (the kernels off), the expert
/// products are views of the expert stack (`narrow_rows`) through [`product`].
pub fn decode_and_prefill_steps(
    model: &StepModel,
    cache: CacheKind,
    q_len: usize,
    kernels_on: bool,
) -> Vec<StepOp> {
    let mut ops = Vec::new();
    let mut push = |op, route| ops.push(StepOp { op, route });
    let weight = |w: Option<WeightFormat>, rows: usize| match w {
        Some(w) => product(rows, model.dtype, w, kernels_on),
        None => Route::Candle,
    };
    let table = match model.weights {
        Some(w) => gather(model.dtype, w, kernels_on),
        None => Route::Candle,
    };
    push("embedding gather", table);
    if model.ple {
        push("PLE gather", table);
        push("PLE projection", weight(model.weights, q_len));
    }
    push("q/k/v product", weight(model.weights, q_len));
    match cache {
        CacheKind::Dense => {
            push("K/V write", Route::Candle);
            push("attention", Route::Candle);
        }
        CacheKind::Packed(_) => {
            push("K/V quantize", kv_quantize(model.dtype, kernels_on));
            push(
                "attention",
                packed_attention(q_len, model.dtype, kernels_on),
            );
        }
    }
    push("o product", weight(model.weights, q_len));
    push("MLP gate/up product", weight(model.weights, q_len));
    push("MLP down product", weight(model.weights, q_len));
    if model.moe {
        // Expert stacks keep the MLX packing (no `Q4_1` form).
        let expert = model.weights.map(|w| WeightFormat { q4_1: false, ..w });
        let routed = moe(model.dtype, expert, expert, kernels_on);
        push("MoE routing", routed);
        if routed == Route::Host {
            // Each expert takes the tokens routed to it: one row in a decode step.
            push("MoE expert products", weight(expert, q_len));
        } else {
            push("MoE expert products", routed);
        }
    }
    push("tied head", weight(model.weights, 1));
    ops
}
