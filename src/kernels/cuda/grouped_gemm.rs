//! Grouped products on cuBLAS: one call multiplies consecutive row blocks of one activation
//! matrix, each by its own weight matrix, with each block at its own length. An MoE layer's
//! prefill sorts its (token, expert) pairs by expert and can run every expert's rows this way,
//! so no block is padded to the longest.
//!
//! This needs cuBLAS's `cublasGemmGroupedBatchedEx` (CUDA 12.5 and later). A build against an
//! older toolkit has no such symbol, and [`grouped_matmul`] then answers `None`, which the
//! caller meets with its padded batched product.

use candle_core::{Result, Tensor};

/// Whether this build has cuBLAS's grouped product (so [`grouped_matmul`] runs on CUDA
/// operands it takes).
pub fn available() -> bool {
    cfg!(cublas_grouped_gemm)
}

/// The weights of [`grouped_matmul`]'s blocks, each `[n, k]`.
#[derive(Debug, Clone, Copy)]
pub enum BlockWeights<'a> {
    /// One contiguous `[E, n, k]` stack; block `g` takes matrix `experts[g]`. The blocks' device
    /// addresses are found by arithmetic on the stack's, which keeps the host's share of a call
    /// with a hundred blocks small.
    Stack {
        /// `[E, n, k]`, contiguous.
        stack: &'a Tensor,
        /// The stack's matrix of each block.
        experts: &'a [usize],
    },
    /// One contiguous `[n, k]` tensor per block.
    Each(&'a [Tensor]),
}

impl BlockWeights<'_> {
    fn blocks(&self) -> usize {
        match self {
            BlockWeights::Stack { experts, .. } => experts.len(),
            BlockWeights::Each(ws) => ws.len(),
        }
    }
}

/// `[R, n]`: for each block in order, its `rows[g]` rows of `x` `[R, k]` times its weight
/// transposed. Block `g` covers rows `rows[..g].sum() ..`; `R` is the sum of `rows`, and blocks
/// of no rows are skipped. `None` where the build's cuBLAS has no grouped product (CUDA before
/// 12.5), where the operands are not CUDA tensors of one dtype among f32, f16 and bf16, where a
/// weight is not contiguous, or where rows of `x`, the weights or the output are not whole
/// 16-byte units.
///
/// # Errors
/// Weights of shapes that disagree with `x`, a block count other than `rows.len()`, block rows
/// that do not sum to `R`, an expert index past the stack, cuBLAS and CUDA errors.
pub fn grouped_matmul(
    x: &Tensor,
    rows: &[usize],
    weights: BlockWeights<'_>,
) -> Result<Option<Tensor>> {
    let (r, k) = x.dims2()?;
    let total: usize = rows.iter().sum();
    if total != r || weights.blocks() != rows.len() {
        candle_core::bail!(
            "grouped_matmul: {} blocks of {total} rows for {} weights and {r} rows",
            rows.len(),
            weights.blocks()
        );
    }
    let live = |g: &usize| rows[*g] > 0;
    let (n, dtype, contiguous, device_ok, offsets) = match weights {
        BlockWeights::Stack { stack, experts } => {
            let (e, n, wk) = stack.dims3()?;
            if wk != k {
                candle_core::bail!(
                    "grouped_matmul: stack {:?} against [{r}, {k}]",
                    stack.dims()
                );
            }
            if let Some(bad) = experts.iter().find(|&&i| i >= e) {
                candle_core::bail!("grouped_matmul: expert {bad} of a stack of {e}");
            }
            let same = stack.device().same_device(x.device());
            (
                n,
                stack.dtype(),
                stack.is_contiguous(),
                same,
                vec![stack.layout().start_offset()],
            )
        }
        BlockWeights::Each(ws) => {
            let Some(first) = (0..ws.len()).find(live) else {
                candle_core::bail!("grouped_matmul: no block has rows");
            };
            let n = ws[first].dim(0)?;
            let mut ok = (true, true);
            for g in (0..ws.len()).filter(live) {
                if ws[g].dims2()? != (n, k) || ws[g].dtype() != ws[first].dtype() {
                    candle_core::bail!(
                        "grouped_matmul: weight {:?} against [{r}, {k}] and [{n}, {k}]",
                        ws[g].dims()
                    );
                }
                ok.0 &= ws[g].is_contiguous();
                ok.1 &= ws[g].device().same_device(x.device());
            }
            let offsets = (0..ws.len())
                .filter(live)
                .map(|g| ws[g].layout().start_offset())
                .collect();
            (n, ws[first].dtype(), ok.0, ok.1, offsets)
        }
    };
    let half_or_f32 = matches!(
        x.dtype(),
        candle_core::DType::F32 | candle_core::DType::F16 | candle_core::DType::BF16
    );
    if !x.device().is_cuda() || dtype != x.dtype() || !contiguous || !device_ok || !half_or_f32 {
        return Ok(None);
    }
    // Rows of whole 16-byte units, and blocks starting on them, keep every operand of every
    // product aligned the way cuBLAS's tensor-core kernels want.
    let elem = x.dtype().size_in_bytes();
    if !(k * elem).is_multiple_of(16)
        || !(n * elem).is_multiple_of(16)
        || offsets.iter().any(|o| !(o * elem).is_multiple_of(16))
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    if !(x.layout().start_offset() * elem).is_multiple_of(16) {
        return Ok(None);
    }
    run(&x, rows, weights, n)
}

