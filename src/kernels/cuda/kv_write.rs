//! Writing one step's new K and V into cache slots on CUDA: dense K/V copied into each
//! sequence's reserved slots (`kv_scatter_batch`, `layer_ops.cu`), or quantized into a packed
//! cache's slots (`quantize_into_*`, `quantize.cu`), one launch for a batch, or through the
//! captured step's parameter area while a CUDA graph records.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::device::{bind, by_dtype, cuda_dev, cuda_storage, kname, tn, u32_of, view};
use super::graph;
use super::kernel_cache::{load_kernel, LAYER_OPS, QUANTIZE};
use crate::kernels::plan::QmatParams;

/// Whether `t` is a cache's slots for `n` tokens as the kernels write them:
/// `[1, kv_heads, n, head_dim]` in `dtype`, a head's tokens contiguous.
pub(super) fn fits_kv_slots(
    t: &Tensor,
    kv_heads: usize,
    n: usize,
    head_dim: usize,
    dtype: DType,
) -> bool {
    let st = t.stride();
    t.dims() == [1, kv_heads, n, head_dim]
        && t.dtype() == dtype
        && st[3] == 1
        && (n == 1 || st[2] == head_dim)
}

/// `struct QkvDst` in `layer_ops.cu`: where a captured step's K and V go.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct QkvDst {
    k: u64,
    v: u64,
    kv_head_stride: u32,
    pad_: u32,
}

/// The [`QkvDst`] of destinations `kd`, `vd` (`[1, kv_heads, n, head_dim]` views, heads equally
/// spaced, as [`qkv_prep_into`] takes them).
///
/// # Errors
/// Views of another layout, or not on a CUDA device.
pub(crate) fn kv_destination(kd: &Tensor, vd: &Tensor) -> Result<QkvDst> {
    let (ks, vs) = (kd.stride(), vd.stride());
    if ks.len() != 4 || ks != vs || ks[3] != 1 || kd.dtype() != vd.dtype() {
        candle_core::bail!(
            "qkv_prep: destinations with strides {ks:?} / {vs:?} cannot be written in place"
        );
    }
    let dev = cuda_dev(kd)?;
    Ok(QkvDst {
        k: super::batched::address(kd, &dev)?,
        v: super::batched::address(vd, &dev)?,
        kv_head_stride: u32_of(ks[1], "kv head stride")?,
        pad_: 0,
    })
}

/// `struct TokenRowsParams` in `layer_ops.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct TokenRowsParams {
    heads: u32,
    tokens: u32,
    chunks: u32,
    pad_: u32,
    src_head: u64,
    src_token: u64,
    dst_head: u64,
    dst_token: u64,
}

/// Copies `src` (`[1, heads, n, width]`, any head and token strides, rows contiguous) into
/// `dst` (`[1, heads, n, width]`, a view into a cache's storage) in one launch, 16 bytes a
/// thread. `Ok(false)`, writing nothing, while a CUDA graph records (the addresses would be
/// baked in) or when the rows, strides or starts are not whole 16-byte units; the caller then
/// makes `src` contiguous and copies it (two passes, the first a strided gather).
///
/// # Errors
/// CUDA errors.
pub(crate) fn copy_token_rows(dst: &Tensor, src: &Tensor) -> Result<bool> {
    let elem = src.dtype().size_in_bytes();
    let (ds, ss) = (dst.stride(), src.stride());
    let on16 = |t: &Tensor, st: &[usize]| {
        t.rank() == 4
            && st[3] == 1
            && (t.layout().start_offset() * elem).is_multiple_of(16)
            && (st[1] * elem).is_multiple_of(16)
            && (st[2] * elem).is_multiple_of(16)
    };
    if graph::recording()
        || !matches!(
            src.dtype(),
            DType::F32 | DType::F16 | DType::BF16 | DType::U32
        )
        || dst.dims() != src.dims()
        || dst.dtype() != src.dtype()
        || !on16(dst, ds)
        || !on16(src, ss)
        || !(src.dim(3)? * elem).is_multiple_of(16)
    {
        return Ok(false);
    }
    let (_, heads, tokens, width) = src.dims4()?;
    let chunks = width * elem / 16;
    let n = heads * tokens * chunks;
    if n == 0 {
        return Ok(true);
    }
    let unit = |x: usize| (x * elem / 16) as u64;
    let params = TokenRowsParams {
        heads: u32_of(heads, "heads")?,
        tokens: u32_of(tokens, "tokens")?,
        chunks: u32_of(chunks, "row chunks")?,
        pad_: 0,
        src_head: unit(ss[1]),
        src_token: unit(ss[2]),
        dst_head: unit(ds[1]),
        dst_token: unit(ds[2]),
    };
    u32_of(n, "16-byte units")?;
    let dev = cuda_dev(src)?;
    let (src_at, dst_at) = (
        super::batched::address(src, &dev)?,
        super::batched::address(dst, &dev)?,
    );
    let func = load_kernel(&dev, "copy_token_rows", &LAYER_OPS)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    b.arg(&params);
    b.arg(&src_at);
    b.arg(&dst_at);
    // SAFETY: arguments match the kernel's signature; both views hold heads x tokens rows of
    // `chunks` 16-byte units at the strides passed, inside their storage (checked shapes).
    unsafe { b.launch(cfg) }.w()?;
    Ok(true)
}

