//! Checks the CUDA quantized kernels against the CPU references on random inputs: quantized
//! attention (fused and dequantize-then-dense paths) over head dims, bits, group sizes, GQA,
//! decode/prefill, causal/sliding masks, key-position encodings and query dtypes; the quantized
//! matmul (matvec and GEMM paths) and embedding lookup. Prints one line per case with the max
//! abs error and PASS/FAIL, then a per-dtype summary; exits non-zero on any failure.
//!
//!     cargo run --release --features cuda --example kernel_check

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::cuda::{attend_packed_cuda, QsdpaPath};
use candle_gemma::kernels::qmatmul::{qembedding, qmatmul, PackedWeight};
use candle_gemma::kernels::{attend, quantize};
use candle_gemma::kv::{KvData, KvView, PackedKv, QuantBits};
use std::collections::BTreeMap;

fn to_dev(p: &PackedKv, dev: &Device) -> Result<PackedKv> {
    Ok(PackedKv {
        codes: p.codes.to_device(dev)?,
        scales: p.scales.to_device(dev)?,
        biases: p.biases.to_device(dev)?,
        bits: p.bits,
        group_size: p.group_size,
    })
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let d = (a - b)?.abs()?.flatten_all()?.to_vec1::<f32>()?;
    Ok(d.iter().fold(
        0f32,
        |m, &x| if x.is_nan() { f32::INFINITY } else { m.max(x) },
    ))
}

fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-4,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

#[derive(Clone, Copy, Debug)]
enum Pos {
    Linear,
    Ring,
    Shuffled,
}

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

fn positions(keys: usize, pos: Pos, seed: u64) -> Vec<usize> {
    match pos {
        Pos::Linear => (0..keys).collect(),
        // A wrapped ring: newest keys first in storage after the wrap point.
        Pos::Ring => {
            let split = keys / 3;
            (0..keys)
                .map(|j| {
                    if j < split {
                        keys - split + j
                    } else {
                        j - split
                    }
                })
                .collect()
        }
        Pos::Shuffled => {
            let mut p: Vec<usize> = (0..keys).collect();
            let mut s = seed | 1;
            for i in (1..keys).rev() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                p.swap(i, (s % (i as u64 + 1)) as usize);
            }
            p
        }
    }
}

fn check_qsdpa(c: &Case, gpu: &Device, stats: &mut BTreeMap<String, f32>) -> Result<bool> {
    let cpu = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (1, c.n_heads, c.q_len, c.hd), &cpu)?.to_dtype(c.dtype)?;
    let k = Tensor::randn(0f32, 1.0, (1, c.kv_heads, c.keys, c.hd), &cpu)?.to_dtype(c.dtype)?;
    let v = Tensor::randn(0f32, 1.0, (1, c.kv_heads, c.keys, c.hd), &cpu)?.to_dtype(c.dtype)?;
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
    let mut ok = true;
    for path in [QsdpaPath::Fused, QsdpaPath::DequantDense] {
        let got = attend_packed_cuda(&qg, &kg, &vg, &pos, q_offset, c.window, scale, path)?;
        let err = max_abs(&got, &want)?;
        let pass = err <= tol(c.dtype);
        ok &= pass;
        let key = format!("qsdpa {:?} {}-bit", c.dtype, c.bits);
        let e = stats.entry(key).or_insert(0.0);
        *e = e.max(err);
        println!(
            "qsdpa dtype={:?} bits={} hd={} group={} heads={}/{} q_len={} keys={} window={:?} pos={:?} path={:?} max_abs={:.3e} {}",
            c.dtype, c.bits, c.hd, c.group, c.n_heads, c.kv_heads, c.q_len, c.keys, c.window,
            c.pos, path, err, if pass { "PASS" } else { "FAIL" }
        );
    }
    // The dispatcher routes packed K/V on CUDA to the kernel.
    let gview = KvView::Single {
        data: KvData::Packed { k: kg, v: vg },
        positions: pos,
    };
    let got = attend(&qg, &gview, &[q_offset], c.window, scale)?;
    let err = max_abs(&got, &want)?;
    ok &= err <= tol(c.dtype);
    Ok(ok)
}

