//! Planning of one sequence's fused attention launch on the host: which kernel (CUDA-core or
//! tensor-core, tiles in registers or staged in shared memory, value scales folded or not), how
//! many query rows a block takes, how the keys split over blocks (flash-decoding), and the K/V
//! operands as the kernel reads them. The one-sequence and batched launchers both launch what
//! [`plan_seq`] returns.

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Tensor};

use crate::kernels::cuda::device::{kname, sm_count};
use crate::kernels::cuda::kernel_cache::{load_kernel, Module, ATTENTION, ATTENTION_TC};
use crate::kernels::layout::{
    last_dim_contiguous, last_dim_contiguous_aligned16, scales_and_biases,
};
use crate::kernels::plan::{
    balanced_split, split_bound, split_keys, split_min_keys_for, AttentionGeometry, KeySplit,
    QsdpaParams, SideStrides, QSDPA_HEAD_DIMS, QSDPA_WARPS,
};
use crate::kernels::QueryPlan;
use crate::kernels::{KernelError, KeyPositions, PackedAffine};

/// Query rows per CUDA-core attention block (the kernels' `NQ`; 2 is also instantiated).
pub(crate) const QSDPA_ROWS: usize = 4;
/// Keys a tensor-core attention block takes per tile (`QT_KEYS`).
pub(crate) const QSDPA_TC_KEYS: usize = 16;
/// Query rows per tensor-core attention block (the N of `mma.m16n8k16`, `QT_ROWS`).
pub(crate) const QSDPA_TC_ROWS: usize = 8;
/// Head dims a block of the split-combining kernel merges (`QC_DIMS`).
pub(crate) const QSDPA_COMBINE_DIMS: usize = 32;
/// Threads a block of the split-combining kernel (`QC_THREADS`).
pub(crate) const QSDPA_COMBINE_BLOCK: u32 = 256;

/// How the split-combining kernel launches for `n_split` splits: the kernel's name prefix
/// (`_TN` or `_batch_TN` follows), the head dims a block merges, and the threads a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CombineLaunch {
    /// `qsdpa_combine_p4` or `_p12`: partials each thread loads before the weights, for up
    /// to 128 or 384 splits in one round.
    pub(crate) kernel: &'static str,
    /// Head dims a block merges (blocks a row: head_dim / dims).
    pub(crate) dims: usize,
    /// Threads a block.
    pub(crate) threads: u32,
}

/// The split-combining launch: a block of 256 threads per 32 head dims of a row, every partial
/// load issued before the softmax weights are known (four loads a thread up to 128 splits,
/// twelve beyond). Both forms sum in the same order, so a batch launch sized for its longest
/// sequence and a graph sized for the most splits give the same bits as a sequence launched
/// alone: a sequence's bits never depend on its batch neighbours.
pub(crate) fn combine_launch(n_split: usize) -> CombineLaunch {
    CombineLaunch {
        kernel: if n_split <= 128 {
            "qsdpa_combine_p4"
        } else {
            "qsdpa_combine_p12"
        },
        dims: QSDPA_COMBINE_DIMS,
        threads: QSDPA_COMBINE_BLOCK,
    }
}

/// The key split of a launch: [`balanced_split`] where the kernel walks its keys one 16-key
/// step at a time, else [`split_keys`]' equal splits. Kernels that attend two staged tiles a
/// step take as many steps for 5 tiles as for 6, so splits one tile apart gain them nothing.
fn key_split(
    keys: usize,
    base_blocks: usize,
    resident: usize,
    min_keys: usize,
    sms: usize,
    one_tile_steps: bool,
) -> KeySplit {
    if !one_tile_steps {
        let (n, per) = split_keys(keys, base_blocks, resident, min_keys);
        return KeySplit { n, per, long: 0 };
    }
    balanced_split(keys, base_blocks, resident, min_keys, sms)
}

