//! Prefill attention on CUDA (`prefill_attention.cu`): one launch a layer for a long query block
//! over dense f16/bf16 K/V, with the online softmax of flash attention. Neither the score matrix
//! nor the `[heads, queries, dim]` output is materialised: the output is written as
//! `[queries, heads, dim]` and handed back as the transposed view the caller reshapes for free.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

use crate::kernels::cuda::device::{bind, by_dtype, compute_major, cuda_dev, kname, wrap};
use crate::kernels::cuda::kernel_cache::{load_kernel, PREFILL_ATTENTION};
use crate::kernels::layout::last_dim_contiguous_aligned16;
use crate::kernels::plan::{PositionCode, QsdpaParams};
use crate::kernels::{KernelError, KeyPositions, QueryPlan};

/// Query rows of one block (`16 * PF_ROW_GROUPS` in `prefill_attention.cu`).
const BLOCK_ROWS: usize = 64;

/// Head dimensions the prefill kernel is built for.
pub const PREFILL_HEAD_DIMS: [usize; 3] = [128, 256, 512];

/// `struct PrefillParams` in `prefill_attention.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PrefillParams {
    q_sh: u64,
    q_sq: u64,
    k_sh: u64,
    k_sk: u64,
    v_sh: u64,
    v_sk: u64,
    n_heads: u32,
    kv_heads: u32,
    q_len: u32,
    keys: u32,
    window: u32,
    q_offset: u32,
    pos_mode: u32,
    pos_base: u32,
    pos_split: u32,
    pos_base2: u32,
    scale_log2: f32,
    pad: u32,
}

// SAFETY: `#[repr(C)]` integers and a float, read by the kernel with the same layout.
unsafe impl DeviceRepr for PrefillParams {}

/// Keys a tile, warps a block and shared-memory bytes a block of the kernel for `head_dim`
/// (`PF_KERNELS` in `prefill_attention.cu`); `wgmma`: the warpgroup-product form, which takes
/// 1 KiB more to start its tiles on a 1024-byte boundary.
fn launch_shape(head_dim: usize, elem: usize, wgmma: bool) -> (usize, u32, u32) {
    let tile = 64;
    let split = (head_dim / 256).max(1);
    let warps = BLOCK_ROWS / 16 * split;
    let tiles = (BLOCK_ROWS + 2 * tile) * head_dim * elem;
    // f32 `[warps][tile / 8 * 4][32]`.
    let partial_scores = if split > 1 { warps * tile * 64 } else { 0 };
    let align = if wgmma { 1024 } else { 0 };
    (
        tile,
        (warps * 32) as u32,
        (tiles + partial_scores + align) as u32,
    )
}

/// Whether a prefill at `head_dim` on `dev` runs the warpgroup-product form
/// (`prefill_attn_wg_*`): a build for compute capability 9.0, a 9.0 device, head dim 256 or
/// 512, and [`crate::LaunchPolicy::prefill_wgmma`] on.
fn uses_wgmma(dev: &candle_core::cuda_backend::CudaDevice, head_dim: usize) -> bool {
    cfg!(prefill_wgmma)
        && matches!(head_dim, 256 | 512)
        && crate::kernels::policy::current().prefill_wgmma
        && compute_major(&dev.cuda_stream()) == 9
}

/// Whether [`attend_prefill`] takes queries `q` over dense `k`/`v`: f16 or bf16 throughout, a
/// head dimension in [`PREFILL_HEAD_DIMS`].
pub(crate) fn supports(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let dtype = q.dtype();
    matches!(dtype, DType::BF16 | DType::F16)
        && k.dtype() == dtype
        && v.dtype() == dtype
        && q.dims()
            .last()
            .is_some_and(|d| PREFILL_HEAD_DIMS.contains(d))
}

/// Flash attention of one sequence's query block on a CUDA device, the kernel the dispatcher
/// ([`crate::kernels::attend`]) runs for query blocks longer than 16 over dense f16/bf16 K/V.
///
/// * `q`: `[1, n_heads, q_len, head_dim]`, `head_dim` in [`PREFILL_HEAD_DIMS`];
/// * `k`, `v`: `[1, kv_heads, keys, head_dim]` in `q`'s dtype, `kv_heads` dividing `n_heads`;
/// * `positions[j]`: absolute position of key `j`; `q_offset`: position of query 0;
///   `window`: `Some(W)` on sliding layers; `scale`: score multiplier.
///
/// Returns `[1, n_heads, q_len, head_dim]` in `q`'s dtype, the transposed view of a contiguous
/// `[1, q_len, n_heads, head_dim]` buffer. Queries that see no key get zeros.
///
/// # Errors
/// [`KernelError::Shape`] for mismatched shapes, [`KernelError::DType`] for dtypes other than
/// f16/bf16 or K/V unlike `q`, candle/CUDA errors.
pub fn attend_prefill_cuda(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &KeyPositions,
    q_offset: usize,
    window: Option<usize>,
    scale: f64,
) -> Result<Tensor, KernelError> {
    let (_, n_heads, _, head_dim) = q.dims4()?;
    let data = crate::kernels::KvData::Dense {
        k: k.clone(),
        v: v.clone(),
    };
    crate::kernels::check_view(n_heads, head_dim, &data, positions)?;
    for t in [k, v] {
        if t.dtype() != q.dtype() || !matches!(t.dtype(), DType::BF16 | DType::F16) {
            return Err(KernelError::DType {
                what: "CUDA prefill attention (queries, keys and values alike)",
                expected: DType::BF16,
                found: t.dtype(),
            });
        }
    }
    if !PREFILL_HEAD_DIMS.contains(&head_dim) {
        return Err(KernelError::Shape {
            what: "CUDA prefill attention head dimension",
            expected: format!("one of {PREFILL_HEAD_DIMS:?}"),
            found: vec![head_dim],
        });
    }
    let plan = QueryPlan {
        q_offset,
        window,
        scale,
    };
    attend_prefill(q, k, v, positions, &plan)
}

