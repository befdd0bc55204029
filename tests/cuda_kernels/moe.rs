//! The mixture-of-experts kernels against the CPU: routing (top-k, softmax, per-expert scale),
//! the grouped expert products over dense experts (per token, per pair, by slot, gated) with
//! the mix (pair order, or rows found through a slot table), the row gather of the prefill
//! path, and the products over MLX-packed experts (plain and gated).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::cuda::moe::{
    gather_rows, grouped_matvec, grouped_matvec_gated, grouped_qmatvec, grouped_qmatvec_gated,
    moe_mix, moe_mix_rows, moe_route,
};
use candle_gemma::kernels::qmatmul::qmatmul;
use candle_gemma::kernels::quantize;
use candle_gemma::kernels::PackedAffine;
use candle_gemma::kv::QuantBits;

use crate::common::close::{max_abs_diff, Checks};
use crate::layer_ops::lim;
use crate::support::{gpu, rnd, tol};

/// Routing, then the grouped products over dense experts of the routed pairs, in `dtype`, with
/// `out` rows of `inp` inputs (and the down products `inp` rows of `out`): rows of up to 1024
/// inputs go through the kernels that take 4 rows a warp, longer ones through one row a warp.
fn check_dense_experts(
    checks: &mut Checks,
    dtype: DType,
    gpu: &Device,
    (out, inp): (usize, usize),
) -> Result<()> {
    let g = |t: &Tensor| t.to_device(gpu);
    let mut report = |name: &str, err: f32, limit: f32| {
        checks.close(
            format!("fused {name} dtype={dtype:?} {out}x{inp}"),
            err,
            limit,
        );
    };
    let lim = lim(dtype);
    // Router: top-3 of 8 logits per token (ties to the lower expert), softmax, per-expert scale.
    let (e, tokens, k) = (8, 5, 3);
    let logits = rnd(&[tokens, e], dtype)?;
    let scale = Tensor::rand(0.5f32, 1.5, e, &Device::Cpu)?;
    let (gidx, gmix) = moe_route(&g(&logits)?, &g(&scale)?, k)?;
    let lg = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let sc = scale.to_vec1::<f32>()?;
    let (gi, gm) = (
        gidx.to_device(&Device::Cpu)?.to_vec2::<u32>()?,
        gmix.to_device(&Device::Cpu)?.to_vec2::<f32>()?,
    );
    let mut route_err = 0f32;
    let mut idx = Vec::new();
    let mut mixv = Vec::new();
    for t in 0..tokens {
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| lg[t][b].total_cmp(&lg[t][a]).then(a.cmp(&b)));
        let sum: f32 = order[..k]
            .iter()
            .map(|&i| (lg[t][i] - lg[t][order[0]]).exp())
            .sum();
        for j in 0..k {
            let want = (lg[t][order[j]] - lg[t][order[0]]).exp() / sum * sc[order[j]];
            if gi[t][j] as usize != order[j] {
                route_err = f32::INFINITY;
            }
            route_err = route_err.max((gm[t][j] - want).abs());
            idx.push(order[j] as u32);
            mixv.push(want);
        }
    }
    report("moe_route", route_err, 1e-5);

    // Grouped expert products (gate/up: x per token; down: x per pair), then the mix.
    let wts = (rnd(&[e, out, inp], dtype)? * 0.1)?;
    let x = rnd(&[tokens, inp], dtype)?;
    let idx_t = Tensor::from_vec(idx.clone(), (tokens, k), &Device::Cpu)?;
    let mut rows = Vec::new();
    for (p, &ex) in idx.iter().enumerate() {
        let xr = x.get(p / k)?.unsqueeze(0)?.to_dtype(DType::F32)?;
        rows.push(xr.matmul(&wts.get(ex as usize)?.to_dtype(DType::F32)?.t()?)?);
    }
    let want = Tensor::cat(&rows, 0)?;
    let got = grouped_matvec(&g(&wts)?, &g(&idx_t)?, &g(&x)?, true)?;
    report("grouped_matvec", max_abs_diff(&got, &want), lim);
    let wd = (rnd(&[e, inp, out], dtype)? * 0.1)?;
    let hmid = rnd(&[tokens * k, out], dtype)?;
    let mix = Tensor::from_vec(mixv.clone(), (tokens, k), &Device::Cpu)?;
    let mut outs = Vec::new();
    for t in 0..tokens {
        let mut acc = Tensor::zeros((1, inp), DType::F32, &Device::Cpu)?;
        for j in 0..k {
            let p = t * k + j;
            let yr = hmid
                .get(p)?
                .unsqueeze(0)?
                .to_dtype(DType::F32)?
                .matmul(&wd.get(idx[p] as usize)?.to_dtype(DType::F32)?.t()?)?;
            acc = (acc + (yr * mixv[p] as f64)?)?;
        }
        outs.push(acc);
    }
    let want = Tensor::cat(&outs, 0)?;
    let y = grouped_matvec(&g(&wd)?, &g(&idx_t)?, &g(&hmid)?, false)?;
    let got = moe_mix(&y, &g(&mix)?)?;
    report("grouped_matvec + moe_mix", max_abs_diff(&got, &want), lim);
    // The same rows stored in reverse, found through a slot table: the same bits.
    let pairs = tokens * k;
    let reversed = g(&Tensor::from_vec(
        (0..pairs as u32).rev().collect::<Vec<_>>(),
        pairs,
        &Device::Cpu,
    )?)?;
    let stored = y.index_select(&reversed, 0)?;
    let rows_got = moe_mix_rows(&stored, &reversed, &g(&mix)?)?;
    report(
        "moe_mix_rows = moe_mix",
        max_abs_diff(&rows_got, &got.to_device(&Device::Cpu)?),
        0.0,
    );
    // Rows gathered 16 bytes at a time, repeats included, equal candle's index_select.
    let picks = g(&Tensor::from_vec(
        vec![4u32, 0, 4, 2, 1, 3, 0],
        7,
        &Device::Cpu,
    )?)?;
    let xg = g(&x)?;
    let err = match gather_rows(&xg, &picks)? {
        Some(t) => max_abs_diff(&t, &xg.index_select(&picks, 0)?.to_device(&Device::Cpu)?),
        None => f32::INFINITY,
    };
    report("gather_rows", err, 0.0);

    // Fewer pairs than experts (the decode grid, one block column per pair slot), with experts
    // picked twice: each must still be computed once for both of its pairs.
    let slot_idx: Vec<u32> = vec![3, 1, 3, 7, 1, 0];
    let (st, sk) = (2, 3);
    let sx = rnd(&[st, inp], dtype)?;
    let mut rows = Vec::new();
    for (p, &ex) in slot_idx.iter().enumerate() {
        let xr = sx.get(p / sk)?.unsqueeze(0)?.to_dtype(DType::F32)?;
        rows.push(xr.matmul(&wts.get(ex as usize)?.to_dtype(DType::F32)?.t()?)?);
    }
    let want = Tensor::cat(&rows, 0)?;
    let sidx = Tensor::from_vec(slot_idx.clone(), (st, sk), &Device::Cpu)?;
    let got = grouped_matvec(&g(&wts)?, &g(&sidx)?, &g(&sx)?, true)?;
    report("grouped_matvec by slot", max_abs_diff(&got, &want), lim);

    // The gated down product: pair rows gelu_tanh(a) * b from the halves of one stacked tensor.
    let gu = rnd(&[tokens * k, 2 * out], dtype)?;
    let (ga, gb) = (gu.narrow(1, 0, out)?, gu.narrow(1, out, out)?);
    let hidden = (ga.gelu()? * &gb)?;
    let mut rows = Vec::new();
    for (p, &ex) in idx.iter().enumerate() {
        rows.push(
            hidden
                .get(p)?
                .unsqueeze(0)?
                .to_dtype(DType::F32)?
                .matmul(&wd.get(ex as usize)?.to_dtype(DType::F32)?.t()?)?,
        );
    }
    let want = Tensor::cat(&rows, 0)?;
    let gug = g(&gu)?;
    let got = grouped_matvec_gated(
        &g(&wd)?,
        &g(&idx_t)?,
        &gug.narrow(1, 0, out)?,
        &gug.narrow(1, out, out)?,
    )?;
    // f32 is declined (the caller gates separately); f16/bf16 must run.
    let err = match (got, dtype) {
        (Some(got), DType::BF16 | DType::F16) => max_abs_diff(&got, &want),
        (None, DType::F32) => 0.0,
        _ => f32::INFINITY,
    };
    report("grouped_matvec gated", err, lim);
    Ok(())
}

