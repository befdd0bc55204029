//! Dispatches the plans of [`super::plan`] on a Metal device: `qkernels.metal` is compiled once
//! per device, pipelines are made once per kernel name, and each call binds its tensors'
//! buffers (at their layouts' byte offsets) on candle's current compute encoder, so the work
//! is ordered with candle's own kernels by the encoder's buffer tracking.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::metal_backend::DeviceId;
use candle_core::op::BackpropOp;
use candle_core::{DType, MetalDevice, MetalStorage, Storage, Tensor};
use candle_metal_kernels::metal::{Buffer, ComputeCommandEncoder, ComputePipeline, Library};
use candle_metal_kernels::MetalKernelError;
use objc2_metal::MTLSize;

use super::plan::{
    plan_attention, plan_dequant_q41, plan_dequant_rows, plan_matvec, plan_moe_product,
    plan_moe_route, plan_quantize, ExpertFormat, MoeParams, ATTENTION_THREADS, COMBINE_THREADS,
    DEQUANT_THREADS, MATVEC_WARPS, MOE_GROUP_THREADS, MOE_ROUTE_THREADS, QUANT_THREADS,
    TARGET_GROUPS,
};
use crate::kernels::QueryPlan;
use crate::kernels::{KernelError, KeyPositions, PackedAffine, QuantBits};

/// The compiled library of one device and the pipelines made from it so far.
struct DeviceKernels {
    library: Library,
    pipelines: HashMap<String, ComputePipeline>,
}

/// How a failed library or pipeline tells the user to fall back.
const FALLBACK: &str = "to run without the crate's Metal kernels, set \
    `LaunchPolicy::metal_kernels = false` (ModelBuilder::launch_policy) or \
    CANDLE_GEMMA_METAL_KERNELS=0";

/// The pipeline of kernel `name` on `dev`, compiling the library on first use.
///
/// # Errors
/// [`KernelError::Config`] naming the kernel and carrying the Metal compiler's message when the
/// library does not compile or the kernel has no pipeline, with how to fall back.
fn pipeline(dev: &MetalDevice, name: &str) -> Result<ComputePipeline, KernelError> {
    static LOADED: OnceLock<Mutex<HashMap<DeviceId, DeviceKernels>>> = OnceLock::new();
    let failed = |what: &str, e: MetalKernelError| KernelError::Config {
        field: "Metal kernel library (qkernels.metal)",
        reason: format!("{what} for kernel `{name}`: {e}; {FALLBACK}"),
    };
    let mut loaded = LOADED
        .get_or_init(Mutex::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("Metal kernel cache poisoned".into()))?;
    let kernels = match loaded.entry(dev.id()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            // IEEE division and `exp` (no fast math): the quantize kernel's codes then equal
            // the CPU's, and every kernel computes what the emulation computes up to fma
            // contraction. `fastMathEnabled` exists on every macOS (`mathMode` only from 15).
            let options = objc2_metal::MTLCompileOptions::new();
            #[allow(deprecated)]
            options.setFastMathEnabled(false);
            let library = dev
                .device()
                .new_library_with_source(super::SOURCE, Some(&options))
                .map_err(|err| failed("the Metal compiler rejected the library", err))?;
            e.insert(DeviceKernels {
                library,
                pipelines: HashMap::new(),
            })
        }
    };
    if let Some(p) = kernels.pipelines.get(name) {
        return Ok(p.clone());
    }
    let function = kernels
        .library
        .get_function(name, None)
        .map_err(|err| failed("no such function in the library", err))?;
    let p = dev
        .device()
        .new_compute_pipeline_state_with_function(&function)
        .map_err(|err| failed("the pipeline could not be made", err))?;
    kernels.pipelines.insert(name.to_string(), p.clone());
    Ok(p)
}

