//! The packed (MLX affine) matmul on the GPU against the CPU reference, over bits, group
//! sizes, scale and activation dtypes, row counts (1..=33) and shapes that select each matvec
//! and GEMM kernel (tile tails, split rows, one-wave builds); misaligned activations; settled
//! weights (bit-identical); and the packed embedding lookup.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::qmatmul::{qembedding, qmatmul};
use candle_gemma::kernels::quantize;
use candle_gemma::kernels::PackedAffine;
use candle_gemma::kv::QuantBits;

use crate::common::close::{max_abs_diff, Checks};
use crate::support::{gpu, tol};

/// One weight shape and format against the CPU: `rows` activation rows, then the embedding
/// lookup of a few rows.
#[allow(clippy::too_many_arguments)] // one case of the sweep, named field by field
fn check_qmatmul(
    out_dim: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
    sdtype: DType,
    xdtype: DType,
    rows: usize,
    gpu: &Device,
    checks: &mut Checks,
) -> Result<()> {
    let cpu = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (out_dim, in_dim), &cpu)?.to_dtype(sdtype)?;
    let p = quantize(&w, QuantBits::from_bits(bits)?, group)?;
    let wc = PackedAffine::new(p.codes, p.scales, p.biases, out_dim, in_dim)?;
    let wg = PackedAffine::new(
        wc.codes.to_device(gpu)?,
        wc.scales.to_device(gpu)?,
        wc.biases.to_device(gpu)?,
        out_dim,
        in_dim,
    )?;
    let x = Tensor::randn(0f32, 1.0, (rows, in_dim), &cpu)?.to_dtype(xdtype)?;
    let want = qmatmul(&x, &wc)?;
    let got = qmatmul(&x.to_device(gpu)?, &wg)?;
    // The same x as a contiguous view starting one element into its buffer (not 16-byte
    // aligned): the launcher must copy it rather than hand the kernel a misaligned pointer.
    let padded = Tensor::cat(&[&x.flatten_all()?.narrow(0, 0, 1)?, &x.flatten_all()?], 0)?;
    let x_off = padded
        .to_device(gpu)?
        .narrow(0, 1, rows * in_dim)?
        .reshape((rows, in_dim))?;
    let got_off = qmatmul(&x_off, &wg)?;
    // Settled weights (copied in by the driver, so complete) take the kernels that start
    // reading them before the PDL wait: same arithmetic, so the same bits.
    let got_settled = qmatmul(&x.to_device(gpu)?, &wg.clone().settled())?;
    let same_bits = max_abs_diff(&got_settled, &got) == 0.0;
    // Output magnitude ~ sqrt(in) * 0.05; scale the tolerance with it.
    let mag = (in_dim as f32).sqrt() * 0.05;
    let err = max_abs_diff(&got, &want).max(max_abs_diff(&got_off, &want));
    let case = format!(
        "qmatmul x={xdtype:?} scales={sdtype:?} bits={bits} group={group} [{out_dim}x{in_dim}] rows={rows}"
    );
    checks.close(&case, err, tol(xdtype) * mag.max(1.0) * 2.0);
    checks.exact(format!("{case} settled-same-bits"), same_bits);
    let ids = Tensor::new(&[3u32, 0, (out_dim - 1) as u32, 3], &cpu)?;
    let we = qembedding(&ids, &wc, xdtype)?;
    let ge = qembedding(&ids.to_device(gpu)?, &wg, xdtype)?;
    checks.close(
        format!("qembedding x={xdtype:?} scales={sdtype:?} bits={bits} group={group}"),
        max_abs_diff(&ge, &we),
        tol(xdtype) * 0.1,
    );
    Ok(())
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Every activation and scale dtype, both bit widths: the general sweep, tile tails, one-row
/// matvecs with whole and leftover 1024-code steps, and rows split over 2 and 4 warps.
#[test]
fn packed_matmul_sweep_matches_cpu() -> Result<()> {
    let Some(gpu) = gpu("qmatmul sweep") else {
        return Ok(());
    };
    let (dev, mut checks) = (&gpu.dev, Checks::new("qmatmul sweep"));
    for xdtype in DTYPES {
        for sdtype in [DType::BF16, DType::F16, DType::F32] {
            for bits in [4, 8] {
                let mut case = |out, inp, group, rows| {
                    check_qmatmul(
                        out,
                        inp,
                        bits,
                        group,
                        sdtype,
                        xdtype,
                        rows,
                        dev,
                        &mut checks,
                    )
                };
                for (group, rows) in [(32, 1), (64, 3), (128, 8), (64, 20)] {
                    case(384, 512, group, rows)?;
                }
                // 9..=32 rows (`qmv_tc4x` for 4-bit weights with scales in the activations'
                // dtype, dequantize-then-GEMM otherwise), 33 (GEMM), an input whose last
                // 128-code chunk is partial, an output tile tail.
                for (group, rows) in [(32, 9), (128, 16), (64, 32), (64, 33)] {
                    case(384, 512, group, rows)?;
                }
                case(200, 1088, 64, 17)?;
                // Output rows not a multiple of the tensor-core tile (16), odd row counts.
                for (group, rows) in [(32, 2), (64, 5), (128, 7)] {
                    case(200, 1024, group, rows)?;
                }
                // One activation row: whole 1024-code steps, a leftover step and an odd row
                // count (qmv_row4 owns 2-4 rows a warp).
                for group in [64, 128] {
                    case(203, 3072, group, 1)?;
                }
                // Few long rows, so qmv_row4 splits each row pair's input over 2 and over 4
                // warps (`row_matvec_split_for`), with a leftover step.
                for (out_dim, in_dim) in [(203, 9472), (37, 17664)] {
                    case(out_dim, in_dim, 128, 1)?;
                }
            }
        }
    }
    checks.finish();
    Ok(())
}

