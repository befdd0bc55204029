//! Criterion: attention of one decode query over 4-bit and 8-bit packed K/V against dense f32
//! K/V on the CPU (the reference kernels), at a few key counts, on E4B's sliding-layer head
//! shape (8 query heads, 2 KV heads, head dim 256; group size 64).
//!
//! ```text
//! cargo bench --bench attention
//! ```
//!
//! Names follow `op/device/dtype/shape`: `attention/cpu/f32-kv-q4/8x2x256-2048keys`.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::{attend, quantize};
use candle_gemma::kv::{KeyPositions, KvData, KvView, QuantBits};
use criterion::{criterion_group, criterion_main, Criterion};

const N_HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 256;
const GROUP: usize = 64;

fn random(shape: (usize, usize, usize, usize)) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .expect("random tensor")
}

fn attention(c: &mut Criterion) {
    let mut group = c.benchmark_group("attention");
    for keys in [512usize, 2048, 8192] {
        let q = random((1, N_HEADS, 1, HEAD_DIM));
        let k = random((1, KV_HEADS, keys, HEAD_DIM));
        let v = random((1, KV_HEADS, keys, HEAD_DIM));
        let packed = |bits| {
            let (k, v) = (quantize(&k, bits, GROUP), quantize(&v, bits, GROUP));
            KvData::Packed {
                k: k.expect("quantize K"),
                v: v.expect("quantize V"),
            }
        };
        let kinds = [
            (
                "f32",
                KvData::Dense {
                    k: k.clone(),
                    v: v.clone(),
                },
            ),
            ("f32-kv-q8", packed(QuantBits::Eight)),
            ("f32-kv-q4", packed(QuantBits::Four)),
        ];
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        for (label, data) in kinds {
            let view = KvView::Single {
                data,
                positions: KeyPositions::range(0..keys),
            };
            let name = format!("cpu/{label}/{N_HEADS}x{KV_HEADS}x{HEAD_DIM}-{keys}keys");
            group.bench_function(name, |b| {
                b.iter(|| attend(&q, &view, &[keys - 1], None, scale).expect("attention"))
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = attention
}
criterion_main!(benches);
