//! Launch plans of the Metal kernels in `qkernels.metal`: parameters, grids, kernel names and
//! operand layouts, free of Metal types. The Metal launcher (`launch`, `metal` feature) binds
//! them to buffers; the CPU emulation test (`tests/metal_emulation.rs`) runs the same plans through the same
//! kernel source compiled as C++, so what a Mac would dispatch is what the test checks.

// Without the `metal` feature only the emulation tests use the plans.
#![cfg_attr(not(feature = "metal"), allow(dead_code))]

use candle_core::{DType, Tensor};

use crate::kernels::layout::{last_dim_contiguous, scales_and_biases};
use crate::kernels::plan::{
    split_keys, AttentionGeometry, KeySplit, QmatParams, QsdpaParams, SideStrides, QSDPA_HEAD_DIMS,
    QSDPA_WARPS,
};
use crate::kernels::QueryPlan;
use crate::kernels::{KernelError, KeyPositions, PackedAffine, QuantBits};

/// Query rows a threadgroup of `qsdpa_*` takes (`QS_NQ` in `qkernels.metal`).
pub(crate) const ATTENTION_ROWS: usize = 4;
/// Threads a threadgroup of `qsdpa_*` (`QS_WARPS` simdgroups of 32).
pub const ATTENTION_THREADS: usize = QSDPA_WARPS * 32;
/// Threads a threadgroup of `qsdpa_combine_*` (its loop over head dims steps by this).
pub const COMBINE_THREADS: usize = 128;
/// Output rows a threadgroup of `qmatvec_*` computes, one per simdgroup (`QMV_WARPS`).
pub const MATVEC_WARPS: usize = 8;
/// Activation rows the matvec kernels are instantiated for (a launch takes the first that fits).
pub const MATVEC_ROW_VARIANTS: [usize; 4] = [1, 2, 4, 8];
/// Threads a threadgroup of `dequant_*`.
pub const DEQUANT_THREADS: usize = 256;
/// Threadgroups a decode attention launch aims for across its key splits. Apple GPUs have 8-80
/// cores and expose no count to query; 256 groups keep the largest busy while a 1k-key view
/// still splits only four ways (see [`SPLIT_MIN_KEYS`]).
pub(crate) const TARGET_GROUPS: usize = 256;
/// Fewest keys a split takes, so short views are not cut into splits that cost more to combine
/// than they save.
pub(crate) const SPLIT_MIN_KEYS: usize = 256;
/// Longest query the fused attention kernel takes; longer ones (prefill) dequantize and run the
/// dense path, as on CUDA.
pub(crate) const MAX_FUSED_Q_LEN: usize = 16;

/// The kernels' name for an element type (`f32`, `f16`, `bf16`).
pub(crate) fn type_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// One side (K or V) as `qsdpa_*` reads it: codes with their head/key strides in words, and
/// scales and biases in the queries' dtype sharing one stride pair. Tensors keep their layouts'
/// start offsets, which the launcher turns into buffer offsets.
pub struct KvSide {
    pub codes: Tensor,
    pub scales: Tensor,
    pub biases: Tensor,
    strides: SideStrides,
}

fn kv_side(p: &PackedAffine, dtype: DType) -> candle_core::Result<KvSide> {
    let (codes, codes_sh, codes_sk) = last_dim_contiguous(&p.codes)?;
    let (scales, biases, sc_sh, sc_sk) = scales_and_biases(p, dtype)?;
    Ok(KvSide {
        codes,
        scales,
        biases,
        strides: SideStrides {
            codes_sh,
            codes_sk,
            sc_sh,
            sc_sk,
        },
    })
}

