//! Quantized KV caches on real (tiny) Gemma 4 checkpoints: 8-bit stays close to the dense
//! reference, 4-bit stays usable, every layer kind quantizes (sliding layers as a quantized
//! ring, which mlx-lm cannot do), KV-shared layers read packed K/V, and the `start` threshold
//! keeps short prompts exact.

mod common;

use candle_gemma::kv::{CacheError, CacheMode, KvCache, ModelCache, QuantBits, QuantSpec};
use candle_gemma::{CacheConfig, Model};
use common::*;

/// Greedy decoding through `Model::forward`: prefill in chunks, then `n` single tokens.
/// Returns the generated ids and the logits that chose each of them.
fn run(model: &Model, cache: &mut ModelCache, prompt: &[u32], n: usize, chunk: Option<usize>) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = Vec::new();
    for piece in prompt.chunks(chunk.unwrap_or(prompt.len()).max(1)) {
        logits = step(model, cache, piece);
    }
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let next = argmax(&logits);
        ids.push(next);
        all.push(std::mem::take(&mut logits));
        logits = step(model, cache, &[next]);
    }
    (ids, all)
}

fn step(model: &Model, cache: &mut ModelCache, tokens: &[u32]) -> Vec<f32> {
    model.forward(&[tokens.to_vec()], cache).expect("forward").squeeze(0).expect("squeeze").to_vec1().expect("logits")
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

fn quant(bits: QuantBits, group_size: usize, start: usize) -> CacheConfig {
    CacheConfig { mode: CacheMode::Quantized(QuantSpec { bits, group_size, start }) }
}

fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn measure() {
    for name in FIXTURES {
        let model = load(name);
        for (bits, gs) in [(QuantBits::Eight, 32), (QuantBits::Four, 32)] {
            let mut worst = 0f64;
            let mut agree = Vec::new();
            for case in golden(name) {
                let mut cache = model.new_cache(&quant(bits, gs, 0)).unwrap();
                let (ids, logits) = run(&model, &mut cache, &case.prompt, case.greedy.len(), None);
                worst = worst.max(max_abs(&log_softmax(&logits[0]), &case.first_logprobs));
                let n = ids.iter().zip(&case.greedy).take_while(|(a, b)| a == b).count();
                agree.push(n);
            }
            eprintln!("{name} {bits:?}: first-step |dlogprob| {worst:.3e}, agreeing prefix {agree:?}");
        }
    }
}
