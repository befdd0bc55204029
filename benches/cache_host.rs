//! Host time of one decode-step cache update (one token appended, the view built) and of
//! encoding the view's key positions for the GPU attention kernels, at long contexts, on the
//! CPU: what every attention layer pays per step before any kernel runs. Prints one JSON line
//! per (cache kind, keys).
//!
//! ```text
//! cargo bench --bench cache_host
//! ```

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::plan::PositionCode;
use candle_gemma::kv::{KvCache, KvView, LayerCacheSpec, RotatingCache, SimpleCache};
use std::time::Instant;

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let (kv_heads, head_dim) = (2, 256);
    for keys in [1024usize, 32768, 131072] {
        for kind in ["simple", "rotating"] {
            // The rotating cache's window is half the context, so its ring has wrapped.
            let window = (kind == "rotating").then_some(keys / 2);
            let spec = LayerCacheSpec {
                kv_heads,
                head_dim,
                window,
            };
            let mut cache: Box<dyn KvCache> = match window {
                None => Box::new(SimpleCache::new(&spec, DType::BF16)),
                Some(_) => Box::new(RotatingCache::new(&spec, DType::BF16)?),
            };
            let prompt = Tensor::zeros((1, kv_heads, keys, head_dim), DType::BF16, &dev)?;
            cache.update(&prompt, &prompt)?;
            let token = Tensor::zeros((1, kv_heads, 1, head_dim), DType::BF16, &dev)?;
            // Past the first growth of the simple cache's storage.
            for _ in 0..8 {
                cache.update(&token, &token)?;
            }
            let steps = 200;
            let t = Instant::now();
            let mut last = None;
            for _ in 0..steps {
                last = Some(cache.update(&token, &token)?);
            }
            let update_us = t.elapsed().as_secs_f64() / steps as f64 * 1e6;
            let Some(KvView::Single { positions, .. }) = last else {
                anyhow::bail!("a single-sequence cache returned a batch view");
            };
            let t = Instant::now();
            for _ in 0..steps {
                std::hint::black_box(PositionCode::of(std::hint::black_box(&positions)));
            }
            let encode_us = t.elapsed().as_secs_f64() / steps as f64 * 1e6;
            println!(
                "{{\"bench\":\"cache_update\",\"kind\":\"{kind}\",\"keys\":{keys},\"runs\":{},\"update_us\":{update_us:.3},\"encode_us\":{encode_us:.3}}}",
                positions.runs().len()
            );
        }
    }
    Ok(())
}
