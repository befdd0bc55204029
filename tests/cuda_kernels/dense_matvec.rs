//! The dense tensor-core matvec family against the CPU matmul (plain, gated, GeGLU over a
//! stacked weight, RMS-normed input, residual add + norm folded in; each declined exactly
//! where its shared memory or row count rules it out), and the packed 4-bit one-row product
//! with the residual add + norm folded in.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::cuda::dense_matvec::{
    dense_matvec, dense_matvec_add_norm, dense_matvec_gated, dense_matvec_geglu,
    dense_matvec_normed, GATED_MV_MAX_SMEM,
};
use candle_gemma::kernels::cuda::layer_ops::AddNormExtra;
use candle_gemma::kernels::cuda::matvec::packed_matvec_add_norm;
use candle_gemma::kernels::qmatmul::qmatmul;
use candle_gemma::kernels::quantize;
use candle_gemma::kernels::PackedAffine;
use candle_gemma::kv::QuantBits;
use candle_nn::ops::rms_norm;

use crate::common::close::{max_abs_diff, Checks};
use crate::support::{gpu, rnd, tol};

/// The tensor-core dense matvec against the CPU matmul (f32 there), in one activation dtype.
fn check_dense_matvec(
    out_dim: usize,
    in_dim: usize,
    rows: usize,
    dtype: DType,
    gpu: &Device,
    checks: &mut Checks,
) -> Result<()> {
    let g = |t: &Tensor| t.to_device(gpu);
    let w = rnd(&[out_dim, in_dim], dtype)?;
    let x = rnd(&[rows, in_dim], dtype)?;
    let want = x
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?;
    let got = dense_matvec(&x.to_device(gpu)?, &w.to_device(gpu)?)?
        .ok_or_else(|| anyhow::anyhow!("dense_matvec declined {dtype:?} [{out_dim}x{in_dim}]"))?;
    // Outputs ~ sqrt(in); the kernel rounds once to the activation type.
    let mag = (in_dim as f32).sqrt();
    let err = max_abs_diff(&got.to_dtype(DType::F32)?, &want);
    let shape = format!("dtype={dtype:?} [{out_dim}x{in_dim}] rows={rows}");
    checks.close(format!("dense_matvec {shape}"), err, tol(dtype) * mag * 2.0);

    // The gated product, its two inputs the strided halves of one stacked tensor (as the MLP's
    // gate/up output), against gelu_tanh(a) * b rounded to the activation type, then the matmul.
    let stacked = rnd(&[rows, 2 * in_dim], dtype)?;
    let (a, b) = (
        stacked.narrow(1, 0, in_dim)?,
        stacked.narrow(1, in_dim, in_dim)?,
    );
    let want = (a.gelu()? * &b)?
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?;
    let sg = stacked.to_device(gpu)?;
    let got = dense_matvec_gated(
        &sg.narrow(1, 0, in_dim)?,
        &sg.narrow(1, in_dim, in_dim)?,
        &w.to_device(gpu)?,
    )?;
    // More than one row, or a gated row beyond the kernel's shared memory, is declined (the
    // caller gates separately).
    let fits = rows == 1 && in_dim * dtype.size_in_bytes() <= GATED_MV_MAX_SMEM;
    let err = match got {
        Some(got) if fits => max_abs_diff(&got.to_dtype(DType::F32)?, &want),
        None if !fits => 0.0,
        _ => f32::INFINITY,
    };
    checks.close(
        format!("dense_matvec_gated {shape}"),
        err,
        tol(dtype) * mag * 2.0,
    );

    // The GeGLU product over a stacked [gate; up] weight (one row only) against the product
    // rounded to the activation type, gelu_tanh of the gate half rounded, times the up half.
    let wst = rnd(&[2 * out_dim, in_dim], dtype)?;
    let y = x
        .to_dtype(DType::F32)?
        .matmul(&wst.to_dtype(DType::F32)?.t()?)?
        .to_dtype(dtype)?
        .to_dtype(DType::F32)?;
    let gl = y
        .narrow(1, 0, out_dim)?
        .gelu()?
        .to_dtype(dtype)?
        .to_dtype(DType::F32)?;
    let want = (gl * y.narrow(1, out_dim, out_dim)?)?;
    let got = dense_matvec_geglu(&g(&x)?, &g(&wst)?)?;
    let err = match got {
        Some(got) if rows == 1 => max_abs_diff(&got.to_dtype(DType::F32)?, &want),
        None if rows > 1 => 0.0,
        _ => f32::INFINITY,
    };
    // Outputs ~ in (gelu of a ~sqrt(in) gate times a ~sqrt(in) up); each half rounds once to
    // the activation type, in whatever order its sum ran.
    checks.close(
        format!("dense_matvec_geglu {shape}"),
        err,
        tol(dtype) * mag * mag * 4.0,
    );

    // The RMS-normed input (the MoE router's), the norm computed in the kernel.
    let nwr = rnd(&[in_dim], dtype)?;
    let want = rms_norm(&x, &nwr, 1e-6)?
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?;
    let got = dense_matvec_normed(&g(&x)?, &g(&nwr)?, 1e-6, &g(&w)?)?;
    let fits_n = rows * in_dim * dtype.size_in_bytes() <= GATED_MV_MAX_SMEM;
    let err = match got {
        Some(got) if fits_n => max_abs_diff(&got.to_dtype(DType::F32)?, &want),
        None if !fits_n => 0.0,
        _ => f32::INFINITY,
    };
    // Normed inputs reach a few units: outputs ~ 3 sqrt(in).
    checks.close(
        format!("dense_matvec_normed {shape}"),
        err,
        tol(dtype) * mag * 8.0,
    );

    // The residual add + norm folded into the product (the last block normalises), plain with
    // the layer scalar and one next norm, gated with two next norms.
    let (res, nw, n1, n2) = (
        rnd(&[rows, out_dim], dtype)?,
        rnd(&[out_dim], dtype)?,
        rnd(&[out_dim], dtype)?,
        rnd(&[out_dim], dtype)?,
    );
    let s = Tensor::new(&[0.75f32], &Device::Cpu)?.to_dtype(dtype)?;
    let y_plain = x
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?
        .to_dtype(dtype)?;
    let y_gated = (a.gelu()? * &b)?
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?
        .to_dtype(dtype)?;
    let (gres, gnw, gn1, gn2, gs) = (g(&res)?, g(&nw)?, g(&n1)?, g(&n2)?, g(&s)?);
    for gated in [false, true] {
        let (y, sc) = if gated {
            (&y_gated, None)
        } else {
            (&y_plain, Some(&s))
        };
        let mut sum = (&res + rms_norm(y, &nw, 1e-6)?)?;
        if let Some(sc) = sc {
            sum = sum.broadcast_mul(sc)?;
        }
        let extra = AddNormExtra {
            scalar: if gated { None } else { Some(&gs) },
            next: Some(&gn1),
            next2: if gated { Some(&gn2) } else { None },
            second_branch: None,
        };
        let (xg, gg) = if gated {
            (
                sg.narrow(1, 0, in_dim)?,
                Some(sg.narrow(1, in_dim, in_dim)?),
            )
        } else {
            (g(&x)?, None)
        };
        let got = dense_matvec_add_norm(&xg, gg.as_ref(), &g(&w)?, &gres, &gnw, 1e-6, &extra)?;
        let err = match got {
            Some((o, o1, o2)) if rows == 1 => {
                let e0 = max_abs_diff(&o, &sum);
                let e1 = max_abs_diff(&o1.expect("asked"), &rms_norm(&sum, &n1, 1e-6)?);
                let e2 = match o2 {
                    Some(o2) => max_abs_diff(&o2, &rms_norm(&sum, &n2, 1e-6)?),
                    None => 0.0,
                };
                // The sum sees y rounded once on each side (an ulp apart at most), so allow the
                // add_norm kernel's bounds doubled.
                e0.max(e1 / 2.0).max(e2 / 2.0)
            }
            // Declined past one row, and where the gated row exceeds shared memory.
            None if rows > 1 || (gated && !fits) => 0.0,
            _ => f32::INFINITY,
        };
        checks.close(
            format!("dense_matvec_add_norm gated={gated} {shape}"),
            err,
            8.0 * tol(dtype),
        );
    }
    Ok(())
}