/// Sequences one `kv_scatter_batch` launch takes (`KV_BATCH` in `layer_ops.cu`).
pub(crate) const KV_BATCH: usize = 16;

/// `struct KvBatchDst` in `layer_ops.cu`: the K/V slots of up to [`KV_BATCH`] sequences, by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KvBatchDst {
    d: [QkvDst; KV_BATCH],
}

/// `struct KvScatterParams` in `layer_ops.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvScatterParams {
    kv_heads: u32,
    n: u32,
    head_dim: u32,
    pad_: u32,
}

/// Copies sequence `b` of `k`, `v` (`[batch, kv_heads, n, head_dim]`) into `dst[b]` (its
/// cache's reserved slots, `[1, kv_heads, n, head_dim]` views with a head's tokens contiguous
/// and K and V heads equally spaced), [`KV_BATCH`] sequences a launch. While a step is
/// captured, the slots go to the step's parameter area (one block for the whole batch) and
/// one launch reads them from there. `Ok(false)` without writing when a destination has
/// another shape, dtype or layout.
///
/// # Errors
/// CUDA errors.
pub(crate) fn kv_scatter_batch(k: &Tensor, v: &Tensor, dst: &[(Tensor, Tensor)]) -> Result<bool> {
    let (batch, kv_heads, n, head_dim) = k.dims4()?;
    let dtype = k.dtype();
    let Ok(name) = tn(dtype) else {
        return Ok(false);
    };
    if batch != dst.len() || v.dims() != k.dims() || v.dtype() != dtype {
        return Ok(false);
    }
    let fits = |t: &Tensor| fits_kv_slots(t, kv_heads, n, head_dim, dtype);
    let mut blocks = Vec::with_capacity(batch);
    for (kd, vd) in dst {
        if !fits(kd) || !fits(vd) || kd.stride()[1] != vd.stride()[1] {
            return Ok(false);
        }
        blocks.push(kv_destination(kd, vd)?);
    }
    let per_seq = kv_heads * n * head_dim;
    if per_seq == 0 || batch == 0 {
        return Ok(true);
    }
    let dev = cuda_dev(k)?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let params = KvScatterParams {
        kv_heads: u32_of(kv_heads, "kv heads")?,
        n: u32_of(n, "tokens")?,
        head_dim: u32_of(head_dim, "head dim")?,
        pad_: 0,
    };
    let scatter = Scatter {
        params,
        dtype,
        per_seq,
    };
    if graph::recording() {
        let slot = graph::Slot::KvDestination {
            seqs: u32_of(batch, "sequences")?,
        };
        let at = graph::record_slice(slot, &blocks)?
            .ok_or_else(|| candle_core::Error::Msg("not capturing a step".into()))?;
        let func = load_kernel(&dev, &format!("kv_scatter_dyn_{name}"), &LAYER_OPS)?;
        scatter.launch(&func, SlotArg::Recorded(at), &k, &v, 0, batch)?;
        return Ok(true);
    }
    let func = load_kernel(&dev, &format!("kv_scatter_batch_{name}"), &LAYER_OPS)?;
    for (c, chunk) in blocks.chunks(KV_BATCH).enumerate() {
        let mut table = KvBatchDst::default();
        table.d[..chunk.len()].copy_from_slice(chunk);
        let slots = SlotArg::Table(&table);
        scatter.launch(&func, slots, &k, &v, c * KV_BATCH, chunk.len())?;
    }
    Ok(true)
}