/// The model's shapes that pick particular kernels: 31B projections; the 31B q_proj at 4 bits
/// (settled, its row pairs need more than one wave of `qmv_row4_*_u2e` on an H100 but fit one
/// of `_u2le`); and one row of 8-bit codes over 6337..=8448 outputs (more than one wave of the
/// 39-register build on an H100, 132 SMs with 6 blocks each, but one of the 32-register `_1w`
/// build, which `qmatvec` takes there; f32 activations: one build fits 8 blocks, so never).
#[test]
fn packed_matmul_at_model_shapes_matches_cpu() -> Result<()> {
    let Some(gpu) = gpu("qmatmul model shapes") else {
        return Ok(());
    };
    let (dev, mut checks) = (&gpu.dev, Checks::new("qmatmul model shapes"));
    let bf16 = DType::BF16;
    check_qmatmul(8192 / 8, 5376, 4, 64, bf16, bf16, 1, dev, &mut checks)?;
    // A batch of 32 through a 31B projection (`qmv_tc4x`).
    check_qmatmul(8192 / 8, 5376, 4, 64, bf16, bf16, 32, dev, &mut checks)?;
    // Outputs wide enough for two and four tiles a warp on an H100 (`qmv_tc4x2`, `qmv_tc4x4`:
    // `batch_tiles_per_warp`), each ending in a partial block, with 20 and 32 rows and an
    // input whose last chunk is partial.
    for out_dim in [2544, 8464] {
        for rows in [20, 32] {
            check_qmatmul(out_dim, 1088, 4, 64, bf16, bf16, rows, dev, &mut checks)?;
        }
    }
    check_qmatmul(5376 / 8, 21504, 8, 64, bf16, bf16, 1, dev, &mut checks)?;
    for dtype in [DType::BF16, DType::F16] {
        for group in [64, 128] {
            check_qmatmul(8192, 5376, 4, group, dtype, dtype, 1, dev, &mut checks)?;
        }
    }
    for xdtype in DTYPES {
        for (out_dim, group) in [(8192, 64), (7001, 128), (6400, 32)] {
            check_qmatmul(out_dim, 1024, 8, group, bf16, xdtype, 1, dev, &mut checks)?;
        }
    }
    checks.finish();
    Ok(())
}
