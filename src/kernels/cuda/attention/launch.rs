//! The fused attention launch of one sequence on CUDA: the entry points behind
//! [`crate::kernels::attend`] for packed and dense K/V, and the launch of the planned kernel
//! with its split combine. Long query blocks over packed K/V dequantize and take the dense path.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

use super::plan::{combine_kernel_name, combine_launch, plan_seq, KvOperand, SeqPlan};
use crate::kernels::cuda::device::{cuda_dev, cuda_storage, kname, view, wrap};
use crate::kernels::cuda::kernel_cache::{load_kernel, ATTENTION};
use crate::kernels::cuda::quantize::dequantize_kv;
use crate::kernels::cuda::scratch::with_scratch;
use crate::kernels::{dense, QueryPlan};
use crate::kernels::{KernelError, KeyPositions, PackedAffine};

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

/// Fused quantized attention of one sequence on a CUDA device: the host API behind
/// [`crate::kernels::attend`] for [`crate::kernels::KvData::Packed`] on CUDA.
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
/// [`KernelError::Shape`] for mismatched shapes or an unsupported head dimension (32, 64, 128,
/// 256 or 512), [`KernelError::BadGroupSize`], [`KernelError::DType`] for a non-float query,
/// candle/CUDA errors.
#[allow(clippy::too_many_arguments)]
pub fn attend_packed_cuda(
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    q_offset: usize,
    window: Option<usize>,
    scale: f64,
    path: QsdpaPath,
) -> Result<Tensor, KernelError> {
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
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    plan: &QueryPlan,
    path: QsdpaPath,
) -> Result<Tensor, KernelError> {
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
        if crate::kernels::flash_prefill(q, &kd, &vd) {
            return super::prefill::attend_prefill(q, &kd, &vd, positions, plan);
        }
        Ok(dense::attend_dense(q, &kd, &vd, &positions.to_vec(), plan)?)
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
) -> Result<Tensor, KernelError> {
    attend_fused(q, KvOperand::Dense(k), KvOperand::Dense(v), positions, plan)
}

/// Plans and launches one sequence's fused attention (see [`plan_seq`]), then the split
/// combine when the keys split.
fn attend_fused(
    q: &Tensor,
    k: KvOperand<'_>,
    v: KvOperand<'_>,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, KernelError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let dtype = q.dtype();
    let tn = kname(dtype)?;
    let dev = cuda_dev(q)?;
    let q = q.contiguous()?;
    let seq_plan = plan_seq(n_heads, q_len, head_dim, dtype, k, v, positions, plan, &dev)?;
    let name = seq_plan.kernel_name(dtype, false)?;
    let threads = seq_plan.block_threads();
    let module = seq_plan.module();
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
    let func = load_kernel(&dev, &name, module)?;
    let comb = load_kernel(&dev, &combine_kernel_name(&combine, tn, false), &ATTENTION)?;

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
