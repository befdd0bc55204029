//! Attention on the GPU against the CPU reference: packed K/V through the fused kernel, the
//! dequantize-then-dense path and the dispatcher; dense K/V through the dispatcher; the same
//! calls with settled keys marked (bit-identical); and batched attention against each
//! sequence alone (bit-identical) and the CPU.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::attend;
use candle_gemma::kernels::cuda::{attend_packed_cuda, QsdpaPath};
use candle_gemma::kernels::quantize;
use candle_gemma::kv::{KeyPositions, KvData, KvView, QuantBits};

use crate::common::close::{max_abs_diff, Checks};
use crate::support::{gpu, positions, rnd, to_dev, tol, Pos};

/// One attention case.
struct Case {
    n_heads: usize,
    kv_heads: usize,
    hd: usize,
    bits: usize,
    group: usize,
    dtype: DType,
    q_len: usize,
    keys: usize,
    window: Option<usize>,
    pos: Pos,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dtype={:?} bits={} hd={} group={} heads={}/{} q_len={} keys={} window={:?} pos={:?}",
            self.dtype,
            self.bits,
            self.hd,
            self.group,
            self.n_heads,
            self.kv_heads,
            self.q_len,
            self.keys,
            self.window,
            self.pos
        )
    }
}

/// The cases of one query dtype: fixture shapes; E4B and 31B sliding/full heads in decode
/// with splits, prefill with a window and shuffled positions; wide GQA.
fn cases(dtype: DType) -> Vec<Case> {
    let mut cases = Vec::new();
    #[allow(clippy::too_many_arguments)] // one row of the table, named field by field
    let mut case = |n_heads, kv_heads, hd, bits, group, q_len, keys, window, pos| {
        cases.push(Case {
            n_heads,
            kv_heads,
            hd,
            bits,
            group,
            dtype,
            q_len,
            keys,
            window,
            pos,
        })
    };
    for bits in [4, 8] {
        // Fixture shapes.
        for (hd, group) in [(32, 32), (64, 32), (64, 64)] {
            case(4, 2, hd, bits, group, 1, 37, None, Pos::Linear);
            case(4, 2, hd, bits, group, 5, 70, Some(16), Pos::Ring);
        }
        for group in [32, 64, 128] {
            // E4B sliding / 31B sliding heads, decode with splits, prefill with window.
            case(8, 2, 256, bits, group, 1, 3000, None, Pos::Linear);
            case(8, 2, 256, bits, group, 1, 600, Some(512), Pos::Ring);
            case(8, 2, 256, bits, group, 24, 300, Some(100), Pos::Shuffled);
            case(8, 2, 512, bits, group, 1, 2500, None, Pos::Shuffled);
            case(8, 4, 512, bits, group, 3, 200, None, Pos::Linear);
        }
        case(32, 16, 256, bits, 64, 1, 1500, None, Pos::Linear);
        case(32, 4, 512, bits, 64, 1, 1500, None, Pos::Ring);
    }
    cases
}

/// The same attention with the keys below `q_offset` marked settled (the tensor-core kernels
/// then load a split's first tile before waiting for the kernel ahead): equal bit for bit to
/// `unmarked`, the result without the mark.
fn check_settled(
    checks: &mut Checks,
    what: &str,
    c: &Case,
    unmarked: &Tensor,
    run: impl Fn(&KeyPositions) -> Result<Tensor>,
    pos: &KeyPositions,
    q_offset: usize,
) -> Result<()> {
    let marked = pos.clone().settled_below(q_offset);
    let got = run(&marked)?;
    checks.exact(
        format!("{what}-settled {c} settled={:?}", marked.settled_keys()),
        max_abs_diff(&got, unmarked) == 0.0,
    );
    Ok(())
}

