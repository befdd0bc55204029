//! The routed experts of an MoE block on CUDA (`moe.cu`): router top-k with the softmax mix
//! weights, the expert products grouped by expert (dense or MLX-packed experts, optionally
//! with the GeGLU gate computed inside), and the weighted sum of each token's picks.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::device::{
    as_rows, bind, by_dtype, check_dtype, contiguous_aligned16, cuda_dev, grid_stride, tn, u32_of,
    wrap,
};
use super::kernel_cache::{load_kernel, MOE};
use crate::kernels::PackedAffine;

/// Warps per grouped-matvec block (`GMV_WARPS`).
const GMV_WARPS: usize = 8;
/// Output rows a warp of the packed grouped matvec computes (`R` in `GROUPED_QMV_INST`).
const GMV_PACKED_ROWS: usize = 4;
/// Fewest pairs of a call with fewer pairs than experts that take the packed kernels decoding
/// each code once for up to 4 pairs (`r4p4`); from as many pairs as experts they always do
/// (most picked experts then have several pairs, and decoding their codes once per pair would
/// bound the kernel). Below, from two tokens on, a batch's tokens often share experts. A block
/// whose expert has a lone pair decodes it alone.
const GMV_MULTI_MIN_PAIRS: usize = 16;
/// Output rows a warp of the tensor-core kernels computes (one m16n8 tile's 16).
const GMV_TC_ROWS: usize = 16;
/// Output rows a warp of the dense grouped matvec computes for short rows (`_r4` kernels).
const GMV_DENSE_SHORT_ROWS: usize = 4;
/// Longest input row (elements) the dense `_r4` kernels take: up to it one row leaves a lane
/// at most four 16-byte loads, too few to hide the memory latency (a down product of 26B-A4B
/// reads 704 inputs, 352 on each of 2 GPUs). Longer rows keep one row a warp.
const GMV_DENSE_SHORT_MAX_IN: usize = 1024;
/// Experts per lane of the router kernel (`ROUTE_MAX_PER_LANE`): at most 512 experts.
const ROUTE_MAX_PER_LANE: usize = 16;

/// `struct RouteParams` in `moe.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct RouteParams {
    tokens: u32,
    experts: u32,
    top_k: u32,
    pad_: u32,
}

/// `struct GroupedMvParams` in `moe.cu`.
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

// SAFETY: `#[repr(C)]` plain integers, passed by value, read by the kernels with the same field
// layout.
unsafe impl DeviceRepr for RouteParams {}
unsafe impl DeviceRepr for GroupedMvParams {}

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
    let func = load_kernel(&dev, &format!("moe_route_{}", tn(dtype)?), &MOE)?;
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
    weights: &PackedAffine,
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
    weights: &PackedAffine,
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
    Packed(&'a PackedAffine, usize),
}

/// How a grouped product reads its weights.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Decode {
    /// On CUDA cores, once a pair (packed: `r4`; dense experts always).
    EachPair,
    /// Packed, on CUDA cores: each code decoded once for up to four pairs of an expert (`r4p4`).
    FourPairs,
    /// On the tensor cores: each weight read (and for packed experts dequantized to a 16-bit
    /// fragment) once for up to 32 pairs of an expert (`moe_tc.cuh`).
    TensorCores,
}

