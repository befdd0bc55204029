//! CUDA launchers for the quantized kernels in `qkernels.cu` (IMAGE embedded at build time, loaded
//! once per device by candle's module cache): fused quantized attention with flash-decoding
//! splits, the quantized matrix-vector product, and row dequantization (prefill GEMM and
//! embedding lookup).

use candle_core::cuda_backend::cudarc::driver::{
    sys, sys::CUdevice_attribute, CudaSlice, CudaView, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Storage, Tensor};

use super::kernel_cache::load_kernel;
use super::params::{
    balanced_split, combine_launch, row_matvec_split_for, split_bound, split_keys,
    split_min_keys_for, AttentionGeometry, CombineLaunch, KeySplit, QmatParams, QsdpaParams,
    SideStrides, QMATVEC_MMA_ROWS, QMATVEC_MMA_WARPS, QMATVEC_ROW_WARPS, QMATVEC_WARPS,
    QROW_MAX_WARPS, QSDPA_HEAD_DIMS, QSDPA_ROWS, QSDPA_TC_KEYS, QSDPA_TC_ROWS, QSDPA_WARPS,
};
use super::scratch::with_scratch;
use crate::kernels::layout::{last_dim_contiguous, scales_and_biases};
use crate::kernels::{dense, QueryPlan};
use crate::kv::{CacheError, KeyPositions, PackedKv};

/// The kernels' image (machine code for the build's compute capability, plus PTX), built by
/// `build.rs` from `qkernels.cu`.
pub(super) const IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/qkernels.fatbin"));
/// Name under which the loaded module is cached.
pub(super) const MODULE: &str = "candle_gemma_qkernels";

// SAFETY: both structs are `#[repr(C)]`, plain integers and floats, passed by value and read
// by the kernels with the same field layout.
unsafe impl DeviceRepr for QsdpaParams {}
unsafe impl DeviceRepr for QmatParams {}

/// Which algorithm the CUDA quantized attention uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QsdpaPath {
    /// Fused for short query blocks (decode), dequantize-then-dense for long prefills.
    #[default]
    Auto,
    /// Always the fused kernel (reads packed K/V in place, split over the key range).
    Fused,
    /// Dequantize K/V on the GPU, then the dense matmul attention.
    DequantDense,
}

/// Query blocks longer than this take the dequantize-then-dense path under [`QsdpaPath::Auto`]
/// (the fused kernel does no tensor-core work, so long prefills are faster through cuBLAS).
pub const FUSED_MAX_Q_LEN: usize = 16;

pub(super) fn kname(dtype: DType) -> Result<&'static str, CacheError> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        found => Err(CacheError::DType {
            what: "queries for the CUDA quantized kernels",
            expected: DType::BF16,
            found,
        }),
    }
}

pub(super) fn cuda_dev(t: &Tensor) -> candle_core::Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => candle_core::bail!("expected a CUDA tensor"),
    }
}

pub(super) fn cuda_storage(s: &Storage) -> candle_core::Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("expected CUDA storage"),
    }
}

/// A view of `t`'s buffer from its layout's start offset.
pub(super) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    layout: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(layout.start_offset()..))
}

/// Wraps a freshly written device buffer as a contiguous tensor.
pub(super) fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: &[usize]) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Multiprocessors of the device (132 on an H100 SXM), read once per process.
pub(super) fn sm_count(dev: &CudaDevice) -> usize {
    static SMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SMS.get_or_init(|| {
        dev.cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |n| n.max(1) as usize)
    })
}

/// `CANDLE_GEMMA_QSDPA_ROWS=2`: two query rows a block at decode instead of four (twice the
/// blocks over the same keys; an A/B switch).
fn decode_rows_two() -> bool {
    static TWO: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TWO.get_or_init(|| std::env::var("CANDLE_GEMMA_QSDPA_ROWS").is_ok_and(|v| v == "2"))
}