/// One sequence's fused attention launch: `kernel` over `groups` threadgroups of
/// [`ATTENTION_THREADS`], then, with more than one key split, `combine` over one threadgroup
/// of [`COMBINE_THREADS`] per query row (`combine_groups`).
///
/// Buffers, in the kernels' order: 0 `params`, 1 `q`, 2-4 K codes/scales/biases, 5-7 V
/// codes/scales/biases, 8 the position table (any buffer when `table` is empty), 9 the output
/// `[1, n_heads, q_len, head_dim]` in `q`'s dtype, 10 and 11 the split partials (f32,
/// `partial_ml_len` and `partial_acc_len` elements; any buffer without splits).
pub struct AttentionLaunch {
    pub params: QsdpaParams,
    pub q: Tensor,
    pub k: KvSide,
    pub v: KvSide,
    pub table: Vec<u32>,
    pub kernel: String,
    pub groups: [usize; 3],
    pub combine: Option<String>,
    pub combine_groups: usize,
    pub partial_ml_len: usize,
    pub partial_acc_len: usize,
    pub out_dims: [usize; 4],
}

/// Plans attention of `q` `[1, n_heads, q_len, head_dim]` over packed K/V of one sequence
/// (shapes already checked by the dispatcher), aiming for `target_groups` threadgroups.
///
/// # Errors
/// [`KernelError::Shape`] for a head dim without a kernel, K and V of different bits or group
/// sizes, or positions beyond `u32`; [`KernelError::DType`] for a non-float query.
pub fn plan_attention(
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    plan: &QueryPlan,
    target_groups: usize,
) -> Result<AttentionLaunch, KernelError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.codes.dims4()?;
    let dtype = q.dtype();
    let tn = type_name(dtype).ok_or(KernelError::DType {
        what: "Metal attention query",
        expected: DType::F32,
        found: dtype,
    })?;
    let bits = k.bits.bits();
    if !QSDPA_HEAD_DIMS.contains(&head_dim) || bits != v.bits.bits() || k.group_size != v.group_size
    {
        return Err(KernelError::Shape {
            what: "Metal fused attention (head_dim, K bits, V bits, K group, V group)",
            expected: format!(
                "head_dim in {QSDPA_HEAD_DIMS:?}, K and V of one bit width and group"
            ),
            found: vec![head_dim, bits, v.bits.bits(), k.group_size, v.group_size],
        });
    }
    let ks = kv_side(k, dtype)?;
    let vs = kv_side(v, dtype)?;
    let geometry = AttentionGeometry {
        n_heads,
        kv_heads,
        q_len,
        head_dim,
        keys,
        group_size: k.group_size,
    };
    let (mut params, table) = QsdpaParams::for_sequence(
        "Metal fused attention (keys, last query position)",
        &geometry,
        ks.strides,
        vs.strides,
        positions,
        plan,
    )?;
    let rows = n_heads / kv_heads.max(1) * q_len;
    let row_groups = rows.div_ceil(ATTENTION_ROWS);
    let (n_split, per) = split_keys(
        keys.max(1),
        row_groups * kv_heads,
        target_groups,
        SPLIT_MIN_KEYS,
    );
    params.set_split(KeySplit {
        n: n_split,
        per,
        long: 0,
    })?;
    let total_rows = kv_heads * rows;
    let (partial_ml_len, partial_acc_len) = if n_split > 1 {
        (n_split * total_rows * 2, n_split * total_rows * head_dim)
    } else {
        (0, 0)
    };
    Ok(AttentionLaunch {
        params,
        q: q.contiguous()?,
        k: ks,
        v: vs,
        table,
        kernel: format!("qsdpa_{tn}_{head_dim}_{bits}"),
        groups: [row_groups, kv_heads, n_split],
        combine: (n_split > 1).then(|| format!("qsdpa_combine_{tn}")),
        combine_groups: total_rows,
        partial_ml_len,
        partial_acc_len,
        out_dims: [1, n_heads, q_len, head_dim],
    })
}

/// A quantized matrix-vector launch: `kernel` over `groups` threadgroups of
/// `MATVEC_WARPS * 32` threads. Buffers: 0 `params`, 1 `x` `[rows, in]` contiguous, 2 codes,
/// 3 scales, 4 biases (all contiguous), 5 `y` `[rows, out]` in `x`'s dtype.
pub struct MatvecLaunch {
    pub params: QmatParams,
    pub kernel: String,
    pub groups: usize,
}

