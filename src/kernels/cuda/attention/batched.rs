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

/// What one sequence's attention in a captured step reads and which launch it needs: its
/// descriptor, the key splits it needs and can take, and the kernel it is planned for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepAttention {
    /// The sequence descriptor the launch reads from the parameter area.
    pub(crate) desc: QsdpaSeq,
    n_split: usize,
    split_bound: usize,
    kernel: KernelKey,
}

/// What must agree for sequences to share one attention launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KernelKey {
    bits: usize,
    dense: bool,
    nq: usize,
    tensor_cores: bool,
    stages: usize,
    fold: bool,
    kv_heads: u32,
    group_size: u32,
}

impl KernelKey {
    fn of(p: &SeqPlan) -> Self {
        Self {
            bits: p.bits,
            dense: p.dense,
            nq: p.nq,
            tensor_cores: p.tensor_cores,
            stages: p.stages,
            fold: p.fold_values,
            kv_heads: p.params.kv_heads,
            group_size: p.params.group_size,
        }
    }
}

impl StepAttention {
    fn of(desc: QsdpaSeq, p: &SeqPlan) -> Self {
        Self {
            desc,
            n_split: p.n_split,
            split_bound: p.split_bound,
            kernel: KernelKey::of(p),
        }
    }
}

/// Plans one sequence's attention in a captured step: `view` attended by `n_heads` queries at
/// `plan` (the same planning the captured launch did). Called by each replay.
///
/// # Errors
/// [`KernelError::Shape`] for a view this path cannot take (another dtype, positions needing a
/// table, storage the kernel does not read in place) or that does not fit the queries.
pub(crate) fn step_attention(
    n_heads: usize,
    head_dim: usize,
    dtype: DType,
    view: &KvView,
    plan: &QueryPlan,
    dev: &CudaDevice,
) -> Result<StepAttention, KernelError> {
    let (desc, seq) = plan_step(n_heads, head_dim, dtype, view, plan, dev)?;
    Ok(StepAttention::of(desc, &seq))
}

/// The slot of one attention launch over `seqs` (one planned sequence each), covering
/// `splits` key splits (the most any sequence needs when `None`); `None` when the sequences
/// need different kernels (or there are none).
pub(crate) fn step_attention_slot(
    seqs: &[StepAttention],
    splits: Option<usize>,
) -> Option<graph::Slot> {
    let first = seqs.first()?;
    if seqs.iter().any(|s| s.kernel != first.kernel) {
        return None;
    }
    let k = first.kernel;
    let splits = splits.unwrap_or_else(|| seqs.iter().map(|s| s.n_split).max().unwrap_or(1));
    Some(graph::Slot::Attention {
        seqs: seqs.len() as u32,
        splits: splits as u32,
        bits: k.bits as u32,
        kernel: graph::kernel_code(k.nq, k.tensor_cores, k.stages, k.fold),
    })
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
/// As [`step_attention`], sequences needing different kernels; not recording.
pub(crate) fn attend_recorded(
    q: &Tensor,
    views: &[&KvView],
    plans: &[QueryPlan],
) -> Result<Tensor, KernelError> {
    let (batch, n_heads, _, head_dim) = q.dims4()?;
    if batch != views.len() || batch != plans.len() || batch == 0 {
        return Err(KernelError::BatchSize {
            expected: batch,
            found: views.len(),
        });
    }
    let dev = cuda_dev(q)?;
    let mut seqs = Vec::with_capacity(batch);
    let mut first = None;
    for (view, plan) in views.iter().zip(plans) {
        let (desc, seq) = plan_step(n_heads, head_dim, q.dtype(), view, plan, &dev)?;
        seqs.push(StepAttention::of(desc, &seq));
        first.get_or_insert(seq);
    }
    let first = first.ok_or(KernelError::BatchSize {
        expected: batch,
        found: 0,
    })?;
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
    let slot = step_attention_slot(&seqs, Some(splits)).ok_or_else(|| KernelError::Shape {
        what: "captured decode attention",
        expected: "sequences attended by one kernel".to_string(),
        found: vec![batch],
    })?;
    let descs: Vec<QsdpaSeq> = seqs.iter().map(|s| s.desc).collect();
    let at = graph::record_slice(slot, &descs)?.ok_or_else(|| {
        KernelError::Candle(candle_core::Error::Msg(
            "attend_recorded called outside a capture".to_string(),
        ))
    })?;
    launch_seqs(q, &first, batch, splits, at, &dev)
}