/// The fewest keys a flash-decoding split takes: [`split_min_keys_for`] the launch, or
/// `CANDLE_GEMMA_SPLIT_MIN_KEYS` for every launch (A/B switch).
fn split_min_keys(row_dims: usize, keys: usize, base_blocks: usize, resident: usize) -> usize {
    static MIN: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *MIN.get_or_init(|| {
        std::env::var("CANDLE_GEMMA_SPLIT_MIN_KEYS")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    forced.unwrap_or_else(|| split_min_keys_for(row_dims, keys, base_blocks, resident))
}

/// The key split of a launch: [`balanced_split`] where the kernel walks its keys one
/// 16-key step at a time, else [`split_keys`]' equal splits. Kernels that attend two staged
/// tiles a step take as many steps for 5 tiles as for 6, so splits one tile apart gain them
/// nothing: on an H100 (`bench-results/h100-s21-split-balance.md`) 31B full 4-bit at 8k keys
/// went 19.8 -> 20.2-20.3 µs and E4B full 4-bit 12.7 -> 12.8-12.9 when they were balanced.
/// `CANDLE_GEMMA_SPLIT_BALANCE=0` keeps equal splits everywhere and `CANDLE_GEMMA_SPLITS=N`
/// takes N splits (at most one wave), steps shared out as evenly, for A/B runs.
fn key_split(
    keys: usize,
    base_blocks: usize,
    resident: usize,
    min_keys: usize,
    sms: usize,
    one_tile_steps: bool,
) -> KeySplit {
    static KNOBS: std::sync::OnceLock<(bool, Option<usize>)> = std::sync::OnceLock::new();
    let (off, forced) = *KNOBS.get_or_init(|| {
        (
            std::env::var("CANDLE_GEMMA_SPLIT_BALANCE").is_ok_and(|v| v == "0"),
            std::env::var("CANDLE_GEMMA_SPLITS")
                .ok()
                .and_then(|v| v.parse().ok()),
        )
    });
    if let Some(n) = forced {
        return KeySplit::even(keys, n.min(split_bound(base_blocks, resident)));
    }
    if off || !one_tile_steps {
        let (n, per) = split_keys(keys, base_blocks, resident, min_keys);
        return KeySplit { n, per, long: 0 };
    }
    balanced_split(keys, base_blocks, resident, min_keys, sms)
}

/// Fused quantized attention of one sequence on a CUDA device: the host API behind
/// [`crate::kernels::attend`] for [`crate::kv::KvData::Packed`] on CUDA.
///
/// * `q`: `[1, n_heads, q_len, head_dim]` (f32, f16 or bf16), on a CUDA device.
/// * `k`, `v`: packed `[1, kv_heads, keys, ..]` on the same device, same bits and group size;
///   scales/biases in `q`'s dtype (converted otherwise).
/// * `positions[j]`: absolute position of key `j`; `q_offset`: position of query 0;
///   `window`: `Some(W)` on sliding layers; `scale`: score multiplier.
///
/// Returns `[1, n_heads, q_len, head_dim]` in `q`'s dtype. Queries that see no key get zeros.
///
/// # Errors
/// [`CacheError::Shape`] for mismatched shapes or an unsupported head dimension (32, 64, 128,
/// 256 or 512), [`CacheError::BadGroupSize`], [`CacheError::DType`] for a non-float query,
/// candle/CUDA errors.
#[allow(clippy::too_many_arguments)]
pub fn attend_packed_cuda(
    q: &Tensor,
    k: &PackedKv,
    v: &PackedKv,
    positions: &KeyPositions,
    q_offset: usize,
    window: Option<usize>,
    scale: f64,
    path: QsdpaPath,
) -> Result<Tensor, CacheError> {
    let plan = QueryPlan {
        q_offset,
        window,
        scale,
    };
    attend_packed(q, k, v, positions, &plan, path)
}

/// [`attend_packed_cuda`] with the dispatcher's [`QueryPlan`].
pub(crate) fn attend_packed(
    q: &Tensor,
    k: &PackedKv,
    v: &PackedKv,
    positions: &KeyPositions,
    plan: &QueryPlan,
    path: QsdpaPath,
) -> Result<Tensor, CacheError> {
    let (_, _, q_len, _) = q.dims4()?;
    let fused = match path {
        QsdpaPath::Auto => q_len <= FUSED_MAX_Q_LEN,
        QsdpaPath::Fused => true,
        QsdpaPath::DequantDense => false,
    };
    if fused {
        attend_fused(
            q,
            KvOperand::Packed(k),
            KvOperand::Packed(v),
            positions,
            plan,
        )
    } else {
        let kd = dequantize_kv(k, q.dtype())?;
        let vd = dequantize_kv(v, q.dtype())?;
        Ok(dense::attend_dense(q, &kd, &vd, &positions.to_vec(), plan)?)
    }
}

/// Dense `[1, kvh, keys, head_dim]` in `dtype` from packed K or V, on the GPU.
///
/// # Errors
/// Shape, dtype and CUDA errors.
pub fn dequantize_kv(p: &PackedKv, dtype: DType) -> Result<Tensor, CacheError> {
    let (b, kvh, keys, words) = p.codes.dims4()?;
    let bits = p.bits.bits();
    let hd = words * 32 / bits;
    let rows = b * kvh * keys;
    let codes = p.codes.contiguous()?.reshape((rows, words))?;
    let scales = p.scales.contiguous()?.reshape((rows, hd / p.group_size))?;
    let biases = p.biases.contiguous()?.reshape((rows, hd / p.group_size))?;
    let dense = dequant_rows(&codes, &scales, &biases, bits, p.group_size, None, dtype)?;
    Ok(dense.reshape((b, kvh, keys, hd))?)
}

/// K or V as the attention kernel reads it.
#[derive(Clone, Copy)]
pub(crate) enum KvOperand<'a> {
    /// MLX affine codes with scales and biases.
    Packed(&'a PackedKv),
    /// Dense `[1, kv_heads, keys, head_dim]` in the queries' dtype.
    Dense(&'a Tensor),
}

impl KvOperand<'_> {
    /// Bits per element as the kernel names them (4/8 packed, 16/32 dense).
    fn bits(&self, dtype: DType) -> usize {
        match self {
            KvOperand::Packed(p) => p.bits.bits(),
            KvOperand::Dense(_) => 8 * dtype.size_in_bytes(),
        }
    }

    fn group_size(&self) -> usize {
        match self {
            KvOperand::Packed(p) => p.group_size,
            KvOperand::Dense(_) => 0,
        }
    }

    /// `(kv_heads, keys)`.
    fn dims(&self) -> candle_core::Result<(usize, usize)> {
        let (_, kvh, keys, _) = match self {
            KvOperand::Packed(p) => p.codes.dims4()?,
            KvOperand::Dense(t) => t.dims4()?,
        };
        Ok((kvh, keys))
    }
}

/// One side (K or V) ready for the kernel: the word tensor with its head/key strides in words,
/// and scales/biases with theirs (the word tensor again for dense operands, never read).
pub(super) struct KernelSide {
    pub(super) words: Tensor,
    pub(super) scales: Tensor,
    pub(super) biases: Tensor,
    strides: SideStrides,
}

pub(super) fn kernel_side(side: KvOperand<'_>, dtype: DType) -> candle_core::Result<KernelSide> {
    let cast = |t: &Tensor| -> candle_core::Result<Tensor> {
        if t.dtype() == dtype {
            Ok(t.clone())
        } else {
            t.to_dtype(dtype)
        }
    };
    match side {
        KvOperand::Packed(p) => {
            // Lanes load up to 16 bytes of codes at once: the start and both strides must be
            // multiples of 4 words, else the view is copied into a fresh (aligned) buffer; a
            // key's words, head_dim * bits / 32, are a multiple of 4 for every head dim.
            // (`contiguous` would keep a contiguous view's misaligned start.)
            let (mut words, mut words_sh, mut words_sk) = last_dim_contiguous(&p.codes)?;
            let aligned = |x: usize| x % 4 == 0;
            if !(aligned(words.layout().start_offset())
                && aligned(words_sh as usize)
                && aligned(words_sk as usize))
            {
                (words, words_sh, words_sk) = last_dim_contiguous(&words.force_contiguous()?)?;
            }
            let (scales, biases, sc_sh, sc_sk) = scales_and_biases(p, dtype)?;
            Ok(KernelSide {
                words,
                scales,
                biases,
                strides: SideStrides {
                    codes_sh: words_sh,
                    codes_sk: words_sk,
                    sc_sh,
                    sc_sk,
                },
            })
        }
        KvOperand::Dense(t) => {
            // Lanes load 16-byte chunks: the start and both strides must be multiples of 16
            // bytes, else the view is copied (a fresh buffer is aligned).
            let per_word = 4 / dtype.size_in_bytes();
            let aligned = |x: usize| x % (4 * per_word) == 0;
            let t = cast(t)?;
            let (mut w, mut sh, mut sk) = last_dim_contiguous(&t)?;
            if !(aligned(w.layout().start_offset()) && aligned(sh as usize) && aligned(sk as usize))
            {
                (w, sh, sk) = last_dim_contiguous(&w.force_contiguous()?)?;
            }
            Ok(KernelSide {
                scales: w.clone(),
                biases: w.clone(),
                words: w,
                strides: SideStrides {
                    codes_sh: sh / per_word as u64,
                    codes_sk: sk / per_word as u64,
                    sc_sh: 0,
                    sc_sk: 0,
                },
            })
        }
    }
}

/// Dense attention of one sequence on CUDA through the fused kernel (K/V read in place, masks
/// from positions, flash-decoding splits): `q` `[1, n_heads, q_len, head_dim]`, `k`/`v`
/// `[1, kv_heads, keys, head_dim]`. Returns `[1, n_heads, q_len, head_dim]` in `q`'s dtype.
pub(crate) fn attend_dense_fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, CacheError> {
    attend_fused(q, KvOperand::Dense(k), KvOperand::Dense(v), positions, plan)
}

/// One sequence's attention launch, planned on the host: kernel parameters (split included),
/// the K/V operands as the kernel reads them, and the position table when positions do not
/// run in one or two ascending runs.
pub(super) struct SeqPlan {
    pub(super) params: QsdpaParams,
    pub(super) ks: KernelSide,
    pub(super) vs: KernelSide,
    pub(super) table: Vec<u32>,
    /// Query rows per block.
    pub(super) nq: usize,
    pub(super) row_blocks: usize,
    pub(super) n_split: usize,
    /// The most splits this shape takes at any number of keys.
    pub(super) split_bound: usize,
    /// Bits per K/V element as the kernel names them (4/8 packed, 16/32 dense).
    pub(super) bits: usize,
    pub(super) dense: bool,
    /// Whether the tensor-core kernel (`qsdpa_tc_*`) runs it rather than the CUDA-core one.
    pub(super) tensor_cores: bool,
    /// Shared-memory tile stages of the tensor-core kernel over packed K/V (0: tiles in
    /// registers), and the dynamic shared memory a block takes for them.
    pub(super) stages: usize,
    pub(super) smem: u32,
    /// Whether the tensor-core kernel folds the value scales into P ([`folds_values`]).
    pub(super) fold_values: bool,
    /// The settled keys ([`KeyPositions::settled_keys`]) as the one-sequence kernels take
    /// them: `start | end << 32` (0: none).
    pub(super) settled: u64,
}

impl SeqPlan {
    /// The attention kernel's name, for one sequence or (`batch`) for a batch launch.
    pub(super) fn kernel_name(&self, dtype: DType, batch: bool) -> Result<String, CacheError> {
        let hd = self.params.head_dim as usize;
        kernel_name_of(
            dtype,
            hd,
            self.bits,
            self.nq,
            self.tensor_cores,
            self.stages,
            self.fold_values,
            batch,
        )
    }

    /// Threads a block.
    pub(super) fn block_threads(&self) -> u32 {
        if self.tensor_cores {
            tc_threads(self.params.head_dim as usize)
        } else {
            (QSDPA_WARPS * 32) as u32
        }
    }
}

/// The split-combining kernel `launch` names for queries of type `tn`, for one sequence or
/// (`batch`) a batch launch.
pub(super) fn combine_kernel_name(launch: &CombineLaunch, tn: &str, batch: bool) -> String {
    let b = if batch { "batch_" } else { "" };
    format!("{}_{b}{tn}", launch.kernel)
}

/// Threads a tensor-core attention block: one warp per 128 head dims.
fn tc_threads(head_dim: usize) -> u32 {
    (head_dim / 128 * 32) as u32
}

/// Whether the tensor-core kernel folds the value scales into P (`qsdpa_tc_fv_*`, see
/// `qt_value_frag_folded` in qsdpa_tc.cuh): 4-bit codes whose tiles sit in registers, in groups
/// of 64 (an m-tile of the output mma must lie in one group, and a lane reads both of its
/// groups' scales in one 4-byte load: `aligned` is [`scales_stageable`]). The output mma then
/// reads the codes without dequantizing them. Measured on an H100 (`bench_kernels
/// --attention-only`, `bench-results/h100-s25-fold.md`). `CANDLE_GEMMA_QT_FOLD=0` turns it off
/// (A/B).
fn folds_values(bits: usize, stages: usize, group_size: usize, aligned: bool) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("CANDLE_GEMMA_QT_FOLD").is_ok_and(|v| v == "0"));
    !off && bits == 4 && stages == 0 && group_size == 64 && aligned
}