/// Plans `x` `[rows, in]` · `Wᵀ` on the matvec kernel, or `None` where it does not apply: more
/// rows than [`MATVEC_ROW_VARIANTS`] holds, a non-float activation or scale dtype, or an input
/// width that is not a whole number of 4-word chunks (the kernel reads 128 bits a step).
pub fn plan_matvec(rows: usize, x_dtype: DType, w: &PackedAffine) -> Option<MatvecLaunch> {
    let tn = type_name(x_dtype)?;
    let sn = type_name(w.scales.dtype())?;
    let bits = w.bits.bits();
    let variant = *MATVEC_ROW_VARIANTS.iter().find(|&&r| r >= rows)?;
    if rows == 0 || !w.in_dim().is_multiple_of(128 / bits) {
        return None;
    }
    Some(MatvecLaunch {
        params: QmatParams {
            rows: u32::try_from(rows).ok()?,
            out_dim: u32::try_from(w.out_dim()).ok()?,
            in_dim: u32::try_from(w.in_dim()).ok()?,
            group_size: u32::try_from(w.group_size).ok()?,
        },
        kernel: format!("qmatvec_{tn}_{sn}_{bits}_{variant}"),
        groups: w.out_dim().div_ceil(MATVEC_WARPS),
    })
}

/// A dequantization launch: `kernel` over `threads` threads in all (one per code word of the
/// output), in threadgroups of [`DEQUANT_THREADS`]. Buffers: 0 `params`, 1 codes, 2 scales,
/// 3 biases (all contiguous), 4 the row index (`u32`, `params.rows` entries; any buffer when
/// `use_idx` is 0), 5 `use_idx`, 6 the dense `[params.rows, in]` output in `dtype`.
pub struct DequantLaunch {
    pub params: QmatParams,
    pub kernel: String,
    pub threads: usize,
    pub use_idx: u32,
}

/// Plans dequantizing all of `w` to `dtype`, or `None` for a non-float dtype.
pub fn plan_dequant(w: &PackedAffine, dtype: DType) -> Option<DequantLaunch> {
    plan_dequant_rows(w, None, dtype)
}

/// Plans dequantizing rows of `w` to `dtype`: the rows a `u32` index of `rows` entries names
/// (the embedding gather), or every row with `None`. `None` for a non-float dtype.
pub fn plan_dequant_rows(
    w: &PackedAffine,
    rows: Option<usize>,
    dtype: DType,
) -> Option<DequantLaunch> {
    let tn = type_name(dtype)?;
    let sn = type_name(w.scales.dtype())?;
    let bits = w.bits.bits();
    let out_rows = rows.unwrap_or(w.out_dim());
    Some(DequantLaunch {
        params: QmatParams {
            rows: u32::try_from(out_rows).ok()?,
            out_dim: u32::try_from(w.out_dim()).ok()?,
            in_dim: u32::try_from(w.in_dim()).ok()?,
            group_size: u32::try_from(w.group_size).ok()?,
        },
        kernel: format!("dequant_{tn}_{sn}_{bits}"),
        threads: out_rows * w.in_dim() * bits / 32,
        use_idx: u32::from(rows.is_some()),
    })
}

/// Threads a threadgroup of `quant_*` (one thread per group of elements).
pub const QUANT_THREADS: usize = 256;

/// A quantization launch: `kernel` over `threads` threads in all (one per quantization group),
/// in threadgroups of [`QUANT_THREADS`]. Buffers: 0 `params` (`rows`, `in_dim` = the row
/// length, `group_size`), 1 `x` `[rows, in_dim]` contiguous, 2 codes `[rows, in_dim * bits /
/// 32]` `u32`, 3 scales and 4 biases `[rows, in_dim / group_size]` in `x`'s dtype.
pub struct QuantLaunch {
    pub params: QmatParams,
    pub kernel: String,
    pub threads: usize,
}

