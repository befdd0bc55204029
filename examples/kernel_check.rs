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
use candle_gemma::kv::{
    BatchCache, KeyPositions, KvCache, KvData, KvView, LayerCache, LayerCacheSpec, PackedKv,
    QuantBits, QuantSpec, QuantizedCache, RotatingCache, SimpleCache,
};
use std::collections::BTreeMap;

fn to_dev(p: &PackedKv, dev: &Device) -> Result<PackedKv> {
    Ok(p.to_device(dev)?)
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

fn positions(keys: usize, pos: Pos, seed: u64) -> KeyPositions {
    let list: Vec<usize> = match pos {
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
    };
    list.into()
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
        if path == QsdpaPath::Fused {
            ok &= check_settled(
                c,
                "qsdpa",
                &got,
                |pos| {
                    Ok(attend_packed_cuda(
                        &qg, &kg, &vg, pos, q_offset, c.window, scale, path,
                    )?)
                },
                &pos,
                q_offset,
            )?;
        }
    }
    // The dispatcher routes packed K/V on CUDA to the kernel.
    let gview = KvView::Single {
        data: KvData::Packed { k: kg, v: vg },
        positions: pos,
    };
    let got = attend(&qg, &gview, &[q_offset], c.window, scale)?;
    let err = max_abs(&got, &want)?;
    ok &= err <= tol(c.dtype);
    // Dense K/V: the dispatcher sends short query blocks to the same kernel reading dense
    // elements, longer ones to the matmul path; both against the CPU dense reference.
    let dense_view = |dev: &Device| -> Result<KvView> {
        Ok(KvView::Single {
            data: KvData::Dense {
                k: k.to_device(dev)?,
                v: v.to_device(dev)?,
            },
            positions: view_positions(&view),
        })
    };
    let want = attend(&q, &dense_view(&Device::Cpu)?, &[q_offset], c.window, scale)?;
    let gpu_dense = dense_view(gpu)?;
    let got = attend(&qg, &gpu_dense, &[q_offset], c.window, scale)?;
    let err = max_abs(&got, &want)?;
    let pass = err <= tol(c.dtype);
    ok &= pass;
    if let KvView::Single { data, positions } = &gpu_dense {
        ok &= check_settled(
            c,
            "dense-attention",
            &got,
            |pos| {
                let marked = KvView::Single {
                    data: data.clone(),
                    positions: pos.clone(),
                };
                Ok(attend(&qg, &marked, &[q_offset], c.window, scale)?)
            },
            positions,
            q_offset,
        )?;
    }
    let e = stats
        .entry(format!("dense attention {:?}", c.dtype))
        .or_insert(0.0);
    *e = e.max(err);
    println!(
        "dense-attention dtype={:?} hd={} heads={}/{} q_len={} keys={} window={:?} pos={:?} max_abs={:.3e} {}",
        c.dtype, c.hd, c.n_heads, c.kv_heads, c.q_len, c.keys, c.window, c.pos, err,
        if pass { "PASS" } else { "FAIL" }
    );
    Ok(ok)
}

/// The same attention with the keys below `q_offset` marked settled (the tensor-core kernels
/// then load a split's first tile before waiting for the kernel ahead): equal bit for bit to
/// `unmarked`, the result without the mark.
fn check_settled(
    c: &Case,
    what: &str,
    unmarked: &Tensor,
    run: impl Fn(&KeyPositions) -> Result<Tensor>,
    pos: &KeyPositions,
    q_offset: usize,
) -> Result<bool> {
    let marked = pos.clone().settled_below(q_offset);
    let got = run(&marked)?;
    let pass = max_abs(&got, unmarked)? == 0.0;
    println!(
        "{what}-settled dtype={:?} bits={} hd={} heads={}/{} q_len={} keys={} window={:?} pos={:?} settled={:?} {}",
        c.dtype, c.bits, c.hd, c.n_heads, c.kv_heads, c.q_len, c.keys, c.window, c.pos,
        marked.settled_keys(),
        if pass { "PASS (bit-identical)" } else { "FAIL" }
    );
    Ok(pass)
}

