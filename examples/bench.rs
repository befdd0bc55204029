//! Whole-model speed at real Gemma 4 shapes with random weights (no checkpoint can be
//! downloaded here): prefill tok/s, decode tok/s at several batch sizes and contexts, bytes
//! read per decode step and the fraction of the bandwidth limit, measured against a
//! device-to-device copy in the same process. Prints one JSON object per line.
//!
//! ```text
//! cargo run --release --features cuda --example bench -- --config fixtures/real-configs/e4b-config.json
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::config::{Config, KvSource};
use candle_gemma::kv::{CacheMode, ModelCache, QuantBits, QuantSpec};
use candle_gemma::{CacheConfig, Model};
use clap::Parser;
use serde_json::json;

#[derive(Debug, Parser)]
struct Args {
    /// config.json of the shape to build (repeatable).
    #[arg(long, required = true)]
    config: Vec<PathBuf>,
    /// Prompt lengths for prefill.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    prefill: Vec<usize>,
    /// Batch sizes for decode.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batch: Vec<usize>,
    /// Contexts for decode.
    #[arg(long, value_delimiter = ',', default_value = "128,4096")]
    context: Vec<usize>,
    /// Decode steps timed per point.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// KV cache: dense, q8, q4 (repeatable).
    #[arg(long, value_delimiter = ',', default_value = "dense")]
    kv: Vec<String>,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
}

/// Copy bandwidth in bytes/s (bytes read + written) into a preallocated 1 GiB buffer, so no
/// allocation is timed.
fn copy_bandwidth(dev: &Device) -> Result<f64> {
    let n = 256 * 1024 * 1024; // f32 elements = 1 GiB
    let a = Tensor::zeros(n, DType::F32, dev)?;
    let b = Tensor::zeros(n, DType::F32, dev)?;
    b.slice_set(&a, 0, 0)?;
    dev.synchronize()?;
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        b.slice_set(&a, 0, 0)?;
    }
    dev.synchronize()?;
    Ok((2 * 4 * n * reps) as f64 / t.elapsed().as_secs_f64())
}

/// Weight bytes one decode step of one token reads (the tied head reads the whole table; MoE
/// reads top_k experts; embedding lookups read one row, ignored).
fn weight_bytes_per_token(cfg: &Config, dtype_bytes: usize) -> usize {
    let h = cfg.hidden_size;
    let nh = cfg.num_attention_heads;
    let mut params = cfg.vocab_size * h;
    let p = cfg.hidden_size_per_layer_input;
    params += cfg.num_layers() * p * h;
    for l in &cfg.layers {
        params += 2 * nh * l.head_dim * h;
        if l.kv == KvSource::Own {
            params += l.kv_heads * l.head_dim * h * if l.has_v_proj { 2 } else { 1 };
        }
        params += 3 * l.intermediate_size * h + 2 * p * h;
        if let Some(m) = &cfg.moe {
            params += m.num_experts * h + m.top_k * 3 * m.intermediate_size * h;
        }
    }
    params * dtype_bytes
}

fn cache_config(kv: &str) -> Result<CacheConfig> {
    let mode = match kv {
        "dense" => CacheMode::Rotating,
        "q8" => CacheMode::Quantized(QuantSpec {
            bits: QuantBits::Eight,
            group_size: 64,
            start: 0,
        }),
        "q4" => CacheMode::Quantized(QuantSpec {
            bits: QuantBits::Four,
            group_size: 64,
            start: 0,
        }),
        other => anyhow::bail!("unknown --kv {other}"),
    };
    Ok(CacheConfig { mode })
}

fn prefill(model: &Model, cc: &CacheConfig, len: usize, seed: u32) -> Result<(ModelCache, f64)> {
    let mut cache = model.new_cache(cc)?;
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..len as u32).map(|i| (i * 7919 + seed) % vocab).collect();
    let t = Instant::now();
    let logits = model.forward(&[prompt], &mut cache)?;
    let _ = logits.to_vec2::<f32>()?;
    Ok((cache, t.elapsed().as_secs_f64()))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = candle_gemma::best_device(args.cpu)?;
    let bw = copy_bandwidth(&dev)?;
    println!(
        "{}",
        json!({"device": format!("{dev:?}"), "copy_bandwidth_gb_s": bw / 1e9})
    );
    for path in &args.config {
        let text = std::fs::read_to_string(path)?;
        let cfg = Config::from_json(&serde_json::from_str(&text)?, None)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let t = Instant::now();
        let model = Model::random(cfg.clone(), &dev, DType::BF16, 1)?;
        dev.synchronize()?;
        let wbytes = weight_bytes_per_token(&cfg, 2);
        eprintln!(
            "{name}: built in {:.1}s, {:.2} GB read per token",
            t.elapsed().as_secs_f64(),
            wbytes as f64 / 1e9
        );
        for kv in &args.kv {
            let cc = cache_config(kv)?;
            for &len in &args.prefill {
                let (_, _) = prefill(&model, &cc, 16, 0)?; // warm-up
                let (_, secs) = prefill(&model, &cc, len, 1)?;
                println!(
                    "{}",
                    json!({"model": name, "kv": kv, "op": "prefill", "tokens": len, "tok_s": len as f64 / secs})
                );
            }
            for &ctx in &args.context {
                for &b in &args.batch {
                    let seqs = (0..b)
                        .map(|i| prefill(&model, &cc, ctx, i as u32).map(|c| c.0))
                        .collect::<Result<Vec<_>>>()?;
                    let mut cache = ModelCache::batch(seqs)?;
                    let kv_bytes = cache.memory_bytes();
                    let tokens: Vec<Vec<u32>> = (0..b).map(|i| vec![100 + i as u32]).collect();
                    let _ = model.forward(&tokens, &mut cache)?.to_vec2::<f32>()?; // warm-up
                    let t = Instant::now();
                    for _ in 0..args.steps {
                        let _ = model.forward(&tokens, &mut cache)?.to_vec2::<f32>()?;
                    }
                    let secs = t.elapsed().as_secs_f64() / args.steps as f64;
                    let bytes = wbytes + kv_bytes;
                    println!(
                        "{}",
                        json!({
                            "model": name, "kv": kv, "op": "decode", "batch": b, "context": ctx,
                            "tok_s": b as f64 / secs, "step_ms": secs * 1e3,
                            "bytes_per_step": bytes, "bandwidth_fraction": (bytes as f64 / secs) / bw,
                        })
                    );
                }
            }
        }
    }
    Ok(())
}