/// Plans quantizing `rows` rows of `dim` elements of `dtype` to `bits` in groups of
/// `group_size` (checked by the caller), or `None` for a non-float dtype or sizes past `u32`.
pub fn plan_quantize(
    rows: usize,
    dim: usize,
    bits: QuantBits,
    group_size: usize,
    dtype: DType,
) -> Option<QuantLaunch> {
    let tn = type_name(dtype)?;
    Some(QuantLaunch {
        params: QmatParams {
            rows: u32::try_from(rows).ok()?,
            out_dim: u32::try_from(rows).ok()?,
            in_dim: u32::try_from(dim).ok()?,
            group_size: u32::try_from(group_size).ok()?,
        },
        kernel: format!("quant_{tn}_{}", bits.bits()),
        threads: rows.checked_mul(dim / group_size.max(1))?,
    })
}

/// A `Q4_1` dequantization launch: `kernel` over `threads` threads in all (one per 32-element
/// block), in threadgroups of [`DEQUANT_THREADS`]. Buffers: 0 `params` (`rows`, `in_dim`), 1
/// the blocks (`rows * in_dim / 32` of 20 bytes), 2 the dense `[rows, in_dim]` output.
pub struct DequantQ41Launch {
    pub params: QmatParams,
    pub kernel: String,
    pub threads: usize,
}

/// Plans dequantizing `rows` rows of `in_dim` (a multiple of 32) held as `Q4_1` blocks to
/// `dtype`, or `None` for a non-float dtype or sizes past `u32`.
pub fn plan_dequant_q41(rows: usize, in_dim: usize, dtype: DType) -> Option<DequantQ41Launch> {
    let tn = type_name(dtype)?;
    Some(DequantQ41Launch {
        params: QmatParams {
            rows: u32::try_from(rows).ok()?,
            out_dim: u32::try_from(rows).ok()?,
            in_dim: u32::try_from(in_dim).ok()?,
            group_size: 32,
        },
        kernel: format!("dequant_q41_{tn}"),
        threads: rows.checked_mul(in_dim / 32)?,
    })
}

/// Parameters of the MoE kernels (`MoeParams` in `qkernels.metal`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoeParams {
    /// (token, pick) pairs: `tokens * top_k`.
    pub pairs: u32,
    /// Picks per token.
    pub top_k: u32,
    /// Experts in the stack.
    pub experts: u32,
    /// Output rows of one expert.
    pub out_dim: u32,
    /// Input width of one expert.
    pub in_dim: u32,
    /// Elements per scale/bias group (packed experts).
    pub group_size: u32,
    /// 1: a pair's activation row is its token's (`pair / top_k`); 0: its own.
    pub x_per_token: u32,
    /// Padding to 32 bytes.
    pub pad: u32,
}

/// Threads a threadgroup of `moe_route_f32` (one per token).
pub const MOE_ROUTE_THREADS: usize = 64;
/// Threads of the single `moe_group` threadgroup (thread 0 works).
pub const MOE_GROUP_THREADS: usize = 32;
/// Most picks a token may make (bounds the routing kernel's `top_k * experts` selection).
pub const MOE_MAX_TOP_K: usize = 32;

/// The routing and grouping launches of one MoE layer: `moe_route_f32` over `route_groups`
/// threadgroups of [`MOE_ROUTE_THREADS`] (buffers: 0 `params`, 1 the logits `[tokens,
/// experts]` f32 contiguous, 2 the per-expert scale `[experts]` f32, 3 the picks `[tokens,
/// top_k]` u32, 4 their weights `[tokens, top_k]` f32), then `moe_group` over one threadgroup
/// of [`MOE_GROUP_THREADS`] (buffers: 0 `params`, 1 the picks, 2 `offsets` `[experts + 1]`, 3
/// `order` `[pairs]`, 4 `used` `[experts + 1]`, 5 `cursor` `[experts]` scratch, all u32).
#[derive(Debug, Clone)]
pub struct MoeRouteLaunch {
    pub params: MoeParams,
    pub route_kernel: &'static str,
    pub route_groups: usize,
    pub group_kernel: &'static str,
}