#[allow(clippy::too_many_arguments)]
fn kernel_name_of(
    dtype: DType,
    hd: usize,
    bits: usize,
    nq: usize,
    tensor_cores: bool,
    stages: usize,
    fold_values: bool,
    batch: bool,
) -> Result<String, CacheError> {
    let tn = kname(dtype)?;
    let b = if batch { "batch_" } else { "" };
    Ok(if tensor_cores {
        if stages > 0 {
            let nts = tc_staging(hd, bits).tiles_per_stage;
            format!("qsdpa_tc_s{stages}x{nts}_{b}{tn}_{hd}_{bits}")
        } else if fold_values {
            format!("qsdpa_tc_fv_{b}{tn}_{hd}_{bits}")
        } else {
            format!("qsdpa_tc_{b}{tn}_{hd}_{bits}")
        }
    } else {
        format!("qsdpa_{b}{tn}_{hd}_{bits}_{nq}")
    })
}

/// How the tensor-core kernel runs over packed K/V of one head dim and bit width: tiles in
/// registers (`stages` 0), or staged in shared memory `stages` steps deep, `tiles_per_stage`
/// 16-key tiles a step; `blocks_per_sm` pins the blocks a multiprocessor holds (by padding the
/// shared memory a block takes) where the driver would fit more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TcStaging {
    pub(super) stages: usize,
    pub(super) tiles_per_stage: usize,
    pub(super) blocks_per_sm: Option<usize>,
}

/// The staging measured best on an H100 at 32k keys (`device-run.sh attnvar`,
/// `bench-results/h100-s17-attn-staged-*.jsonl`): 8-bit codes and 4-bit codes at head dim 512
/// are staged. 4-bit codes at head dim 256 kept their tiles in registers (staging one tile a
/// step ran 4-17% slower on E4B sliding); since the twentieth session they are staged two
/// tiles a step except for 1-2 KV heads ([`registers_for_few_heads`]). 8-bit at head dim 256
/// was pinned at 6 blocks a multiprocessor until the eighteenth session's cheaper combine made
/// the 8 that fit (more, shorter splits) faster again (E4B sliding 26.7-27.6 -> 26.3-26.4 µs,
/// 31B sliding 118.4-121.0 -> 114.5-118.2; `bench-results/h100-s18-attn-pins.md`; no other pin
/// helped). `CANDLE_GEMMA_QT_STAGED=0` keeps every tile in registers (A/B).
pub(super) fn tc_staging(head_dim: usize, bits: usize) -> TcStaging {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("CANDLE_GEMMA_QT_STAGED").is_ok_and(|v| v == "0"));
    let registers = TcStaging {
        stages: 0,
        tiles_per_stage: 1,
        blocks_per_sm: None,
    };
    let staged = |tiles_per_stage, blocks_per_sm| TcStaging {
        stages: 2,
        tiles_per_stage,
        blocks_per_sm,
    };
    let chosen = match (head_dim, bits) {
        _ if off => registers,
        (256, 8) | (512, 8) => staged(1, None),
        (512, 4) | (256, 4) => staged(2, None),
        _ => registers,
    };
    match pin_override(head_dim, bits) {
        Some(n) => TcStaging {
            blocks_per_sm: (n > 0).then_some(n),
            ..chosen
        },
        None => chosen,
    }
}

/// `CANDLE_GEMMA_QT_PIN=HDxBITS=N,..` (e.g. `256x8=8,512x4=3`): pins N blocks a multiprocessor
/// for that head dim and bit width (0: no pin), overriding [`tc_staging`]'s table, for A/B runs.
fn pin_override(head_dim: usize, bits: usize) -> Option<usize> {
    static PINS: std::sync::OnceLock<Vec<((usize, usize), usize)>> = std::sync::OnceLock::new();
    let pins = PINS.get_or_init(|| {
        let spec = std::env::var("CANDLE_GEMMA_QT_PIN").unwrap_or_default();
        spec.split(',')
            .filter_map(|item| {
                let (shape, n) = item.split_once('=')?;
                let (hd, b) = shape.split_once('x')?;
                Some(((hd.parse().ok()?, b.parse().ok()?), n.parse().ok()?))
            })
            .collect()
    });
    pins.iter()
        .find(|(shape, _)| *shape == (head_dim, bits))
        .map(|&(_, n)| n)
}

/// Bytes of one shared-memory stage (`qt_stage_bytes` times the tiles a stage): 16 keys of K
/// and V codes a tile, and their scales and biases sized for groups of 32.
fn tc_stage_bytes(head_dim: usize, bits: usize, tiles: usize) -> usize {
    tiles * QSDPA_TC_KEYS * (2 * head_dim * bits / 8 + 4 * (head_dim / 32) * 2)
}

/// Dynamic shared memory a staged block asks for: its stages, or more where `staging` pins the
/// blocks a multiprocessor holds (a share just over one `blocks_per_sm + 1`-th of it).
fn tc_block_smem(dev: &CudaDevice, head_dim: usize, bits: usize, staging: TcStaging) -> u32 {
    let stages = staging.stages * tc_stage_bytes(head_dim, bits, staging.tiles_per_stage);
    let pinned = staging.blocks_per_sm.map_or(0, |n| {
        static SMEM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let per_sm = *SMEM.get_or_init(|| {
            dev.cuda_stream()
                .context()
                .attribute(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                )
                .map_or(0, |n| n.max(0) as usize)
        });
        per_sm / (n + 1)
    });
    stages.max(pinned) as u32
}

/// Whether a launch over `keys` keys with `base_blocks` blocks a key split (KV heads x row
/// blocks) keeps tiles at head dim 256 in registers although [`tc_staging`] stages them: at
/// most 4 such blocks (1-2 KV heads, as in E4B's and E2B's sliding layers), and for 8-bit codes
/// fewer than 64k keys.
///
/// 4-bit codes (twentieth session, `bench_kernels --attention-only --shape S`, two rounds,
/// `bench-results/h100-s20-staged256x4-*`): staged two tiles a step, 31B sliding (16 KV heads)
/// took 8.5-8.8 µs at 1k keys against 9.6-9.7 in registers, 68.9 against 72.2-72.6 at 32k,
/// 248.9 against 256.1-256.2 at 128k; E4B sliding was slower staged at 1k and 8k keys (6.0-6.1
/// against 5.8, 9.7-9.8 against 9.4-9.5) and the same at 32k (16.7-17.0 against 16.9-17.2).
/// 8-bit codes (nineteenth session, timed on the GPU alone: `bench_kernels`' `queued_seconds`,
/// two rounds each; `bench-results/h100-s19-attn-knobs.md`, `h100-s19-attn-staged-*.jsonl`,
/// `h100-s19-attn-registers-*.jsonl`), E4B sliding 8-bit, registers against staged: 13.4
/// against 13.9 µs at 8k keys, 25.3-25.4 against 25.8-25.9 at 32k, 69.2-69.3 against
/// 65.2-65.9 at 128k, 8.0-8.1 either way at 1k. 31B sliding (16 KV heads) at 32k took
/// 122.1-122.9 in registers against 112.3-112.4 staged.
fn registers_for_few_heads(head_dim: usize, bits: usize, base_blocks: usize, keys: usize) -> bool {
    match (head_dim, bits) {
        (256, 4) => base_blocks <= 4,
        (256, 8) => base_blocks <= 4 && keys < 1 << 16,
        _ => false,
    }
}

/// Whether both sides' scales and biases can be staged in 4-byte copies: every key's and
/// head's first value at an even element.
fn scales_stageable(sides: [&KernelSide; 2]) -> bool {
    sides.iter().all(|s| {
        s.scales.layout().start_offset() % 2 == 0
            && s.biases.layout().start_offset() % 2 == 0
            && s.strides.sc_sh % 2 == 0
            && s.strides.sc_sk % 2 == 0
    })
}

/// Whether attention with these operands runs on the tensor-core kernel: f16/bf16 queries,
/// head dim 256 or 512, 4/8-bit codes (groups of a multiple of 32) or dense K/V in the query's
/// type. Measured on an H100 (`bench_kernels`; see the README's Performance section).
/// `CANDLE_GEMMA_QSDPA_TC=0` keeps the CUDA-core kernel, for comparison.
fn uses_tensor_core_attention(dtype: DType, head_dim: usize, bits: usize, group: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("CANDLE_GEMMA_QSDPA_TC").is_ok_and(|v| v == "0"));
    !off && matches!(dtype, DType::F16 | DType::BF16)
        && matches!(head_dim, 256 | 512)
        && match bits {
            4 | 8 => group % 32 == 0 && group > 0,
            16 => true,
            _ => false,
        }
}

