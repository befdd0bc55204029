//! Batched decode attention on CUDA: every sequence of a [`KvView::Batch`] attended by one
//! launch of the fused kernel (and one of its split combine), instead of one or two launches
//! per sequence and a concatenation of their outputs.
//!
//! Each sequence keeps its own K/V storage (see the batch cache): the launch reads a
//! table of per-sequence descriptors (kernel parameters and device addresses of its K/V), so
//! sequences of different lengths, positions and storage batch without padding.

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Tensor};

use super::launch::FUSED_MAX_Q_LEN;
use super::plan::{combine_kernel_name, combine_launch, plan_seq, KvOperand, SeqPlan};
use crate::kernels::cuda::device::{cuda_dev, cuda_storage, kname, view, wrap};
use crate::kernels::cuda::graph;
use crate::kernels::cuda::kernel_cache::{load_kernel, ATTENTION};
use crate::kernels::plan::{QsdpaParams, QSDPA_HEAD_DIMS};
use crate::kernels::{check_view, QueryPlan};
use crate::kernels::{KernelError, KeyPositions, KvData, KvView};

/// `struct QsdpaSeq` in `attention.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct QsdpaSeq {
    pub(crate) p: QsdpaParams,
    kc: u64,
    ks: u64,
    kb: u64,
    vc: u64,
    vs: u64,
    vb: u64,
    pos: u64,
    pad_: u64,
}

// SAFETY: `#[repr(C)]` plain integers and floats, read by the kernel with the same layout.
unsafe impl DeviceRepr for QsdpaSeq {}

/// Device address of `t`'s first element.
pub(crate) fn address(t: &Tensor, dev: &CudaDevice) -> candle_core::Result<u64> {
    let (s, l) = t.storage_and_layout();
    let cs = cuda_storage(&s)?;
    let stream = dev.cuda_stream();
    let base = match t.dtype() {
        DType::U32 => view::<u32>(cs, l)?.device_ptr(&stream).0,
        DType::F32 => view::<f32>(cs, l)?.device_ptr(&stream).0,
        DType::F16 => view::<half::f16>(cs, l)?.device_ptr(&stream).0,
        DType::BF16 => view::<half::bf16>(cs, l)?.device_ptr(&stream).0,
        other => candle_core::bail!("no device address for {other:?} tensors"),
    };
    Ok(base)
}

/// Attends every sequence of `views` in one launch: `q` `[batch, n_heads, q_len, head_dim]`,
/// one view per sequence. Returns `None` (the caller attends sequence by sequence) when the
/// path does not apply: a view that is itself a batch, dense and packed views mixed, packed
/// views with different bits or group sizes, dense K/V in another dtype than `q`, long query
/// blocks, head dims the kernel lacks, or the path switched off.
///
/// # Errors
/// [`KernelError::Shape`] for views that do not fit the queries, candle/CUDA errors.
pub(crate) fn attend_batch(
    q: &Tensor,
    views: &[KvView],
    q_offsets: &[usize],
    window: Option<usize>,
    scale: f64,
) -> Result<Option<Tensor>, KernelError> {
    let (batch, n_heads, q_len, head_dim) = q.dims4()?;
    let dtype = q.dtype();
    if batch < 2
        || q_len > FUSED_MAX_Q_LEN
        || !QSDPA_HEAD_DIMS.contains(&head_dim)
        || kname(dtype).is_err()
    {
        return Ok(None);
    }
    let mut seqs = Vec::with_capacity(batch);
    for (view, &q_offset) in views.iter().zip(q_offsets) {
        let KvView::Single { data, positions } = view else {
            return Ok(None);
        };
        check_view(n_heads, head_dim, data, positions)?;
        let (k, v) = match data {
            KvData::Dense { k, v } if k.dtype() == dtype && v.dtype() == dtype => {
                (KvOperand::Dense(k), KvOperand::Dense(v))
            }
            KvData::Dense { .. } => return Ok(None),
            KvData::Packed { k, v } => (KvOperand::Packed(k), KvOperand::Packed(v)),
        };
        seqs.push((k, v, positions, q_offset));
    }
    let dev = cuda_dev(q)?;
    let mut plans: Vec<SeqPlan> = Vec::with_capacity(batch);
    for &(k, v, positions, q_offset) in &seqs {
        let plan = QueryPlan {
            q_offset,
            window,
            scale,
        };
        plans.push(plan_seq(
            n_heads, q_len, head_dim, dtype, k, v, positions, &plan, &dev,
        )?);
    }
    let first = &plans[0];
    let same_kernel = plans.iter().all(|p| {
        p.bits == first.bits
            && p.dense == first.dense
            && p.nq == first.nq
            && p.tensor_cores == first.tensor_cores
            && p.stages == first.stages
            && p.params.kv_heads == first.params.kv_heads
            && p.params.group_size == first.params.group_size
    });
    let n_split_max = plans.iter().map(|p| p.n_split).max().unwrap_or(1);
    if !same_kernel || batch * n_split_max > u16::MAX as usize {
        return Ok(None);
    }

    // Position tables of all sequences in one buffer.
    let mut tables = Vec::new();
    let mut table_at = Vec::with_capacity(batch);
    for p in &plans {
        table_at.push(tables.len());
        tables.extend_from_slice(&p.table);
    }
    let tables = if tables.is_empty() {
        None
    } else {
        Some(dev.clone_htod(&tables)?)
    };
    let tables_base = match &tables {
        Some(t) => t.device_ptr(&dev.cuda_stream()).0,
        None => 0,
    };
    let mut descs = Vec::with_capacity(batch);
    for (p, &at) in plans.iter().zip(&table_at) {
        descs.push(descriptor(
            p,
            (!p.table.is_empty()).then_some(tables_base + 4 * at as u64),
            &dev,
        )?);
    }
    let descs = dev.clone_htod(&descs)?;
    let descs_at = descs.device_ptr(&dev.cuda_stream()).0;
    let out = launch_seqs(q, first, batch, n_split_max, descs_at, &dev)?;
    drop(descs);
    drop(plans);
    Ok(Some(out))
}