/// Checks that `threads` per threadgroup fit `p` on this device. The kernels assume SIMD
/// groups of 32 threads (every Apple GPU) and threadgroups of at most 256; a pipeline whose
/// register use lowers its limit below the launch gets a typed error, not a failed dispatch.
///
/// # Errors
/// [`KernelError::Config`] naming the kernel, the size and the limit.
fn check_threads(p: &ComputePipeline, name: &str, threads: usize) -> Result<(), KernelError> {
    let limit = p.max_total_threads_per_threadgroup();
    if threads > limit {
        return Err(KernelError::Config {
            field: "threadgroup size",
            reason: format!(
                "kernel `{name}` launches {threads} threads per threadgroup; this device's \
                 pipeline allows {limit}; {FALLBACK}"
            ),
        });
    }
    Ok(())
}

fn metal_dev(t: &Tensor) -> candle_core::Result<MetalDevice> {
    match t.device() {
        candle_core::Device::Metal(d) => Ok(d.clone()),
        _ => candle_core::bail!("expected a Metal tensor"),
    }
}

/// Binds `t`'s buffer at argument `index` from its layout's start (`output`: written by the
/// kernel, which orders later readers after it).
fn bind(
    enc: &ComputeCommandEncoder,
    index: usize,
    t: &Tensor,
    output: bool,
) -> candle_core::Result<()> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Metal(m) = &*storage else {
        candle_core::bail!("expected Metal storage")
    };
    let offset = layout.start_offset() * t.dtype().size_in_bytes();
    if output {
        enc.set_output_buffer(index, Some(m.buffer()), offset);
    } else {
        enc.set_input_buffer(index, Some(m.buffer()), offset);
    }
    Ok(())
}

fn size(width: usize, height: usize, depth: usize) -> MTLSize {
    MTLSize {
        width,
        height,
        depth,
    }
}

/// A fresh buffer of `count` elements of `dtype` wrapped as a contiguous tensor of `dims`.
fn new_tensor(
    dev: &MetalDevice,
    count: usize,
    dtype: DType,
    dims: &[usize],
) -> candle_core::Result<(Tensor, std::sync::Arc<Buffer>)> {
    let buffer = dev.new_buffer(count.max(1), dtype, "candle-gemma")?;
    let storage = MetalStorage::new(buffer.clone(), dev.clone(), count, dtype);
    let t = Tensor::from_storage(Storage::Metal(storage), dims, BackpropOp::none(), false);
    Ok((t, buffer))
}

/// Fused quantized attention of one sequence (see [`super::attend_packed`]).
pub(super) fn attend_packed(
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, KernelError> {
    attend_packed_with(q, k, v, positions, plan, TARGET_GROUPS)
}

/// `attend_packed` aiming for `target_groups` threadgroups (tests split short views so).
pub fn attend_packed_with(
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    plan: &QueryPlan,
    target_groups: usize,
) -> Result<Tensor, KernelError> {
    let dev = metal_dev(q)?;
    let launch = plan_attention(q, k, v, positions, plan, target_groups)?;
    let dtype = q.dtype();
    let out_len: usize = launch.out_dims.iter().product();
    let (out, out_buf) = new_tensor(&dev, out_len, dtype, &launch.out_dims)?;
    let table = if launch.table.is_empty() {
        None
    } else {
        Some(dev.new_buffer_with_data(&launch.table)?)
    };
    let ml = dev.new_buffer(launch.partial_ml_len.max(1), DType::F32, "qsdpa_ml")?;
    let acc = dev.new_buffer(launch.partial_acc_len.max(1), DType::F32, "qsdpa_acc")?;
    let main = pipeline(&dev, &launch.kernel)?;
    check_threads(&main, &launch.kernel, ATTENTION_THREADS)?;
    let combine = launch
        .combine
        .as_deref()
        .map(|name| {
            let p = pipeline(&dev, name)?;
            check_threads(&p, name, COMBINE_THREADS)?;
            Ok::<_, KernelError>(p)
        })
        .transpose()?;

    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&main);
    enc.set_bytes(0, &launch.params);
    bind(enc, 1, &launch.q, false)?;
    for (i, side) in [&launch.k, &launch.v].into_iter().enumerate() {
        bind(enc, 2 + 3 * i, &side.codes, false)?;
        bind(enc, 3 + 3 * i, &side.scales, false)?;
        bind(enc, 4 + 3 * i, &side.biases, false)?;
    }
    // Without a table the kernel never reads argument 8: any buffer will do.
    enc.set_input_buffer(8, Some(table.as_deref().unwrap_or(&out_buf)), 0);
    enc.set_output_buffer(9, Some(&*out_buf), 0);
    enc.set_output_buffer(10, Some(&*ml), 0);
    enc.set_output_buffer(11, Some(&*acc), 0);
    let [gx, gy, gz] = launch.groups;
    enc.dispatch_thread_groups(size(gx, gy, gz), size(ATTENTION_THREADS, 1, 1));
    if let Some(combine) = &combine {
        enc.set_compute_pipeline_state(combine);
        enc.set_bytes(0, &launch.params);
        enc.set_input_buffer(1, Some(&*ml), 0);
        enc.set_input_buffer(2, Some(&*acc), 0);
        enc.set_output_buffer(3, Some(&*out_buf), 0);
        enc.dispatch_thread_groups(
            size(launch.combine_groups, 1, 1),
            size(COMBINE_THREADS, 1, 1),
        );
    }
    Ok(out)
}

