//! The fused decoder-layer kernels against the candle op chains they replace (run on the
//! CPU): residual add + RMS norm (with the layer scalar, one or two next norms, a second
//! branch), GeGLU, q/k/v norms with RoPE and the K/V write, the greedy argmax and the masked softmax.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::cuda::layer_ops::{
    add_norm, add_norm_ext, gelu_mul, qkv_prep, qkv_prep_into, AddNormExtra, QkvSources,
    ADD_NORM_MAX_WIDTH,
};
use candle_gemma::kernels::cuda::reduce::{argmax_rows, masked_softmax};
use candle_nn::ops::rms_norm;

use crate::common::close::{max_abs_diff, Checks};
use crate::support::{gpu, rnd, tol};

/// Values of order 1-4 after the norms: a few ulps of the activation type.
pub fn lim(dtype: DType) -> f32 {
    4.0 * tol(dtype)
}

/// Residual sums reach ~20 on thousands of random elements, where one bf16 step is 0.125: the
/// same few ulps as [`lim`], relative to the largest expected value.
fn sum_lim(dtype: DType, want: &Tensor) -> Result<f32> {
    let top = want.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?;
    Ok(lim(dtype) * (top.to_scalar::<f32>()? / 4.0).max(1.0))
}

/// Residual add + norm: the layer scalar and the next norm, a 31B-wide row, the refusal of
/// rows too wide, a prefill chunk's rows, two next norms, and the two-branch end of a 26B-A4B
/// layer.
fn check_add_norm(checks: &mut Checks, dtype: DType, gpu: &Device) -> Result<()> {
    let g = |t: &Tensor| t.to_device(gpu);
    let mut report = |name: &str, err: f32, limit: f32| {
        checks.close(format!("fused {name} dtype={dtype:?}"), err, limit);
    };
    let lim = lim(dtype);
    let sum_lim = |want: &Tensor| sum_lim(dtype, want);
    // Residual add + norm, with the layer scalar and the next norm.
    let h = 2816;
    let (res, y, w, w2) = (
        rnd(&[3, h], dtype)?,
        rnd(&[3, h], dtype)?,
        rnd(&[h], dtype)?,
        rnd(&[h], dtype)?,
    );
    let s = Tensor::new(&[0.75f32], &Device::Cpu)?.to_dtype(dtype)?;
    let eps = 1e-6;
    let want = (&res + rms_norm(&y, &w, eps as f32)?)?.broadcast_mul(&s)?;
    let want2 = rms_norm(&want, &w2, eps as f32)?;
    let (got, got2) = add_norm(
        &g(&res)?,
        &g(&y)?,
        &g(&w)?,
        eps,
        Some(&g(&s)?),
        Some(&g(&w2)?),
    )?;
    report("add_norm", max_abs_diff(&got, &want), sum_lim(&want)?);
    // A 31B-wide row (several elements a thread).
    let hw = 5376;
    let (rw, yw, ww, w2w) = (
        rnd(&[2, hw], dtype)?,
        rnd(&[2, hw], dtype)?,
        rnd(&[hw], dtype)?,
        rnd(&[hw], dtype)?,
    );
    let want_w = (&rw + rms_norm(&yw, &ww, eps as f32)?)?;
    let (got_w, next_w) = add_norm(&g(&rw)?, &g(&yw)?, &g(&ww)?, eps, None, Some(&g(&w2w)?))?;
    report(
        "add_norm wide",
        max_abs_diff(&got_w, &want_w),
        sum_lim(&want_w)?,
    );
    report(
        "add_norm wide next",
        max_abs_diff(
            &next_w.expect("requested"),
            &rms_norm(&want_w, &w2w, eps as f32)?,
        ),
        2.0 * lim,
    );
    // Rows wider than the kernel keeps in registers are refused (the model takes candle's ops).
    let wide = rnd(&[1, ADD_NORM_MAX_WIDTH + 8], dtype)?.to_device(gpu)?;
    let wide_w = rnd(&[ADD_NORM_MAX_WIDTH + 8], dtype)?.to_device(gpu)?;
    let refused = add_norm(&wide, &wide, &wide_w, eps, None, None).is_err();
    report(
        "add_norm refuses wide rows",
        if refused { 0.0 } else { f32::INFINITY },
        0.0,
    );
    // The next norm sees the sum after its rounding to the activation type in both paths, but
    // its outputs (normalised values times unit-normal weights) reach ~16, where one bf16 ulp is
    // 0.0625: allow two ulps there.
    report(
        "add_norm next",
        max_abs_diff(&got2.expect("requested"), &want2),
        2.0 * lim,
    );

    // A prefill chunk's rows (the many-row form, a warp a row), E4B- and 31B-wide, with the
    // scalar and two next norms; 100 rows leave the last block part-filled.
    for hp in [2560, 5376] {
        let (rp, yp, wp, w2p, w3p) = (
            rnd(&[100, hp], dtype)?,
            rnd(&[100, hp], dtype)?,
            rnd(&[hp], dtype)?,
            rnd(&[hp], dtype)?,
            rnd(&[hp], dtype)?,
        );
        let want = (&rp + rms_norm(&yp, &wp, eps as f32)?)?.broadcast_mul(&s)?;
        let extra = AddNormExtra {
            scalar: Some(&g(&s)?),
            next: Some(&g(&w2p)?),
            next2: Some(&g(&w3p)?),
            ..Default::default()
        };
        let (got, n1, n2) = add_norm_ext(&g(&rp)?, &g(&yp)?, &g(&wp)?, eps, &extra)?;
        report(
            &format!("add_norm 100 rows of {hp}: sum"),
            max_abs_diff(&got, &want),
            sum_lim(&want)?,
        );
        // Normed rows times unit-normal weights reach ~30 over half a million elements, where
        // one bf16 step is 0.25: the tolerance scales with the largest expected value.
        for (name, n, wn) in [("first", n1, &w2p), ("second", n2, &w3p)] {
            let reference = rms_norm(&want, wn, eps as f32)?;
            report(
                &format!("add_norm 100 rows of {hp}: {name} next"),
                max_abs_diff(&n.expect("requested"), &reference),
                sum_lim(&reference)?.max(2.0 * lim),
            );
        }
    }

    // Two norms of the sum (26B-A4B: both feed-forward inputs), no scalar.
    let w3 = rnd(&[h], dtype)?;
    let sum = (&res + rms_norm(&y, &w, eps as f32)?)?;
    let extra = AddNormExtra {
        next: Some(&g(&w2)?),
        next2: Some(&g(&w3)?),
        ..Default::default()
    };
    let (got, n1, n2) = add_norm_ext(&g(&res)?, &g(&y)?, &g(&w)?, eps, &extra)?;
    report(
        "add_norm two next: sum",
        max_abs_diff(&got, &sum),
        sum_lim(&sum)?,
    );
    report(
        "add_norm two next: first",
        max_abs_diff(&n1.expect("requested"), &rms_norm(&sum, &w2, eps as f32)?),
        2.0 * lim,
    );
    report(
        "add_norm two next: second",
        max_abs_diff(&n2.expect("requested"), &rms_norm(&sum, &w3, eps as f32)?),
        2.0 * lim,
    );
    // The two-branch end of a 26B-A4B layer: res + norm(norm_a(a) + norm_b(b)), scalar, next.
    let (bb, wa, wb) = (rnd(&[3, h], dtype)?, rnd(&[h], dtype)?, rnd(&[h], dtype)?);
    let branch = (rms_norm(&y, &wa, eps as f32)? + rms_norm(&bb, &wb, eps as f32)?)?;
    let want = (&res + rms_norm(&branch, &w, eps as f32)?)?.broadcast_mul(&s)?;
    let want2 = rms_norm(&want, &w2, eps as f32)?;
    let (gbb, gwa, gwb) = (g(&bb)?, g(&wa)?, g(&wb)?);
    let extra = AddNormExtra {
        scalar: Some(&g(&s)?),
        next: Some(&g(&w2)?),
        second_branch: Some((&gbb, &gwa, &gwb)),
        ..Default::default()
    };
    let (got, n1, _) = add_norm_ext(&g(&res)?, &g(&y)?, &g(&w)?, eps, &extra)?;
    report(
        "add_norm two branches: sum",
        max_abs_diff(&got, &want),
        2.0 * lim,
    );
    report(
        "add_norm two branches: next",
        max_abs_diff(&n1.expect("requested"), &want2),
        4.0 * lim,
    );
    Ok(())
}