/// Attention of one sequence's query block `q` `[1, n_heads, q_len, head_dim]` over dense
/// `k`/`v` `[1, kv_heads, keys, head_dim]` (see [`supports`]), keys at `positions`. Returns
/// `[1, n_heads, q_len, head_dim]` in `q`'s dtype, as the transposed view of a contiguous
/// `[1, q_len, n_heads, head_dim]` buffer. Queries that see no key get zeros.
pub(crate) fn attend_prefill(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Result<Tensor, KernelError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.dims4()?;
    let dtype = q.dtype();
    let too_big = || KernelError::Shape {
        what: "CUDA prefill attention (keys, last query position)",
        expected: "values below 2^32".into(),
        found: vec![keys, plan.q_offset + q_len],
    };
    let u32_of = |x: usize| u32::try_from(x).map_err(|_| too_big());
    u32_of(plan.q_offset + q_len)?;
    let code = PositionCode::of(positions).ok_or_else(too_big)?;
    let mut pos = QsdpaParams::default();
    let table = code.apply(&mut pos).map(<[u32]>::to_vec);
    let dev = cuda_dev(q)?;
    let (q, q_sh, q_sq) = last_dim_contiguous_aligned16(q)?;
    let (k, k_sh, k_sk) = last_dim_contiguous_aligned16(k)?;
    let (v, v_sh, v_sk) = last_dim_contiguous_aligned16(v)?;
    let params = PrefillParams {
        q_sh,
        q_sq,
        k_sh,
        k_sk,
        v_sh,
        v_sk,
        n_heads: u32_of(n_heads)?,
        kv_heads: u32_of(kv_heads)?,
        q_len: u32_of(q_len)?,
        keys: u32_of(keys)?,
        window: u32_of(plan.window.unwrap_or(0))?,
        q_offset: u32_of(plan.q_offset)?,
        pos_mode: pos.pos_mode,
        pos_base: pos.pos_base,
        pos_split: pos.pos_split,
        pos_base2: pos.pos_base2,
        scale_log2: (plan.scale * std::f64::consts::LOG2_E) as f32,
        pad: 0,
    };
    let wgmma = uses_wgmma(&dev, head_dim);
    let (_, threads, smem) = launch_shape(head_dim, dtype.size_in_bytes(), wgmma);
    let form = if wgmma { "wg_" } else { "" };
    let name = format!("prefill_attn_{form}{head_dim}_{}", kname(dtype)?);
    let func = load_kernel(&dev, &name, &PREFILL_ATTENTION)?;
    // Allows the block its shared memory (above the default 48 KiB).
    if func.resident_blocks_with(threads, smem).is_none() {
        return Err(KernelError::Shape {
            what: "CUDA prefill attention (shared memory a block)",
            expected: "a device that grants it".into(),
            found: vec![smem as usize],
        });
    }
    let rows = n_heads / kv_heads * q_len;
    let cfg = LaunchConfig {
        grid_dim: (u32_of(rows.div_ceil(BLOCK_ROWS))?, u32_of(kv_heads)?, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let table = match table {
        Some(t) => Some(dev.clone_htod(&t)?),
        None => None,
    };
    let out = by_dtype!(dtype, E, {
        // SAFETY: uninitialised, then every element written by the kernel (each query row of
        // each head is one block row).
        let mut out = unsafe { dev.alloc::<E>(q_len * n_heads * head_dim)? };
        if q_len > 0 {
            bind!(qv, q, E);
            bind!(kv, k, E);
            bind!(vv, v, E);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&qv);
            b.arg(&kv);
            b.arg(&vv);
            match &table {
                Some(t) => b.arg(t),
                None => b.arg(&kv),
            };
            b.arg(&mut out);
            // SAFETY: arguments match the kernel's signature; the grid covers the rows and KV
            // heads of the checked shapes; the table, when read, has `keys` entries.
            unsafe { b.launch(cfg) }.w()?;
        }
        wrap(out, &dev, &[1, q_len, n_heads, head_dim])
    });
    Ok(out.transpose(1, 2)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_fits_the_shared_memory_of_an_h100() {
        for hd in PREFILL_HEAD_DIMS {
            for wgmma in [false, true] {
                let (tile, threads, smem) = launch_shape(hd, 2, wgmma);
                assert!(smem <= 227 * 1024, "{hd}: {smem}");
                assert!(
                    tile as u32 <= threads,
                    "{hd}: the table vote needs a thread a key"
                );
            }
        }
        assert_eq!(launch_shape(512, 2, false), (64, 256, 224 * 1024));
        assert_eq!(launch_shape(256, 2, false), (64, 128, 96 * 1024));
        assert_eq!(launch_shape(512, 2, true), (64, 256, 225 * 1024));
    }
}