/// `x` `[rows, in]` · `Wᵀ` on the matvec kernel, or `None` where it does not apply (see
/// [`plan_matvec`]).
pub fn qmatvec(x: &Tensor, w: &PackedAffine) -> Result<Option<Tensor>, KernelError> {
    let (rows, _) = x.dims2()?;
    let Some(launch) = plan_matvec(rows, x.dtype(), w) else {
        return Ok(None);
    };
    let dev = metal_dev(x)?;
    let x = x.contiguous()?;
    let (codes, scales, biases) = (
        w.codes.contiguous()?,
        w.scales.contiguous()?,
        w.biases.contiguous()?,
    );
    let (y, y_buf) = new_tensor(&dev, rows * w.out_dim(), x.dtype(), &[rows, w.out_dim()])?;
    let p = pipeline(&dev, &launch.kernel)?;
    check_threads(&p, &launch.kernel, MATVEC_WARPS * 32)?;
    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&p);
    enc.set_bytes(0, &launch.params);
    bind(enc, 1, &x, false)?;
    bind(enc, 2, &codes, false)?;
    bind(enc, 3, &scales, false)?;
    bind(enc, 4, &biases, false)?;
    enc.set_output_buffer(5, Some(&*y_buf), 0);
    enc.dispatch_thread_groups(size(launch.groups, 1, 1), size(MATVEC_WARPS * 32, 1, 1));
    Ok(Some(y))
}

/// All of `w` dequantized to `dtype` `[out, in]`, or `None` for a dtype without a kernel.
pub fn dequantize_weight(w: &PackedAffine, dtype: DType) -> Result<Option<Tensor>, KernelError> {
    dequantize_rows(w, None, dtype)
}