/// The residual add + norm folded into the packed 4-bit one-row product (`qmv_row4_norm`)
/// against the unfused path: the GPU's own packed product, then the add + norm on the CPU.
fn check_packed_add_norm(
    out_dim: usize,
    in_dim: usize,
    dtype: DType,
    gpu: &Device,
    checks: &mut Checks,
) -> Result<()> {
    let g = |t: &Tensor| t.to_device(gpu);
    let w = Tensor::randn(0f32, 0.05, (out_dim, in_dim), &Device::Cpu)?.to_dtype(dtype)?;
    let p = quantize(&w, QuantBits::from_bits(4)?, 64)?;
    let wg = PackedAffine::new(g(&p.codes)?, g(&p.scales)?, g(&p.biases)?, out_dim, in_dim)?;
    let x = rnd(&[1, in_dim], dtype)?;
    let y = qmatmul(&g(&x)?, &wg)?.to_device(&Device::Cpu)?;
    let (res, nw, n1, n2) = (
        rnd(&[1, out_dim], dtype)?,
        rnd(&[out_dim], dtype)?,
        rnd(&[out_dim], dtype)?,
        rnd(&[out_dim], dtype)?,
    );
    let s = Tensor::new(&[0.75f32], &Device::Cpu)?.to_dtype(dtype)?;
    let (gres, gnw, gn1, gn2, gs) = (g(&res)?, g(&nw)?, g(&n1)?, g(&n2)?, g(&s)?);
    for with_scalar in [true, false] {
        let mut sum = (&res + rms_norm(&y, &nw, 1e-6)?)?;
        if with_scalar {
            sum = sum.broadcast_mul(&s)?;
        }
        let extra = AddNormExtra {
            scalar: with_scalar.then_some(&gs),
            next: Some(&gn1),
            next2: (!with_scalar).then_some(&gn2),
            second_branch: None,
        };
        let got = packed_matvec_add_norm(&g(&x)?, &wg, &gres, &gnw, 1e-6, &extra)?;
        // The settled weight's kernel (first loads before the PDL wait) gives the same bits.
        let settled =
            packed_matvec_add_norm(&g(&x)?, &wg.clone().settled(), &gres, &gnw, 1e-6, &extra)?;
        let same = |p: Option<&Tensor>, q: Option<&Tensor>| -> Result<bool> {
            Ok(match (p, q) {
                (Some(p), Some(q)) => max_abs_diff(p, q) == 0.0,
                (p, q) => p.is_none() && q.is_none(),
            })
        };
        let same_bits = match (&got, &settled) {
            (Some((a, a1, a2)), Some((b, b1, b2))) => {
                same(Some(a), Some(b))?
                    && same(a1.as_ref(), b1.as_ref())?
                    && same(a2.as_ref(), b2.as_ref())?
            }
            _ => false,
        };
        let err = match got {
            Some((o, o1, o2)) => {
                let e0 = max_abs_diff(&o, &sum);
                let e1 = match o1 {
                    Some(o1) => max_abs_diff(&o1, &rms_norm(&sum, &n1, 1e-6)?),
                    None => f32::INFINITY,
                };
                let e2 = match (o2, with_scalar) {
                    (Some(o2), false) => max_abs_diff(&o2, &rms_norm(&sum, &n2, 1e-6)?),
                    (None, true) => 0.0,
                    _ => f32::INFINITY,
                };
                e0.max(e1 / 2.0).max(e2 / 2.0)
            }
            None => f32::INFINITY,
        };
        let case = format!(
            "packed_matvec_add_norm scalar={with_scalar} dtype={dtype:?} [{out_dim}x{in_dim}]"
        );
        checks.close(&case, err, 8.0 * tol(dtype));
        checks.exact(format!("{case} settled-same-bits"), same_bits);
    }
    Ok(())
}

