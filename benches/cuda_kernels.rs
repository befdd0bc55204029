//! GPU benchmark of the quantized kernels, printing one JSON object per line:
//! quantized attention (4/8-bit, fused decode and auto prefill) against the crate's dense bf16
//! attention (candle matmul + softmax) at 1k..128k keys on the E4B and 31B head shapes, and
//! quantized matvec/GEMM against bf16 on the 31B projection shapes, with achieved GB/s against a
//! device-to-device copy measured in the same process. Times are medians of several repeats,
//! each `iters` launches between two device synchronizations.
//!
//! `--experts`: the routed-expert grouped matvec (26B-A4B shapes), packed against bf16.
//!
//! ```text
//! cargo bench --features cuda --bench cuda_kernels [-- --quick]
//! ```
//!
//! Flags: `--quick` (fewer key counts), `--l2-resident`, `--matmul-only`, `--attention-only`,
//! `--dense-only`, `--launch-floor`, `--experts`, `--shape NAME`, `--keys N`, `--proj NAME`,
//! `--rows N`; `BENCH_KERNELS_ONCE=N` makes each point N calls for a profiler. On a GPU machine
//! without a toolchain, build here with `cargo bench --features cuda --bench cuda_kernels
//! --no-run` and carry the binary it names (`target/release/deps/cuda_kernels-<hash>`).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::attend;
use candle_gemma::kernels::cuda::{attend_packed_cuda, QsdpaPath};
use candle_gemma::kernels::qmatmul::qmatmul;
use candle_gemma::kv::{KeyPositions, KvData, KvView, PackedAffine, QuantBits};
use std::time::Instant;

/// Calls a measurement point makes under a profiler (`BENCH_KERNELS_ONCE` set: its count, or 1).
fn profiler_calls() -> Option<usize> {
    let v = std::env::var("BENCH_KERNELS_ONCE").ok()?;
    Some(v.parse().unwrap_or(1).max(1))
}

/// Median seconds per call of `f`.
fn time<F: FnMut() -> Result<()>>(dev: &Device, iters: usize, mut f: F) -> Result<f64> {
    // A few calls per measurement point (`BENCH_KERNELS_ONCE`: 1, or the count it gives), for
    // a profiler that records every launch.
    if let Some(calls) = profiler_calls() {
        for _ in 0..calls {
            f()?;
        }
        dev.synchronize()?;
        return Ok(1.0);
    }
    for _ in 0..2 {
        f()?;
    }
    dev.synchronize()?;
    let mut v = Vec::new();
    let mut enq = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        enq.push(t.elapsed().as_secs_f64() / iters as f64);
        dev.synchronize()?;
        v.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    enq.sort_by(|a, b| a.total_cmp(b));
    LAST_ENQUEUE.with(|c| c.set(enq[2]));
    Ok(v[2])
}

/// GPU seconds per call of `f` with the host out of the way (median of 5): a spin kernel
/// holds the stream while the host enqueues `iters` calls behind it, and events around those
/// calls time them back to back, as a captured graph would run them. `None` off CUDA, or when
/// the host had not finished enqueueing before the spin ended (then it would still set the
/// pace). Call after `time` on the same `f`: the spin is sized from its enqueue time.
fn queued_time<F: FnMut() -> Result<()>>(
    dev: &Device,
    iters: usize,
    mut f: F,
) -> Result<Option<f64>> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let Device::Cuda(c) = dev else {
        return Ok(None);
    };
    if profiler_calls().is_some() {
        return Ok(None);
    }
    let spin = std::time::Duration::from_secs_f64(4.0 * iters as f64 * last_enqueue() + 500e-6);
    let stream = c.cuda_stream();
    let mut v = Vec::new();
    for _ in 0..5 {
        dev.synchronize()?;
        let t = Instant::now();
        candle_gemma::kernels::cuda::diagnostics::gpu_spin(c, spin.as_nanos() as u64)?;
        let a = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..iters {
            f()?;
        }
        let b = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        if t.elapsed() >= spin {
            return Ok(None);
        }
        v.push(a.elapsed_ms(&b)? as f64 * 1e-3 / iters as f64);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(Some(v[2]))
}

/// `Some(x)` as a JSON number, `None` as null.
fn json_num(x: Option<f64>) -> String {
    x.map_or_else(|| "null".into(), |x| format!("{x:.6e}"))
}

