//! candle-transformers' `gemma4` text model as a speed peer: random bf16 weights (created on
//! demand by a `VarMap`) at a real config's shapes, on CUDA; prints the same JSON lines as
//! `benches/model_speed.rs` (prefill tok/s, decode tok/s at batch 1 and 8 after a 128-token context).
//! It has no PLE, KV sharing or MoE, so it runs a different (larger) amount of work on E2B/E4B
//! and cannot run 26B-A4B; the numbers are a speed reference only.
//!
//!     peer-candle-transformers fixtures/real-configs/e4b-config.json [...]

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::gemma4::config::Gemma4TextConfig;
use candle_transformers::models::gemma4::text::TextModel;
use serde_json::json;

fn ids(b: usize, n: usize, seed: u32, vocab: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<u32> = (0..b * n)
        .map(|i| (i as u32).wrapping_mul(7919).wrapping_add(seed) % vocab as u32)
        .collect();
    Ok(Tensor::from_vec(v, (b, n), dev)?)
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    for path in std::env::args().skip(1) {
        let raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        let text = raw.get("text_config").cloned().unwrap_or(raw);
        let cfg: Gemma4TextConfig = serde_json::from_value(text)?;
        let name = std::path::Path::new(&path)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::BF16, &dev);
        let mut model = match TextModel::new(&cfg, vb) {
            Ok(m) => m,
            Err(e) => {
                println!("{}", json!({"engine": "candle-transformers", "model": name, "error": e.to_string()}));
                continue;
            }
        };
        dev.synchronize()?;
        let vocab = cfg.vocab_size;
        for n in [512usize, 4096] {
            let mut point = || -> Result<f64> {
                model.clear_kv_cache();
                let _ = model.forward(&ids(1, 16, 0, vocab, &dev)?, 0)?;
                model.clear_kv_cache();
                dev.synchronize()?;
                let t = Instant::now();
                let _ = model
                    .forward(&ids(1, n, 1, vocab, &dev)?, 0)?
                    .squeeze(1)?
                    .argmax(1)?
                    .to_vec1::<u32>()?;
                Ok(n as f64 / t.elapsed().as_secs_f64())
            };
            match point() {
                Ok(tok_s) => println!("{}", json!({"engine": "candle-transformers", "model": name, "op": "prefill", "tokens": n, "tok_s": tok_s})),
                Err(e) => println!("{}", json!({"engine": "candle-transformers", "model": name, "op": "prefill", "tokens": n, "error": e.to_string()})),
            }
        }
        for b in [1usize, 8] {
            let context = 128;
            let steps = 16;
            let mut point = || -> Result<f64> {
                model.clear_kv_cache();
                let _ = model.forward(&ids(b, context, 2, vocab, &dev)?, 0)?;
                let step = ids(b, 1, 3, vocab, &dev)?;
                let _ = model.forward(&step, context)?.squeeze(1)?.argmax(1)?.to_vec1::<u32>()?;
                let t = Instant::now();
                for i in 0..steps {
                    let _ = model
                        .forward(&step, context + 1 + i)?
                        .squeeze(1)?
                        .argmax(1)?
                        .to_vec1::<u32>()?;
                }
                Ok(t.elapsed().as_secs_f64() / steps as f64)
            };
            match point() {
                Ok(secs) => println!("{}", json!({"engine": "candle-transformers", "model": name, "op": "decode", "batch": b, "context": context, "tok_s": b as f64 / secs, "step_ms": secs * 1e3})),
                Err(e) => println!("{}", json!({"engine": "candle-transformers", "model": name, "op": "decode", "batch": b, "error": e.to_string()})),
            }
        }
        model.clear_kv_cache();
        drop(model);
        drop(map);
    }
    Ok(())
}