/// Rows `idx` (`[n]` `u32` on `w`'s device, each below `w.out_dim()`) of `w` dequantized to
/// `dtype` `[n, in]`, or every row with `None` (`[out, in]`); `None` for a dtype without a
/// kernel. The gather reads the index on the device: nothing comes back to the host.
pub fn dequantize_rows(
    w: &PackedAffine,
    idx: Option<&Tensor>,
    dtype: DType,
) -> Result<Option<Tensor>, KernelError> {
    let idx = idx
        .map(|i| i.to_dtype(DType::U32)?.flatten_all()?.contiguous())
        .transpose()?;
    let Some(launch) = plan_dequant_rows(w, idx.as_ref().map(Tensor::elem_count), dtype) else {
        return Ok(None);
    };
    let dev = metal_dev(&w.codes)?;
    let (codes, scales, biases) = (
        w.codes.contiguous()?,
        w.scales.contiguous()?,
        w.biases.contiguous()?,
    );
    let rows = launch.params.rows as usize;
    let (out, out_buf) = new_tensor(&dev, rows * w.in_dim(), dtype, &[rows, w.in_dim()])?;
    if launch.threads == 0 {
        return Ok(Some(out));
    }
    let p = pipeline(&dev, &launch.kernel)?;
    check_threads(&p, &launch.kernel, DEQUANT_THREADS)?;
    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&p);
    enc.set_bytes(0, &launch.params);
    bind(enc, 1, &codes, false)?;
    bind(enc, 2, &scales, false)?;
    bind(enc, 3, &biases, false)?;
    // Without an index, argument 4 is never read.
    bind(enc, 4, idx.as_ref().unwrap_or(&codes), false)?;
    enc.set_bytes(5, &launch.use_idx);
    enc.set_output_buffer(6, Some(&*out_buf), 0);
    let groups = launch.threads.div_ceil(DEQUANT_THREADS);
    enc.dispatch_thread_groups(size(groups, 1, 1), size(DEQUANT_THREADS, 1, 1));
    Ok(Some(out))
}

/// `x` `[.., dim]` quantized on the device (shapes as [`crate::kernels::quantize`], whose
/// caller checked the group size), or `None` for a dtype without a kernel.
pub fn quantize(
    x: &Tensor,
    bits: QuantBits,
    group_size: usize,
) -> Result<Option<PackedAffine>, KernelError> {
    let dims = x.dims().to_vec();
    let dim = dims.last().copied().unwrap_or(0);
    let rows = x.elem_count() / dim.max(1);
    let Some(launch) = plan_quantize(rows, dim, bits, group_size, x.dtype()) else {
        return Ok(None);
    };
    let dev = metal_dev(x)?;
    let x = x.contiguous()?;
    let with_last = |last: usize| {
        let mut d = dims.clone();
        if let Some(l) = d.last_mut() {
            *l = last;
        }
        d
    };
    let (words, groups) = (dim * bits.bits() / 32, dim / group_size);
    let (codes, codes_buf) = new_tensor(&dev, rows * words, DType::U32, &with_last(words))?;
    let (scales, scales_buf) = new_tensor(&dev, rows * groups, x.dtype(), &with_last(groups))?;
    let (biases, biases_buf) = new_tensor(&dev, rows * groups, x.dtype(), &with_last(groups))?;
    if launch.threads > 0 {
        let p = pipeline(&dev, &launch.kernel)?;
        check_threads(&p, &launch.kernel, QUANT_THREADS)?;
        let guard = dev.command_encoder()?;
        let enc: &ComputeCommandEncoder = guard.as_ref();
        enc.set_compute_pipeline_state(&p);
        enc.set_bytes(0, &launch.params);
        bind(enc, 1, &x, false)?;
        enc.set_output_buffer(2, Some(&*codes_buf), 0);
        enc.set_output_buffer(3, Some(&*scales_buf), 0);
        enc.set_output_buffer(4, Some(&*biases_buf), 0);
        let tgs = launch.threads.div_ceil(QUANT_THREADS);
        enc.dispatch_thread_groups(size(tgs, 1, 1), size(QUANT_THREADS, 1, 1));
    }
    Ok(Some(PackedAffine::from_parts(
        codes,
        scales,
        biases,
        crate::kernels::AffineSpec { bits, group_size },
    )))
}