/// One case: packed K/V through both kernel paths and the dispatcher, then dense K/V through
/// the dispatcher, each against the CPU.
fn check_case(checks: &mut Checks, c: &Case, gpu: &Device) -> Result<()> {
    let q = rnd(&[1, c.n_heads, c.q_len, c.hd], c.dtype)?;
    let k = rnd(&[1, c.kv_heads, c.keys, c.hd], c.dtype)?;
    let v = rnd(&[1, c.kv_heads, c.keys, c.hd], c.dtype)?;
    let bits = QuantBits::from_bits(c.bits)?;
    let (kp, vp) = (quantize(&k, bits, c.group)?, quantize(&v, bits, c.group)?);
    let pos = positions(c.keys, c.pos, c.keys as u64 * 31 + c.hd as u64);
    let q_offset = c.keys - c.q_len;
    let scale = 1.0 / (c.hd as f64).sqrt();
    let view = KvView::Single {
        data: KvData::Packed {
            k: kp.clone(),
            v: vp.clone(),
        },
        positions: pos.clone(),
    };
    let want = attend(&q, &view, &[q_offset], c.window, scale)?;
    let (kg, vg, qg) = (to_dev(&kp, gpu)?, to_dev(&vp, gpu)?, q.to_device(gpu)?);
    for path in [QsdpaPath::Fused, QsdpaPath::DequantDense] {
        let got = attend_packed_cuda(&qg, &kg, &vg, &pos, q_offset, c.window, scale, path)?;
        checks.close(
            format!("qsdpa {c} path={path:?}"),
            max_abs_diff(&got, &want),
            tol(c.dtype),
        );
        if path == QsdpaPath::Fused {
            let run = |pos: &KeyPositions| -> Result<Tensor> {
                Ok(attend_packed_cuda(
                    &qg, &kg, &vg, pos, q_offset, c.window, scale, path,
                )?)
            };
            check_settled(checks, "qsdpa", c, &got, run, &pos, q_offset)?;
        }
    }
    // The dispatcher routes packed K/V on CUDA to the kernel.
    let gview = KvView::Single {
        data: KvData::Packed { k: kg, v: vg },
        positions: pos.clone(),
    };
    let got = attend(&qg, &gview, &[q_offset], c.window, scale)?;
    checks.close(
        format!("qsdpa-dispatch {c}"),
        max_abs_diff(&got, &want),
        tol(c.dtype),
    );
    // Dense K/V: the dispatcher sends short query blocks to the same kernel reading dense
    // elements, longer ones to the matmul path; both against the CPU dense reference.
    let dense = |dev: &Device| -> Result<KvData> {
        Ok(KvData::Dense {
            k: k.to_device(dev)?,
            v: v.to_device(dev)?,
        })
    };
    let dense_view = |data: KvData| KvView::Single {
        data,
        positions: pos.clone(),
    };
    let want = attend(
        &q,
        &dense_view(dense(&Device::Cpu)?),
        &[q_offset],
        c.window,
        scale,
    )?;
    let gpu_data = dense(gpu)?;
    let got = attend(
        &qg,
        &dense_view(gpu_data.clone()),
        &[q_offset],
        c.window,
        scale,
    )?;
    checks.close(
        format!("dense-attention {c}"),
        max_abs_diff(&got, &want),
        tol(c.dtype),
    );
    let run = |pos: &KeyPositions| -> Result<Tensor> {
        let marked = KvView::Single {
            data: gpu_data.clone(),
            positions: pos.clone(),
        };
        Ok(attend(&qg, &marked, &[q_offset], c.window, scale)?)
    };
    check_settled(checks, "dense-attention", c, &got, run, &pos, q_offset)
}

fn attention_matches_cpu(dtype: DType) -> Result<()> {
    let what = format!("attention {dtype:?}");
    let Some(gpu) = gpu(&what) else {
        return Ok(());
    };
    let mut checks = Checks::new(what);
    for c in cases(dtype) {
        check_case(&mut checks, &c, &gpu.dev)?;
    }
    checks.finish();
    Ok(())
}

#[test]
fn attention_matches_cpu_f32() -> Result<()> {
    attention_matches_cpu(DType::F32)
}