thread_local! {
    /// Host seconds per call of the last `time`'s median timing, before its synchronize: near
    /// the call's seconds, the host (not the GPU) set the pace.
    static LAST_ENQUEUE: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

fn last_enqueue() -> f64 {
    LAST_ENQUEUE.with(|c| c.get())
}

fn rand_codes(shape: (usize, usize, usize, usize), dev: &Device) -> Result<Tensor> {
    // Random 24-bit patterns (exact in f32); the code values do not change the timing.
    Ok(Tensor::rand(0f32, 16777215.0, shape, dev)?.to_dtype(DType::U32)?)
}

/// K/V copies an attention point rotates through so that L2 (50 MB on an H100) cannot keep
/// them between calls, as in a decode step where every other layer's weights and caches pass
/// through L2 in between: enough for 200 MB (at most 256), or one with `l2_resident`.
fn kv_copies(bytes: usize, l2_resident: bool) -> usize {
    if l2_resident {
        1
    } else {
        200_000_000usize.div_ceil(bytes.max(1)).clamp(1, 256)
    }
}

fn packed(
    kvh: usize,
    keys: usize,
    hd: usize,
    bits: usize,
    group: usize,
    dev: &Device,
) -> Result<PackedAffine> {
    Ok(PackedAffine::from_parts(
        rand_codes((1, kvh, keys, hd * bits / 32), dev)?,
        Tensor::rand(0.001f32, 0.02, (1, kvh, keys, hd / group), dev)?.to_dtype(DType::BF16)?,
        Tensor::rand(-0.1f32, 0.0, (1, kvh, keys, hd / group), dev)?.to_dtype(DType::BF16)?,
        candle_gemma::kernels::AffineSpec {
            bits: QuantBits::from_bits(bits)?,
            group_size: group,
        },
    ))
}

/// The value after `flag` on the command line, if given.
fn arg_value(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    // `--l2-resident`: one K/V copy a point, so small caches stay in L2 between calls; by
    // default copies rotate as the weights do.
    let l2_resident = std::env::args().any(|a| a == "--l2-resident");
    // `--matmul-only`: skip the attention benches (the matvec kernels alone).
    let attention = !std::env::args().any(|a| a == "--matmul-only");
    // `--dense-only`: only the dense bf16 matvec (tensor-core kernel vs cuBLAS).
    let dense_only = std::env::args().any(|a| a == "--dense-only");
    // Which matvec kernel `qmatmul` takes for bf16 activations with bf16 scales (see
    // `matvec_plan::choose`: 4-bit codes are dequantized before the mma, one activation row read
    // row-contiguous; one row of 8-bit or group-32 codes stays on the SIMT kernel).
    let matvec_kernel = |rows: usize, bits: usize, group: usize| {
        if rows == 1 && bits == 4 {
            "row_contiguous_tensor_core"
        } else if rows <= 8 && bits == 4 {
            "dequant_tensor_core"
        } else if rows == 1 && (bits == 8 || group == 32) {
            "simt"
        } else if rows <= 8 {
            "tensor_core"
        } else {
            "dequant_gemm"
        }
    };
    let dev = Device::new_cuda(0)?;

    // Copy bandwidth: 1 GiB device-to-device memcpy into a preallocated buffer, bytes read +
    // written.
    let cdev = match &dev {
        Device::Cuda(c) => c.clone(),
        _ => anyhow::bail!("needs a CUDA device"),
    };
    let n = 256 * 1024 * 1024;
    let src = cdev.alloc_zeros::<f32>(n)?;
    let mut dst = cdev.alloc_zeros::<f32>(n)?;
    let t_copy = time(&dev, 10, || {
        cdev.memcpy_dtod(&src, &mut dst)?;
        Ok(())
    })?;
    drop((src, dst));
    let copy_gbs = 2.0 * 1024f64.powi(3) / t_copy / 1e9;
    println!(
        "{{\"bench\":\"copy\",\"bytes\":{},\"seconds\":{t_copy:.6e},\"gb_per_s\":{copy_gbs:.1}}}",
        2u64 << 30
    );

    if dense_only {
        return bench_dense_matvec(&dev, copy_gbs);
    }
    if std::env::args().any(|a| a == "--launch-floor") {
        return bench_launch_floor(&dev);
    }
    if std::env::args().any(|a| a == "--experts") {
        return bench_grouped_experts(&dev, copy_gbs);
    }

    // Quantized attention vs dense bf16.
    let shapes: [(&str, usize, usize, usize); 4] = [
        ("e4b_sliding", 8, 2, 256),
        ("e4b_full", 8, 2, 512),
        ("31b_sliding", 32, 16, 256),
        ("31b_full", 32, 4, 512),
    ];
    let key_counts: &[usize] = if quick {
        &[1024, 32768]
    } else {
        &[1024, 8192, 32768, 131072]
    };
    // `--shape NAME`, `--keys N`: one attention shape or key count (for a profiler's run).
    let only_shape = arg_value("--shape");
    let only_keys = arg_value("--keys").and_then(|k| k.parse::<usize>().ok());
    for &(name, nh, kvh, hd) in shapes
        .iter()
        .filter(|s| attention && only_shape.as_deref().is_none_or(|o| o == s.0))
    {
        for &keys in key_counts
            .iter()
            .filter(|&&k| only_keys.is_none_or(|o| o == k))
        {
            for q_len in [1usize, 512] {
                if q_len > 1 && keys > 32768 {
                    continue; // the dense path's host-built mask dominates there
                }
                let iters = if q_len == 1 { 50 } else { 3 };
                let q =
                    Tensor::randn(0f32, 1.0, (1, nh, q_len, hd), &dev)?.to_dtype(DType::BF16)?;
                let q_off = keys - q_len;
                // As a cache marks its view: the keys before the queries' were settled before
                // the step (the newest are the step's own writes).
                let pos = KeyPositions::range(0..keys).settled_below(q_off);
                let scale = 1.0 / (hd as f64).sqrt();
                let dense_bytes = 2 * kvh * keys * hd * 2;
                let dense_copies = kv_copies(dense_bytes, l2_resident);
                let dviews: Vec<KvView> = (0..dense_copies)
                    .map(|_| {
                        let shape = (1, kvh, keys, hd);
                        let k = Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(DType::BF16)?;
                        let v = Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(DType::BF16)?;
                        Ok(KvView::Single {
                            data: KvData::Dense { k, v },
                            positions: pos.clone(),
                        })
                    })
                    .collect::<Result<_>>()?;
                let mut i = 0;
                let mut dense_call = || {
                    i += 1;
                    attend(&q, &dviews[i % dense_copies], &[q_off], None, scale)?;
                    Ok(())
                };
                let t_dense = time(&dev, iters, &mut dense_call)?;
                let dense_enqueue = last_enqueue();
                let dense_queued = if q_len == 1 {
                    queued_time(&dev, iters, &mut dense_call)?
                } else {
                    None
                };
                drop(dviews);
                for bits in [4usize, 8] {
                    let kv_bytes = 2 * kvh * keys * (hd * bits / 8 + 2 * 2 * hd / 64);
                    let copies = kv_copies(kv_bytes, l2_resident);
                    let kvs: Vec<(PackedAffine, PackedAffine)> = (0..copies)
                        .map(|_| {
                            Ok((
                                packed(kvh, keys, hd, bits, 64, &dev)?,
                                packed(kvh, keys, hd, bits, 64, &dev)?,
                            ))
                        })
                        .collect::<Result<_>>()?;
                    let paths: &[QsdpaPath] = if q_len == 1 {
                        &[QsdpaPath::Fused]
                    } else if keys <= 8192 {
                        &[QsdpaPath::Fused, QsdpaPath::DequantDense]
                    } else {
                        &[QsdpaPath::DequantDense]
                    };
                    for &path in paths {
                        let mut i = 0;
                        let mut packed_call = || {
                            i += 1;
                            let (k, v) = &kvs[i % copies];
                            attend_packed_cuda(&q, k, v, &pos, q_off, None, scale, path)?;
                            Ok(())
                        };
                        let t = time(&dev, iters, &mut packed_call)?;
                        let enqueue = last_enqueue();
                        let queued = if q_len == 1 && dense_queued.is_some() {
                            queued_time(&dev, iters, &mut packed_call)?
                        } else {
                            None
                        };
                        let queued_speedup = dense_queued.zip(queued).map(|(d, p)| d / p);
                        println!(
                            "{{\"bench\":\"qsdpa\",\"shape\":\"{name}\",\"heads\":{nh},\"kv_heads\":{kvh},\"head_dim\":{hd},\"keys\":{keys},\"q_len\":{q_len},\"bits\":{bits},\"group\":64,\"path\":\"{path:?}\",\"kv_copies\":{copies},\"dense_copies\":{dense_copies},\"seconds\":{t:.6e},\"enqueue_seconds\":{enqueue:.6e},\"dense_bf16_seconds\":{t_dense:.6e},\"dense_enqueue_seconds\":{dense_enqueue:.6e},\"speedup\":{:.3},\"kv_gb_per_s\":{:.1},\"queued_seconds\":{},\"dense_queued_seconds\":{},\"queued_speedup\":{}}}",
                            t_dense / t,
                            kv_bytes as f64 / t / 1e9,
                            json_num(queued),
                            json_num(dense_queued),
                            json_num(queued_speedup),
                        );
                    }
                }
            }
        }
    }

    // `--attention-only`: stop after the attention benches.
    if std::env::args().any(|a| a == "--attention-only") {
        return Ok(());
    }
    // Quantized matvec / GEMM vs bf16 on the 31B projections ([out, in]).
    // The 31B projections, and E4B's down_proj (few row pairs: `qmv_row4` splits its input).
    let projs: [(&str, usize, usize); 4] = [
        ("q_proj_sliding", 8192, 5376),
        ("mlp_gate_up", 21504, 5376),
        ("mlp_down", 5376, 21504),
        ("e4b_mlp_down", 2560, 10240),
    ];
    // `--proj NAME`, `--rows N`: one projection or activation row count.
    let only_proj = arg_value("--proj");
    let only_rows = arg_value("--rows").and_then(|r| r.parse::<usize>().ok());
    for &(name, out, inp) in projs
        .iter()
        .filter(|p| only_proj.as_deref().is_none_or(|o| o == p.0))
    {
        // Weight copies rotated so that L2 (50 MB) cannot hold them: 200 MB of 4-bit codes.
        let rot = 200_000_000usize.div_ceil(out * inp / 2).clamp(4, 16);
        for rows in [1usize, 8, 512]
            .into_iter()
            .filter(|&r| only_rows.is_none_or(|o| o == r))
        {
            let iters = if rows <= 8 { 40 } else { 5 };
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &dev)?.to_dtype(DType::BF16)?;
            let ws: Vec<Tensor> = (0..rot)
                .map(|_| Ok(Tensor::randn(0f32, 0.02, (out, inp), &dev)?.to_dtype(DType::BF16)?))
                .collect::<Result<_>>()?;
            let mut i = 0;
            let t_bf16 = time(&dev, iters, || {
                i += 1;
                x.matmul(&ws[i % rot].t()?)?;
                Ok(())
            })?;
            let dense_bytes = out * inp * 2;
            drop(ws);
            let groups: &[usize] = if rows == 1 { &[32, 64, 128] } else { &[64] };
            for (bits, &group) in [4usize, 8]
                .into_iter()
                .flat_map(|b| groups.iter().map(move |g| (b, g)))
            {
                let wq: Vec<PackedAffine> = (0..rot)
                    .map(|_| {
                        let p = packed(1, out, inp, bits, group, &dev)?;
                        // Settled, as a loaded model's weights: complete before any call.
                        Ok(PackedAffine::new(
                            p.codes.squeeze(0)?.squeeze(0)?,
                            p.scales.squeeze(0)?.squeeze(0)?,
                            p.biases.squeeze(0)?.squeeze(0)?,
                            out,
                            inp,
                        )?
                        .settled())
                    })
                    .collect::<Result<_>>()?;
                let bytes = wq[0].packed_bytes();
                let mut i = 0;
                let mut call = || {
                    i += 1;
                    qmatmul(&x, &wq[i % rot])?;
                    Ok(())
                };
                let t = time(&dev, iters, &mut call)?;
                let enqueue = last_enqueue();
                let queued = if rows == 1 {
                    queued_time(&dev, iters, &mut call)?
                } else {
                    None
                };
                let queued_fraction = queued.map(|q| bytes as f64 / q / 1e9 / copy_gbs);
                let gbs = bytes as f64 / t / 1e9;
                // Also a copy moving the same bytes (half read, half written), rotated like
                // the weights: what a transfer of this size reaches, ramp and tail included.
                let same = if rows == 1 {
                    copy_of_size(&cdev, &dev, bytes, rot)?
                } else {
                    0.0
                };
                println!(
                    "{{\"bench\":\"qmatmul\",\"kernel\":\"{}\",\"shape\":\"{name}\",\"out\":{out},\"in\":{inp},\"rows\":{rows},\"bits\":{bits},\"group\":{group},\"seconds\":{t:.6e},\"enqueue_seconds\":{enqueue:.6e},\"bf16_seconds\":{t_bf16:.6e},\"speedup\":{:.3},\"packed_bytes\":{bytes},\"gb_per_s\":{gbs:.1},\"bf16_gb_per_s\":{:.1},\"copy_gb_per_s\":{copy_gbs:.1},\"fraction_of_copy\":{:.3},\"same_size_copy_gb_per_s\":{same:.1},\"fraction_of_same_size_copy\":{:.3},\"queued_seconds\":{},\"queued_fraction_of_copy\":{}}}",
                    matvec_kernel(rows, bits, group),
                    t_bf16 / t,
                    dense_bytes as f64 / t_bf16 / 1e9,
                    gbs / copy_gbs,
                    if same > 0.0 { gbs / same } else { 0.0 },
                    json_num(queued),
                    queued_fraction.map_or_else(|| "null".into(), |f| format!("{f:.3}")),
                );
            }
        }
    }
    Ok(())
}