fn check_qmatmul(
    out_dim: usize,
    in_dim: usize,
    bits: usize,
    group: usize,
    sdtype: DType,
    xdtype: DType,
    rows: usize,
    gpu: &Device,
    stats: &mut BTreeMap<String, f32>,
) -> Result<bool> {
    let cpu = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (out_dim, in_dim), &cpu)?.to_dtype(sdtype)?;
    let p = quantize(&w, QuantBits::from_bits(bits)?, group)?;
    let wc = PackedWeight::new(p.codes, p.scales, p.biases, out_dim, in_dim)?;
    let wg = PackedWeight::new(
        wc.codes.to_device(gpu)?,
        wc.scales.to_device(gpu)?,
        wc.biases.to_device(gpu)?,
        out_dim,
        in_dim,
    )?;
    let x = Tensor::randn(0f32, 1.0, (rows, in_dim), &cpu)?.to_dtype(xdtype)?;
    let want = qmatmul(&x, &wc)?;
    let got = qmatmul(&x.to_device(gpu)?, &wg)?;
    // Output magnitude ~ sqrt(in) * 0.05; scale the tolerance with it.
    let mag = (in_dim as f32).sqrt() * 0.05;
    let err = max_abs(&got, &want)?;
    let pass = err <= tol(xdtype) * mag.max(1.0) * 2.0;
    let e = stats
        .entry(format!("qmatmul x={xdtype:?} {bits}-bit"))
        .or_insert(0.0);
    *e = e.max(err);
    println!(
        "qmatmul x={xdtype:?} scales={sdtype:?} bits={bits} group={group} [{out_dim}x{in_dim}] rows={rows} max_abs={err:.3e} {}",
        if pass { "PASS" } else { "FAIL" }
    );
    let ids = Tensor::new(&[3u32, 0, (out_dim - 1) as u32, 3], &cpu)?;
    let we = qembedding(&ids, &wc, xdtype)?;
    let ge = qembedding(&ids.to_device(gpu)?, &wg, xdtype)?;
    let err_e = max_abs(&ge, &we)?;
    let pass_e = err_e <= tol(xdtype) * 0.1;
    println!(
        "qembedding x={xdtype:?} scales={sdtype:?} bits={bits} group={group} max_abs={err_e:.3e} {}",
        if pass_e { "PASS" } else { "FAIL" }
    );
    Ok(pass && pass_e)
}

fn main() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let mut stats = BTreeMap::new();
    let mut all_ok = true;
    let mut cases = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for bits in [4, 8] {
            // Fixture shapes.
            for (hd, group) in [(32, 32), (64, 32), (64, 64)] {
                cases.push(Case {
                    n_heads: 4,
                    kv_heads: 2,
                    hd,
                    bits,
                    group,
                    dtype,
                    q_len: 1,
                    keys: 37,
                    window: None,
                    pos: Pos::Linear,
                });
                cases.push(Case {
                    n_heads: 4,
                    kv_heads: 2,
                    hd,
                    bits,
                    group,
                    dtype,
                    q_len: 5,
                    keys: 70,
                    window: Some(16),
                    pos: Pos::Ring,
                });
            }
            for group in [32, 64, 128] {
                // E4B sliding / 31B sliding heads, decode with splits, prefill with window.
                cases.push(Case {
                    n_heads: 8,
                    kv_heads: 2,
                    hd: 256,
                    bits,
                    group,
                    dtype,
                    q_len: 1,
                    keys: 3000,
                    window: None,
                    pos: Pos::Linear,
                });
                cases.push(Case {
                    n_heads: 8,
                    kv_heads: 2,
                    hd: 256,
                    bits,
                    group,
                    dtype,
                    q_len: 1,
                    keys: 600,
                    window: Some(512),
                    pos: Pos::Ring,
                });
                cases.push(Case {
                    n_heads: 8,
                    kv_heads: 2,
                    hd: 256,
                    bits,
                    group,
                    dtype,
                    q_len: 24,
                    keys: 300,
                    window: Some(100),
                    pos: Pos::Shuffled,
                });
                cases.push(Case {
                    n_heads: 8,
                    kv_heads: 2,
                    hd: 512,
                    bits,
                    group,
                    dtype,
                    q_len: 1,
                    keys: 2500,
                    window: None,
                    pos: Pos::Shuffled,
                });
                cases.push(Case {
                    n_heads: 8,
                    kv_heads: 4,
                    hd: 512,
                    bits,
                    group,
                    dtype,
                    q_len: 3,
                    keys: 200,
                    window: None,
                    pos: Pos::Linear,
                });
            }
            cases.push(Case {
                n_heads: 32,
                kv_heads: 16,
                hd: 256,
                bits,
                group: 64,
                dtype,
                q_len: 1,
                keys: 1500,
                window: None,
                pos: Pos::Linear,
            });
            cases.push(Case {
                n_heads: 32,
                kv_heads: 4,
                hd: 512,
                bits,
                group: 64,
                dtype,
                q_len: 1,
                keys: 1500,
                window: None,
                pos: Pos::Ring,
            });
        }
    }
    for c in &cases {
        all_ok &= check_qsdpa(c, &gpu, &mut stats)?;
    }
    for xdtype in [DType::F32, DType::BF16, DType::F16] {
        for sdtype in [DType::BF16, DType::F16, DType::F32] {
            for bits in [4, 8] {
                for (group, rows) in [(32, 1), (64, 3), (128, 8), (64, 20)] {
                    all_ok &= check_qmatmul(
                        384, 512, bits, group, sdtype, xdtype, rows, &gpu, &mut stats,
                    )?;
                }
            }
        }
    }
    all_ok &= check_qmatmul(
        8192 / 8,
        5376,
        4,
        64,
        DType::BF16,
        DType::BF16,
        1,
        &gpu,
        &mut stats,
    )?;
    all_ok &= check_qmatmul(
        5376 / 8,
        21504,
        8,
        64,
        DType::BF16,
        DType::BF16,
        1,
        &gpu,
        &mut stats,
    )?;
    println!("\nsummary (max abs error over all cases):");
    for (k, v) in &stats {
        println!("  {k:<28} {v:.3e}");
    }
    println!("{}", if all_ok { "ALL PASS" } else { "SOME FAILED" });
    if !all_ok {
        std::process::exit(1);
    }
    Ok(())
}