/// Plans routing `tokens` tokens over `experts` experts with `top_k` picks each, or `None`
/// where the kernels do not apply (no picks, more picks than experts or than
/// [`MOE_MAX_TOP_K`], sizes past `u32`).
pub fn plan_moe_route(tokens: usize, experts: usize, top_k: usize) -> Option<MoeRouteLaunch> {
    if top_k == 0 || top_k > experts || top_k > MOE_MAX_TOP_K {
        return None;
    }
    Some(MoeRouteLaunch {
        params: MoeParams {
            pairs: u32::try_from(tokens.checked_mul(top_k)?).ok()?,
            top_k: u32::try_from(top_k).ok()?,
            experts: u32::try_from(experts).ok()?,
            ..MoeParams::default()
        },
        route_kernel: "moe_route_f32",
        route_groups: tokens.div_ceil(MOE_ROUTE_THREADS),
        group_kernel: "moe_group",
    })
}

/// An expert stack as the routed-product kernels read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertFormat {
    /// `[experts * out, in]` in the activations' dtype.
    Dense,
    /// MLX affine codes `[experts * out, in * bits / 32]` with scales and biases
    /// `[experts * out, in / group_size]` of `scale_dtype`.
    Packed {
        /// Bit width of the codes.
        bits: QuantBits,
        /// Elements per group.
        group_size: usize,
        /// The dtype of the scales and biases.
        scale_dtype: DType,
    },
}

/// A routed expert product: `kernel` over `groups` threadgroups of `MATVEC_WARPS * 32`
/// threads (x: blocks of [`MATVEC_WARPS`] output rows; y: the picked experts, at most
/// `min(experts, pairs)`). Packed (`moe_qmatvec_*`) buffers: 0 `params`, 1 `x` contiguous,
/// 2 codes, 3 scales, 4 biases, 5 `offsets`, 6 `order`, 7 `used`, 8 `y` `[pairs, out]` in
/// `x`'s dtype. Dense (`moe_matvec_*`): 0 `params`, 1 `x`, 2 the weights, 3 `offsets`, 4
/// `order`, 5 `used`, 6 `y`.
#[derive(Debug, Clone)]
pub struct MoeProductLaunch {
    pub params: MoeParams,
    pub kernel: String,
    pub groups: [usize; 2],
}

/// Plans the product of every routed pair with its expert (`out` rows of `in_dim` each, in a
/// stack of `experts`): activations per token (`x_per_token`, `[pairs / top_k, in_dim]`) or per
/// pair. `None` for a dtype without a kernel, an input width that is not a whole number of
/// 32-element steps, or a group that does not divide it.
pub fn plan_moe_product(
    route: &MoeParams,
    out: usize,
    in_dim: usize,
    x_dtype: DType,
    x_per_token: bool,
    format: ExpertFormat,
) -> Option<MoeProductLaunch> {
    let tn = type_name(x_dtype)?;
    if in_dim == 0 || !in_dim.is_multiple_of(32) {
        return None;
    }
    let (kernel, group_size) = match format {
        ExpertFormat::Dense => (format!("moe_matvec_{tn}"), 0),
        ExpertFormat::Packed {
            bits,
            group_size,
            scale_dtype,
        } => {
            if group_size == 0
                || !in_dim.is_multiple_of(group_size)
                || group_size % (32 / bits.bits()) != 0
            {
                return None;
            }
            let sn = type_name(scale_dtype)?;
            (format!("moe_qmatvec_{tn}_{sn}_{}", bits.bits()), group_size)
        }
    };
    Some(MoeProductLaunch {
        params: MoeParams {
            out_dim: u32::try_from(out).ok()?,
            in_dim: u32::try_from(in_dim).ok()?,
            group_size: u32::try_from(group_size).ok()?,
            x_per_token: u32::from(x_per_token),
            ..*route
        },
        kernel,
        groups: [
            out.div_ceil(MATVEC_WARPS),
            (route.experts as usize).min(route.pairs as usize),
        ],
    })
}