/// GeGLU over the halves of a stacked product, and q/k/v prep (norms, RoPE, layout; then
/// written into cache slots).
/// GeGLU, and the q/k/v preparation at head dim `hd` (256 and 512 take a warp a head, others a
/// block).
fn check_geglu_and_qkv(checks: &mut Checks, dtype: DType, gpu: &Device, hd: usize) -> Result<()> {
    let g = |t: &Tensor| t.to_device(gpu);
    let mut report = |name: &str, err: f32, limit: f32| {
        checks.close(format!("fused {name} dtype={dtype:?} hd={hd}"), err, limit);
    };
    let lim = lim(dtype);
    let eps = 1e-6;
    // GeGLU over the two halves of a stacked product: 16-bit rows on 16-byte boundaries take
    // eight elements a thread; a width of 700 (rows off those boundaries) the element loop.
    for width in [704, 700] {
        let gu = rnd(&[5, 2 * width], dtype)?;
        let want = (gu.narrow(1, 0, width)?.gelu()? * gu.narrow(1, width, width)?)?;
        let gug = g(&gu)?;
        let got = gelu_mul(&gug.narrow(1, 0, width)?, &gug.narrow(1, width, width)?)?;
        report(
            &format!("gelu_mul width={width}"),
            max_abs_diff(&got, &want),
            lim,
        );
    }

    // q/k/v norms, RoPE and layout: batch 2, 3 tokens, 4 query heads, 2 KV heads.
    let (b, sl, nh, kvh) = (2, 3, 4, 2);
    let qkv = rnd(&[b * sl, (nh + 2 * kvh) * hd], dtype)?;
    let (qw, kw) = (rnd(&[hd], dtype)?, rnd(&[hd], dtype)?);
    let angles = (Tensor::rand(0f32, 6.0, (b, sl, hd / 2), &Device::Cpu)?).to_dtype(DType::F32)?;
    let (cos, sin) = (
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    );
    let heads = |t: Tensor, n: usize| -> Result<Tensor> {
        Ok(t.reshape((b, sl, n, hd))?.transpose(1, 2)?.contiguous()?)
    };
    let part = |start: usize, n: usize| qkv.narrow(1, start * hd, n * hd);
    let ones = Tensor::ones(hd, dtype, &Device::Cpu)?;
    let norm = |t: Tensor, w: &Tensor| rms_norm(&t.contiguous()?, w, eps as f32);
    let wq = candle_nn::rotary_emb::rope(
        &heads(norm(part(0, nh)?.reshape((b * sl * nh, hd))?, &qw)?, nh)?,
        &cos,
        &sin,
    )?;
    let wk = candle_nn::rotary_emb::rope(
        &heads(norm(part(nh, kvh)?.reshape((b * sl * kvh, hd))?, &kw)?, kvh)?,
        &cos,
        &sin,
    )?;
    let wv = heads(
        norm(part(nh + kvh, kvh)?.reshape((b * sl * kvh, hd))?, &ones)?,
        kvh,
    )?;
    let qkvg = g(&qkv)?;
    let (qg, kg, vg) = (
        qkvg.narrow(1, 0, nh * hd)?,
        qkvg.narrow(1, nh * hd, kvh * hd)?,
        qkvg.narrow(1, (nh + kvh) * hd, kvh * hd)?,
    );
    let (qwg, kwg, cg, sg) = (g(&qw)?, g(&kw)?, g(&cos)?, g(&sin)?);
    let src = QkvSources {
        q: &qg,
        k: Some((&kg, &kwg)),
        v: Some(&vg),
        q_norm: &qwg,
        cos: &cg,
        sin: &sg,
    };
    let (gq, gkv) = qkv_prep(&src, b, sl, hd, eps)?;
    let (gk, gv) = gkv.expect("KV-owning");
    report("qkv_prep q", max_abs_diff(&gq, &wq), lim);
    report("qkv_prep k", max_abs_diff(&gk, &wk), lim);
    report("qkv_prep v", max_abs_diff(&gv, &wv), lim);

    // The same for the first sequence, k and v written into slots 5..8 of cache-shaped
    // buffers [1, kv_heads, 16, head_dim] (heads 16 slots apart), as a decode step writes them.
    let first = |t: &Tensor| t.narrow(0, 0, sl);
    let src1 = QkvSources {
        q: &first(&qg)?,
        k: Some((&first(&kg)?, &kwg)),
        v: Some(&first(&vg)?),
        q_norm: &qwg,
        cos: &cg.narrow(0, 0, 1)?,
        sin: &sg.narrow(0, 0, 1)?,
    };
    let cache = |seed: f64| -> Result<Tensor> {
        Ok(g(
            &(Tensor::ones((1, kvh, 16, hd), dtype, &Device::Cpu)? * seed)?
        )?)
    };
    let (kc, vc) = (cache(7.0)?, cache(9.0)?);
    let (q1, none) = qkv_prep_into(
        &src1,
        1,
        sl,
        hd,
        eps,
        Some((&kc.narrow(2, 5, sl)?, &vc.narrow(2, 5, sl)?)),
    )?;
    // The slots hold the fresh k/v; every other slot is untouched.
    let untouched = |c: &Tensor, fill: f64| -> Result<f32> {
        let c = c.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        let outside = Tensor::cat(&[c.narrow(2, 0, 5)?, c.narrow(2, 5 + sl, 16 - 5 - sl)?], 2)?;
        Ok((outside - fill)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?)
    };
    let err = max_abs_diff(&q1, &gq.narrow(0, 0, 1)?)
        .max(max_abs_diff(&kc.narrow(2, 5, sl)?, &gk.narrow(0, 0, 1)?))
        .max(max_abs_diff(&vc.narrow(2, 5, sl)?, &gv.narrow(0, 0, 1)?))
        .max(untouched(&kc, 7.0)?)
        .max(untouched(&vc, 9.0)?)
        .max(if none.is_none() { 0.0 } else { f32::INFINITY });
    report("qkv_prep into cache slots", err, 0.0);
    Ok(())
}