/// The descriptor of one planned sequence; `table` is the device address of its position
/// table when it has one.
fn descriptor(p: &SeqPlan, table: Option<u64>, dev: &CudaDevice) -> candle_core::Result<QsdpaSeq> {
    let kc = address(&p.ks.words, dev)?;
    Ok(QsdpaSeq {
        p: p.params,
        kc,
        ks: address(&p.ks.scales, dev)?,
        kb: address(&p.ks.biases, dev)?,
        vc: address(&p.vs.words, dev)?,
        vs: address(&p.vs.scales, dev)?,
        vb: address(&p.vs.biases, dev)?,
        // Read only by sequences with a table (position mode 2).
        pos: table.unwrap_or(kc),
        pad_: 0,
    })
}

/// Launches the batch kernel (and its combine when any sequence may split) over `batch`
/// sequences whose descriptors sit at device address `descs`, each split at most `n_split_max`
/// ways; `first` is any sequence's plan (they share the kernel). `q` is `[batch, n_heads, q_len,
/// head_dim]`.
fn launch_seqs(
    q: &Tensor,
    first: &SeqPlan,
    batch: usize,
    n_split_max: usize,
    descs: u64,
    dev: &CudaDevice,
) -> Result<Tensor, KernelError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let dtype = q.dtype();
    let row_blocks = first.row_blocks;
    let kv_heads = first.params.kv_heads as usize;
    let total_rows = n_heads * q_len;
    let tn = kname(dtype)?;
    let func = load_kernel(dev, &first.kernel_name(dtype, true)?, first.module())?;
    let combine = combine_launch(n_split_max);
    let comb = load_kernel(dev, &combine_kernel_name(&combine, tn, true), &ATTENTION)?;
    // Shared-memory stages above 48 KiB need the kernel's leave (asked once).
    if first.smem > 0
        && func
            .resident_blocks_with(first.block_threads(), first.smem)
            .is_none()
    {
        return Err(KernelError::Config {
            field: "attention shared-memory stages",
            reason: format!(
                "the device refuses {} bytes of shared memory a block for {}",
                first.smem,
                first.kernel_name(dtype, true)?
            ),
        });
    }
    let main_cfg = LaunchConfig {
        grid_dim: (
            row_blocks as u32,
            kv_heads as u32,
            (batch * n_split_max) as u32,
        ),
        block_dim: (first.block_threads(), 1, 1),
        shared_mem_bytes: first.smem,
    };
    let comb_cfg = LaunchConfig {
        grid_dim: (
            total_rows as u32,
            batch as u32,
            head_dim.div_ceil(combine.dims) as u32,
        ),
        block_dim: (combine.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let q = q.contiguous()?;
    let n_split_max32 = n_split_max as u32;
    let out_len = batch * total_rows * head_dim;
    let part_rows = batch * n_split_max * total_rows;

    macro_rules! go {
        ($t:ty) => {{
            // SAFETY: every output row is written, by the main kernel (one split) or the
            // combine; every partial that is read is written first by its split's block.
            let mut out = unsafe { dev.alloc::<$t>(out_len)? };
            let parts = if n_split_max > 1 {
                // SAFETY: as above.
                unsafe {
                    Some((
                        dev.alloc::<f32>(part_rows * 2)?,
                        dev.alloc::<f32>(part_rows * head_dim)?,
                    ))
                }
            } else {
                None
            };
            {
                let (q_s, q_l) = q.storage_and_layout();
                let qv = view::<$t>(cuda_storage(&q_s)?, q_l)?;
                let mut b = func.builder();
                b.arg(&descs);
                b.arg(&n_split_max32);
                b.arg(&qv);
                b.arg(&mut out);
                match &parts {
                    Some((ml, acc)) => {
                        b.arg(ml);
                        b.arg(acc);
                    }
                    None => {
                        b.arg(&descs);
                        b.arg(&descs);
                    }
                }
                // SAFETY: argument list and types match the kernel's signature; every
                // descriptor addresses live tensors (held by the caller until after the
                // launches), with strides and key counts planned from their layouts.
                unsafe { b.launch(main_cfg) }.w()?;
            }
            if let Some((ml, acc)) = &parts {
                let mut b = comb.builder();
                b.arg(&descs);
                b.arg(&n_split_max32);
                b.arg(&mut out);
                b.arg(ml);
                b.arg(acc);
                // SAFETY: as above; sequences with one split return at once.
                unsafe { b.launch(comb_cfg) }.w()?;
            }
            wrap(out, dev, &[batch, n_heads, q_len, head_dim])
        }};
    }
    Ok(match dtype {
        DType::F32 => go!(f32),
        DType::F16 => go!(half::f16),
        _ => go!(half::bf16),
    })
}

/// The one sequence of `view` (a single view, or a batch of one).
fn single(view: &KvView) -> Option<(&KvData, &KeyPositions)> {
    match view {
        KvView::Single { data, positions } => Some((data, positions)),
        KvView::Batch(views) if views.len() == 1 => single(&views[0]),
        KvView::Batch(_) => None,
    }
}

/// What a captured decode step's attention reads: one descriptor per sequence (views[b] with
/// plans[b]) and the slot that names the launch (the most key splits any sequence needs, the
/// bits of the K/V its kernel reads, the kernel). Called by the capture and by each replay, so
/// both plan alike.
///
/// # Errors
/// [`KernelError::Shape`] for views this path cannot take (another dtype, positions needing a
/// table, storage the kernel does not read in place, sequences needing different kernels) or
/// that do not fit the queries.
pub(crate) fn step_descriptors(
    n_heads: usize,
    head_dim: usize,
    dtype: DType,
    views: &[&KvView],
    plans: &[QueryPlan],
    dev: &CudaDevice,
) -> Result<(Vec<QsdpaSeq>, graph::Slot), KernelError> {
    let (descs, seqs) = plan_steps(n_heads, head_dim, dtype, views, plans, dev)?;
    let slot = step_slot(&seqs, seqs.iter().map(|s| s.n_split).max().unwrap_or(1))?;
    Ok((descs, slot))
}

/// The slot of an attention launch over `seqs` covering `splits` key splits.
fn step_slot(seqs: &[SeqPlan], splits: usize) -> Result<graph::Slot, KernelError> {
    let first = seqs.first().ok_or(KernelError::BatchSize {
        expected: 1,
        found: 0,
    })?;
    Ok(graph::Slot::Attention {
        seqs: seqs.len() as u32,
        splits: splits as u32,
        bits: first.bits as u32,
        kernel: graph::kernel_code(
            first.nq,
            first.tensor_cores,
            first.stages,
            first.fold_values,
        ),
    })
}

/// Plans each sequence of a captured step ([`plan_step`]) and checks they share one kernel.
fn plan_steps(
    n_heads: usize,
    head_dim: usize,
    dtype: DType,
    views: &[&KvView],
    plans: &[QueryPlan],
    dev: &CudaDevice,
) -> Result<(Vec<QsdpaSeq>, Vec<SeqPlan>), KernelError> {
    if views.is_empty() || views.len() != plans.len() {
        return Err(KernelError::BatchSize {
            expected: plans.len(),
            found: views.len(),
        });
    }
    let mut descs = Vec::with_capacity(views.len());
    let mut seqs: Vec<SeqPlan> = Vec::with_capacity(views.len());
    for (view, plan) in views.iter().zip(plans) {
        let (desc, seq) = plan_step(n_heads, head_dim, dtype, view, plan, dev)?;
        if let Some(first) = seqs.first() {
            let same = seq.bits == first.bits
                && seq.dense == first.dense
                && seq.nq == first.nq
                && seq.tensor_cores == first.tensor_cores
                && seq.stages == first.stages
                && seq.fold_values == first.fold_values
                && seq.params.kv_heads == first.params.kv_heads
                && seq.params.group_size == first.params.group_size;
            if !same {
                return Err(KernelError::Shape {
                    what: "captured decode attention",
                    expected: "sequences attended by one kernel".to_string(),
                    found: vec![first.bits, seq.bits],
                });
            }
        }
        descs.push(desc);
        seqs.push(seq);
    }
    Ok((descs, seqs))
}

/// One sequence of a captured step, planned from `view` (dense K/V in `dtype`, or packed K/V
/// with scales in `dtype`, with positions that need no table), and its descriptor.
fn plan_step(
    n_heads: usize,
    head_dim: usize,
    dtype: DType,
    view: &KvView,
    plan: &QueryPlan,
    dev: &CudaDevice,
) -> Result<(QsdpaSeq, SeqPlan), KernelError> {
    let unsupported = |what: &str| KernelError::Shape {
        what: "captured decode attention",
        expected: format!(
            "one sequence of dense K/V, or packed K/V with scales, in the activations' dtype \
             ({what})"
        ),
        found: vec![n_heads, head_dim],
    };
    let (data, positions) = single(view).ok_or_else(|| unsupported("view"))?;
    let (k, v, parts) = match data {
        KvData::Dense { k, v } if k.dtype() == dtype && v.dtype() == dtype => (
            KvOperand::Dense(k),
            KvOperand::Dense(v),
            vec![k.id(), v.id()],
        ),
        KvData::Packed { k, v }
            if [&k.scales, &k.biases, &v.scales, &v.biases]
                .iter()
                .all(|t| t.dtype() == dtype) =>
        {
            let ids = [k, v]
                .iter()
                .flat_map(|p| [p.codes.id(), p.scales.id(), p.biases.id()])
                .collect();
            (KvOperand::Packed(k), KvOperand::Packed(v), ids)
        }
        _ => return Err(unsupported("dtype")),
    };
    if !QSDPA_HEAD_DIMS.contains(&head_dim) {
        return Err(unsupported("head dim"));
    }
    check_view(n_heads, head_dim, data, positions)?;
    let seq = plan_seq(n_heads, 1, head_dim, dtype, k, v, positions, plan, dev)?;
    if !seq.table.is_empty() {
        return Err(unsupported("positions in one or two runs"));
    }
    // The descriptor must name the cache's own storage: an operand the planning copied (to
    // align or convert it) would be freed before a replay reads it.
    let read = if seq.dense {
        vec![seq.ks.words.id(), seq.vs.words.id()]
    } else {
        [&seq.ks, &seq.vs]
            .iter()
            .flat_map(|s| [s.words.id(), s.scales.id(), s.biases.id()])
            .collect()
    };
    if read != parts {
        return Err(unsupported("storage the kernel reads in place"));
    }
    Ok((descriptor(&seq, None, dev)?, seq))
}

/// Decode queries `q` `[batch, n_heads, 1, head_dim]`, sequence `b` attending `views[b]` at
/// `plans[b]`, while a step is captured: the descriptors go to the step's parameter area (one
/// block) and one launch reads them from there, covering more key splits than this step needs
/// (see [`graph::covered_splits`]; the unused ones return at once).
///
/// # Errors
/// As [`step_descriptors`]; not recording.
pub(crate) fn attend_recorded(
    q: &Tensor,
    views: &[&KvView],
    plans: &[QueryPlan],
) -> Result<Tensor, KernelError> {
    let (batch, n_heads, _, head_dim) = q.dims4()?;
    if batch != views.len() {
        return Err(KernelError::BatchSize {
            expected: batch,
            found: views.len(),
        });
    }
    let dev = cuda_dev(q)?;
    let (descs, seqs) = plan_steps(n_heads, head_dim, q.dtype(), views, plans, &dev)?;
    let need = seqs.iter().map(|s| s.n_split).max().unwrap_or(1);
    let bound = seqs.iter().map(|s| s.split_bound).max().unwrap_or(1);
    let splits = graph::covered_splits(need, bound);
    if batch * splits > u16::MAX as usize {
        return Err(KernelError::Shape {
            what: "captured decode attention",
            expected: format!("at most {} sequences x key splits", u16::MAX),
            found: vec![batch, splits],
        });
    }
    let slot = step_slot(&seqs, splits)?;
    let at = graph::record_slice(slot, &descs)?.ok_or_else(|| {
        KernelError::Candle(candle_core::Error::Msg(
            "attend_recorded called outside a capture".to_string(),
        ))
    })?;
    launch_seqs(q, &seqs[0], batch, splits, at, &dev)
}