/// Batched attention (one launch for every sequence of a batch view) against attending each
/// sequence alone on the GPU (same kernel body and split plan: equal bit for bit) and against
/// the CPU: sequences of different lengths (one split and several), position layouts and
/// query offsets, dense or packed K/V.
fn check_batched(
    dtype: DType,
    packed: Option<usize>,
    hd: usize,
    gpu: &Device,
    stats: &mut BTreeMap<String, f32>,
) -> Result<bool> {
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
            None => (
                KvData::Dense {
                    k: k.clone(),
                    v: v.clone(),
                },
                KvData::Dense {
                    k: k.to_device(gpu)?,
                    v: v.to_device(gpu)?,
                },
            ),
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
        alone.push(attend(
            &qg.narrow(0, b, 1)?,
            view,
            &offsets[b..=b],
            window,
            scale,
        )?);
    }
    let alone = Tensor::cat(&alone, 0)?;
    let want = attend(&q, &KvView::Batch(cpu_views), &offsets, window, scale)?;
    let diff_alone = max_abs(&got, &alone)?;
    let err = max_abs(&got, &want)?;
    let pass = diff_alone == 0.0 && err <= tol(dtype);
    let e = stats
        .entry(format!("batched attention {dtype:?}"))
        .or_insert(0.0);
    *e = e.max(err);
    println!(
        "batched-attention dtype={dtype:?} kv={} hd={hd} lens={:?} vs-alone={diff_alone:.3e} max_abs={err:.3e} {}",
        packed.map_or("dense".to_string(), |b| format!("{b}-bit")),
        lens.map(|l| l.0),
        if pass { "PASS" } else { "FAIL" }
    );
    Ok(pass)
}

/// The KV cache's quantization on the GPU against the CPU reference: codes, scales and biases
/// must be identical.
fn check_quantize(dtype: DType, gpu: &Device) -> Result<bool> {
    let mut ok = true;
    for bits in [QuantBits::Four, QuantBits::Eight] {
        for group in [32, 64, 128] {
            let x = (rnd(&[2, 3, 5, 256], dtype)? * 3.0)?;
            let want = quantize(&x, bits, group)?;
            let got = quantize(&x.to_device(gpu)?, bits, group)?;
            let pass = packed_identical(&want, &got)?;
            ok &= pass;
            println!(
                "quantize dtype={dtype:?} bits={} group={group} {}",
                bits.bits(),
                if pass { "PASS (bit-exact)" } else { "FAIL" }
            );
        }
    }
    Ok(ok)
}

/// Whether two cache views hold the same keys: the same positions and, per sequence, packed
/// codes, scales and biases bit for bit or dense K/V equal (a batch: every sequence alike).
fn views_identical(a: &KvView, b: &KvView) -> Result<bool> {
    Ok(match (a, b) {
        (KvView::Batch(a), KvView::Batch(b)) => {
            let mut all = a.len() == b.len();
            for (a, b) in a.iter().zip(b) {
                all &= views_identical(a, b)?;
            }
            all
        }
        (
            KvView::Single {
                data: da,
                positions: pa,
            },
            KvView::Single {
                data: db,
                positions: pb,
            },
        ) => {
            pa.to_vec() == pb.to_vec()
                && match (da, db) {
                    (KvData::Packed { k: ka, v: va }, KvData::Packed { k: kb, v: vb }) => {
                        packed_identical(ka, kb)? && packed_identical(va, vb)?
                    }
                    (KvData::Dense { k: ka, v: va }, KvData::Dense { k: kb, v: vb }) => {
                        max_abs(ka, kb)? == 0.0 && max_abs(va, vb)? == 0.0
                    }
                    _ => false,
                }
        }
        _ => false,
    })
}

/// Whether two packed tensors (on any devices) hold the same shapes, the same code words and
/// bit-identical scales and biases (f16/bf16 values are exact in f32).
fn packed_identical(a: &PackedKv, b: &PackedKv) -> Result<bool> {
    let words = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u32>()?)
    };
    let f32s = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    Ok(a.codes.dims() == b.codes.dims()
        && a.scales.dims() == b.scales.dims()
        && a.biases.dims() == b.biases.dims()
        && words(&a.codes)? == words(&b.codes)?
        && f32s(&a.scales)? == f32s(&b.scales)?
        && f32s(&a.biases)? == f32s(&b.biases)?)
}