/// Plans one sequence: `q` is `[.., n_heads, q_len, head_dim]` in `dtype`.
#[allow(clippy::too_many_arguments)] // the query's shape and dtype, the view, the plan
pub(super) fn plan_seq(
    n_heads: usize,
    q_len: usize,
    head_dim: usize,
    dtype: DType,
    k: KvOperand<'_>,
    v: KvOperand<'_>,
    positions: &KeyPositions,
    plan: &QueryPlan,
    dev: &CudaDevice,
) -> Result<SeqPlan, CacheError> {
    let (kv_heads, keys) = k.dims()?;
    kname(dtype)?;
    let bits = k.bits(dtype);
    if !QSDPA_HEAD_DIMS.contains(&head_dim)
        || bits != v.bits(dtype)
        || k.group_size() != v.group_size()
    {
        return Err(CacheError::Shape {
            what: "CUDA fused attention",
            expected: format!(
                "head_dim in {QSDPA_HEAD_DIMS:?}, K and V with the same bits and group size"
            ),
            found: vec![
                head_dim,
                bits,
                v.bits(dtype),
                k.group_size(),
                v.group_size(),
            ],
        });
    }
    let ks = kernel_side(k, dtype)?;
    let vs = kernel_side(v, dtype)?;
    let geometry = AttentionGeometry {
        n_heads,
        kv_heads,
        q_len,
        head_dim,
        keys,
        // Dense operands have no groups; any non-zero value keeps the index arithmetic finite.
        group_size: k.group_size().max(1),
    };
    let (mut params, table) = QsdpaParams::for_sequence(
        "CUDA fused attention (keys, last query position)",
        &geometry,
        ks.strides,
        vs.strides,
        positions,
        plan,
    )?;
    let rows = n_heads / kv_heads * q_len;
    // Query rows per block: 2 when a KV head serves at most 2 rows (31B sliding decode) or for
    // 4-bit K/V at head dim 512 (4 rows there take ~220 registers a thread; measured on an H100
    // at 32k keys: 363 -> 315 us on the 31B full-layer shape, where 8-bit got slower), else 4.
    let nq = if rows <= 2 || (head_dim >= 512 && bits == 4) || q_len == 1 && decode_rows_two() {
        2
    } else {
        QSDPA_ROWS
    };
    let tensor_cores = uses_tensor_core_attention(dtype, head_dim, bits, k.group_size());
    let nq = if tensor_cores { QSDPA_TC_ROWS } else { nq };
    let row_blocks = rows.div_ceil(nq);
    // The CUDA-core kernel fills the GPU about four times over; the tensor-core one once (the
    // blocks it holds at once: one wave, no tail).
    let sms = sm_count(dev);
    let staging = tc_staging(head_dim, bits);
    // Scales and biases at even elements: stageable in 4-byte copies, and foldable.
    let aligned = scales_stageable([&ks, &vs]);
    let mut stages = if tensor_cores
        && matches!(bits, 4 | 8)
        && aligned
        && !registers_for_few_heads(head_dim, bits, row_blocks * kv_heads, keys)
    {
        staging.stages
    } else {
        0
    };
    // A pin pads the shared memory of register-tile blocks too.
    let mut smem = if stages > 0 || (tensor_cores && staging.blocks_per_sm.is_some()) {
        tc_block_smem(dev, head_dim, bits, TcStaging { stages, ..staging })
    } else {
        0
    };
    let fold = |stages| tensor_cores && folds_values(bits, stages, k.group_size(), aligned);
    let resident = if tensor_cores {
        let threads = tc_threads(head_dim);
        let name = kernel_name_of(dtype, head_dim, bits, nq, true, stages, fold(stages), false)?;
        let staged = load_kernel(dev, &name, MODULE, IMAGE)?.resident_blocks_with(threads, smem);
        let blocks = match staged {
            Some(n) => Some(n),
            None if stages > 0 => {
                // The device refused the stages' shared memory: tiles in registers.
                (stages, smem) = (0, 0);
                let name = kernel_name_of(dtype, head_dim, bits, nq, true, 0, fold(0), false)?;
                load_kernel(dev, &name, MODULE, IMAGE)?.resident_blocks(threads)
            }
            None => None,
        };
        blocks.map_or(4 * sms, |n| n.max(1) * sms)
    } else {
        4 * sms
    };
    let split = key_split(
        keys.max(1),
        row_blocks * kv_heads,
        resident,
        split_min_keys(
            n_heads * q_len * head_dim,
            keys,
            row_blocks * kv_heads,
            resident,
        ),
        sms,
        !(tensor_cores && stages > 0 && staging.tiles_per_stage > 1),
    );
    let n_split = split.n;
    params.set_split(split)?;
    let split_bound = split_bound(row_blocks * kv_heads, resident);

    Ok(SeqPlan {
        params,
        ks,
        vs,
        table,
        nq,
        row_blocks,
        n_split,
        split_bound,
        bits,
        dense: matches!(k, KvOperand::Dense(_)),
        tensor_cores,
        stages,
        smem,
        fold_values: fold(stages),
        settled: settled_arg(positions, keys),
    })
}

/// The one-sequence kernels' last argument: the keys marked settled
/// ([`KeyPositions::settled_keys`]) as `start | end << 32`, 0 for none. The tensor-core kernels
/// load a split's first tile (or stage) before waiting for the kernel ahead when it lies there.
///
/// Packed register-tile kernels also ask L2 for the split's second tile there.
///
/// Measured on an H100 (`bench_kernels --attention-only`, GPU-only µs, the previous binary and
/// this one alternating, two rounds; `bench-results/h100-s23-attn-early.md`): E4B sliding
/// 4-bit at 32k keys 16.2-16.3 -> 14.7-14.8, dense 30.2 -> 28.8; 31B sliding 4-bit at 32k 69.2
/// -> 66.8; 1k points 0.7-2.1 µs faster except 31B sliding 4-bit (8.0 -> 8.3-8.4). The L2
/// prefetch then took E4B sliding 4-bit at 32k to 14.3-14.4
/// (`bench-results/h100-s24-attn-prefetch.md`).
fn settled_arg(positions: &KeyPositions, keys: usize) -> u64 {
    let r = positions.settled_keys();
    match (u32::try_from(r.start), u32::try_from(r.end.min(keys))) {
        (Ok(lo), Ok(hi)) if lo < hi => u64::from(lo) | (u64::from(hi) << 32),
        _ => 0,
    }
}