/// The shape of one batch's K/V scatter.
struct Scatter {
    params: KvScatterParams,
    dtype: DType,
    /// Elements of one sequence's K (or V) rows.
    per_seq: usize,
}

impl Scatter {
    /// Launches `func` over sequences `first..first + seqs` of contiguous `k`, `v`, one grid
    /// layer a sequence. The caller has checked every sequence's slots against this shape.
    fn launch(
        &self,
        func: &super::kernel_cache::Kernel,
        slots: SlotArg<'_, KvBatchDst>,
        k: &Tensor,
        v: &Tensor,
        first: usize,
        seqs: usize,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (
                self.per_seq.div_ceil(256).min(64) as u32,
                2,
                u32_of(seqs, "sequences")?,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let rows = first * self.per_seq..(first + seqs) * self.per_seq;
        by_dtype!(self.dtype, E, {
            bind!(kv_, k, E);
            bind!(vv_, v, E);
            let (kv_, vv_) = (kv_.slice(rows.clone()), vv_.slice(rows.clone()));
            let mut b = func.builder();
            b.arg(&self.params);
            match &slots {
                SlotArg::Recorded(at) => b.arg(at),
                SlotArg::Table(table) => b.arg(*table),
            };
            b.arg(&kv_);
            b.arg(&vv_);
            // SAFETY: arguments match the kernel's signature; every destination (a recorded
            // block is rewritten before each replay with destinations checked by the same
            // `kv_destination`) holds kv_heads heads of n tokens at its head stride.
            unsafe { b.launch(cfg) }.w()?;
            Ok::<(), candle_core::Error>(())
        })
    }
}

/// [`quantize`] of new K and V rows (`k`, `v`: `[1, kv_heads, n, head_dim]`) written straight
/// into a packed cache's reserved slots `dst` (codes, scales, biases of K, then of V; each
/// `[1, kv_heads, n, width]`), one launch for both, bit-exact with [`quantize`]. Returns
/// `Ok(false)` without writing when the destinations are not laid out as the kernel writes them
/// (tokens of a head contiguous, K and V alike, scales in `k`'s dtype): the caller then
/// quantizes and copies. While a step is captured, the slots go to the step's parameter area
/// (they move from step to step; the graph does not).
///
/// # Errors
/// Candle/CUDA errors.
pub(crate) fn quantize_kv_into(
    k: &Tensor,
    v: &Tensor,
    bits: crate::kernels::QuantBits,
    group_size: usize,
    dst: &[Tensor],
) -> Result<bool> {
    quantize_kv_into_batch(k, v, bits, group_size, &[dst.to_vec()])
}

/// [`quantize_kv_into`] for a batch: sequence `b` of `k`, `v` (`[batch, kv_heads, n,
/// head_dim]`) into `dst[b]` (each sequence's six packed slots), [`KVQ_BATCH`] sequences a
/// launch; while a step is captured, one launch reading every sequence's slots from the
/// step's parameter area. `Ok(false)` without writing when some sequence's slots are not laid
/// out as `quantize_into` writes them.
///
/// # Errors
/// Candle/CUDA errors.
pub(crate) fn quantize_kv_into_batch(
    k: &Tensor,
    v: &Tensor,
    bits: crate::kernels::QuantBits,
    group_size: usize,
    dst: &[Vec<Tensor>],
) -> Result<bool> {
    let (batch, _, _, hd) = k.dims4()?;
    if batch != dst.len()
        || v.dims() != k.dims()
        || v.dtype() != k.dtype()
        || kname(k.dtype()).is_err()
    {
        return Ok(false);
    }
    let want = (bits.bits() as u32, group_size as u32);
    let mut blocks = Vec::with_capacity(batch);
    for slots in dst {
        match kvq_destination(slots, hd, k.dtype())? {
            Some((block, quant)) if quant == want => blocks.push(block),
            _ => return Ok(false),
        }
    }
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    if graph::recording() {
        let slot = graph::Slot::KvQuantDestination {
            bits: want.0,
            group_size: want.1,
            seqs: u32_of(batch, "sequences")?,
        };
        let at = graph::record_slice(slot, &blocks)?
            .ok_or_else(|| candle_core::Error::Msg("not capturing a step".into()))?;
        let rows = 0..k.elem_count();
        launch_quantize_into(&k, &v, rows, bits, group_size, SlotArg::Recorded(at))?;
        return Ok(true);
    }
    let seq_len = k.elem_count() / batch.max(1);
    for (c, chunk) in blocks.chunks(KVQ_BATCH).enumerate() {
        let mut table = KvqBatch::default();
        table.d[..chunk.len()].copy_from_slice(chunk);
        let first = c * KVQ_BATCH * seq_len;
        let rows = first..first + chunk.len() * seq_len;
        launch_quantize_into(&k, &v, rows, bits, group_size, SlotArg::Table(&table))?;
    }
    Ok(true)
}

/// Where a K/V write launch finds its sequences' slots.
enum SlotArg<'a, T> {
    /// The device address of recorded slots, one per sequence, in a captured step's parameter
    /// area (the `_dyn` kernels).
    Recorded(u64),
    /// A table of up to 16 sequences' slots passed by value (the `_batch` kernels):
    /// [`KvBatchDst`] or [`KvqBatch`].
    Table(&'a T),
}

/// Launches the quantize-into kernel `slots` names over the sequences of contiguous `k`, `v`
/// (`[batch, kv_heads, n, head_dim]`) whose elements lie in `rows`, one grid layer a sequence.
/// The caller has checked every sequence's slots against this shape.
fn launch_quantize_into(
    k: &Tensor,
    v: &Tensor,
    rows: std::ops::Range<usize>,
    bits: crate::kernels::QuantBits,
    group_size: usize,
    slots: SlotArg<'_, KvqBatch>,
) -> Result<()> {
    let (_, kvh, n, hd) = k.dims4()?;
    let dtype = k.dtype();
    let tn = kname(dtype).map_err(candle_core::Error::wrap)?;
    let nb = bits.bits();
    let per_side = kvh * n * (hd / group_size);
    let sequences = rows.len() / (kvh * n * hd).max(1);
    if per_side == 0 || sequences == 0 {
        return Ok(());
    }
    let dev = cuda_dev(k)?;
    let params = QmatParams {
        rows: u32::try_from(per_side).map_err(candle_core::Error::wrap)?,
        out_dim: u32::try_from(n * (hd / group_size)).map_err(candle_core::Error::wrap)?,
        in_dim: hd as u32,
        group_size: group_size as u32,
    };
    let name = match slots {
        SlotArg::Recorded(_) => format!("quantize_into_dyn_{tn}_{nb}"),
        SlotArg::Table(_) => format!("quantize_into_batch_{tn}_{nb}"),
    };
    let func = load_kernel(&dev, &name, &QUANTIZE)?;
    let cfg = LaunchConfig {
        grid_dim: (per_side.div_ceil(128) as u32, 2, sequences as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    macro_rules! go {
        ($t:ty) => {{
            let (k_s, k_l) = k.storage_and_layout();
            let (v_s, v_l) = v.storage_and_layout();
            let kv_ = view::<$t>(cuda_storage(&k_s)?, k_l)?.slice(rows.clone());
            let vv_ = view::<$t>(cuda_storage(&v_s)?, v_l)?.slice(rows.clone());
            let mut bl = func.builder();
            bl.arg(&params);
            match &slots {
                SlotArg::Recorded(at) => bl.arg(at),
                SlotArg::Table(table) => bl.arg(*table),
            };
            bl.arg(&kv_);
            bl.arg(&vv_);
            // SAFETY: arguments match the kernel's signature; one thread per group of each side
            // of each sequence, every sequence's slots checked by the caller to hold kv_heads x
            // n groups at their strides (a recorded block is rewritten before each replay with
            // slots checked the same way, `kvq_destination`).
            unsafe { bl.launch(cfg) }.w()?;
        }};
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::F16 => go!(half::f16),
        _ => go!(half::bf16),
    }
    Ok(())
}

/// `struct KvqDst` in `quantize.cu`: where new K and V are quantized to (the six slot addresses
/// and their head strides, in code words and in scales).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct KvqDst {
    kc: u64,
    ks: u64,
    kb: u64,
    vc: u64,
    vs: u64,
    vb: u64,
    c_sh: u32,
    s_sh: u32,
}

/// Sequences one `quantize_into_batch` launch takes (`KVQ_BATCH` in `quantize.cu`).
pub(crate) const KVQ_BATCH: usize = 16;

/// `struct KvqBatch` in `quantize.cu`: the slots of up to [`KVQ_BATCH`] sequences, passed by
/// value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KvqBatch {
    d: [KvqDst; KVQ_BATCH],
}

/// The [`KvqDst`] of packed slots `dst` (codes, scales, biases of K then of V, `[1, kvh, n, ..]`
/// views, scales in `dtype`) for rows of `head_dim`, with the quantization their widths imply
/// (bits, group size); `None` when they are not laid out as `quantize_into`
/// writes them: rows of one head contiguous, K and V codes at one head stride, the four
/// scale/bias views at another.
///
/// # Errors
/// Slots not on a CUDA device.
pub(crate) fn kvq_destination(
    dst: &[Tensor],
    head_dim: usize,
    dtype: DType,
) -> Result<Option<(KvqDst, (u32, u32))>> {
    let [kc, ks, kb, vc, vs, vb] = dst else {
        return Ok(None);
    };
    let (Ok((_, kvh, n, words)), Ok((_, _, _, groups))) = (kc.dims4(), ks.dims4()) else {
        return Ok(None);
    };
    if head_dim == 0
        || groups == 0
        || (words * 32) % head_dim != 0
        || !head_dim.is_multiple_of(groups)
    {
        return Ok(None);
    }
    let (bits, group_size) = (words * 32 / head_dim, head_dim / groups);
    let fits = |t: &Tensor, width: usize, dt: DType| {
        let st = t.stride();
        t.dims() == [1, kvh, n, width]
            && t.dtype() == dt
            && st[3] == 1
            && (n == 1 || st[2] == width)
    };
    let s_sh = ks.stride()[1];
    let laid_out = matches!(bits, 4 | 8)
        && fits(kc, words, DType::U32)
        && fits(vc, words, DType::U32)
        && kc.stride()[1] == vc.stride()[1]
        && [ks, kb, vs, vb]
            .iter()
            .all(|t| fits(t, groups, dtype) && t.stride()[1] == s_sh);
    let (Ok(c_sh), Ok(s_sh)) = (u32::try_from(kc.stride()[1]), u32::try_from(s_sh)) else {
        return Ok(None);
    };
    if !laid_out {
        return Ok(None);
    }
    let dev = cuda_dev(kc)?;
    let a = |t: &Tensor| super::batched::address(t, &dev);
    let block = KvqDst {
        kc: a(kc)?,
        ks: a(ks)?,
        kb: a(kb)?,
        vc: a(vc)?,
        vs: a(vs)?,
        vb: a(vb)?,
        c_sh,
        s_sh,
    };
    Ok(Some((block, (bits as u32, group_size as u32))))
}