/// Tile tails (outputs not a multiple of 16/32, inputs not a multiple of 32), both tile counts
/// (the two-tile kernel from 32 * 2 * SMs outputs), 1..=8 rows.
#[test]
fn dense_matvec_family_matches_cpu() -> Result<()> {
    let Some(gpu) = gpu("dense_matvec") else {
        return Ok(());
    };
    let mut checks = Checks::new("dense_matvec");
    for dtype in [DType::BF16, DType::F16] {
        for (out_dim, in_dim) in [
            (384, 512),
            (200, 1032),
            (9000, 264),
            (5000, 264),
            (40, 2568),
        ] {
            for rows in [1, 3, 8] {
                check_dense_matvec(out_dim, in_dim, rows, dtype, &gpu.dev, &mut checks)?;
            }
        }
        // E4B's down projection: one gated row of 10,240 inputs in bf16 (in f16 the GeGLU
        // check's products, ~sqrt(in) squared, pass its largest value), and two, declined.
        let rows: &[usize] = if dtype == DType::BF16 { &[1, 2] } else { &[2] };
        for &rows in rows {
            check_dense_matvec(2560, 10240, rows, dtype, &gpu.dev, &mut checks)?;
        }
    }
    checks.finish();
    Ok(())
}

/// An odd row count (a partial warp), E4B/26B-A4B widths and the widest taken
/// (`PACKED_FOLD_MAX_WIDTH`).
#[test]
fn packed_matvec_add_norm_matches_unfused() -> Result<()> {
    let Some(gpu) = gpu("packed_matvec_add_norm") else {
        return Ok(());
    };
    let mut checks = Checks::new("packed_matvec_add_norm");
    for dtype in [DType::BF16, DType::F16] {
        for (out_dim, in_dim) in [(2560, 2048), (2816, 4096), (4096, 2048), (1001, 1024)] {
            check_packed_add_norm(out_dim, in_dim, dtype, &gpu.dev, &mut checks)?;
        }
    }
    checks.finish();
    Ok(())
}