/// Dense expert products with many pairs an expert: about 4 an expert, 10, then (16-bit
/// activations on the tensor cores from 256 pairs) 33 and 40 (past the 32 pairs of one pass,
/// into a part or a whole of an 8-pair tile), plain and gated, against the f32 product of each
/// pair. 40 rows an
/// expert (not a multiple of a tile's 16); 1056 and 224 inputs end part-way into a 128-input
/// chunk.
fn check_dense_many_pairs(checks: &mut Checks, dtype: DType, gpu: &Device) -> Result<()> {
    let g = |t: &Tensor| t.to_device(gpu);
    let (e, rows, wide, narrow) = (8usize, 40, 1056, 224);
    let wts = (rnd(&[e, rows, wide], dtype)? * 0.1)?;
    let wd = (rnd(&[e, rows, narrow], dtype)? * 0.1)?;
    let product = |x: &Tensor, w: &Tensor, ex: u32| -> Result<Tensor> {
        Ok(x.unsqueeze(0)?
            .to_dtype(DType::F32)?
            .matmul(&w.get(ex as usize)?.to_dtype(DType::F32)?.t()?)?)
    };
    let mut report = |name: String, err: f32| {
        checks.close(format!("{name} dtype={dtype:?}"), err, lim(dtype));
    };
    for (tokens, k) in [(12usize, 3usize), (40, 2), (33, 8), (40, 8)] {
        let idx: Vec<u32> = (0..tokens * k)
            .map(|p| ((p / k) * 3 + (p % k) * 5) as u32 % e as u32)
            .collect();
        let idx_t = g(&Tensor::from_vec(idx.clone(), (tokens, k), &Device::Cpu)?)?;
        let x = rnd(&[tokens, wide], dtype)?;
        let mut want = Vec::new();
        for (p, &ex) in idx.iter().enumerate() {
            want.push(product(&x.get(p / k)?, &wts, ex)?);
        }
        let got = grouped_matvec(&g(&wts)?, &idx_t, &g(&x)?, true)?;
        report(
            format!("grouped_matvec pairs={}", tokens * k),
            max_abs_diff(&got, &Tensor::cat(&want, 0)?),
        );
        // Gated: pair rows gelu_tanh(a) * b (16-bit only; f32 is declined).
        let gu = rnd(&[tokens * k, 2 * narrow], dtype)?;
        let hidden = (gu.narrow(1, 0, narrow)?.gelu()? * gu.narrow(1, narrow, narrow)?)?;
        let gug = g(&gu)?;
        let got = grouped_matvec_gated(
            &g(&wd)?,
            &idx_t,
            &gug.narrow(1, 0, narrow)?,
            &gug.narrow(1, narrow, narrow)?,
        )?;
        let mut want = Vec::new();
        for (p, &ex) in idx.iter().enumerate() {
            want.push(product(&hidden.get(p)?, &wd, ex)?);
        }
        let err = match (got, dtype) {
            (Some(got), DType::BF16 | DType::F16) => max_abs_diff(&got, &Tensor::cat(&want, 0)?),
            (None, DType::F32) => 0.0,
            _ => f32::INFINITY,
        };
        report(format!("grouped_matvec gated pairs={}", tokens * k), err);
    }
    Ok(())
}

