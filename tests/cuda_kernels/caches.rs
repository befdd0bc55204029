//! K/V quantization and cache updates on the GPU against the CPU, exactly: the quantizer's
//! codes, scales and biases; quantized caches (growing and ring, single and batched) that
//! quantize straight into their slots; dense batch caches written with one launch.

use anyhow::Result;
use candle_core::{DType, Device};
use candle_gemma::kernels::quantize;
use candle_gemma::kv::{
    BatchCache, KvCache, LayerCache, LayerCacheSpec, QuantBits, QuantSpec, QuantizedCache,
    RotatingCache, SimpleCache,
};

use crate::common::close::Checks;
use crate::support::{gpu, packed_identical, rnd, views_identical};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[test]
fn quantize_is_bit_exact() -> Result<()> {
    let Some(gpu) = gpu("quantize") else {
        return Ok(());
    };
    let mut checks = Checks::new("quantize");
    for dtype in DTYPES {
        for bits in [QuantBits::Four, QuantBits::Eight] {
            for group in [32, 64, 128] {
                let x = (rnd(&[2, 3, 5, 256], dtype)? * 3.0)?;
                let want = quantize(&x, bits, group)?;
                let got = quantize(&x.to_device(&gpu.dev)?, bits, group)?;
                checks.exact(
                    format!(
                        "quantize dtype={dtype:?} bits={} group={group}",
                        bits.bits()
                    ),
                    packed_identical(&want, &got)?,
                );
            }
        }
    }
    checks.finish();
    Ok(())
}

/// Feeds `steps` updates of random K/V (`[batch, 2, n, 256]`, keys scaled by `k_scale`) to a
/// CPU cache and a GPU cache and checks that their views are identical after every update.
#[allow(clippy::too_many_arguments)] // one call per table row, named argument by argument
fn same_updates(
    checks: &mut Checks,
    case: &str,
    (cpu, gpu): (&mut dyn KvCache, &mut dyn KvCache),
    dev: &Device,
    batch: usize,
    steps: &[usize],
    dtype: DType,
    k_scale: f64,
) -> Result<()> {
    let mut differs = Vec::new();
    for (step, &n) in steps.iter().enumerate() {
        let k = (rnd(&[batch, 2, n, 256], dtype)? * k_scale)?;
        let v = rnd(&[batch, 2, n, 256], dtype)?;
        let want = cpu.update(&k, &v)?;
        let got = gpu.update(&k.to_device(dev)?, &v.to_device(dev)?)?;
        if !views_identical(&want, &got)? {
            differs.push(format!("step {step} ({n} tokens)"));
        }
    }
    let case = if differs.is_empty() {
        case.to_string()
    } else {
        format!("{case} differs at {}", differs.join(", "))
    };
    checks.exact(case, differs.is_empty());
    Ok(())
}

/// A quantized cache fed the same K/V on the CPU and on the GPU (where packed updates quantize
/// straight into the storage's slots) holds bit-identical codes, scales and biases at the same
/// positions after every update: growing and ring caches, one-token steps and multi-token
/// writes (a ring write that wraps takes the quantize-and-copy path). Then a batch of three
/// sequences at different offsets: on the GPU one launch quantizes every sequence's tokens
/// into its own slots.
#[test]
fn quantized_cache_updates_are_bit_exact() -> Result<()> {
    let Some(gpu) = gpu("quantized cache") else {
        return Ok(());
    };
    let dev = &gpu.dev;
    let mut checks = Checks::new("quantized cache");
    for dtype in DTYPES {
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
                let steps = [5, 1, 1, 3, 1, 7, 1, 1, 1, 9, 1, 1, 2, 1, 1, 1, 1, 1, 4, 1];
                let name = format!("dtype={dtype:?} bits={} window={window:?}", bits.bits());
                let caches = (&mut cpu_cache as &mut dyn KvCache, &mut gpu_cache as _);
                let case = format!("quantized-cache {name}");
                same_updates(&mut checks, &case, caches, dev, 1, &steps, dtype, 2.0)?;

                // The same prefixes on both devices.
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
                let (mut cpu_batch, mut gpu_batch) = (fill(&Device::Cpu)?, fill(dev)?);
                let steps = [1, 1, 2, 1, 3, 1, 1, 5, 1, 1];
                let caches = (&mut cpu_batch as &mut dyn KvCache, &mut gpu_batch as _);
                let case = format!("quantized-batch-cache {name} sequences=3");
                same_updates(&mut checks, &case, caches, dev, 3, &steps, dtype, 2.0)?;
            }
        }
    }
    checks.finish();
    Ok(())
}

/// A batch of three dense caches (simple, or rotating with a window of 16) at different offsets
/// on the CPU and on the GPU, fed the same K/V: the GPU writes every sequence's rows with one
/// launch; each sequence's K/V and positions must match the CPU's exactly after every update.
#[test]
fn dense_batch_cache_updates_are_exact() -> Result<()> {
    let Some(gpu) = gpu("dense batch cache") else {
        return Ok(());
    };
    let dev = &gpu.dev;
    let mut checks = Checks::new("dense batch cache");
    for dtype in DTYPES {
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
            let (mut cpu_batch, mut gpu_batch) = (fill(&Device::Cpu)?, fill(dev)?);
            let steps = [1, 1, 2, 1, 3, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1];
            let caches = (&mut cpu_batch as &mut dyn KvCache, &mut gpu_batch as _);
            let case = format!("dense-batch-cache dtype={dtype:?} window={window:?} sequences=3");
            same_updates(&mut checks, &case, caches, dev, 3, &steps, dtype, 1.0)?;
        }
    }
    checks.finish();
    Ok(())
}
