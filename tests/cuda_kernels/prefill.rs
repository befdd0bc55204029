//! The flash prefill attention kernel against the CPU reference in f32: long query blocks over
//! dense f16/bf16 K/V at the head dimensions it is built for, GQA from 1 to 8 query heads a KV
//! head, causal and sliding masks (tiles skipped, partly and wholly visible), key positions in
//! one run, a wrapped ring and a table, query blocks that do not fill the last row block; and
//! the dispatcher's result for the same call, bit for bit.

use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_gemma::kernels::attend;
use candle_gemma::kernels::cuda::attend_prefill_cuda;
use candle_gemma::kv::{KvData, KvView};

use crate::common::close::{max_abs_diff, Checks};
use crate::support::{gpu, positions, rnd, tol, Pos};

/// One case: heads (query / KV), head dim, query block, keys, window, key layout.
type Case = (usize, usize, usize, usize, usize, Option<usize>, Pos);

const CASES: [Case; 9] = [
    // E4B-like: 8 query heads on one KV head, the first chunk of a prompt.
    (8, 1, 256, 40, 40, None, Pos::Linear),
    (8, 1, 512, 100, 100, None, Pos::Linear),
    // A later chunk behind cached keys, sliding window: tiles before the window are skipped.
    (8, 2, 256, 200, 700, Some(128), Pos::Linear),
    // A rotating cache's ring of window + chunk keys (31B sliding shape, cut down).
    (32, 16, 256, 300, 812, Some(512), Pos::Ring),
    // Full layers at head dim 512: causal over every key, positions in a table.
    (8, 4, 512, 130, 391, None, Pos::Shuffled),
    (32, 4, 512, 96, 96, None, Pos::Ring),
    // Head dim 128, a window shorter than a tile.
    (4, 1, 128, 77, 100, Some(40), Pos::Ring),
    (4, 2, 128, 65, 1000, None, Pos::Linear),
    // A window that hides every cached key from the first queries.
    (2, 1, 256, 33, 300, Some(20), Pos::Shuffled),
];

#[test]
fn prefill_attention_matches_cpu() -> Result<()> {
    let Some(gpu) = gpu("prefill attention") else {
        return Ok(());
    };
    let mut checks = Checks::new("prefill attention");
    for dtype in [DType::BF16, DType::F16] {
        for &(n_heads, kv_heads, hd, q_len, keys, window, pos) in &CASES {
            let q = rnd(&[1, n_heads, q_len, hd], dtype)?;
            let k = rnd(&[1, kv_heads, keys, hd], dtype)?;
            let v = rnd(&[1, kv_heads, keys, hd], dtype)?;
            let pos = positions(keys, pos, keys as u64 * 7 + hd as u64);
            let q_offset = keys - q_len;
            let scale = 1.0 / (hd as f64).sqrt();
            let view = |k: &Tensor, v: &Tensor| KvView::Single {
                data: KvData::Dense {
                    k: k.clone(),
                    v: v.clone(),
                },
                positions: pos.clone(),
            };
            let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
            let want = attend(
                &f32_of(&q)?,
                &view(&f32_of(&k)?, &f32_of(&v)?),
                &[q_offset],
                window,
                scale,
            )?;
            let (qg, kg, vg) = (
                q.to_device(&gpu.dev)?,
                k.to_device(&gpu.dev)?,
                v.to_device(&gpu.dev)?,
            );
            let got = attend_prefill_cuda(&qg, &kg, &vg, &pos, q_offset, window, scale)?;
            let name = format!(
                "dtype={dtype:?} heads={n_heads}/{kv_heads} hd={hd} q_len={q_len} keys={keys} window={window:?} pos={pos:?}"
            );
            checks.close(
                format!("prefill {name}"),
                max_abs_diff(&got, &want),
                tol(dtype),
            );
            let routed = attend(&qg, &view(&kg, &vg), &[q_offset], window, scale)?;
            checks.exact(
                format!("prefill-dispatch {name}"),
                max_abs_diff(&routed, &got) == 0.0,
            );
        }
    }
    checks.finish();
    Ok(())
}

/// At Gemma 4's score scale (1.0 on RMS-normed queries and keys: scores of order ±√head_dim)
/// the kernel, which keeps scores in f32, is at least as close to the f32 reference as the
/// score-matrix path it replaces, which rounds the scores to the query dtype before the
/// softmax (run here on the CPU in bf16, the same rounding).
#[test]
fn prefill_attention_at_gemma_scale_is_no_worse_than_the_score_matrix() -> Result<()> {
    let Some(gpu) = gpu("prefill attention at Gemma scale") else {
        return Ok(());
    };
    let mut checks = Checks::new("prefill attention at Gemma scale");
    let dtype = DType::BF16;
    for &(n_heads, kv_heads, hd, q_len, keys, window, pos) in &[
        (8, 2, 256, 256, 768, Some(512), Pos::Ring),
        (8, 2, 512, 256, 768, None, Pos::Linear),
    ] {
        let q = rnd(&[1, n_heads, q_len, hd], dtype)?;
        let k = rnd(&[1, kv_heads, keys, hd], dtype)?;
        let v = rnd(&[1, kv_heads, keys, hd], dtype)?;
        let pos = positions(keys, pos, 3);
        let q_offset = keys - q_len;
        let view = |k: &Tensor, v: &Tensor| KvView::Single {
            data: KvData::Dense {
                k: k.clone(),
                v: v.clone(),
            },
            positions: pos.clone(),
        };
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let want = attend(
            &f32_of(&q)?,
            &view(&f32_of(&k)?, &f32_of(&v)?),
            &[q_offset],
            window,
            1.0,
        )?;
        let matrix = attend(&q, &view(&k, &v), &[q_offset], window, 1.0)?;
        let (qg, kg, vg) = (
            q.to_device(&gpu.dev)?,
            k.to_device(&gpu.dev)?,
            v.to_device(&gpu.dev)?,
        );
        let got = attend_prefill_cuda(&qg, &kg, &vg, &pos, q_offset, window, 1.0)?;
        let (e_kernel, e_matrix) = (max_abs_diff(&got, &want), max_abs_diff(&matrix, &want));
        let name = format!("hd={hd} q_len={q_len} keys={keys} window={window:?}");
        println!("gemma-scale {name}: kernel {e_kernel:.3e}, score matrix {e_matrix:.3e}");
        checks.close(format!("gemma-scale {name}"), e_kernel, tol(dtype));
        checks.exact(format!("gemma-scale-no-worse {name}"), e_kernel <= e_matrix);
    }
    checks.finish();
    Ok(())
}