/// A quantized cache fed the same K/V on the CPU and on the GPU (where packed updates quantize
/// straight into the storage's slots) holds bit-identical codes, scales and biases at the same
/// positions after every update: growing and ring caches, one-token steps and multi-token
/// writes (a ring write that wraps takes the quantize-and-copy path).
fn check_quantized_cache(dtype: DType, gpu: &Device) -> Result<bool> {
    let mut ok = true;
    for bits in [QuantBits::Four, QuantBits::Eight] {
        for window in [None, Some(16)] {
            let spec = LayerCacheSpec {
                kv_heads: 2,
                head_dim: 256,
                window,
            };
            let quant = QuantSpec {
                bits,
                group_size: 64,
                start: 0,
            };
            let mut cpu_cache = QuantizedCache::new(&spec, &quant, dtype)?;
            let mut gpu_cache = QuantizedCache::new(&spec, &quant, dtype)?;
            let mut pass = true;
            for (step, n) in [
                5usize, 1, 1, 3, 1, 7, 1, 1, 1, 9, 1, 1, 2, 1, 1, 1, 1, 1, 4, 1,
            ]
            .into_iter()
            .enumerate()
            {
                let k = (rnd(&[1, 2, n, 256], dtype)? * 2.0)?;
                let v = rnd(&[1, 2, n, 256], dtype)?;
                let want = cpu_cache.update(&k, &v)?;
                let got = gpu_cache.update(&k.to_device(gpu)?, &v.to_device(gpu)?)?;
                let same = views_identical(&want, &got)?;
                if !same {
                    println!("quantized-cache step {step} ({n} tokens) differs");
                }
                pass &= same;
            }
            ok &= pass;
            println!(
                "quantized-cache dtype={dtype:?} bits={} window={window:?} {}",
                bits.bits(),
                if pass { "PASS (bit-exact)" } else { "FAIL" }
            );
            // A batch of three sequences at different offsets: on the GPU one launch quantizes
            // every sequence's tokens into its own slots. The same prefixes on both devices.
            let mut prefixes = Vec::new();
            for i in 0..3usize {
                let n = 2 + 3 * i;
                prefixes.push((rnd(&[1, 2, n, 256], dtype)?, rnd(&[1, 2, n, 256], dtype)?));
            }
            let fill = |dev: &Device| -> Result<BatchCache> {
                let mut seqs = Vec::new();
                for (k, v) in &prefixes {
                    let mut c = QuantizedCache::new(&spec, &quant, dtype)?;
                    c.update(&k.to_device(dev)?, &v.to_device(dev)?)?;
                    seqs.push(LayerCache::Quantized(c));
                }
                Ok(BatchCache::new(seqs)?)
            };
            let (mut cpu_batch, mut gpu_batch) = (fill(&Device::Cpu)?, fill(gpu)?);
            let mut pass = true;
            for (step, n) in [1usize, 1, 2, 1, 3, 1, 1, 5, 1, 1].into_iter().enumerate() {
                let k = (rnd(&[3, 2, n, 256], dtype)? * 2.0)?;
                let v = rnd(&[3, 2, n, 256], dtype)?;
                let want = cpu_batch.update(&k, &v)?;
                let got = gpu_batch.update(&k.to_device(gpu)?, &v.to_device(gpu)?)?;
                let same = views_identical(&want, &got)?;
                if !same {
                    println!("quantized batch-cache step {step} ({n} tokens) differs");
                }
                pass &= same;
            }
            ok &= pass;
            println!(
                "quantized-batch-cache dtype={dtype:?} bits={} window={window:?} sequences=3 {}",
                bits.bits(),
                if pass { "PASS (bit-exact)" } else { "FAIL" }
            );
        }
    }
    Ok(ok)
}

