//! The CPU reference of the quantized weight matmul against dequantize-then-matmul, and the
//! quantized embedding against rows of the dequantized table (no GPU needed).

use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::qmatmul::{qembedding, qmatmul};
use candle_gemma::kernels::quantize;
use candle_gemma::kernels::PackedAffine;
use candle_gemma::kv::QuantBits;
use common::close::max_abs_diff;

mod common;

fn packed(out: usize, inp: usize, bits: usize, group: usize, dtype: DType) -> PackedAffine {
    let w = Tensor::randn(0f32, 0.05, (out, inp), &Device::Cpu)
        .and_then(|w| w.to_dtype(dtype))
        .unwrap();
    let p = quantize(&w, QuantBits::from_bits(bits).unwrap(), group).unwrap();
    PackedAffine::new(p.codes, p.scales, p.biases, out, inp).unwrap()
}

#[test]
fn qmatmul_matches_dequantize_then_matmul() {
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            for sdtype in [DType::F32, DType::BF16, DType::F16] {
                let w = packed(48, 256, bits, group, sdtype);
                assert_eq!((w.bits.bits(), w.group_size), (bits, group));
                let x = Tensor::randn(0f32, 1.0, (2, 3, 256), &Device::Cpu).unwrap();
                let got = qmatmul(&x, &w).unwrap();
                assert_eq!(got.dims(), &[2, 3, 48]);
                let dense = w.dequantize(DType::F32).unwrap();
                let want = x.broadcast_matmul(&dense.t().unwrap()).unwrap();
                let err = max_abs_diff(&got, &want);
                assert!(err < 1e-4, "bits {bits} group {group} {sdtype:?}: {err}");
            }
        }
    }
}

#[test]
fn qmatmul_keeps_the_activation_dtype() {
    let w = packed(16, 64, 4, 32, DType::BF16);
    let x = Tensor::randn(0f32, 1.0, (1, 64), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let y = qmatmul(&x, &w).unwrap();
    assert_eq!((y.dtype(), y.dims()), (DType::BF16, &[1usize, 16][..]));
}

#[test]
fn qembedding_matches_dequantized_rows() {
    let w = packed(10, 128, 8, 64, DType::F16);
    let ids = Tensor::new(&[[7u32, 0], [9, 7]], &Device::Cpu).unwrap();
    let got = qembedding(&ids, &w, DType::F32).unwrap();
    assert_eq!(got.dims(), &[2, 2, 128]);
    let dense = w.dequantize(DType::F32).unwrap();
    let want = dense
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((2, 2, 128))
        .unwrap();
    assert_eq!(max_abs_diff(&got, &want), 0.0);
}

#[test]
fn bad_shapes_and_ids_are_errors() {
    let w = packed(10, 128, 4, 64, DType::F32);
    let x = Tensor::zeros((1, 64), DType::F32, &Device::Cpu).unwrap();
    assert!(qmatmul(&x, &w).is_err());
    let ids = Tensor::new(&[10u32], &Device::Cpu).unwrap();
    assert!(qembedding(&ids, &w, DType::F32).is_err());
    let codes = Tensor::zeros((10, 12), DType::U32, &Device::Cpu).unwrap();
    let scales = Tensor::zeros((10, 2), DType::F32, &Device::Cpu).unwrap();
    assert!(PackedAffine::new(codes, scales.clone(), scales, 10, 128).is_err());
}