/// Bandwidth (bytes read + written per second) of device-to-device copies moving `bytes` in all
/// (`bytes / 2` each), over `rot` source/destination pairs taken in turn.
fn copy_of_size(
    cdev: &candle_core::cuda_backend::CudaDevice,
    dev: &Device,
    bytes: usize,
    rot: usize,
) -> Result<f64> {
    let n = bytes / 2 / 4;
    let mut pairs = (0..rot)
        .map(|_| Ok((cdev.alloc_zeros::<f32>(n)?, cdev.alloc_zeros::<f32>(n)?)))
        .collect::<Result<Vec<_>>>()?;
    let mut i = 0;
    let t = time(dev, 40, || {
        i += 1;
        let (src, dst) = &mut pairs[i % rot];
        cdev.memcpy_dtod(&*src, dst)?;
        Ok(())
    })?;
    Ok((2 * n * 4) as f64 / t / 1e9)
}

/// Dense bf16 decode products: the crate's tensor-core matvec against cuBLAS (candle's
/// matmul), 1 and 8 rows, on the 31B and E4B projection and head shapes, with GB/s against the
/// copy bandwidth.
fn bench_dense_matvec(dev: &Device, copy_gbs: f64) -> Result<()> {
    use candle_gemma::kernels::cuda::dense_matvec::{dense_matvec, dense_matvec_gated};
    use candle_gemma::kernels::cuda::layer_ops::gelu_mul;
    let shapes: [(&str, usize, usize); 16] = [
        ("31b_q_proj", 8192, 5376),
        ("31b_gate_up", 43008, 5376),
        ("31b_down", 5376, 21504),
        ("31b_head", 262144, 5376),
        ("e4b_qkv", 3072, 2560),
        ("e4b_gate_up", 20480, 2560),
        ("e4b_down", 2560, 10240),
        ("e4b_head", 262144, 2560),
        ("e2b_qkv", 2560, 1536),
        ("e2b_gate_up", 12288, 1536),
        ("e2b_down", 1536, 6144),
        ("26b_qkv", 8192, 2816),
        ("26b_o", 2816, 4096),
        ("26b_down", 2816, 2112),
        ("e2b_wide_down", 1536, 12288),
        ("e4b_ple_down", 2560, 256),
    ];
    for &(name, out, inp) in &shapes {
        // Enough weight copies that L2 (50 MB) cannot hold the rotation.
        let rot = (200_000_000 / (out * inp * 2)).clamp(2, 8);
        let ws: Vec<Tensor> = (0..rot)
            .map(|_| Ok(Tensor::randn(0f32, 0.02, (out, inp), dev)?.to_dtype(DType::BF16)?))
            .collect::<Result<_>>()?;
        let bytes = (out * inp * 2) as f64;
        for rows in [1usize, 8] {
            let x = Tensor::randn(0f32, 1.0, (rows, inp), dev)?.to_dtype(DType::BF16)?;
            let mut i = 0;
            let t_cublas = time(dev, 40, || {
                i += 1;
                x.matmul(&ws[i % rot].t()?)?;
                Ok(())
            })?;
            let mut i = 0;
            let t_mma = time(dev, 40, || {
                i += 1;
                dense_matvec(&x, &ws[i % rot])?.ok_or_else(|| anyhow::anyhow!("not applicable"))?;
                Ok(())
            })?;
            println!(
                "{{\"bench\":\"dense_matvec\",\"shape\":\"{name}\",\"out\":{out},\"in\":{inp},\"rows\":{rows},\"seconds\":{t_mma:.6e},\"cublas_seconds\":{t_cublas:.6e},\"speedup\":{:.3},\"fraction_of_copy\":{:.3},\"cublas_fraction_of_copy\":{:.3},\"copy_gb_per_s\":{copy_gbs:.1}}}",
                t_cublas / t_mma,
                bytes / t_mma / 1e9 / copy_gbs,
                bytes / t_cublas / 1e9 / copy_gbs,
            );
            if !name.ends_with("down") {
                continue;
            }
            // The gated product (gelu(a) * b computed in the kernel) against the separate gate
            // launch followed by the plain kernel or cuBLAS.
            let ab = Tensor::randn(0f32, 1.0, (rows, 2 * inp), dev)?.to_dtype(DType::BF16)?;
            let (a, b) = (ab.narrow(1, 0, inp)?, ab.narrow(1, inp, inp)?);
            if dense_matvec_gated(&a, &b, &ws[0])?.is_none() {
                continue; // gated rows beyond the kernel's shared memory
            }
            let mut i = 0;
            let t_gated = time(dev, 40, || {
                i += 1;
                dense_matvec_gated(&a, &b, &ws[i % rot])?;
                Ok(())
            })?;
            let mut i = 0;
            let t_split = time(dev, 40, || {
                i += 1;
                let g = gelu_mul(&a, &b)?;
                dense_matvec(&g, &ws[i % rot])?;
                Ok(())
            })?;
            let mut i = 0;
            let t_split_cublas = time(dev, 40, || {
                i += 1;
                gelu_mul(&a, &b)?.matmul(&ws[i % rot].t()?)?;
                Ok(())
            })?;
            println!(
                "{{\"bench\":\"gated_matvec\",\"shape\":\"{name}\",\"rows\":{rows},\"gated_seconds\":{t_gated:.6e},\"gate_then_matvec_seconds\":{t_split:.6e},\"gate_then_cublas_seconds\":{t_split_cublas:.6e},\"gated_fraction_of_copy\":{:.3}}}",
                bytes / t_gated / 1e9 / copy_gbs,
            );
        }
    }
    Ok(())
}