/// A batch of three dense caches (simple, or rotating with a window of 16) at different offsets
/// on the CPU and on the GPU, fed the same K/V: the GPU writes every sequence's rows with one
/// launch; each sequence's K/V and positions must match the CPU's exactly after every update.
fn check_dense_batch_cache(dtype: DType, gpu: &Device) -> Result<bool> {
    let mut ok = true;
    for window in [None, Some(16)] {
        let spec = LayerCacheSpec {
            kv_heads: 2,
            head_dim: 256,
            window,
        };
        let mut prefixes = Vec::new();
        for i in 0..3usize {
            let n = 2 + 3 * i;
            prefixes.push((rnd(&[1, 2, n, 256], dtype)?, rnd(&[1, 2, n, 256], dtype)?));
        }
        let fill = |dev: &Device| -> Result<BatchCache> {
            let mut seqs = Vec::new();
            for (k, v) in &prefixes {
                let mut c = match window {
                    None => LayerCache::Simple(SimpleCache::new(&spec, dtype)),
                    Some(_) => LayerCache::Rotating(RotatingCache::new(&spec, dtype)?),
                };
                c.update(&k.to_device(dev)?, &v.to_device(dev)?)?;
                seqs.push(c);
            }
            Ok(BatchCache::new(seqs)?)
        };
        let (mut cpu_batch, mut gpu_batch) = (fill(&Device::Cpu)?, fill(gpu)?);
        let mut pass = true;
        for (step, n) in [1usize, 1, 2, 1, 3, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1]
            .into_iter()
            .enumerate()
        {
            let k = rnd(&[3, 2, n, 256], dtype)?;
            let v = rnd(&[3, 2, n, 256], dtype)?;
            let want = cpu_batch.update(&k, &v)?;
            let got = gpu_batch.update(&k.to_device(gpu)?, &v.to_device(gpu)?)?;
            let same = views_identical(&want, &got)?;
            if !same {
                println!("dense batch-cache step {step} ({n} tokens) differs");
            }
            pass &= same;
        }
        ok &= pass;
        println!(
            "dense-batch-cache dtype={dtype:?} window={window:?} sequences=3 {}",
            if pass { "PASS (exact)" } else { "FAIL" }
        );
    }
    Ok(ok)
}

fn view_positions(v: &KvView) -> KeyPositions {
    match v {
        KvView::Single { positions, .. } => positions.clone(),
        KvView::Batch(_) => KeyPositions::new(),
    }
}

/// Random `[shape]` in `dtype` on the CPU.
fn rnd(shape: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)?)
}

/// The fused decoder-layer kernels against the candle op chains they replace (run on the CPU).
fn check_fused(dtype: DType, gpu: &Device, stats: &mut BTreeMap<String, f32>) -> Result<bool> {
    use candle_gemma::kernels::cuda::fused::{
        add_norm, add_norm_ext, gelu_mul, grouped_matvec, grouped_matvec_gated, moe_mix, moe_route,
        qkv_prep, qkv_prep_into, AddNormExtra, QkvSources, ADD_NORM_MAX_WIDTH,
    };
    use candle_nn::ops::rms_norm;
    let g = |t: &Tensor| t.to_device(gpu);
    let mut ok = true;
    let mut report = |name: &str, err: f32, limit: f32| {
        let pass = err <= limit;
        ok &= pass;
        let e = stats
            .entry(format!("fused {name} {dtype:?}"))
            .or_insert(0.0);
        *e = e.max(err);
        println!(
            "fused {name} dtype={dtype:?} max_abs={err:.3e} {}",
            if pass { "PASS" } else { "FAIL" }
        );
    };
    // Values of order 1-4 after the norms: allow a few ulps of the activation type.
    let lim = 4.0 * tol(dtype);
    // Residual sums reach ~20 on thousands of random elements, where one bf16 step is 0.125:
    // the same few ulps, relative to the largest expected value.
    let sum_lim = |want: &Tensor| -> Result<f32> {
        let top = want.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?;
        Ok(lim * (top.to_scalar::<f32>()? / 4.0).max(1.0))
    };

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
    report("add_norm", max_abs(&got, &want)?, sum_lim(&want)?);
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
        max_abs(&got_w, &want_w)?,
        sum_lim(&want_w)?,
    );
    report(
        "add_norm wide next",
        max_abs(
            &next_w.expect("requested"),
            &rms_norm(&want_w, &w2w, eps as f32)?,
        )?,
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
        max_abs(&got2.expect("requested"), &want2)?,
        2.0 * lim,
    );

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
        max_abs(&got, &sum)?,
        sum_lim(&sum)?,
    );
    report(
        "add_norm two next: first",
        max_abs(&n1.expect("requested"), &rms_norm(&sum, &w2, eps as f32)?)?,
        2.0 * lim,
    );
    report(
        "add_norm two next: second",
        max_abs(&n2.expect("requested"), &rms_norm(&sum, &w3, eps as f32)?)?,
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
        max_abs(&got, &want)?,
        2.0 * lim,
    );
    report(
        "add_norm two branches: next",
        max_abs(&n1.expect("requested"), &want2)?,
        4.0 * lim,
    );

    // GeGLU over the two halves of a stacked product.
    let gu = rnd(&[5, 2 * 704], dtype)?;
    let want = (gu.narrow(1, 0, 704)?.gelu()? * gu.narrow(1, 704, 704)?)?;
    let gug = g(&gu)?;
    let got = gelu_mul(&gug.narrow(1, 0, 704)?, &gug.narrow(1, 704, 704)?)?;
    report("gelu_mul", max_abs(&got, &want)?, lim);

    // q/k/v norms, RoPE and layout: batch 2, 3 tokens, 4 query heads, 2 KV heads, head dim 256.
    let (b, sl, nh, kvh, hd) = (2, 3, 4, 2, 256);
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
    report("qkv_prep q", max_abs(&gq, &wq)?, lim);
    report("qkv_prep k", max_abs(&gk, &wk)?, lim);
    report("qkv_prep v", max_abs(&gv, &wv)?, lim);

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
    let err = max_abs(&q1, &gq.narrow(0, 0, 1)?)?
        .max(max_abs(&kc.narrow(2, 5, sl)?, &gk.narrow(0, 0, 1)?)?)
        .max(max_abs(&vc.narrow(2, 5, sl)?, &gv.narrow(0, 0, 1)?)?)
        .max(untouched(&kc, 7.0)?)
        .max(untouched(&vc, 9.0)?)
        .max(if none.is_none() { 0.0 } else { f32::INFINITY });
    report("qkv_prep into cache slots", err, 0.0);

    // Router: top-3 of 8 logits per token (ties to the lower expert), softmax, per-expert scale.
    let (e, out, inp, tokens, k) = (8, 64, 128, 5, 3);
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
    report("grouped_matvec", max_abs(&got, &want)?, lim);
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
    report("grouped_matvec + moe_mix", max_abs(&got, &want)?, lim);

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
    report("grouped_matvec by slot", max_abs(&got, &want)?, lim);

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
        (Some(got), DType::BF16 | DType::F16) => max_abs(&got, &want)?,
        (None, DType::F32) => 0.0,
        _ => f32::INFINITY,
    };
    report("grouped_matvec gated", err, lim);

    // Greedy pick over a vocabulary-sized row, with a planted tie (the lower index wins).
    if dtype == DType::F32 {
        let mut rows = rnd(&[3, 262_144], DType::F32)?.to_vec2::<f32>()?;
        rows[1][7] = 100.0;
        rows[1][90_000] = 100.0;
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
        let got = candle_gemma::kernels::cuda::fused::argmax_rows(&g(&x)?)?.to_vec1::<u32>()?;
        report(
            "argmax_rows",
            if got == want { 0.0 } else { f32::INFINITY },
            0.0,
        );
    }
    Ok(ok)
}

