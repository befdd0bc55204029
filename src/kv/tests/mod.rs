//! Cache tests: every cache kind against the simplest correct version (attention over the full
//! history with the window mask). This module holds the shared fixtures; the tests are grouped
//! by capability: `caches` (each kind alone: chunked prefill, long generation, trims, errors,
//! and a proptest driving random operation sequences), `batch`, `prompt` (save/restore) and
//! `slots` (reserved slots written in place, marks).

mod batch;
mod caches;
mod prompt;
mod slots;

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::kernels::testutil::{flat, max_abs_diff};
use crate::kernels::{attend, dequantize, quantize};

const KVH: usize = 2;
const NH: usize = 4;
const HD: usize = 32;

fn rand(seed: u64, shape: (usize, usize, usize, usize)) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The full history of one sequence: what a perfect cache would hold.
struct History {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

impl History {
    fn new() -> Self {
        Self { k: None, v: None }
    }
    fn len(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dim(2).unwrap())
    }
    fn push(&mut self, k: &Tensor, v: &Tensor) {
        let cat = |a: &Option<Tensor>, b: &Tensor| match a {
            Some(a) => Tensor::cat(&[a, b], 2).unwrap(),
            None => b.clone(),
        };
        self.k = Some(cat(&self.k, k));
        self.v = Some(cat(&self.v, v));
    }
    fn trim(&mut self, n: usize) {
        let keep = self.len() - n;
        if keep == 0 {
            *self = Self::new();
        } else {
            self.k = Some(self.k.as_ref().unwrap().narrow(2, 0, keep).unwrap());
            self.v = Some(self.v.as_ref().unwrap().narrow(2, 0, keep).unwrap());
        }
    }
    /// Attention of `q` (queries at `q_off..`) over the whole history with the window mask;
    /// `quant`: the history as a quantized cache would hold it.
    fn attend(
        &self,
        q: &Tensor,
        q_off: usize,
        window: Option<usize>,
        quant: Option<QuantSpec>,
    ) -> Tensor {
        let (mut k, mut v) = (self.k.clone().unwrap(), self.v.clone().unwrap());
        if let Some(qs) = quant {
            k = dequantize(&quantize(&k, qs.bits, qs.group_size).unwrap()).unwrap();
            v = dequantize(&quantize(&v, qs.bits, qs.group_size).unwrap()).unwrap();
        }
        let view = KvView::Single {
            data: KvData::Dense { k, v },
            positions: (0..self.len()).collect(),
        };
        attend(q, &view, &[q_off], window, 1.0).unwrap()
    }
}

fn spec(window: Option<usize>) -> LayerCacheSpec {
    LayerCacheSpec {
        kv_heads: KVH,
        head_dim: HD,
        window,
    }
}

/// One step on a cache and the reference; returns the max |difference| of the outputs.
fn step(
    cache: &mut LayerCache,
    hist: &mut History,
    window: Option<usize>,
    n: usize,
    seed: u64,
) -> f32 {
    let q_off = cache.offsets()[0];
    assert_eq!(q_off, hist.len());
    let k = rand(seed, (1, KVH, n, HD));
    let v = rand(seed + 1, (1, KVH, n, HD));
    let q = rand(seed + 2, (1, NH, n, HD));
    let view = cache.update(&k, &v).unwrap();
    hist.push(&k, &v);
    let quant = match (&view, cache.kind()) {
        (
            KvView::Single {
                data: KvData::Packed { .. },
                ..
            },
            CacheKind::Quantized {
                bits,
                group_size,
                start,
                ..
            },
        ) => Some(QuantSpec {
            bits: QuantBits::from_bits(bits).unwrap(),
            group_size,
            start,
        }),
        _ => None,
    };
    let got = attend(&q, &view, &[q_off], window, 1.0).unwrap();
    let want = hist.attend(&q, q_off, window, quant);
    max_abs_diff(&got, &want)
}

fn all_kinds(window: usize) -> Vec<(LayerCache, Option<usize>)> {
    let w = Some(window);
    let q = |bits, start| QuantSpec {
        bits,
        group_size: 32,
        start,
    };
    vec![
        (
            LayerCache::Simple(SimpleCache::new(&spec(None), DType::F32)),
            None,
        ),
        (
            LayerCache::Simple(SimpleCache::new(&spec(None), DType::F32)),
            w,
        ),
        (
            LayerCache::Rotating(RotatingCache::new(&spec(w), DType::F32).unwrap()),
            w,
        ),
        (
            LayerCache::Rotating(RotatingCache::with_slack(&spec(w), 3, DType::F32).unwrap()),
            w,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(None), &q(QuantBits::Eight, 0), DType::F32).unwrap(),
            ),
            None,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(None), &q(QuantBits::Four, 5), DType::F32).unwrap(),
            ),
            None,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(w), &q(QuantBits::Four, 0), DType::F32).unwrap(),
            ),
            w,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(w), &q(QuantBits::Eight, 7), DType::F32).unwrap(),
            ),
            w,
        ),
    ]
}

const TOL: f32 = 1e-4;

fn quant_cfg(bits: QuantBits, start: usize) -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 32,
            start,
        }),
    }
}

fn prompt_roundtrip(cache: ModelCache, tokens: Vec<u32>, name: &str) -> PromptCache {
    let meta = CacheMeta::of(&cache, DType::F32, "test-model");
    let pc = PromptCache::new(tokens, cache, meta);
    let dir = std::env::temp_dir().join(format!(
        "kv-prompt-{}-{name}.safetensors",
        std::process::id()
    ));
    pc.save(&dir).unwrap();
    let back = PromptCache::load(&dir, &Device::Cpu).unwrap();
    let _ = std::fs::remove_file(&dir);
    assert_eq!(back.tokens, pc.tokens);
    assert_eq!(back.meta, pc.meta);
    back
}