/// K or V as the attention kernel reads it.
#[derive(Clone, Copy)]
pub(crate) enum KvOperand<'a> {
    /// MLX affine codes with scales and biases.
    Packed(&'a PackedAffine),
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
            let aligned = |x: usize| x.is_multiple_of(4);
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
            // Lanes load 16-byte chunks.
            let per_word = 4 / dtype.size_in_bytes();
            let (w, sh, sk) = last_dim_contiguous_aligned16(&cast(t)?)?;
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
    pub(super) fn kernel_name(&self, dtype: DType, batch: bool) -> Result<String, KernelError> {
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

    /// The module holding the attention kernel: `attention_tc.cu` for the tensor-core kernel,
    /// else `attention.cu` (which also holds the split combine).
    pub(super) fn module(&self) -> &'static Module {
        if self.tensor_cores {
            &ATTENTION_TC
        } else {
            &ATTENTION
        }
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
/// reads the codes without dequantizing them.
fn folds_values(bits: usize, stages: usize, group_size: usize, aligned: bool) -> bool {
    bits == 4 && stages == 0 && group_size == 64 && aligned
}

/// The attention kernel's name: `qsdpa_tc_*` for the tensor-core kernel (staged
/// `s{stages}x{tiles}`, value-folding `fv`, or tiles in registers), else the CUDA-core
/// `qsdpa_*` for `nq` query rows a block; `batch` names the batched launch's kernel.
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
) -> Result<String, KernelError> {
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
/// 16-key tiles a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TcStaging {
    pub(super) stages: usize,
    pub(super) tiles_per_stage: usize,
}

/// The staging of the tensor-core kernel over packed K/V: 8-bit codes at head dim 256 and 512
/// stage one tile a step, 4-bit codes two tiles a step, other shapes keep their tiles in
/// registers. Launches over 1-2 KV heads keep registers even where this stages
/// ([`registers_for_few_heads`]).
pub(super) fn tc_staging(head_dim: usize, bits: usize) -> TcStaging {
    let staged = |tiles_per_stage| TcStaging {
        stages: 2,
        tiles_per_stage,
    };
    match (head_dim, bits) {
        (256, 8) | (512, 8) => staged(1),
        (512, 4) | (256, 4) => staged(2),
        _ => TcStaging {
            stages: 0,
            tiles_per_stage: 1,
        },
    }
}

/// Bytes of one shared-memory stage (`qt_stage_bytes` times the tiles a stage): 16 keys of K
/// and V codes a tile, and their scales and biases sized for groups of 32.
fn tc_stage_bytes(head_dim: usize, bits: usize, tiles: usize) -> usize {
    tiles * QSDPA_TC_KEYS * (2 * head_dim * bits / 8 + 4 * (head_dim / 32) * 2)
}

/// Dynamic shared memory a staged block asks for: its stages.
fn tc_block_smem(head_dim: usize, bits: usize, staging: TcStaging) -> u32 {
    (staging.stages * tc_stage_bytes(head_dim, bits, staging.tiles_per_stage)) as u32
}

/// Whether a launch over `keys` keys with `base_blocks` blocks a key split (KV heads x row
/// blocks) keeps tiles at head dim 256 in registers although [`tc_staging`] stages them: at
/// most 4 such blocks (1-2 KV heads, as in E4B's and E2B's sliding layers), and for 8-bit codes
/// fewer than 64k keys. With so few blocks a split, staging costs more than it saves.
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
/// type. Everything else runs on the CUDA-core kernel.
fn uses_tensor_core_attention(dtype: DType, head_dim: usize, bits: usize, group: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && matches!(head_dim, 256 | 512)
        && match bits {
            4 | 8 => group.is_multiple_of(32) && group > 0,
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
) -> Result<SeqPlan, KernelError> {
    let (kv_heads, keys) = k.dims()?;
    kname(dtype)?;
    let bits = k.bits(dtype);
    if !QSDPA_HEAD_DIMS.contains(&head_dim)
        || bits != v.bits(dtype)
        || k.group_size() != v.group_size()
    {
        return Err(KernelError::Shape {
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
    // 4-bit K/V at head dim 512 (4 rows there take ~220 registers a thread), else 4.
    let nq = if rows <= 2 || (head_dim >= 512 && bits == 4) {
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
    let mut smem = if stages > 0 {
        tc_block_smem(head_dim, bits, staging)
    } else {
        0
    };
    let fold = |stages| tensor_cores && folds_values(bits, stages, k.group_size(), aligned);
    let resident = if tensor_cores {
        let threads = tc_threads(head_dim);
        let name = kernel_name_of(dtype, head_dim, bits, nq, true, stages, fold(stages), false)?;
        let staged = load_kernel(dev, &name, &ATTENTION_TC)?.resident_blocks_with(threads, smem);
        let blocks = match staged {
            Some(n) => Some(n),
            None if stages > 0 => {
                // The device refused the stages' shared memory: tiles in registers.
                (stages, smem) = (0, 0);
                let name = kernel_name_of(dtype, head_dim, bits, nq, true, 0, fold(0), false)?;
                load_kernel(dev, &name, &ATTENTION_TC)?.resident_blocks(threads)
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
        split_min_keys_for(
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
fn settled_arg(positions: &KeyPositions, keys: usize) -> u64 {
    if !crate::kernels::policy::current().early_loads {
        return 0;
    }
    let r = positions.settled_keys();
    match (u32::try_from(r.start), u32::try_from(r.end.min(keys))) {
        (Ok(lo), Ok(hi)) if lo < hi => u64::from(lo) | (u64::from(hi) << 32),
        _ => 0,
    }
}