/// The routed expert products over MLX-packed experts (`grouped_qmatvec`, plain and gated)
/// against the CPU reference product of each picked expert: few pairs (one block per pair slot,
/// experts picked twice) and many (one block per expert).
fn check_grouped_packed(
    xdtype: DType,
    sdtype: DType,
    bits: usize,
    group: usize,
    gpu: &Device,
    stats: &mut BTreeMap<String, f32>,
) -> Result<bool> {
    use candle_gemma::kernels::cuda::fused::{grouped_qmatvec, grouped_qmatvec_gated};
    let cpu = Device::Cpu;
    // 40 rows an expert: not a multiple of the 8 rows of a block.
    let (experts, out_dim, in_dim) = (8, 40, 256);
    let w = Tensor::randn(0f32, 0.05, (experts * out_dim, in_dim), &cpu)?.to_dtype(sdtype)?;
    let p = quantize(&w, QuantBits::from_bits(bits)?, group)?;
    let wc = PackedWeight::new(p.codes, p.scales, p.biases, experts * out_dim, in_dim)?;
    let wg = PackedWeight::new(
        wc.codes.to_device(gpu)?,
        wc.scales.to_device(gpu)?,
        wc.biases.to_device(gpu)?,
        experts * out_dim,
        in_dim,
    )?;
    let expert = |e: u32| wc.narrow_rows(e as usize * out_dim, out_dim);
    let lim = tol(xdtype) * ((in_dim as f32).sqrt() * 0.05).max(1.0) * 2.0;
    let mut ok = true;
    let mut report = |name: String, err: f32| {
        let pass = err <= lim;
        ok &= pass;
        let e = stats.entry("grouped_qmatvec".into()).or_insert(0.0);
        *e = e.max(err);
        println!(
            "{name} x={xdtype:?} scales={sdtype:?} bits={bits} group={group} max_abs={err:.3e} {}",
            if pass { "PASS" } else { "FAIL" }
        );
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
            max_abs(&got, &want)?,
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
            (Some(got), DType::BF16 | DType::F16) => max_abs(&got, &want)?,
            (None, DType::F32) => 0.0,
            _ => f32::INFINITY,
        };
        report(format!("grouped_qmatvec gated pairs={}", tokens * k), err);
    }
    Ok(ok)
}

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
    let same_bits = max_abs(&got_settled, &got)? == 0.0;
    // Output magnitude ~ sqrt(in) * 0.05; scale the tolerance with it.
    let mag = (in_dim as f32).sqrt() * 0.05;
    let err = max_abs(&got, &want)?.max(max_abs(&got_off, &want)?);
    let pass = err <= tol(xdtype) * mag.max(1.0) * 2.0 && same_bits;
    let e = stats
        .entry(format!("qmatmul x={xdtype:?} {bits}-bit"))
        .or_insert(0.0);
    *e = e.max(err);
    println!(
        "qmatmul x={xdtype:?} scales={sdtype:?} bits={bits} group={group} [{out_dim}x{in_dim}] rows={rows} max_abs={err:.3e} settled_same_bits={same_bits} {}",
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

/// The tensor-core dense matvec against the CPU matmul (f32 there), in one activation dtype.
fn check_dense_matvec(
    out_dim: usize,
    in_dim: usize,
    rows: usize,
    dtype: DType,
    gpu: &Device,
    stats: &mut BTreeMap<String, f32>,
) -> Result<bool> {
    use candle_gemma::kernels::cuda::fused::{
        dense_matvec, dense_matvec_add_norm, dense_matvec_gated, dense_matvec_normed, AddNormExtra,
        GATED_MV_MAX_SMEM,
    };
    use candle_nn::ops::rms_norm;
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
    let err = max_abs(&got.to_dtype(DType::F32)?, &want)?;
    let pass = err <= tol(dtype) * mag * 2.0;
    let e = stats
        .entry(format!("dense_matvec {dtype:?}"))
        .or_insert(0.0);
    *e = e.max(err);
    println!(
        "dense_matvec dtype={dtype:?} [{out_dim}x{in_dim}] rows={rows} max_abs={err:.3e} {}",
        if pass { "PASS" } else { "FAIL" }
    );

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
    // Gated rows beyond the kernel's shared memory are declined (the caller gates separately).
    let fits = rows * in_dim * dtype.size_in_bytes() <= GATED_MV_MAX_SMEM;
    let (err_g, pass_g) = match got {
        Some(got) if fits => {
            let e = max_abs(&got.to_dtype(DType::F32)?, &want)?;
            (e, e <= tol(dtype) * mag * 2.0)
        }
        None if !fits => (0.0, true),
        _ => (f32::INFINITY, false),
    };
    let e = stats
        .entry(format!("dense_matvec_gated {dtype:?}"))
        .or_insert(0.0);
    *e = e.max(err_g);
    println!(
        "dense_matvec_gated dtype={dtype:?} [{out_dim}x{in_dim}] rows={rows} max_abs={err_g:.3e} {}",
        if pass_g { "PASS" } else { "FAIL" }
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
    let got = candle_gemma::kernels::cuda::fused::dense_matvec_geglu(&g(&x)?, &g(&wst)?)?;
    let (err_q, pass_q) = match got {
        Some(got) if rows == 1 => {
            // Outputs ~ in (gelu of a ~sqrt(in) gate times a ~sqrt(in) up); each half rounds
            // once to the activation type, in whatever order its sum ran.
            let e = max_abs(&got.to_dtype(DType::F32)?, &want)?;
            (e, e <= tol(dtype) * mag * mag * 4.0)
        }
        None if rows > 1 => (0.0, true),
        _ => (f32::INFINITY, false),
    };
    let e = stats
        .entry(format!("dense_matvec_geglu {dtype:?}"))
        .or_insert(0.0);
    *e = e.max(err_q);
    println!(
        "dense_matvec_geglu dtype={dtype:?} [{out_dim}x{in_dim}] rows={rows} max_abs={err_q:.3e} {}",
        if pass_q { "PASS" } else { "FAIL" }
    );

    // The RMS-normed input (the MoE router's), the norm computed in the kernel.
    let nwr = rnd(&[in_dim], dtype)?;
    let want = rms_norm(&x, &nwr, 1e-6)?
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?;
    let got = dense_matvec_normed(&g(&x)?, &g(&nwr)?, 1e-6, &g(&w)?)?;
    let fits_n = rows * in_dim * dtype.size_in_bytes() <= GATED_MV_MAX_SMEM;
    let (err_r, pass_r) = match got {
        Some(got) if fits_n => {
            // Normed inputs reach a few units: outputs ~ 3 sqrt(in).
            let e = max_abs(&got.to_dtype(DType::F32)?, &want)?;
            (e, e <= tol(dtype) * mag * 8.0)
        }
        None if !fits_n => (0.0, true),
        _ => (f32::INFINITY, false),
    };
    let e = stats
        .entry(format!("dense_matvec_normed {dtype:?}"))
        .or_insert(0.0);
    *e = e.max(err_r);
    println!(
        "dense_matvec_normed dtype={dtype:?} [{out_dim}x{in_dim}] rows={rows} max_abs={err_r:.3e} {}",
        if pass_r { "PASS" } else { "FAIL" }
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
    let mut pass_n = true;
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
        let (err, ok) = match got {
            Some((o, o1, o2)) => {
                let e0 = max_abs(&o, &sum)?;
                let e1 = max_abs(&o1.expect("asked"), &rms_norm(&sum, &n1, 1e-6)?)?;
                let e2 = match o2 {
                    Some(o2) => max_abs(&o2, &rms_norm(&sum, &n2, 1e-6)?)?,
                    None => 0.0,
                };
                // The sum sees y rounded once on each side (an ulp apart at most), so allow the
                // add_norm kernel's bounds doubled.
                let e = e0.max(e1 / 2.0).max(e2 / 2.0);
                (e, e <= 8.0 * tol(dtype))
            }
            // Declined only where the gated rows exceed shared memory.
            None => (0.0, gated && !fits),
        };
        pass_n &= ok;
        let key = format!("dense_matvec_add_norm {dtype:?}");
        let st = stats.entry(key).or_insert(0.0);
        *st = st.max(err);
        println!(
            "dense_matvec_add_norm gated={gated} dtype={dtype:?} [{out_dim}x{in_dim}] rows={rows} max_abs={err:.3e} {}",
            if ok { "PASS" } else { "FAIL" }
        );
    }
    Ok(pass && pass_g && pass_q && pass_n && pass_r)
}

/// The residual add + norm folded into the packed 4-bit one-row product (`qmv_row4_norm`)
/// against the unfused path: the GPU's own packed product, then the add + norm on the CPU.
fn check_packed_add_norm(
    out_dim: usize,
    in_dim: usize,
    dtype: DType,
    gpu: &Device,
    stats: &mut BTreeMap<String, f32>,
) -> Result<bool> {
    use candle_gemma::kernels::cuda::fused::{packed_matvec_add_norm, AddNormExtra};
    use candle_nn::ops::rms_norm;
    let g = |t: &Tensor| t.to_device(gpu);
    let w = Tensor::randn(0f32, 0.05, (out_dim, in_dim), &Device::Cpu)?.to_dtype(dtype)?;
    let p = quantize(&w, QuantBits::from_bits(4)?, 64)?;
    let wg = PackedWeight::new(g(&p.codes)?, g(&p.scales)?, g(&p.biases)?, out_dim, in_dim)?;
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
    let mut ok = true;
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
                (Some(p), Some(q)) => max_abs(p, q)? == 0.0,
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
        let (err, pass) = match got {
            Some((o, o1, o2)) => {
                let e0 = max_abs(&o, &sum)?;
                let e1 = match o1 {
                    Some(o1) => max_abs(&o1, &rms_norm(&sum, &n1, 1e-6)?)?,
                    None => f32::INFINITY,
                };
                let e2 = match (o2, with_scalar) {
                    (Some(o2), false) => max_abs(&o2, &rms_norm(&sum, &n2, 1e-6)?)?,
                    (None, true) => 0.0,
                    _ => f32::INFINITY,
                };
                let e = e0.max(e1 / 2.0).max(e2 / 2.0);
                (e, e <= 8.0 * tol(dtype))
            }
            None => (f32::INFINITY, false),
        };
        let pass = pass && same_bits;
        ok &= pass;
        let st = stats
            .entry(format!("packed_matvec_add_norm {dtype:?}"))
            .or_insert(0.0);
        *st = st.max(err);
        println!(
            "packed_matvec_add_norm scalar={with_scalar} dtype={dtype:?} [{out_dim}x{in_dim}] max_abs={err:.3e} settled_same_bits={same_bits} {}",
            if pass { "PASS" } else { "FAIL" }
        );
    }
    Ok(ok)
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
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for packed in [None, Some(4), Some(8)] {
            for hd in [256, 512] {
                all_ok &= check_batched(dtype, packed, hd, &gpu, &mut stats)?;
            }
        }
    }
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        all_ok &= check_fused(dtype, &gpu, &mut stats)?;
        all_ok &= check_quantize(dtype, &gpu)?;
        all_ok &= check_quantized_cache(dtype, &gpu)?;
        all_ok &= check_dense_batch_cache(dtype, &gpu)?;
    }
    for xdtype in [DType::F32, DType::BF16, DType::F16] {
        for sdtype in [DType::BF16, DType::F16, DType::F32] {
            for bits in [4, 8] {
                for (group, rows) in [(32, 1), (64, 3), (128, 8), (64, 20)] {
                    all_ok &= check_qmatmul(
                        384, 512, bits, group, sdtype, xdtype, rows, &gpu, &mut stats,
                    )?;
                }
                // Output rows not a multiple of the tensor-core tile (16), odd row counts.
                for (group, rows) in [(32, 2), (64, 5), (128, 7)] {
                    all_ok &= check_qmatmul(
                        200, 1024, bits, group, sdtype, xdtype, rows, &gpu, &mut stats,
                    )?;
                }
                // One activation row: whole 1024-code steps, a leftover step and an odd row count
                // (qmv_row4 owns 2-4 rows a warp).
                for group in [64, 128] {
                    all_ok &=
                        check_qmatmul(203, 3072, bits, group, sdtype, xdtype, 1, &gpu, &mut stats)?;
                }
                // Few long rows, so qmv_row4 splits each row pair's input over 2 and over 4
                // warps (`row_matvec_split_for`), with a leftover step.
                for (out_dim, in_dim) in [(203, 9472), (37, 17664)] {
                    all_ok &= check_qmatmul(
                        out_dim, in_dim, bits, 128, sdtype, xdtype, 1, &gpu, &mut stats,
                    )?;
                }
                for group in [32, 64, 128] {
                    all_ok &= check_grouped_packed(xdtype, sdtype, bits, group, &gpu, &mut stats)?;
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
    // The 31B q_proj shape at 4 bits, one row: settled, its row pairs need more than one wave
    // of `qmv_row4_*_u2e` on an H100 but fit one of `_u2le` (8-warp blocks; `qmatvec`).
    for dtype in [DType::BF16, DType::F16] {
        for group in [64, 128] {
            all_ok &= check_qmatmul(8192, 5376, 4, group, dtype, dtype, 1, &gpu, &mut stats)?;
        }
    }
    // One row of 8-bit codes over 6337..=8448 outputs: more than one wave of the 39-register
    // build on an H100 (132 SMs, 6 blocks each) but one of the 32-register `_1w` build, which
    // `qmatvec` takes there (f32 activations: one build fits 8 blocks, so never).
    for xdtype in [DType::F32, DType::BF16, DType::F16] {
        for (out_dim, group) in [(8192, 64), (7001, 128), (6400, 32)] {
            all_ok &= check_qmatmul(
                out_dim,
                1024,
                8,
                group,
                DType::BF16,
                xdtype,
                1,
                &gpu,
                &mut stats,
            )?;
        }
    }
    // Tile tails (outputs not a multiple of 16/32, inputs not a multiple of 32), both tile
    // counts (the two-tile kernel from 32 * 2 * SMs outputs), 1..=8 rows.
    for dtype in [DType::BF16, DType::F16] {
        for (out_dim, in_dim) in [
            (384, 512),
            (200, 1032),
            (9000, 264),
            (5000, 264),
            (40, 2568),
        ] {
            for rows in [1, 3, 8] {
                all_ok &= check_dense_matvec(out_dim, in_dim, rows, dtype, &gpu, &mut stats)?;
            }
        }
    }
    // The packed product with the add + norm folded in: an odd row count (a partial warp),
    // E4B/26B-A4B widths and the widest taken (PACKED_FOLD_MAX_WIDTH).
    for dtype in [DType::BF16, DType::F16] {
        for (out_dim, in_dim) in [(2560, 2048), (2816, 4096), (4096, 2048), (1001, 1024)] {
            all_ok &= check_packed_add_norm(out_dim, in_dim, dtype, &gpu, &mut stats)?;
        }
    }
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