#[test]
fn attention_matches_cpu_bf16() -> Result<()> {
    attention_matches_cpu(DType::BF16)
}

#[test]
fn attention_matches_cpu_f16() -> Result<()> {
    attention_matches_cpu(DType::F16)
}

/// Batched attention (one launch for every sequence of a batch view) against attending each
/// sequence alone on the GPU (same kernel body and split plan: equal bit for bit) and against
/// the CPU: sequences of different lengths (one split and several), position layouts and
/// query offsets, dense or packed K/V.
fn check_batched(
    checks: &mut Checks,
    dtype: DType,
    packed: Option<usize>,
    hd: usize,
    gpu: &Device,
) -> Result<()> {
    let (n_heads, kv_heads, q_len) = (8, 2, 1);
    let lens = [(37, Pos::Linear), (700, Pos::Ring), (3000, Pos::Shuffled)];
    let q = rnd(&[lens.len(), n_heads, q_len, hd], dtype)?;
    let mut cpu_views = Vec::new();
    let mut gpu_views = Vec::new();
    let mut offsets = Vec::new();
    for (i, &(keys, pos)) in lens.iter().enumerate() {
        let k = rnd(&[1, kv_heads, keys, hd], dtype)?;
        let v = rnd(&[1, kv_heads, keys, hd], dtype)?;
        let positions = positions(keys, pos, 7 + i as u64);
        let (cpu_data, gpu_data) = match packed {
            Some(bits) => {
                let bits = QuantBits::from_bits(bits)?;
                let (kp, vp) = (quantize(&k, bits, 64)?, quantize(&v, bits, 64)?);
                let gpu_data = KvData::Packed {
                    k: to_dev(&kp, gpu)?,
                    v: to_dev(&vp, gpu)?,
                };
                (KvData::Packed { k: kp, v: vp }, gpu_data)
            }
            None => {
                let gpu_data = KvData::Dense {
                    k: k.to_device(gpu)?,
                    v: v.to_device(gpu)?,
                };
                (KvData::Dense { k, v }, gpu_data)
            }
        };
        cpu_views.push(KvView::Single {
            data: cpu_data,
            positions: positions.clone(),
        });
        gpu_views.push(KvView::Single {
            data: gpu_data,
            positions,
        });
        offsets.push(keys - q_len);
    }
    let window = Some(512);
    let scale = 1.0 / (hd as f64).sqrt();
    let qg = q.to_device(gpu)?;
    let got = attend(
        &qg,
        &KvView::Batch(gpu_views.clone()),
        &offsets,
        window,
        scale,
    )?;
    let mut alone = Vec::new();
    for (b, view) in gpu_views.iter().enumerate() {
        let qb = qg.narrow(0, b, 1)?;
        alone.push(attend(&qb, view, &offsets[b..=b], window, scale)?);
    }
    let alone = Tensor::cat(&alone, 0)?;
    let want = attend(&q, &KvView::Batch(cpu_views), &offsets, window, scale)?;
    let kv = packed.map_or("dense".to_string(), |b| format!("{b}-bit"));
    let case = format!(
        "batched-attention dtype={dtype:?} kv={kv} hd={hd} lens={:?}",
        lens.map(|l| l.0)
    );
    checks.exact(
        format!("{case} vs-alone"),
        max_abs_diff(&got, &alone) == 0.0,
    );
    checks.close(
        format!("{case} vs-cpu"),
        max_abs_diff(&got, &want),
        tol(dtype),
    );
    Ok(())
}

#[test]
fn batched_attention_matches_alone_and_cpu() -> Result<()> {
    let Some(gpu) = gpu("batched attention") else {
        return Ok(());
    };
    let mut checks = Checks::new("batched attention");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for packed in [None, Some(4), Some(8)] {
            for hd in [256, 512] {
                check_batched(&mut checks, dtype, packed, hd, &gpu.dev)?;
            }
        }
    }
    checks.finish();
    Ok(())
}