/// The routed-expert products of 26B-A4B decode (128 experts, 8 picked a token, hidden 2816,
/// expert width 704): the grouped matvec over packed 4/8-bit experts against the same kernel
/// over bf16 experts, with GB/s counted over the picked experts' bytes (packed codes, scales and
/// biases) against the copy bandwidth. Each call picks 8 experts not picked in the previous 15
/// calls, so the 128 experts' weights cycle through L2 (50 MB) instead of staying in it.
fn bench_grouped_experts(dev: &Device, copy_gbs: f64) -> Result<()> {
    use candle_gemma::kernels::cuda::moe::{grouped_matvec, grouped_qmatvec};
    let (experts, top_k, hidden, width) = (128usize, 8usize, 2816usize, 704usize);
    let picks: Vec<Tensor> = (0..experts / top_k)
        .map(|set| {
            let ids: Vec<u32> = (0..top_k)
                .map(|j| (j * (experts / top_k) + set) as u32)
                .collect();
            Ok(Tensor::from_vec(ids, (1, top_k), dev)?)
        })
        .collect::<Result<_>>()?;
    // (name, rows an expert, input width, inputs: one row a token or one a pick)
    let shapes = [
        ("26b_experts_gate_up", 2 * width, hidden, true),
        ("26b_experts_down", hidden, width, false),
    ];
    for (name, out, inp, per_token) in shapes {
        let x_rows = if per_token { 1 } else { top_k };
        let x = Tensor::randn(0f32, 1.0, (x_rows, inp), dev)?.to_dtype(DType::BF16)?;
        let dense = Tensor::randn(0f32, 0.02, (experts, out, inp), dev)?.to_dtype(DType::BF16)?;
        let mut i = 0;
        let t_bf16 = time(dev, 40, || {
            i += 1;
            grouped_matvec(&dense, &picks[i % picks.len()], &x, per_token)?;
            Ok(())
        })?;
        drop(dense);
        for (bits, group) in [(4usize, 32usize), (4, 64), (8, 32), (8, 64)] {
            let p = packed(1, experts * out, inp, bits, group, dev)?;
            let w = PackedAffine::new(
                p.codes.squeeze(0)?.squeeze(0)?,
                p.scales.squeeze(0)?.squeeze(0)?,
                p.biases.squeeze(0)?.squeeze(0)?,
                experts * out,
                inp,
            )?;
            let bytes = w.packed_bytes() / experts * top_k;
            let mut i = 0;
            let t = time(dev, 40, || {
                i += 1;
                grouped_qmatvec(&w, experts, &picks[i % picks.len()], &x, per_token)?;
                Ok(())
            })?;
            let gbs = bytes as f64 / t / 1e9;
            println!(
                "{{\"bench\":\"grouped_experts\",\"shape\":\"{name}\",\"experts\":{experts},\"picked\":{top_k},\"out\":{out},\"in\":{inp},\"bits\":{bits},\"group\":{group},\"seconds\":{t:.6e},\"bf16_seconds\":{t_bf16:.6e},\"speedup\":{:.3},\"picked_packed_bytes\":{bytes},\"gb_per_s\":{gbs:.1},\"bf16_gb_per_s\":{:.1},\"copy_gb_per_s\":{copy_gbs:.1},\"fraction_of_copy\":{:.3}}}",
                t_bf16 / t,
                (top_k * out * inp * 2) as f64 / t_bf16 / 1e9,
                gbs / copy_gbs
            );
        }
    }
    Ok(())
}