#[test]
fn add_norm_matches_candle() -> Result<()> {
    let Some(gpu) = gpu("add_norm") else {
        return Ok(());
    };
    let mut checks = Checks::new("add_norm");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        check_add_norm(&mut checks, dtype, &gpu.dev)?;
    }
    checks.finish();
    Ok(())
}

#[test]
fn geglu_and_qkv_prep_match_candle() -> Result<()> {
    let Some(gpu) = gpu("gelu_mul, qkv_prep") else {
        return Ok(());
    };
    let mut checks = Checks::new("gelu_mul, qkv_prep");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for hd in [256, 512, 128] {
            check_geglu_and_qkv(&mut checks, dtype, &gpu.dev, hd)?;
        }
    }
    checks.finish();
    Ok(())
}

#[test]
fn argmax_rows_picks_the_first_maximum() -> Result<()> {
    let Some(gpu) = gpu("argmax_rows") else {
        return Ok(());
    };
    let mut checks = Checks::new("argmax_rows");
    let dtype = DType::F32;
    let g = |t: &Tensor| t.to_device(&gpu.dev);
    let mut report = |name: &str, err: f32, limit: f32| {
        checks.close(format!("fused {name} dtype={dtype:?}"), err, limit);
    };
    // Greedy pick over a vocabulary-sized row, with a planted tie across chunks (the lower
    // index wins); a width that leaves a short last chunk, with NaNs (never picked) and the
    // maximum in that chunk; a row of NaNs (index 0).
    for cols in [262_144, 4_099] {
        let mut rows = rnd(&[3, cols], DType::F32)?.to_vec2::<f32>()?;
        if cols == 262_144 {
            rows[1][7] = 100.0;
            rows[1][90_000] = 100.0;
        } else {
            rows[0][5] = f32::NAN;
            rows[0][4_098] = 50.0;
            rows[1][4_097] = 60.0;
            rows[1][4_096] = f32::NAN;
            rows[2].iter_mut().for_each(|v| *v = f32::NAN);
        }
        let want: Vec<u32> = rows
            .iter()
            .map(|r| {
                r.iter()
                    .enumerate()
                    .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
                        if v > b.1 {
                            (i, v)
                        } else {
                            b
                        }
                    })
                    .0 as u32
            })
            .collect();
        let x = Tensor::new(rows, &Device::Cpu)?;
        let got = argmax_rows(&g(&x)?)?.to_vec1::<u32>()?;
        report(
            &format!("argmax_rows cols={cols}"),
            if got == want { 0.0 } else { f32::INFINITY },
            0.0,
        );
    }
    checks.finish();
    Ok(())
}