impl ExpertStack<'_> {
    /// Output rows one warp computes (`Rows::R` of the kernel's row reader) for rows of
    /// `in_dim` inputs.
    fn rows_per_warp(&self, in_dim: usize, decode: Decode) -> usize {
        match self {
            _ if decode == Decode::TensorCores => GMV_TC_ROWS,
            ExpertStack::Dense(_) if in_dim <= GMV_DENSE_SHORT_MAX_IN => GMV_DENSE_SHORT_ROWS,
            ExpertStack::Dense(_) => 1,
            ExpertStack::Packed(..) => GMV_PACKED_ROWS,
        }
    }

    /// Whether the tensor-core kernels take these weights for activations of `dtype`: 16-bit
    /// activations, and dense rows of a multiple of 32 inputs, or 4-bit codes whose groups
    /// tile 32-input slices with scales and biases of the activations' type.
    fn tensor_cores_take(&self, dtype: DType, in_dim: usize) -> bool {
        match *self {
            ExpertStack::Dense(_) => {
                matches!(dtype, DType::BF16 | DType::F16) && in_dim.is_multiple_of(32)
            }
            ExpertStack::Packed(w, _) => super::matvec_plan::dequantizes_before_mma(
                dtype,
                w.scales.dtype(),
                w.biases.dtype(),
                w.bits.bits(),
                w.group_size,
                in_dim,
            ),
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

    /// The kernel's name for activations of `dtype` (`decode`, `in_dim`: as in
    /// [`ExpertStack::rows_per_warp`]).
    fn kernel(&self, gated: bool, dtype: DType, decode: Decode, in_dim: usize) -> Result<String> {
        let g = if gated { "_gated" } else { "" };
        let t = tn(dtype)?;
        Ok(match (*self, decode) {
            (ExpertStack::Dense(_), Decode::TensorCores) => format!("grouped_mv_tc{g}_{t}"),
            (ExpertStack::Packed(..), Decode::TensorCores) => format!("grouped_qmv_tc{g}_{t}"),
            (ExpertStack::Dense(_), _) => match self.rows_per_warp(in_dim, decode) {
                1 => format!("grouped_mv{g}_{t}"),
                r => format!("grouped_mv{g}_{t}_r{r}"),
            },
            (ExpertStack::Packed(w, _), _) => {
                let s = tn(w.scales.dtype())?;
                let v = if decode == Decode::FourPairs {
                    "p4"
                } else {
                    ""
                };
                format!(
                    "grouped_qmv{g}_{t}_{s}_{}_r{GMV_PACKED_ROWS}{v}",
                    w.bits.bits()
                )
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
    // Several pairs at once from two tokens and `GMV_MULTI_MIN_PAIRS` on (26B-A4B, 4-bit
    // experts, one H100: batch 8 1.39x under the random router's shared picks, 0.97x with
    // every pick a different expert; see docs/moe-decode.md).
    let multi = !by_slot || pairs >= GMV_MULTI_MIN_PAIRS.max(2 * top_k);
    let policy = crate::kernels::policy::current();
    let (tc_min, four_pairs) = match weights {
        ExpertStack::Dense(_) => (policy.moe_tc_min_pairs_dense, false),
        ExpertStack::Packed(..) => (policy.moe_tc_min_pairs, multi),
    };
    let decode =
        if multi && tc_min > 0 && pairs >= tc_min && weights.tensor_cores_take(dtype, in_dim) {
            Decode::TensorCores
        } else if four_pairs {
            Decode::FourPairs
        } else {
            Decode::EachPair
        };
    let func = load_kernel(
        &dev,
        &weights.kernel(gate.is_some(), dtype, decode, in_dim)?,
        &MOE,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (
            u32_of(if by_slot { pairs } else { experts }, "experts")?,
            out_dim.div_ceil(GMV_WARPS * weights.rows_per_warp(in_dim, decode)) as u32,
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
    mix_with(y, None, mix)
}

/// [`moe_mix`] over rows kept in another order: pair `q`'s row is `y[slot[q]]` (`slot` u32
/// `[tokens * top_k]`, e.g. the pairs' rows in an expert-sorted product), so the rows need
/// no gather back into pair order first.
///
/// # Errors
/// Shapes that disagree, a slot past `y`'s rows is not checked on the device (callers build
/// `slot` from the rows they wrote), CUDA errors.
pub fn moe_mix_rows(y: &Tensor, slot: &Tensor, mix: &Tensor) -> Result<Tensor> {
    mix_with(y, Some(slot), mix)
}

fn mix_with(y: &Tensor, slot: Option<&Tensor>, mix: &Tensor) -> Result<Tensor> {
    let dtype = y.dtype();
    check_dtype(&[y], dtype)?;
    let (tokens, top_k) = mix.dims2()?;
    let (rows, out_dim) = y.dims2()?;
    let pairs = tokens * top_k;
    let shape_ok = match slot {
        Some(s) => s.dims() == [pairs] && s.dtype() == DType::U32,
        None => rows == pairs,
    };
    if !shape_ok {
        candle_core::bail!(
            "moe_mix: y {:?}, slot {:?}, mix {:?}",
            y.dims(),
            slot.map(|s| s.dims().to_vec()),
            mix.dims()
        );
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
    let kernel = if slot.is_some() {
        "moe_mix_rows"
    } else {
        "moe_mix"
    };
    let func = load_kernel(&dev, &format!("{kernel}_{}", tn(dtype)?), &MOE)?;
    let cfg = grid_stride(n);
    let slot = slot.map(Tensor::contiguous).transpose()?;
    by_dtype!(dtype, E, {
        // SAFETY: grid-stride loop writes every element.
        let mut out = unsafe { dev.alloc::<E>(n.max(1))? };
        if n > 0 {
            bind!(yv, y, E);
            bind!(mv, mix, f32);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&yv);
            match slot.as_ref() {
                Some(sl) => {
                    bind!(sv, sl, u32);
                    b.arg(&sv);
                    b.arg(&mv);
                    b.arg(&mut out);
                    // SAFETY: arguments match `moe_mix_rows`'s signature.
                    unsafe { b.launch(cfg) }.w()?;
                }
                None => {
                    b.arg(&mv);
                    b.arg(&mut out);
                    // SAFETY: arguments match `moe_mix`'s signature.
                    unsafe { b.launch(cfg) }.w()?;
                }
            }
        }
        Ok(wrap(out, &dev, &[tokens, out_dim]))
    })
}

/// `src`'s rows `idx` (u32 `[n]`) as a new `[n, width]` tensor, copied 16 bytes at a time;
/// `None` when a row is not a whole number of 16-byte units or `src` does not start
/// 16-byte aligned (the caller then takes candle's `index_select`, which walks elements one
/// by one).
///
/// # Errors
/// A non-2-D `src`, non-u32 `idx`, CUDA errors. Indices are not checked on the device: callers
/// build them from `src`'s rows.
pub fn gather_rows(src: &Tensor, idx: &Tensor) -> Result<Option<Tensor>> {
    let (_, width) = src.dims2()?;
    let bytes = width * src.dtype().size_in_bytes();
    if idx.dtype() != DType::U32 || idx.rank() != 1 {
        candle_core::bail!(
            "gather_rows: u32 [n] indices expected, found {:?}",
            idx.dims()
        );
    }
    let src = src.contiguous()?;
    let elem = src.dtype().size_in_bytes();
    if !bytes.is_multiple_of(16) || (src.layout().start_offset() * elem) % 16 != 0 {
        return Ok(None);
    }
    let n = idx.dim(0)?;
    let units = bytes / 16;
    let dev = cuda_dev(&src)?;
    let idx = idx.contiguous()?;
    let func = load_kernel(&dev, "gather_rows_u4", &MOE)?;
    let cfg = grid_stride(n * units);
    by_dtype!(src.dtype(), E, {
        // SAFETY: the grid-stride loop writes every unit of every row.
        let mut out = unsafe { dev.alloc::<E>((n * width).max(1))? };
        if n > 0 {
            bind!(sv, src, E);
            bind!(iv, idx, u32);
            let rows = u32_of(n, "rows")?;
            let units = u32_of(units, "row units")?;
            let mut b = func.builder();
            b.arg(&sv);
            b.arg(&iv);
            b.arg(&mut out);
            b.arg(&rows);
            b.arg(&units);
            // SAFETY: arguments match the kernel's signature; rows are `units` 16-byte units,
            // `src` starts 16-byte aligned and pool allocations are.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(Some(wrap(out, &dev, &[n, width])))
    })
}
