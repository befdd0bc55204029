//! Grouped products on cuBLAS: one call multiplies consecutive row blocks of one activation
//! matrix, each by its own weight matrix, with each block at its own length. An MoE layer's
//! prefill sorts its (token, expert) pairs by expert and runs every expert's rows this way, so
//! no block is padded to the longest.
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

/// One row block of [`grouped_matmul`]: `rows` consecutive rows of the activations, and the
/// `[n, k]` weight they are multiplied by (transposed).
#[derive(Debug, Clone)]
pub struct RowBlock {
    /// Rows of the block (0: skipped; its weight is not read).
    pub rows: usize,
    /// `[n, k]`, contiguous (a view into a stacked `[E, n, k]` tensor is).
    pub weight: Tensor,
}

/// `[R, n]`: for each block in order, its rows of `x` `[R, k]` times its weight transposed, so
/// block `g` covers rows `sum(rows of blocks before g) ..`, and `R` is the sum of the blocks'
/// rows. `None` where the build's cuBLAS has no grouped product (CUDA before 12.5), where the
/// operands are not CUDA tensors of one dtype among f32, f16 and bf16, where a weight is not
/// contiguous, or where rows of `x`, the weights or the output are not whole 16-byte units.
///
/// # Errors
/// Weights of shapes that disagree with `x` or each other, block rows that do not sum to `R`,
/// cuBLAS and CUDA errors.
pub fn grouped_matmul(x: &Tensor, blocks: &[RowBlock]) -> Result<Option<Tensor>> {
    let (r, k) = x.dims2()?;
    let total: usize = blocks.iter().map(|b| b.rows).sum();
    if total != r {
        candle_core::bail!("grouped_matmul: blocks cover {total} rows of {r}");
    }
    let Some(first) = blocks.iter().find(|b| b.rows > 0) else {
        candle_core::bail!("grouped_matmul: no block has rows");
    };
    let (n, wk) = first.weight.dims2()?;
    for b in blocks.iter().filter(|b| b.rows > 0) {
        if b.weight.dims2()? != (n, k) || wk != k {
            candle_core::bail!(
                "grouped_matmul: weight {:?} against activations [{r}, {k}] and [{n}, {k}]",
                b.weight.dims()
            );
        }
        if !x.device().is_cuda()
            || b.weight.dtype() != x.dtype()
            || !b.weight.is_contiguous()
            || !b.weight.device().same_device(x.device())
        {
            return Ok(None);
        }
    }
    if !matches!(
        x.dtype(),
        candle_core::DType::F32 | candle_core::DType::F16 | candle_core::DType::BF16
    ) {
        return Ok(None);
    }
    // Rows of whole 16-byte units, and blocks starting on them, keep every operand of every
    // product aligned the way cuBLAS's tensor-core kernels want.
    let elem = x.dtype().size_in_bytes();
    let aligned16 = |t: &Tensor| (t.layout().start_offset() * elem) % 16 == 0;
    if (k * elem) % 16 != 0
        || (n * elem) % 16 != 0
        || !blocks.iter().all(|b| b.rows == 0 || aligned16(&b.weight))
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    if !aligned16(&x) {
        return Ok(None);
    }
    run(&x, blocks, n)
}

#[cfg(not(cublas_grouped_gemm))]
fn run(_x: &Tensor, _blocks: &[RowBlock], _n: usize) -> Result<Option<Tensor>> {
    Ok(None)
}

#[cfg(cublas_grouped_gemm)]
fn run(x: &Tensor, blocks: &[RowBlock], n: usize) -> Result<Option<Tensor>> {
    use super::device::{bind, by_dtype, cuda_dev, wrap};
    use candle_core::cuda_backend::cudarc::cublas::sys;
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use std::ffi::c_int;

    let (r, k) = x.dims2()?;
    let dev = cuda_dev(x)?;
    let stream = dev.cuda_stream();
    let elem = x.dtype().size_in_bytes() as u64;
    let int = |v: usize, what: &str| -> Result<c_int> {
        c_int::try_from(v)
            .map_err(|_| candle_core::Error::Msg(format!("grouped_matmul: {what} {v}")))
    };
    let (data_type, live): (sys::cudaDataType, Vec<&RowBlock>) = (
        match x.dtype() {
            candle_core::DType::F32 => sys::cudaDataType::CUDA_R_32F,
            candle_core::DType::F16 => sys::cudaDataType::CUDA_R_16F,
            _ => sys::cudaDataType::CUDA_R_16BF,
        },
        blocks.iter().filter(|b| b.rows > 0).collect(),
    );
    by_dtype!(x.dtype(), E, {
        // SAFETY: every row belongs to one block, and each block's product writes all its rows.
        let out = unsafe { dev.alloc::<E>((r * n).max(1))? };
        let out_ptr = out.device_ptr(&stream).0;
        bind!(xv, x, E);
        let x_ptr = xv.device_ptr(&stream).0;
        // Column-major, as cuBLAS sees row-major data: each block computes
        // `outᵀ[n, rows] = W[n, k] (stored as kᵀ) · xᵀ[k, rows]`.
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let mut cols = Vec::with_capacity(live.len());
        let mut row = 0u64;
        for block in blocks {
            if block.rows > 0 {
                bind!(wv, block.weight, E);
                a.push(wv.device_ptr(&stream).0);
                b.push(x_ptr + row * k as u64 * elem);
                c.push(out_ptr + row * n as u64 * elem);
                cols.push(int(block.rows, "rows")?);
            }
            row += block.rows as u64;
        }
        let groups = live.len();
        let (a_dev, b_dev, c_dev) = (
            dev.clone_htod(&a)?,
            dev.clone_htod(&b)?,
            dev.clone_htod(&c)?,
        );
        let (n_i, k_i) = (int(n, "width")?, int(k, "depth")?);
        let trans_a = vec![sys::cublasOperation_t::CUBLAS_OP_T; groups];
        let trans_b = vec![sys::cublasOperation_t::CUBLAS_OP_N; groups];
        let (ms, ks) = (vec![n_i; groups], vec![k_i; groups]);
        let (alpha, beta) = (vec![1f32; groups], vec![0f32; groups]);
        let (lda, ldc) = (vec![k_i; groups], vec![n_i; groups]);
        let ones = vec![1 as c_int; groups];
        let blas = dev.cublas_handle();
        // SAFETY: the pointer arrays live on the device until the call is enqueued (their frees
        // are ordered on the same stream); every host array has `groups` entries; the
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
                a_dev.device_ptr(&stream).0 as *const *const std::ffi::c_void,
                data_type,
                lda.as_ptr(),
                b_dev.device_ptr(&stream).0 as *const *const std::ffi::c_void,
                data_type,
                lda.as_ptr(),
                beta.as_ptr().cast(),
                c_dev.device_ptr(&stream).0 as *const *mut std::ffi::c_void,
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