#[cfg(not(cublas_grouped_gemm))]
fn run(_x: &Tensor, _rows: &[usize], _w: BlockWeights<'_>, _n: usize) -> Result<Option<Tensor>> {
    Ok(None)
}

#[cfg(cublas_grouped_gemm)]
fn run(x: &Tensor, rows: &[usize], weights: BlockWeights<'_>, n: usize) -> Result<Option<Tensor>> {
    use super::device::{bind, by_dtype, cuda_dev, wrap};
    use candle_core::cuda_backend::cudarc::cublas::sys;
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use std::ffi::{c_int, c_void};

    let (r, k) = x.dims2()?;
    let dev = cuda_dev(x)?;
    let stream = dev.cuda_stream();
    let elem = x.dtype().size_in_bytes() as u64;
    let int = |v: usize, what: &str| -> Result<c_int> {
        c_int::try_from(v)
            .map_err(|_| candle_core::Error::Msg(format!("grouped_matmul: {what} {v}")))
    };
    let data_type = match x.dtype() {
        candle_core::DType::F32 => sys::cudaDataType::CUDA_R_32F,
        candle_core::DType::F16 => sys::cudaDataType::CUDA_R_16F,
        _ => sys::cudaDataType::CUDA_R_16BF,
    };
    by_dtype!(x.dtype(), E, {
        // SAFETY: every row belongs to one block, and each block's product writes all its rows.
        let out = unsafe { dev.alloc::<E>((r * n).max(1))? };
        let out_ptr = out.device_ptr(&stream).0;
        bind!(xv, x, E);
        let x_ptr = xv.device_ptr(&stream).0;
        let mut weight_ptrs = vec![0u64; rows.len()];
        match weights {
            BlockWeights::Stack { stack, experts } => {
                bind!(sv, stack, E);
                let base = sv.device_ptr(&stream).0;
                let matrix = (n * k) as u64 * elem;
                for (p, &e) in weight_ptrs.iter_mut().zip(experts) {
                    *p = base + e as u64 * matrix;
                }
            }
            BlockWeights::Each(ws) => {
                for (g, p) in weight_ptrs
                    .iter_mut()
                    .enumerate()
                    .filter(|(g, _)| rows[*g] > 0)
                {
                    bind!(wv, ws[g], E);
                    *p = wv.device_ptr(&stream).0;
                }
            }
        }
        // Column-major, as cuBLAS sees row-major data: each block computes
        // `outᵀ[n, rows] = W[n, k] (stored as Wᵀ) · xᵀ[k, rows]`. One upload holds the three
        // pointer arrays: weights, activations, outputs.
        let live: Vec<usize> = (0..rows.len()).filter(|&g| rows[g] > 0).collect();
        let groups = live.len();
        let mut ptrs = vec![0u64; 3 * groups];
        let mut cols = Vec::with_capacity(groups);
        let mut row = 0u64;
        let mut next = 0;
        for (g, &rows_g) in rows.iter().enumerate() {
            if rows_g > 0 {
                ptrs[next] = weight_ptrs[g];
                ptrs[groups + next] = x_ptr + row * k as u64 * elem;
                ptrs[2 * groups + next] = out_ptr + row * n as u64 * elem;
                cols.push(int(rows_g, "rows")?);
                next += 1;
            }
            row += rows_g as u64;
        }
        let ptrs_dev = dev.clone_htod(&ptrs)?;
        let arrays = ptrs_dev.device_ptr(&stream).0;
        let array = |i: u64| (arrays + i * groups as u64 * 8) as *const *const c_void;
        let (n_i, k_i) = (int(n, "width")?, int(k, "depth")?);
        let trans_a = vec![sys::cublasOperation_t::CUBLAS_OP_T; groups];
        let trans_b = vec![sys::cublasOperation_t::CUBLAS_OP_N; groups];
        let (ms, ks) = (vec![n_i; groups], vec![k_i; groups]);
        let (alpha, beta) = (vec![1f32; groups], vec![0f32; groups]);
        let (lda, ldc) = (vec![k_i; groups], vec![n_i; groups]);
        let ones = vec![1 as c_int; groups];
        let blas = dev.cublas_handle();
        // SAFETY: the pointer arrays stay on the device until the call is enqueued (their free
        // is ordered on the same stream); every host array has `groups` entries; the
        // activation, weight and output buffers outlive the call and hold the rows addressed.
        let status = unsafe {
            sys::cublasGemmGroupedBatchedEx(
                *blas.handle(),
                trans_a.as_ptr(),
                trans_b.as_ptr(),
                ms.as_ptr(),
                cols.as_ptr(),
                ks.as_ptr(),
                alpha.as_ptr().cast(),
                array(0),
                data_type,
                lda.as_ptr(),
                array(1),
                data_type,
                lda.as_ptr(),
                beta.as_ptr().cast(),
                array(2) as *const *mut c_void,
                data_type,
                ldc.as_ptr(),
                int(groups, "groups")?,
                ones.as_ptr(),
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            candle_core::bail!("grouped_matmul: cublasGemmGroupedBatchedEx returned {status:?}");
        }
        Ok(Some(wrap(out, &dev, &[r, n])))
    })
}
