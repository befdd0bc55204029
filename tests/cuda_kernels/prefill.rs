//! The flash prefill attention kernel against the CPU reference in f32: long query blocks over
//! dense f16/bf16 K/V at the head dimensions it is built for, GQA from 1 to 8 query heads a KV
//! head, causal and sliding masks (tiles skipped, partly and wholly visible), key positions in
//! one run, a wrapped ring and a table, query blocks that do not fill the last row block; and
//! the dispatcher's result for the same call, bit for bit.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::attend;
use candle_gemma::kernels::cuda::attend_prefill_cuda;
use candle_gemma::kv::{KeyPositions, KvData, KvView};

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

/// One case's random inputs in `dtype` and their key positions (the last `q_len` of `keys`).
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: KeyPositions,
    q_offset: usize,
}

impl Inputs {
    fn new(case: &Case, dtype: DType, seed: u64) -> Result<Self> {
        let &(n_heads, kv_heads, hd, q_len, keys, _, layout) = case;
        Ok(Self {
            q: rnd(&[1, n_heads, q_len, hd], dtype)?,
            k: rnd(&[1, kv_heads, keys, hd], dtype)?,
            v: rnd(&[1, kv_heads, keys, hd], dtype)?,
            pos: positions(keys, layout, seed),
            q_offset: keys - q_len,
        })
    }

    fn view(&self, k: &Tensor, v: &Tensor) -> KvView {
        KvView::Single {
            data: KvData::Dense {
                k: k.clone(),
                v: v.clone(),
            },
            positions: self.pos.clone(),
        }
    }

    /// The dispatcher on these inputs converted to `dtype` (the CPU reference in f32).
    fn attend_as(&self, dtype: DType, window: Option<usize>, scale: f64) -> Result<Tensor> {
        let (q, k, v) = (
            self.q.to_dtype(dtype)?,
            self.k.to_dtype(dtype)?,
            self.v.to_dtype(dtype)?,
        );
        Ok(attend(
            &q,
            &self.view(&k, &v),
            &[self.q_offset],
            window,
            scale,
        )?)
    }

    /// The inputs on `dev`.
    fn on(&self, dev: &Device) -> Result<(Tensor, Tensor, Tensor)> {
        Ok((
            self.q.to_device(dev)?,
            self.k.to_device(dev)?,
            self.v.to_device(dev)?,
        ))
    }
}

#[test]
fn prefill_attention_matches_cpu() -> Result<()> {
    let Some(gpu) = gpu("prefill attention") else {
        return Ok(());
    };
    let mut checks = Checks::new("prefill attention");
    for dtype in [DType::BF16, DType::F16] {
        for case in &CASES {
            let &(n_heads, kv_heads, hd, q_len, keys, window, layout) = case;
            let inp = Inputs::new(case, dtype, keys as u64 * 7 + hd as u64)?;
            let scale = 1.0 / (hd as f64).sqrt();
            let want = inp.attend_as(DType::F32, window, scale)?;
            let (qg, kg, vg) = inp.on(&gpu.dev)?;
            let got = attend_prefill_cuda(&qg, &kg, &vg, &inp.pos, inp.q_offset, window, scale)?;
            let name = format!(
                "dtype={dtype:?} heads={n_heads}/{kv_heads} hd={hd} q_len={q_len} keys={keys} window={window:?} pos={layout:?}"
            );
            checks.close(
                format!("prefill {name}"),
                max_abs_diff(&got, &want),
                tol(dtype),
            );
            let routed = attend(&qg, &inp.view(&kg, &vg), &[inp.q_offset], window, scale)?;
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
    let cases: [Case; 2] = [
        (8, 2, 256, 256, 768, Some(512), Pos::Ring),
        (8, 2, 512, 256, 768, None, Pos::Linear),
    ];
    for case in &cases {
        let &(_, _, hd, q_len, keys, window, _) = case;
        let inp = Inputs::new(case, dtype, 3)?;
        let want = inp.attend_as(DType::F32, window, 1.0)?;
        let matrix = inp.attend_as(dtype, window, 1.0)?;
        let (qg, kg, vg) = inp.on(&gpu.dev)?;
        let got = attend_prefill_cuda(&qg, &kg, &vg, &inp.pos, inp.q_offset, window, 1.0)?;
        let (e_kernel, e_matrix) = (max_abs_diff(&got, &want), max_abs_diff(&matrix, &want));
        let name = format!("hd={hd} q_len={q_len} keys={keys} window={window:?}");
        println!("gemma-scale {name}: kernel {e_kernel:.3e}, score matrix {e_matrix:.3e}");
        checks.close(format!("gemma-scale {name}"), e_kernel, tol(dtype));
        checks.exact(format!("gemma-scale-no-worse {name}"), e_kernel <= e_matrix);
    }
    checks.finish();
    Ok(())
}