/// A matrix `[rows, in_dim]` held as candle `Q4_1` blocks in `blocks` dequantized to `dtype`
/// on the device, or `None` for a dtype without a kernel.
pub fn dequantize_q41(
    dev: &MetalDevice,
    blocks: &Buffer,
    rows: usize,
    in_dim: usize,
    dtype: DType,
) -> Result<Option<Tensor>, KernelError> {
    let Some(launch) = plan_dequant_q41(rows, in_dim, dtype) else {
        return Ok(None);
    };
    let (out, out_buf) = new_tensor(dev, rows * in_dim, dtype, &[rows, in_dim])?;
    if launch.threads == 0 {
        return Ok(Some(out));
    }
    let p = pipeline(dev, &launch.kernel)?;
    check_threads(&p, &launch.kernel, DEQUANT_THREADS)?;
    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&p);
    enc.set_bytes(0, &launch.params);
    enc.set_input_buffer(1, Some(blocks), 0);
    enc.set_output_buffer(2, Some(&*out_buf), 0);
    let groups = launch.threads.div_ceil(DEQUANT_THREADS);
    enc.dispatch_thread_groups(size(groups, 1, 1), size(DEQUANT_THREADS, 1, 1));
    Ok(Some(out))
}

/// One MoE layer's routing on the device: the picks and weights of every token and the pairs
/// grouped by expert (see [`super::plan::MoeRouteLaunch`]). Nothing of it is read back.
pub struct MoeRouting {
    /// The routing parameters (pairs, picks, experts).
    pub params: MoeParams,
    /// `[tokens, top_k]` u32: the picked experts.
    pub idx: Tensor,
    /// `[tokens, top_k]` f32: their weights.
    pub weights: Tensor,
    offsets: Tensor,
    order: Tensor,
    used: Tensor,
}

/// An expert stack for [`moe_product`].
#[derive(Debug, Clone, Copy)]
pub enum MoeExperts<'a> {
    /// `[experts, out, in]` in the activations' dtype.
    Dense(&'a Tensor),
    /// `[experts * out, in]` packed, expert `e` owning rows `e * out ..`.
    Packed {
        /// The stacked rows.
        weight: &'a PackedAffine,
        /// The number of experts.
        experts: usize,
    },
}

/// Routes `logits` `[tokens, experts]` (f32) with `scale` `[experts]` (f32) on the device and
/// groups the pairs by expert; `None` where the kernels do not apply (see
/// [`plan_moe_route`]).
pub fn moe_route(
    logits: &Tensor,
    scale: &Tensor,
    top_k: usize,
) -> Result<Option<MoeRouting>, KernelError> {
    let (tokens, experts) = logits.dims2()?;
    let Some(launch) = plan_moe_route(tokens, experts, top_k) else {
        return Ok(None);
    };
    let dev = metal_dev(logits)?;
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let scale = scale.to_dtype(DType::F32)?.contiguous()?;
    let pairs = tokens * top_k;
    let (idx, idx_buf) = new_tensor(&dev, pairs, DType::U32, &[tokens, top_k])?;
    let (weights, w_buf) = new_tensor(&dev, pairs, DType::F32, &[tokens, top_k])?;
    let (offsets, offsets_buf) = new_tensor(&dev, experts + 1, DType::U32, &[experts + 1])?;
    let (order, order_buf) = new_tensor(&dev, pairs, DType::U32, &[pairs])?;
    let (used, used_buf) = new_tensor(&dev, experts + 1, DType::U32, &[experts + 1])?;
    let cursor = dev.new_buffer(experts.max(1), DType::U32, "moe_cursor")?;
    let route = pipeline(&dev, launch.route_kernel)?;
    check_threads(&route, launch.route_kernel, MOE_ROUTE_THREADS)?;
    let group = pipeline(&dev, launch.group_kernel)?;
    check_threads(&group, launch.group_kernel, MOE_GROUP_THREADS)?;
    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    if tokens > 0 {
        enc.set_compute_pipeline_state(&route);
        enc.set_bytes(0, &launch.params);
        bind(enc, 1, &logits, false)?;
        bind(enc, 2, &scale, false)?;
        enc.set_output_buffer(3, Some(&*idx_buf), 0);
        enc.set_output_buffer(4, Some(&*w_buf), 0);
        enc.dispatch_thread_groups(
            size(launch.route_groups, 1, 1),
            size(MOE_ROUTE_THREADS, 1, 1),
        );
    }
    // Also with no tokens: `used` then says no expert was picked.
    enc.set_compute_pipeline_state(&group);
    enc.set_bytes(0, &launch.params);
    enc.set_input_buffer(1, Some(&*idx_buf), 0);
    enc.set_output_buffer(2, Some(&*offsets_buf), 0);
    enc.set_output_buffer(3, Some(&*order_buf), 0);
    enc.set_output_buffer(4, Some(&*used_buf), 0);
    enc.set_output_buffer(5, Some(&*cursor), 0);
    enc.dispatch_thread_groups(size(1, 1, 1), size(MOE_GROUP_THREADS, 1, 1));
    Ok(Some(MoeRouting {
        params: launch.params,
        idx,
        weights,
        offsets,
        order,
        used,
    }))
}