fn attend_fused(
    q: &Tensor,
    k: KvOperand<'_>,
    v: KvOperand<'_>,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, CacheError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let dtype = q.dtype();
    let tn = kname(dtype)?;
    let dev = cuda_dev(q)?;
    let q = q.contiguous()?;
    let seq_plan = plan_seq(n_heads, q_len, head_dim, dtype, k, v, positions, plan, &dev)?;
    let name = seq_plan.kernel_name(dtype, false)?;
    let threads = seq_plan.block_threads();
    let SeqPlan {
        params,
        ks,
        vs,
        table,
        row_blocks,
        n_split,
        dense,
        smem,
        settled,
        ..
    } = seq_plan;
    let kv_heads = params.kv_heads as usize;
    let rows = n_heads / kv_heads * q_len;
    let out_len = n_heads * q_len * head_dim;
    let total_rows = kv_heads * rows;
    // Without a table or splits the kernel never touches these buffers: pass the K words
    // instead of allocating placeholders.
    let pos_buf: Option<CudaSlice<u32>> = if table.is_empty() {
        None
    } else {
        Some(dev.clone_htod(&table)?)
    };
    // Every element of the partial buffers that is read is written first (each split block
    // writes all its rows): per-thread scratch buffers, only used between the two launches.
    let (ml_len, acc_len) = if n_split > 1 {
        (n_split * total_rows * 2, n_split * total_rows * head_dim)
    } else {
        (0, 0)
    };

    let main_cfg = LaunchConfig {
        grid_dim: (row_blocks as u32, kv_heads as u32, n_split as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let combine = combine_launch(n_split);
    let comb_cfg = LaunchConfig {
        grid_dim: (total_rows as u32, head_dim.div_ceil(combine.dims) as u32, 1),
        block_dim: (combine.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = load_kernel(&dev, &name, MODULE, IMAGE)?;
    let comb = load_kernel(
        &dev,
        &combine_kernel_name(&combine, tn, false),
        MODULE,
        IMAGE,
    )?;

    macro_rules! go {
        ($t:ty) => {{
            // SAFETY: uninitialised, then fully written by the kernel before it is read.
            let mut out = unsafe { dev.alloc::<$t>(out_len)? };
            with_scratch::<f32, _>(&dev, "qsdpa_ml", ml_len, |ml| {
                with_scratch::<f32, _>(&dev, "qsdpa_acc", acc_len, |acc| {
                    let parts = (n_split > 1).then_some((&*ml, &*acc));
                    {
                        let (q_s, q_l) = q.storage_and_layout();
                        let (kc_s, kc_l) = ks.words.storage_and_layout();
                        let (ks_s, ks_l) = ks.scales.storage_and_layout();
                        let (kb_s, kb_l) = ks.biases.storage_and_layout();
                        let (vc_s, vc_l) = vs.words.storage_and_layout();
                        let (vs_s, vs_l) = vs.scales.storage_and_layout();
                        let (vb_s, vb_l) = vs.biases.storage_and_layout();
                        let qv = view::<$t>(cuda_storage(&q_s)?, q_l)?;
                        let ksv = view::<$t>(cuda_storage(&ks_s)?, ks_l)?;
                        let kbv = view::<$t>(cuda_storage(&kb_s)?, kb_l)?;
                        let vsv = view::<$t>(cuda_storage(&vs_s)?, vs_l)?;
                        let vbv = view::<$t>(cuda_storage(&vb_s)?, vb_l)?;
                        // Dense words are the elements themselves (the kernel reads them as
                        // u32 words).
                        let (kcv, vcv);
                        let (kcd, vcd);
                        let mut b = func.builder();
                        b.arg(&params);
                        b.arg(&qv);
                        if dense {
                            kcd = view::<$t>(cuda_storage(&kc_s)?, kc_l)?;
                            b.arg(&kcd);
                        } else {
                            kcv = view::<u32>(cuda_storage(&kc_s)?, kc_l)?;
                            b.arg(&kcv);
                        }
                        b.arg(&ksv);
                        b.arg(&kbv);
                        if dense {
                            vcd = view::<$t>(cuda_storage(&vc_s)?, vc_l)?;
                            b.arg(&vcd);
                        } else {
                            vcv = view::<u32>(cuda_storage(&vc_s)?, vc_l)?;
                            b.arg(&vcv);
                        }
                        b.arg(&vsv);
                        b.arg(&vbv);
                        match &pos_buf {
                            Some(p) => b.arg(p),
                            None => b.arg(&ksv),
                        };
                        b.arg(&mut out);
                        match parts {
                            Some((ml, acc)) => {
                                b.arg(ml);
                                b.arg(acc);
                            }
                            None => {
                                b.arg(&ksv);
                                b.arg(&ksv);
                            }
                        }
                        b.arg(&settled);
                        // SAFETY: argument list and types match the kernel's signature; grid within
                        // the buffers' sizes (checked shapes above).
                        unsafe { b.launch(main_cfg) }.w()?;
                    }
                    if let Some((ml, acc)) = parts {
                        let mut b = comb.builder();
                        b.arg(&params);
                        b.arg(ml);
                        b.arg(acc);
                        b.arg(&mut out);
                        // SAFETY: as above.
                        unsafe { b.launch(comb_cfg) }.w()?;
                    }
                    Ok(())
                })
            })?;
            wrap(out, &dev, &[1, n_heads, q_len, head_dim])
        }};
    }
    let out = match dtype {
        DType::F32 => go!(f32),
        DType::F16 => go!(half::f16),
        _ => go!(half::bf16),
    };
    Ok(out)
}

/// Whether [`qmatvec`] takes the tensor-core kernel: f16/bf16 activations, MLX group sizes, and
/// not a single row of 8-bit or group-32 codes. Measured on an H100 (`bench_kernels
/// --matmul-only`, 31B shapes): the tensor-core kernel is 2.5-6x faster at 8 rows and up to
/// 1.35x faster for one 4-bit row at groups 64/128, but the SIMT kernel is faster for one 8-bit
/// row and for one 4-bit row at group 32. f32 activations keep the SIMT kernel, whose products
/// stay in f32. `CANDLE_GEMMA_QMV_SIMT=1` forces the SIMT kernel, for comparison.
fn uses_tensor_core_matvec(
    x_dtype: DType,
    rows: usize,
    bits: usize,
    group_size: usize,
    in_dim: usize,
) -> bool {
    static FORCE_SIMT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let force_simt =
        *FORCE_SIMT.get_or_init(|| std::env::var("CANDLE_GEMMA_QMV_SIMT").is_ok_and(|v| v == "1"));
    matches!(x_dtype, DType::BF16 | DType::F16)
        && matches!(group_size, 32 | 64 | 128)
        && in_dim % group_size == 0
        && (rows > 1 || (bits == 4 && group_size > 32))
        && !force_simt
}

/// Resident blocks a multiprocessor `qmv_tc4` is compiled for: 4 (registers capped at 64,
/// 32 warps an SM), measured 5-10% faster on an H100 than the uncapped build (3 blocks, 76
/// registers) on the 31B projections. `CANDLE_GEMMA_QTC_BLOCKS=1` takes the uncapped one, `=2`
/// the 128-register one with four chunks a step (measured 0.42-0.51 of the copy bandwidth
/// against 0.49-0.61 for the default, `bench-results/h100-s6-qtc-variants.jsonl`).
fn tc4_blocks() -> usize {
    static B: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *B.get_or_init(
        || match std::env::var("CANDLE_GEMMA_QTC_BLOCKS").as_deref() {
            Ok("1") => 1,
            Ok("2") => 2,
            _ => 4,
        },
    )
}

/// Whether [`qmatvec`] takes `qmv_tc4`, which dequantizes 4-bit codes to the activation type
/// in registers (one rounding per weight, as dequantizing W first would) and accumulates whole
/// rows on the tensor cores: f16/bf16 activations with scales and biases of the same type,
/// groups of a multiple of 32. `CANDLE_GEMMA_QMV=old` keeps the earlier kernels, for comparison.
fn dequantizes_before_mma(
    x_dtype: DType,
    scale_dtype: DType,
    bias_dtype: DType,
    bits: usize,
    group_size: usize,
    in_dim: usize,
) -> bool {
    static OLD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let old = *OLD.get_or_init(|| std::env::var("CANDLE_GEMMA_QMV").is_ok_and(|v| v == "old"));
    matches!(x_dtype, DType::BF16 | DType::F16)
        && scale_dtype == x_dtype
        && bias_dtype == x_dtype
        && bits == 4
        && group_size >= 32
        && group_size % 32 == 0
        && in_dim % group_size == 0
        && !old
}

/// Whether one activation row takes `qmv_row4` (row-contiguous loads, same rounding as
/// `qmv_tc4`) when `qmv_tc4` would serve: measured 0.55-0.75 of the copy bandwidth against
/// 0.51-0.64 on the 31B projections. `CANDLE_GEMMA_QROW=off` keeps `qmv_tc4`, for comparison.
fn row_contiguous_matvec() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CANDLE_GEMMA_QROW").map_or(true, |v| v != "off"))
}

/// Whether one activation row of `x_dtype` through `w` takes `qmv_row4` (so `qmv_row4_norm`
/// can fold the residual add + norm into it).
pub(super) fn takes_row_matvec(x_dtype: DType, w: &crate::kernels::qmatmul::PackedWeight) -> bool {
    dequantizes_before_mma(
        x_dtype,
        w.scales.dtype(),
        w.biases.dtype(),
        w.bits.bits(),
        w.group_size,
        w.in_dim(),
    ) && row_contiguous_matvec()
}

/// Warps a block of `qmv_row4`: [`QMATVEC_ROW_WARPS`], or `CANDLE_GEMMA_QROW_WARPS` (1, 2, 4
/// or 8) to compare.
fn row_matvec_warps() -> usize {
    row_matvec_warps_for(QMATVEC_ROW_WARPS)
}

/// Warps a block of a `qmv_row4` launch whose own default is `default`, unless
/// `CANDLE_GEMMA_QROW_WARPS` fixes them. `_u2le` launches (one wave of row pairs) take
/// [`QROW_MAX_WARPS`]: on an H100 the 31B q_proj at 4 bits went from 0.692-0.697 /
/// 0.723-0.726 to 0.709-0.713 / 0.740-0.744 of the copy bandwidth (groups 128 / 64; the
/// previous build and this one alternating, `bench-results/h100-s24-qrow-late8-ab-*.jsonl`),
/// while 8-warp blocks for every launch made gate/up (several waves, `_u2e`) 3-4% slower
/// (`h100-s24-qrow-warps-*.jsonl`, `CANDLE_GEMMA_QROW_WARPS`).
fn row_matvec_warps_for(default: usize) -> usize {
    static W: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    W.get_or_init(|| {
        std::env::var("CANDLE_GEMMA_QROW_WARPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|w| matches!(w, 1 | 2 | 4 | 8))
    })
    .unwrap_or(default)
}

/// Kernel-name suffix of the `qmv_row4` variant for a launch over rows of `in_dim` codes with
/// `split` warps a row pair: `_u1` issues one step's loads before its math, `_u2` two, `_u2l`
/// two with x read in the math (64 registers, 32 warps an SM); an `e` after it issues the first
/// weight loads before the PDL wait, for weights marked
/// [`PackedWeight::settled`](crate::kernels::qmatmul::PackedWeight::settled) (`settled`).
///
/// Unsettled weights: unsplit rows of at least 5120 codes take `_u2`, the rest `_u1`. Measured
/// on H100s (`bench_kernels`, same machine): against `_u1`, `_u2` is 4-7% faster on the 31B
/// q_proj and gate/up, ~1% on down, 6% slower on E4B's down split over 2 warps. 4-bit batch-1
/// decode, `_u2` for rows of 5120+ codes: 31B 97.7 -> 99.8-100.3 tok/s; `_u2` everywhere cost
/// E4B (rows of 2048-4096 codes but its down) 317 -> 301-304. `_u2l` is 6-8% faster than
/// `_u2` on the 31B q_proj alone, even on gate/up, 20-30% slower on rows of 10240+ codes, and
/// as the 31B q/k/v and gate/up choice it gave 97.4-97.8 tok/s against 98.1-99.7 for `_u2`.
///
/// Settled weights take the same choice with `e`, and `_u2le` (`_u2l`'s 32 warps an SM rather
/// than `_u2`'s 24) where `late_fits`: the launch's row pairs need more than one wave of `_u2`
/// warps and fit in one of `_u2l`'s ([`late_variant_fits`]; the 31B q_proj alone among the
/// 31B projections, which the model stacks with k/v). Measured on an H100 (`bench_kernels
/// --matmul-only --rows 1`, GPU-only time, `bench-results/h100-s22-qrow-early.md`), group 64:
/// 31B q_proj 13.7 (`_u2`) -> 13.0 (`_u2e`) -> 11.3 µs (`_u2le`, which also lets its
/// dependents launch before its wait); gate/up 28.0 -> 27.5; down 28.8 -> 26.7.
///
/// `CANDLE_GEMMA_QROW_STEPS=1|2|2l|1e|2e|2le` fixes the variant, and
/// `CANDLE_GEMMA_QROW_EARLY=0` (no `e`) or `nol` (no `_u2le`) change the rule, to compare.
pub(super) fn row_matvec_variant(
    split: usize,
    in_dim: usize,
    settled: bool,
    late_fits: bool,
) -> &'static str {
    static FIXED: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    let fixed = FIXED.get_or_init(
        || match std::env::var("CANDLE_GEMMA_QROW_STEPS").as_deref() {
            Ok("1") => Some("_u1"),
            Ok("2") => Some("_u2"),
            Ok("2l") => Some("_u2l"),
            Ok("1e") => Some("_u1e"),
            Ok("2e") => Some("_u2e"),
            Ok("2le") => Some("_u2le"),
            _ => None,
        },
    );
    if let Some(v) = fixed {
        return v;
    }
    match (loads_early(settled), long_rows(split, in_dim)) {
        (false, true) => "_u2",
        (false, false) => "_u1",
        (true, true) if late_fits && early_rule() != "nol" => "_u2le",
        (true, true) => "_u2e",
        (true, false) => "_u1e",
    }
}

/// Whether a `qmv_row4` launch takes a two-step variant: unsplit rows of 5120+ codes.
fn long_rows(split: usize, in_dim: usize) -> bool {
    split == 1 && in_dim >= 5 * 1024
}

/// `CANDLE_GEMMA_QROW_EARLY`: `0` keeps every product's loads after the PDL wait, `nol` keeps
/// `_u2le` out of [`row_matvec_variant`]'s rule (A/B switches).
fn early_rule() -> &'static str {
    static RULE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RULE.get_or_init(|| std::env::var("CANDLE_GEMMA_QROW_EARLY").unwrap_or_default())
}

/// Whether a one-row product over a weight marked settled (`settled`) issues its first weight
/// loads before the PDL wait (the `e` kernels), unless `CANDLE_GEMMA_QROW_EARLY=0`.
fn loads_early(settled: bool) -> bool {
    settled && early_rule() != "0"
}

/// Whether `out_dim` rows (row pairs of `warps`-warp blocks) take more than one wave of
/// `qmv_row4_{tn}_u2e` on `dev` but fit in one wave of `_u2le` (see [`row_matvec_variant`]).
fn late_variant_fits(
    dev: &CudaDevice,
    tn: &'static str,
    out_dim: usize,
    warps: usize,
) -> candle_core::Result<bool> {
    fits_one_wave_only_of(
        dev,
        &format!("qmv_row4_{tn}_u2e"),
        &format!("qmv_row4_{tn}_u2le"),
        out_dim.div_ceil(2),
        warps,
    )
}

/// Whether `units` (one a warp, `warps` warps a block) take more than one wave of kernel
/// `wide` on `dev` but fit in one wave of kernel `narrow` (which holds more of them at once).
///
/// The 8-bit one-row `qmatvec` takes its 32-register `_1w` build where this holds: the 31B
/// q_proj shape (8192 rows, 1024 blocks, 1.29 waves of the 39-register build at 6 blocks a
/// multiprocessor, one wave at 8) went from 0.69-0.71 to 0.74-0.76 of the copy bandwidth on an
/// H100, while the capped build was 3-25% slower on the down projections, which fit one wave
/// either way (`bench-results/h100-s24-qmv8.md`).
fn fits_one_wave_only_of(
    dev: &CudaDevice,
    wide: &str,
    narrow: &str,
    units: usize,
    warps: usize,
) -> candle_core::Result<bool> {
    let wave = |name: &str| -> candle_core::Result<usize> {
        Ok(resident_units(dev, name, warps)? * sm_count(dev))
    };
    Ok(units > wave(wide)? && units <= wave(narrow)?)
}

/// Warps of kernel `name` in `warps`-warp blocks one multiprocessor of `dev` holds at once,
/// asked of the driver once per kernel and block size.
/// Launches ask this on the host's hot path: a known answer costs a lock and a lookup, no
/// allocation.
fn resident_units(dev: &CudaDevice, name: &str, warps: usize) -> candle_core::Result<usize> {
    type Known = std::collections::HashMap<usize, std::collections::HashMap<String, usize>>;
    static KNOWN: std::sync::OnceLock<std::sync::Mutex<Known>> = std::sync::OnceLock::new();
    let known = KNOWN.get_or_init(Default::default);
    let cached = known
        .lock()
        .ok()
        .and_then(|m| m.get(&warps).and_then(|by_name| by_name.get(name)).copied());
    if let Some(n) = cached {
        return Ok(n);
    }
    let blocks = load_kernel(dev, name, MODULE, IMAGE)?
        .resident_blocks((warps * 32) as u32)
        .unwrap_or(0);
    let n = blocks * warps;
    if let Ok(mut m) = known.lock() {
        m.entry(warps).or_default().insert(name.to_string(), n);
    }
    Ok(n)
}

/// Warps that share each row pair of `qmv_row4`, splitting the input (1, 2 or 4):
/// [`row_matvec_split_for`] of the launch, or `CANDLE_GEMMA_QROW_SPLIT` to compare.
fn row_matvec_split(dev: &CudaDevice, out_dim: usize, in_dim: usize) -> usize {
    static FIXED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let fixed = *FIXED.get_or_init(|| {
        std::env::var("CANDLE_GEMMA_QROW_SPLIT")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|s| matches!(s, 1 | 2 | 4))
    });
    fixed.unwrap_or_else(|| row_matvec_split_for(out_dim, in_dim, sm_count(dev)))
}

/// `t` itself when contiguous and starting on a 16-byte boundary, else a copy into a fresh
/// buffer (`contiguous` alone keeps a contiguous view's start).
pub(super) fn contiguous_aligned16(t: &Tensor) -> candle_core::Result<Tensor> {
    let aligned = (t.layout().start_offset() * t.dtype().size_in_bytes()) % 16 == 0;
    if t.is_contiguous() && aligned {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
}

/// Quantized `x · Wᵀ` for `rows <= 8` activation rows (decode): `x` `[rows, in]` contiguous,
/// `codes` `[out, in*bits/32]`, `scales`/`biases` `[out, in/group]`. Returns `[rows, out]`.
/// `settled`: the weight is
/// [`PackedWeight::settled`](crate::kernels::qmatmul::PackedWeight::settled) (see
/// [`row_matvec_variant`]).
pub(crate) fn qmatvec(
    x: &Tensor,
    codes: &Tensor,
    scales: &Tensor,
    biases: &Tensor,
    bits: usize,
    group_size: usize,
    settled: bool,
) -> candle_core::Result<Tensor> {
    let (rows, in_dim) = x.dims2()?;
    let (out_dim, _) = codes.dims2()?;
    let dev = cuda_dev(x)?;
    let tn = kname(x.dtype()).map_err(candle_core::Error::wrap)?;
    let sn = kname(scales.dtype()).map_err(candle_core::Error::wrap)?;
    let r = match rows {
        1 => 1,
        2 => 2,
        3 | 4 => 4,
        5..=8 => 8,
        _ => candle_core::bail!("qmatvec takes 1..=8 rows, got {rows}"),
    };
    let params = QmatParams {
        rows: rows as u32,
        out_dim: out_dim as u32,
        in_dim: in_dim as u32,
        group_size: group_size as u32,
    };
    // Tensor-core kernels: 16 output rows a block; SIMT kernel: one warp per output row;
    // `qmv_row4`: two output rows a warp index, times `split` warps over the input.
    let mut split = 1;
    let (name, rows_per_block, warps) = if dequantizes_before_mma(
        x.dtype(),
        scales.dtype(),
        biases.dtype(),
        bits,
        group_size,
        in_dim,
    ) {
        if rows == 1 && row_contiguous_matvec() {
            split = row_matvec_split(&dev, out_dim, in_dim);
            let late_warps = row_matvec_warps_for(QROW_MAX_WARPS).min(QROW_MAX_WARPS / split);
            let late_fits = loads_early(settled)
                && long_rows(split, in_dim)
                && late_variant_fits(&dev, tn, out_dim, late_warps)?;
            let variant = row_matvec_variant(split, in_dim, settled, late_fits);
            let warps = if variant == "_u2le" {
                late_warps
            } else {
                row_matvec_warps().min(QROW_MAX_WARPS / split)
            };
            (format!("qmv_row4_{tn}{variant}"), warps * 2, warps)
        } else {
            (
                format!("qmv_tc4_{tn}_b{}", tc4_blocks()),
                QMATVEC_MMA_ROWS,
                QMATVEC_MMA_WARPS,
            )
        }
    } else if uses_tensor_core_matvec(x.dtype(), rows, bits, group_size, in_dim) {
        let name = format!("qmv_mma_{tn}_{sn}_{bits}_{group_size}");
        (name, QMATVEC_MMA_ROWS, QMATVEC_MMA_WARPS)
    } else {
        let mut name = format!("qmatvec_{tn}_{sn}_{bits}_{r}");
        if bits == 8 && r == 1 {
            let one_wave = format!("{name}w");
            if fits_one_wave_only_of(&dev, &name, &one_wave, out_dim, QMATVEC_WARPS)? {
                name = one_wave;
            }
        }
        (name, QMATVEC_WARPS, QMATVEC_WARPS)
    };
    let func = load_kernel(&dev, &name, MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (out_dim.div_ceil(rows_per_block) as u32, 1, 1),
        block_dim: ((warps * 32) as u32, split as u32, 1),
        shared_mem_bytes: 0,
    };
    // The kernels read x and the codes 16 bytes at a time: views starting elsewhere are copied.
    let (x, codes) = (contiguous_aligned16(x)?, contiguous_aligned16(codes)?);
    let (scales, biases) = (scales.contiguous()?, biases.contiguous()?);
    macro_rules! go {
        ($t:ty, $s:ty) => {{
            // SAFETY: fully written by either kernel (every output row of every activation row).
            let mut y = unsafe { dev.alloc::<$t>(rows * out_dim)? };
            {
                let (x_s, x_l) = x.storage_and_layout();
                let (c_s, c_l) = codes.storage_and_layout();
                let (s_s, s_l) = scales.storage_and_layout();
                let (b_s, b_l) = biases.storage_and_layout();
                let xv = view::<$t>(cuda_storage(&x_s)?, x_l)?;
                let cv = view::<u32>(cuda_storage(&c_s)?, c_l)?;
                let sv = view::<$s>(cuda_storage(&s_s)?, s_l)?;
                let bv = view::<$s>(cuda_storage(&b_s)?, b_l)?;
                let mut b = func.builder();
                b.arg(&params);
                b.arg(&xv);
                b.arg(&cv);
                b.arg(&sv);
                b.arg(&bv);
                b.arg(&mut y);
                // SAFETY: arguments match the kernel signature; shapes checked by the caller.
                unsafe { b.launch(cfg) }.w()?;
            }
            wrap(y, &dev, &[rows, out_dim])
        }};
    }
    macro_rules! by_scale {
        ($t:ty) => {
            match scales.dtype() {
                DType::F32 => go!($t, f32),
                DType::F16 => go!($t, half::f16),
                _ => go!($t, half::bf16),
            }
        };
    }
    Ok(match x.dtype() {
        DType::F32 => by_scale!(f32),
        DType::F16 => by_scale!(half::f16),
        _ => by_scale!(half::bf16),
    })
}

/// Dequantizes rows of a packed matrix (`codes` `[n, in*bits/32]`, scales/biases
/// `[n, in/group]`) into dense `[m, in]` in `dtype`: row `i` is packed row `idx[i]`
/// (`idx`: u32 `[m]`), or row `i` when `idx` is `None` (`m = n`).
pub(crate) fn dequant_rows(
    codes: &Tensor,
    scales: &Tensor,
    biases: &Tensor,
    bits: usize,
    group_size: usize,
    idx: Option<&Tensor>,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let (n, words) = codes.dims2()?;
    let in_dim = words * 32 / bits;
    let dev = cuda_dev(codes)?;
    let tn = kname(dtype).map_err(candle_core::Error::wrap)?;
    let sn = kname(scales.dtype()).map_err(candle_core::Error::wrap)?;
    let idx = match idx {
        Some(i) => Some(i.to_dtype(DType::U32)?.flatten_all()?.contiguous()?),
        None => None,
    };
    let m = idx.as_ref().map_or(n, |i| i.elem_count());
    let params = QmatParams {
        rows: m as u32,
        out_dim: n as u32,
        in_dim: in_dim as u32,
        group_size: group_size as u32,
    };
    let func = load_kernel(&dev, &format!("dequant_{tn}_{sn}_{bits}"), MODULE, IMAGE)?;
    let total = m * words;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256).clamp(1, 132 * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (codes, scales, biases) = (
        codes.contiguous()?,
        scales.contiguous()?,
        biases.contiguous()?,
    );
    macro_rules! go {
        ($t:ty, $s:ty) => {{
            // SAFETY: fully written (one thread per packed word of every output row).
            let mut y = unsafe { dev.alloc::<$t>((m * in_dim).max(1))? };
            if total > 0 {
                let (c_s, c_l) = codes.storage_and_layout();
                let (s_s, s_l) = scales.storage_and_layout();
                let (b_s, b_l) = biases.storage_and_layout();
                let cv = view::<u32>(cuda_storage(&c_s)?, c_l)?;
                let sv = view::<$s>(cuda_storage(&s_s)?, s_l)?;
                let bv = view::<$s>(cuda_storage(&b_s)?, b_l)?;
                let mut b = func.builder();
                b.arg(&params);
                b.arg(&cv);
                b.arg(&sv);
                b.arg(&bv);
                let guard = idx.as_ref().map(|i| i.storage_and_layout());
                let iv = match &guard {
                    Some((st, l)) => Some(view::<u32>(cuda_storage(st)?, l)?),
                    None => None,
                };
                // A null index pointer selects "row i" in the kernel.
                let null = 0u64;
                match &iv {
                    Some(iv) => b.arg(iv),
                    None => b.arg(&null),
                };
                b.arg(&mut y);
                // SAFETY: arguments match the kernel signature; indices are the caller's
                // responsibility and checked against `n` before the call.
                unsafe { b.launch(cfg) }.w()?;
            }
            wrap(y, &dev, &[m, in_dim])
        }};
    }
    macro_rules! by_scale {
        ($t:ty) => {
            match scales.dtype() {
                DType::F32 => go!($t, f32),
                DType::F16 => go!($t, half::f16),
                _ => go!($t, half::bf16),
            }
        };
    }
    Ok(match dtype {
        DType::F32 => by_scale!(f32),
        DType::F16 => by_scale!(half::f16),
        _ => by_scale!(half::bf16),
    })
}

/// Group-wise affine quantization of `x` (`[..., dim]`, f32/f16/bf16, on CUDA) along its last
/// axis, bit-exact with the CPU reference [`crate::kernels::quantize`]: codes `[..., dim * bits /
/// 32]`, scales and biases `[..., dim / group_size]` in `x`'s dtype. The caller checks the group
/// size.
pub(crate) fn quantize(
    x: &Tensor,
    bits: crate::kv::QuantBits,
    group_size: usize,
) -> candle_core::Result<PackedKv> {
    let dims = x.dims().to_vec();
    let dim = dims.last().copied().unwrap_or(0);
    let b = bits.bits();
    let dev = cuda_dev(x)?;
    let tn = kname(x.dtype()).map_err(candle_core::Error::wrap)?;
    let x = x.contiguous()?;
    let groups = x.elem_count() / group_size.max(1);
    let params = QmatParams {
        rows: u32::try_from(groups).map_err(candle_core::Error::wrap)?,
        out_dim: 0,
        in_dim: dim as u32,
        group_size: group_size as u32,
    };
    let func = load_kernel(&dev, &format!("quantize_{tn}_{b}"), MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let lead = &dims[..dims.len().saturating_sub(1)];
    let shape_with = |last: usize| {
        let mut s = lead.to_vec();
        s.push(last);
        s
    };
    let words = x.elem_count() * b / 32;
    macro_rules! go {
        ($t:ty) => {{
            // SAFETY: every group writes its scale, bias and all its code words.
            let (mut codes, mut scales, mut biases) = unsafe {
                (
                    dev.alloc::<u32>(words.max(1))?,
                    dev.alloc::<$t>(groups.max(1))?,
                    dev.alloc::<$t>(groups.max(1))?,
                )
            };
            if groups > 0 {
                let (x_s, x_l) = x.storage_and_layout();
                let xv = view::<$t>(cuda_storage(&x_s)?, x_l)?;
                let mut bl = func.builder();
                bl.arg(&params);
                bl.arg(&xv);
                bl.arg(&mut codes);
                bl.arg(&mut scales);
                bl.arg(&mut biases);
                // SAFETY: arguments match the kernel's signature; one thread per group.
                unsafe { bl.launch(cfg) }.w()?;
            }
            (
                wrap(codes, &dev, &shape_with(dim * b / 32)),
                wrap(scales, &dev, &shape_with(dim / group_size)),
                wrap(biases, &dev, &shape_with(dim / group_size)),
            )
        }};
    }
    let (codes, scales, biases) = match x.dtype() {
        DType::F32 => go!(f32),
        DType::F16 => go!(half::f16),
        _ => go!(half::bf16),
    };
    Ok(PackedKv::from_parts(
        codes,
        scales,
        biases,
        crate::kernels::AffineSpec { bits, group_size },
    ))
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
    bits: crate::kv::QuantBits,
    group_size: usize,
    dst: &[Tensor],
) -> candle_core::Result<bool> {
    if !super::graph::recording() {
        return quantize_kv_into_batch(k, v, bits, group_size, &[dst.to_vec()]);
    }
    let (b, _, _, hd) = k.dims4()?;
    if b != 1 || v.dims() != k.dims() || v.dtype() != k.dtype() {
        return Ok(false);
    }
    let Some((block, slot)) = kvq_destination(dst, hd, k.dtype())? else {
        return Ok(false);
    };
    if slot
        != (super::graph::Slot::KvQuantDestination {
            bits: bits.bits() as u32,
            group_size: group_size as u32,
        })
    {
        return Ok(false);
    }
    let at = super::graph::record(slot, &block)?
        .ok_or_else(|| candle_core::Error::Msg("not capturing a step".into()))?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    launch_quantize_into(
        &k,
        &v,
        0..k.elem_count(),
        bits,
        group_size,
        SlotArg::Recorded(at),
    )?;
    Ok(true)
}

/// [`quantize_kv_into`] for a batch: sequence `b` of `k`, `v` (`[batch, kv_heads, n,
/// head_dim]`) into `dst[b]` (each sequence's six packed slots), [`KVQ_BATCH`] sequences a
/// launch. `Ok(false)` without writing when some sequence's slots are not laid out as
/// `quantize_into` writes them, or while a step is captured.
///
/// # Errors
/// Candle/CUDA errors.
pub(crate) fn quantize_kv_into_batch(
    k: &Tensor,
    v: &Tensor,
    bits: crate::kv::QuantBits,
    group_size: usize,
    dst: &[Vec<Tensor>],
) -> candle_core::Result<bool> {
    let (batch, _, _, hd) = k.dims4()?;
    if batch != dst.len()
        || v.dims() != k.dims()
        || v.dtype() != k.dtype()
        || kname(k.dtype()).is_err()
        || super::graph::recording()
    {
        return Ok(false);
    }
    let want = super::graph::Slot::KvQuantDestination {
        bits: bits.bits() as u32,
        group_size: group_size as u32,
    };
    let mut blocks = Vec::with_capacity(batch);
    for slots in dst {
        match kvq_destination(slots, hd, k.dtype())? {
            Some((block, slot)) if slot == want => blocks.push(block),
            _ => return Ok(false),
        }
    }
    let (k, v) = (k.contiguous()?, v.contiguous()?);
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

/// Where a `quantize_into` launch finds its slots.
enum SlotArg<'a> {
    /// The device address of a recorded [`KvqDst`] (`quantize_into_dyn`, one sequence).
    Recorded(u64),
    /// A table of sequences' slots passed by value (`quantize_into_batch`).
    Table(&'a KvqBatch),
}

/// Launches the quantize-into kernel `slots` names over the sequences of contiguous `k`, `v`
/// (`[batch, kv_heads, n, head_dim]`) whose elements lie in `rows`, one grid layer a sequence.
/// The caller has checked every sequence's slots against this shape.
fn launch_quantize_into(
    k: &Tensor,
    v: &Tensor,
    rows: std::ops::Range<usize>,
    bits: crate::kv::QuantBits,
    group_size: usize,
    slots: SlotArg<'_>,
) -> candle_core::Result<()> {
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
    let func = load_kernel(&dev, &name, MODULE, IMAGE)?;
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

/// `struct KvqDst` in `qkernels.cu`: where new K and V are quantized to (the six slot addresses
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

/// Sequences one `quantize_into_batch` launch takes (`KVQ_BATCH` in `qkernels.cu`).
pub(crate) const KVQ_BATCH: usize = 16;

/// `struct KvqBatch` in `qkernels.cu`: the slots of up to [`KVQ_BATCH`] sequences, passed by
/// value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KvqBatch {
    d: [KvqDst; KVQ_BATCH],
}

/// The [`KvqDst`] of packed slots `dst` (codes, scales, biases of K then of V, `[1, kvh, n, ..]`
/// views, scales in `dtype`) for rows of `head_dim`, with the quantization their widths imply
/// (as the graph slot that records it); `None` when they are not laid out as `quantize_into`
/// writes them: rows of one head contiguous, K and V codes at one head stride, the four
/// scale/bias views at another.
///
/// # Errors
/// Slots not on a CUDA device.
pub(crate) fn kvq_destination(
    dst: &[Tensor],
    head_dim: usize,
    dtype: DType,
) -> candle_core::Result<Option<(KvqDst, super::graph::Slot)>> {
    let [kc, ks, kb, vc, vs, vb] = dst else {
        return Ok(None);
    };
    let (Ok((_, kvh, n, words)), Ok((_, _, _, groups))) = (kc.dims4(), ks.dims4()) else {
        return Ok(None);
    };
    if head_dim == 0 || groups == 0 || (words * 32) % head_dim != 0 || head_dim % groups != 0 {
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
    let slot = super::graph::Slot::KvQuantDestination {
        bits: bits as u32,
        group_size: group_size as u32,
    };
    Ok(Some((block, slot)))
}

/// The stream-ordered memory pool candle allocates from (the device's default pool).
fn default_pool(dev: &CudaDevice) -> candle_core::Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let cu_dev = dev.cuda_stream().context().cu_device();
    // SAFETY: writes one pool handle for a valid device ordinal.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev) }
        .result()
        .map_err(candle_core::Error::wrap)?;
    Ok(pool)
}

/// Lets the device's memory pool keep freed blocks for reuse instead of returning them to the
/// driver at every synchronisation (its default release threshold is 0): every forward frees
/// and reallocates the same activation sizes, and regrowing the pool each time costs host time.
/// Called once per process by the fused path.
///
/// # Errors
/// CUDA errors.
pub fn retain_pool_memory(dev: &CudaDevice) -> candle_core::Result<()> {
    let pool = default_pool(dev)?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the attribute takes a pointer to a u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(candle_core::Error::wrap)
}

/// Stops cudarc from creating two CUDA events for every buffer allocated from now on, unless
/// the context already runs several streams or `CANDLE_GEMMA_EVENT_TRACKING=1` is set.
///
/// cudarc only consults those events to order work across streams; candle and this crate use one
/// stream per device, so on a single-stream context they are pure host cost: an event create and
/// destroy pair per buffer, paid on every op of every decode step. Buffers allocated after this
/// call carry no events, so an application that later moves them to another stream of the same
/// context must synchronise that stream itself.
pub fn skip_event_tracking(dev: &CudaDevice) {
    let keep = std::env::var("CANDLE_GEMMA_EVENT_TRACKING").is_ok_and(|v| v == "1");
    let ctx = dev.cuda_stream().context().clone();
    if !keep && !ctx.is_in_multi_stream_mode() {
        // SAFETY: with a single stream the events are never waited on (see above).
        unsafe { dev.disable_event_tracking() };
    }
}

/// Occupies the device's stream for `ns` nanoseconds (one spinning thread). A benchmark that
/// enqueues work behind it sees that work run back to back on the GPU, so events around the
/// work time the GPU alone, not the host's enqueue.
///
/// # Errors
/// CUDA errors (loading or launching the kernel).
pub fn gpu_spin(dev: &CudaDevice, ns: u64) -> candle_core::Result<()> {
    let func = load_kernel(dev, "gpu_spin", MODULE, IMAGE)?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    b.arg(&ns);
    // SAFETY: the kernel takes one u64 and touches no memory.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Returns the pool's unused blocks to the driver (so a memory reading counts live tensors).
///
/// # Errors
/// CUDA errors.
pub fn trim_pool(dev: &CudaDevice) -> candle_core::Result<()> {
    let pool = default_pool(dev)?;
    // SAFETY: trims a valid pool handle down to its live allocations.
    unsafe { sys::cuMemPoolTrimTo(pool, 0) }
        .result()
        .map_err(candle_core::Error::wrap)
}