/// The fixed cost of one small kernel, on the host (time to enqueue) and on the GPU (time per
/// launch of a long run of them, the host far ahead): what a decode step of a small model pays
/// per launch whatever the kernel does.
fn bench_launch_floor(dev: &Device) -> Result<()> {
    use candle_gemma::kernels::cuda::layer_ops::{add_norm, gelu_mul};
    let x = Tensor::rand(-1f32, 1.0, (1, 1, 2560), dev)?.to_dtype(DType::BF16)?;
    let y = Tensor::rand(-1f32, 1.0, (1, 1, 2560), dev)?.to_dtype(DType::BF16)?;
    let w = Tensor::rand(0.5f32, 1.5, 2560, dev)?.to_dtype(DType::BF16)?;
    let n = 4000;
    // As the model runs: without cudarc's per-buffer events (single stream).
    if let Device::Cuda(c) = dev {
        candle_gemma::kernels::cuda::pool::skip_event_tracking(c);
    }
    for (what, us) in candle_gemma::kernels::cuda::diagnostics::probe_host_costs(&x, n)? {
        println!("{{\"bench\":\"host_cost\",\"what\":\"{what}\",\"host_us\":{us:.3}}}");
    }
    let run = |name: &str, f: &dyn Fn() -> Result<Tensor>| -> Result<()> {
        for _ in 0..50 {
            f()?;
        }
        dev.synchronize()?;
        let t = Instant::now();
        for _ in 0..n {
            f()?;
        }
        let host = t.elapsed().as_secs_f64() / n as f64;
        dev.synchronize()?;
        let total = t.elapsed().as_secs_f64() / n as f64;
        println!(
            "{{\"bench\":\"launch_floor\",\"kernel\":\"{name}\",\"elements\":2560,\"host_us\":{:.3},\"per_launch_us\":{:.3}}}",
            host * 1e6,
            total * 1e6
        );
        Ok(())
    };
    run("candle_affine", &|| Ok(x.affine(1.5, 0.25)?))?;
    run("candle_add", &|| Ok((&x + &y)?))?;
    run("gelu_mul", &|| Ok(gelu_mul(&x, &y)?))?;
    run(
        "add_norm",
        &|| Ok(add_norm(&x, &y, &w, 1e-6, None, None)?.0),
    )?;
    run("add_norm_next", &|| {
        Ok(add_norm(&x, &y, &w, 1e-6, None, Some(&w))?.0)
    })?;
    Ok(())
}