/// Every routed pair's product with its expert, `[pairs, out]` in `x`'s dtype, pairs in token
/// order: `x` `[tokens, in]` per token (`x_per_token`, the gate/up product) or `[pairs, in]`
/// per pair (the down product). `None` where no kernel takes the operands (see
/// [`plan_moe_product`]).
pub fn moe_product(
    routing: &MoeRouting,
    x: &Tensor,
    x_per_token: bool,
    experts: MoeExperts<'_>,
) -> Result<Option<Tensor>, KernelError> {
    let in_dim = x.dim(1)?;
    let (format, out) = match experts {
        MoeExperts::Dense(w) => {
            let (_, out, w_in) = w.dims3()?;
            if w.dtype() != x.dtype() || w_in != in_dim {
                return Ok(None);
            }
            (ExpertFormat::Dense, out)
        }
        MoeExperts::Packed { weight, experts } => {
            // A stack held only as `Q4_1` blocks has placeholder codes.
            if !weight.mlx_resident()
                || weight.in_dim() != in_dim
                || experts == 0
                || weight.out_dim() % experts != 0
            {
                return Ok(None);
            }
            let format = ExpertFormat::Packed {
                bits: weight.bits,
                group_size: weight.group_size,
                scale_dtype: weight.scales.dtype(),
            };
            (format, weight.out_dim() / experts)
        }
    };
    let Some(launch) =
        plan_moe_product(&routing.params, out, in_dim, x.dtype(), x_per_token, format)
    else {
        return Ok(None);
    };
    let dev = metal_dev(x)?;
    let x = x.contiguous()?;
    let pairs = routing.params.pairs as usize;
    let (y, y_buf) = new_tensor(&dev, pairs * out, x.dtype(), &[pairs, out])?;
    if pairs == 0 {
        return Ok(Some(y));
    }
    let p = pipeline(&dev, &launch.kernel)?;
    check_threads(&p, &launch.kernel, MATVEC_WARPS * 32)?;
    let operands = match experts {
        MoeExperts::Dense(w) => vec![w.contiguous()?],
        MoeExperts::Packed { weight, .. } => vec![
            weight.codes.contiguous()?,
            weight.scales.contiguous()?,
            weight.biases.contiguous()?,
        ],
    };
    let guard = dev.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&p);
    enc.set_bytes(0, &launch.params);
    bind(enc, 1, &x, false)?;
    for (i, t) in operands.iter().enumerate() {
        bind(enc, 2 + i, t, false)?;
    }
    let next = 2 + operands.len();
    bind(enc, next, &routing.offsets, false)?;
    bind(enc, next + 1, &routing.order, false)?;
    bind(enc, next + 2, &routing.used, false)?;
    enc.set_output_buffer(next + 3, Some(&*y_buf), 0);
    let [gx, gy] = launch.groups;
    enc.dispatch_thread_groups(size(gx, gy, 1), size(MATVEC_WARPS * 32, 1, 1));
    Ok(Some(y))
}