#[test]
fn routing_and_dense_expert_products_match_cpu() -> Result<()> {
    let Some(gpu) = gpu("moe dense experts") else {
        return Ok(());
    };
    let mut checks = Checks::new("moe dense experts");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for shape in [(72, 128), (1032, 1040)] {
            check_dense_experts(&mut checks, dtype, &gpu.dev, shape)?;
        }
        check_dense_many_pairs(&mut checks, dtype, &gpu.dev)?;
    }
    checks.finish();
    Ok(())
}

/// The routed expert products over MLX-packed experts (`grouped_qmatvec`, plain and gated)
/// against the CPU reference product of each picked expert: few pairs (one block per pair slot,
/// experts picked twice) and many (one block per expert, up to 40 pairs an expert). 16-bit
/// activations with 4-bit codes and scales of their type take the tensor-core kernels from 16
/// pairs; `in_dim` not a multiple of 128 leaves their last 128-input chunk part empty.
fn check_grouped_packed(
    (xdtype, sdtype): (DType, DType),
    bits: usize,
    group: usize,
    in_dim: usize,
    gpu: &Device,
    checks: &mut Checks,
) -> Result<()> {
    let cpu = Device::Cpu;
    // 40 rows an expert: not a multiple of the 8 rows of a block, nor of a tensor-core tile's
    // 16. The cases pick among the first 8 experts, except one that spreads 24 pairs over 32
    // experts.
    let (experts, out_dim) = (32, 40);
    let w = Tensor::randn(0f32, 0.05, (experts * out_dim, in_dim), &cpu)?.to_dtype(sdtype)?;
    let p = quantize(&w, QuantBits::from_bits(bits)?, group)?;
    let wc = PackedAffine::new(p.codes, p.scales, p.biases, experts * out_dim, in_dim)?;
    let wg = PackedAffine::new(
        wc.codes.to_device(gpu)?,
        wc.scales.to_device(gpu)?,
        wc.biases.to_device(gpu)?,
        experts * out_dim,
        in_dim,
    )?;
    let expert = |e: u32| wc.narrow_rows(e as usize * out_dim, out_dim);
    let lim = tol(xdtype) * ((in_dim as f32).sqrt() * 0.05).max(1.0) * 2.0;
    let mut report = |name: String, err: f32| {
        let case =
            format!("{name} x={xdtype:?} scales={sdtype:?} bits={bits} group={group} in={in_dim}");
        checks.close(case, err, lim);
    };
    for (tokens, k, idx) in [
        (2usize, 3usize, vec![3u32, 1, 3, 7, 1, 0]),
        (
            20,
            2,
            (0..20u32)
                .flat_map(|t| [(t * 3) % 8, (t * 3 + 5) % 8])
                .collect(),
        ),
        // Fewer pairs than experts, but enough for the several-pairs kernel: lone pairs (each
        // decoded alone in it) beside experts picked three times.
        (
            12,
            2,
            (0..12u32)
                .flat_map(|t| [(t * 5) % 32, 31 - t % 4])
                .collect(),
        ),
        // More pairs an expert: about 10, then 40 (every token picks each of experts 0-7).
        (
            40,
            2,
            (0..40u32)
                .flat_map(|t| [(t * 3) % 8, (t * 3 + 5) % 8])
                .collect(),
        ),
        (
            40,
            8,
            (0..40u32)
                .flat_map(|t| (0..8).map(move |j| (t + j) % 8))
                .collect(),
        ),
    ] {
        let idx_t = Tensor::from_vec(idx.clone(), (tokens, k), &cpu)?;
        let x = rnd(&[tokens, in_dim], xdtype)?;
        let mut rows = Vec::new();
        for (p, &e) in idx.iter().enumerate() {
            rows.push(qmatmul(&x.get(p / k)?.unsqueeze(0)?, &expert(e)?)?);
        }
        let want = Tensor::cat(&rows, 0)?;
        let got = grouped_qmatvec(
            &wg,
            experts,
            &idx_t.to_device(gpu)?,
            &x.to_device(gpu)?,
            true,
        )?;
        report(
            format!("grouped_qmatvec pairs={}", tokens * k),
            max_abs_diff(&got, &want),
        );
        // Gated: pair rows gelu_tanh(a) * b from the halves of one stacked tensor (16-bit only).
        let gu = rnd(&[tokens * k, 2 * in_dim], xdtype)?;
        let hidden = (gu.narrow(1, 0, in_dim)?.gelu()? * gu.narrow(1, in_dim, in_dim)?)?;
        let mut rows = Vec::new();
        for (p, &e) in idx.iter().enumerate() {
            rows.push(qmatmul(&hidden.get(p)?.unsqueeze(0)?, &expert(e)?)?);
        }
        let want = Tensor::cat(&rows, 0)?;
        let gug = gu.to_device(gpu)?;
        let got = grouped_qmatvec_gated(
            &wg,
            experts,
            &idx_t.to_device(gpu)?,
            &gug.narrow(1, 0, in_dim)?,
            &gug.narrow(1, in_dim, in_dim)?,
        )?;
        let err = match (got, xdtype) {
            (Some(got), DType::BF16 | DType::F16) => max_abs_diff(&got, &want),
            (None, DType::F32) => 0.0,
            _ => f32::INFINITY,
        };
        report(format!("grouped_qmatvec gated pairs={}", tokens * k), err);
    }
    Ok(())
}

#[test]
fn packed_expert_products_match_cpu() -> Result<()> {
    let Some(gpu) = gpu("grouped_qmatvec") else {
        return Ok(());
    };
    let mut checks = Checks::new("grouped_qmatvec");
    for xdtype in [DType::F32, DType::BF16, DType::F16] {
        for sdtype in [DType::BF16, DType::F16, DType::F32] {
            for bits in [4, 8] {
                for group in [32, 64, 128] {
                    let dtypes = (xdtype, sdtype);
                    check_grouped_packed(dtypes, bits, group, 256, &gpu.dev, &mut checks)?;
                }
            }
        }
    }
    // Inputs ending half-way through a tensor-core chunk of 128.
    for (dtype, group) in [(DType::BF16, 64), (DType::F16, 32)] {
        check_grouped_packed((dtype, dtype), 4, group, 192, &gpu.dev, &mut checks)?;
    }
    checks.finish();
    Ok(())
}