#[test]
fn masked_softmax_matches_the_host() -> Result<()> {
    let Some(gpu) = gpu("masked_softmax") else {
        return Ok(());
    };
    let mut checks = Checks::new("masked_softmax");
    // Rows held in registers (16 and 32 keys a thread) and rows read three times (longer), with
    // a causal and a sliding mask; keys at positions 0.., queries at the end of the keys.
    for (keys, window) in [
        (100, None),
        (1000, Some(64)),
        (5000, None),
        (9000, Some(4096)),
    ] {
        let (heads, q_len, scale) = (2, 3, 0.125f32);
        let scores = rnd(&[heads * q_len, keys], DType::F32)?;
        let positions: Vec<usize> = (0..keys).collect();
        let q_offset = keys - q_len;
        let got = masked_softmax(
            &scores.to_device(&gpu.dev)?,
            &positions,
            q_offset,
            q_len,
            window,
            f64::from(scale),
        )?;
        let rows = scores.to_vec2::<f32>()?;
        let mut want = Vec::with_capacity(rows.len());
        for (r, row) in rows.iter().enumerate() {
            let qpos = q_offset + r % q_len;
            let visible = |j: usize| j <= qpos && window.is_none_or(|w| j + w > qpos);
            let m = (0..keys)
                .filter(|&j| visible(j))
                .map(|j| row[j] * scale)
                .fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = (0..keys)
                .map(|j| {
                    if visible(j) {
                        (row[j] * scale - m).exp()
                    } else {
                        0.0
                    }
                })
                .collect();
            let sum: f32 = e.iter().sum();
            want.push(e.iter().map(|x| x / sum).collect::<Vec<_>>());
        }
        let want = Tensor::new(want, &Device::Cpu)?;
        checks.close(
            format!("keys={keys} window={window:?}"),
            max_abs_diff(&got, &want),
            1e-5,
        );
    }
    checks.finish();
    Ok(())
}
