//! The grouped product over row blocks (`grouped_matmul`, cuBLAS's grouped GEMM) against the
//! CPU product of each block, with blocks of unequal and zero rows, weights as separate
//! tensors and as views into one stacked tensor; rows that are not 16-byte multiples are
//! declined.

use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_gemma::kernels::cuda::grouped_gemm::{available, grouped_matmul, BlockWeights};

use crate::common::close::{max_abs_diff, Checks};
use crate::layer_ops::lim;
use crate::support::{gpu, rnd};

/// Blocks of `rows` (zeros included) over `[R, k]` activations and `[n, k]` weights in `dtype`,
/// the weights views of one `[blocks, n, k]` stack when `stacked`.
fn check(
    checks: &mut Checks,
    dev: &Device,
    dtype: DType,
    rows: &[usize],
    (n, k): (usize, usize),
    stacked: bool,
) -> Result<()> {
    let r: usize = rows.iter().sum();
    let x = rnd(&[r, k], dtype)?;
    let scale = 1.0 / (k as f64).sqrt();
    let stack = (rnd(&[rows.len(), n, k], DType::F32)? * scale)?.to_dtype(dtype)?;
    let weights: Vec<Tensor> = (0..rows.len())
        .map(|g| Ok(stack.i(g)?.contiguous()?))
        .collect::<Result<_>>()?;
    let stack_dev = stack.to_device(dev)?;
    let each = weights
        .iter()
        .map(|w| Ok(w.to_device(dev)?))
        .collect::<Result<Vec<_>>>()?;
    let order: Vec<usize> = (0..rows.len()).collect();
    let blocks = if stacked {
        BlockWeights::Stack {
            stack: &stack_dev,
            experts: &order,
        }
    } else {
        BlockWeights::Each(&each)
    };
    let case = format!("grouped_matmul {dtype:?} rows {rows:?} n {n} k {k} stacked {stacked}");
    let aligned = (n * dtype.size_in_bytes()).is_multiple_of(16)
        && (k * dtype.size_in_bytes()).is_multiple_of(16);
    let Some(got) = grouped_matmul(&x.to_device(dev)?, rows, blocks)? else {
        checks.exact(
            format!("{case}: declined (rows not 16-byte multiples)"),
            !aligned,
        );
        return Ok(());
    };
    checks.exact(format!("{case}: taken"), aligned);
    let xf = x.to_dtype(DType::F32)?;
    let mut want = Vec::new();
    let mut start = 0;
    for (g, &rows) in rows.iter().enumerate() {
        if rows > 0 {
            let w = weights[g].to_dtype(DType::F32)?;
            want.push(xf.narrow(0, start, rows)?.matmul(&w.t()?)?);
        }
        start += rows;
    }
    let want = Tensor::cat(&want, 0)?;
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    checks.close(case, max_abs_diff(&got, &want), lim(dtype));
    Ok(())
}

#[test]
fn grouped_products_match_cpu() -> Result<()> {
    let Some(gpu) = gpu("grouped_matmul") else {
        return Ok(());
    };
    if !available() {
        eprintln!("grouped_matmul: this build's cuBLAS has no grouped product; skipped");
        return Ok(());
    }
    let mut checks = Checks::new("grouped_matmul");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for stacked in [false, true] {
            check(
                &mut checks,
                &gpu.dev,
                dtype,
                &[3, 0, 17, 130, 1],
                (96, 200),
                stacked,
            )?;
            check(
                &mut checks,
                &gpu.dev,
                dtype,
                &[64, 256, 0, 300],
                (1408, 2816),
                stacked,
            )?;
        }
        check(&mut checks, &gpu.dev, dtype, &[0, 513], (70, 33), true)?;
    }
    checks.finish();
    Ok(())
}
