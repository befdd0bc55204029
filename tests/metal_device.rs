//! On a Mac (`cargo test --release --features metal --test metal_device`): every fixture's
//! goldens on the Metal device in f32, with each cache kind, and the device kernels that have
//! no emulation twin in `metal_emulation.rs` (quantize, row gather, candle's `Q4_1` products,
//! the MoE routing and routed products) against the CPU. Without the `metal` feature, or without a Metal device, the tests say so
//! and pass; `scripts/mac-check.sh` runs them and reports which ran.
#![cfg(feature = "metal")]

mod common;

use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::cpu::moe_route_row;
use candle_gemma::kernels::metal::launch::{moe_product, moe_route, MoeExperts};
use candle_gemma::kernels::metal::q4_1::Q41Weight;
use candle_gemma::kernels::qmatmul::{qembedding, qmatmul};
use candle_gemma::kernels::quantize;
use candle_gemma::kv::{CacheMode, PackedAffine, QuantBits, QuantSpec};
use candle_gemma::{CacheConfig, Model};
use common::close::max_abs_diff;
use common::*;

fn metal() -> Option<Device> {
    match Device::new_metal(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no Metal device ({e}): skipped");
            None
        }
    }
}

/// A quantized cache of `bits`, group 64, packed from the first token.
fn quantized(bits: QuantBits) -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 64,
            start: 0,
        }),
    }
}

#[test]
fn fixture_goldens_hold_on_the_metal_device_in_f32() {
    let Some(dev) = metal() else { return };
    // golden.rs's bound: every product on the device computes in f32 (candle's Q4_1
    // matrix-vector kernel, the crate's kernels, candle's f32 matmul after `dequant`).
    for name in FIXTURES {
        let tol = 2e-3;
        let model = Model::builder()
            .path(fixture(name))
            .device(dev.clone())
            .dtype(DType::F32)
            .build()
            .unwrap_or_else(|e| panic!("fixture {name} loads on Metal: {e}"));
        for (i, case) in golden(name).iter().enumerate() {
            let max_diff = first_step_deviation(&model, case);
            assert!(
                max_diff < tol,
                "{name} case {i} on Metal: first-step log-probs differ by {max_diff}"
            );
            for cache in [
                CacheConfig::default(),
                quantized(QuantBits::Eight),
                quantized(QuantBits::Four),
            ] {
                let got = greedy(&model, &case.prompt, case.greedy.len(), cache, None);
                let n = comparable_steps(&case.margins, 0.05).min(got.len());
                assert_eq!(
                    &got[..n.min(4)],
                    &case.greedy[..n.min(4)],
                    "{name} case {i} on Metal: first greedy ids differ"
                );
            }
            eprintln!("{name} case {i} on Metal f32: max |dlogprob| {max_diff:.2e}");
        }
    }
}

#[test]
fn quantize_gather_and_q4_1_products_match_the_cpu_on_the_device() {
    let Some(dev) = metal() else { return };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = Tensor::randn(0f32, 1.0, (1, 2, 7, 256), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("x");
        for (bits, group) in [(QuantBits::Four, 64), (QuantBits::Eight, 32)] {
            let want = quantize(&x, bits, group).expect("CPU");
            let got = quantize(&x.to_device(&dev).expect("up"), bits, group).expect("Metal");
            let codes = |t: &Tensor| -> Vec<u32> {
                t.flatten_all()
                    .and_then(|t| t.to_device(&Device::Cpu))
                    .and_then(|t| t.to_vec1())
                    .expect("codes")
            };
            assert_eq!(codes(&got.codes), codes(&want.codes), "{dtype:?} {bits:?}");
            let got_s = got.scales.to_device(&Device::Cpu).expect("down");
            assert_eq!(max_abs_diff(&got_s, &want.scales), 0.0, "{dtype:?} scales");
        }
        let table = quantize(
            &Tensor::randn(0f32, 0.05, (64, 512), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("table"),
            QuantBits::Eight,
            64,
        )
        .expect("packed");
        let table = PackedAffine::new(table.codes, table.scales, table.biases, 64, 512).expect("p");
        let ids = Tensor::new(&[3u32, 0, 63, 3], &Device::Cpu).expect("ids");
        let want = qembedding(&ids, &table, dtype).expect("CPU gather");
        let got = qembedding(
            &ids.to_device(&dev).expect("ids up"),
            &table.to_device(&dev).expect("table up"),
            dtype,
        )
        .expect("Metal gather")
        .to_device(&Device::Cpu)
        .expect("down");
        assert!(max_abs_diff(&got, &want) <= 1e-2, "{dtype:?} gather");
    }
    // candle's Q4_1 product on the device against the crate's CPU reference.
    let w = quantize(
        &Tensor::randn(0f32, 0.05, (96, 512), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .expect("w"),
        QuantBits::Four,
        64,
    )
    .expect("packed");
    let w = PackedAffine::new(w.codes, w.scales, w.biases, 96, 512).expect("p");
    let q = Q41Weight::from_packed(&w, &dev)
        .expect("converts")
        .expect("bf16 scales of this size map exactly");
    for rows in [1, 8] {
        let x = Tensor::randn(0f32, 1.0, (rows, 512), &Device::Cpu).expect("x");
        let want = qmatmul(&x, &w).expect("CPU reference");
        let got = q
            .matmul(&x.to_device(&dev).expect("up"))
            .and_then(|t| Ok(t.to_device(&Device::Cpu)?))
            .expect("Metal Q4_1");
        let err = max_abs_diff(&got, &want);
        eprintln!("Q4_1 product on Metal, {rows} rows: max abs error {err:.2e}");
        assert!(err <= 1e-2, "{rows} rows: {err}");
    }
    // A loaded matrix as the model holds it on a Mac: the blocks replace the MLX packing, and
    // products of any row count (candle's kernel up to 8, `dequant_q41` beyond) and gathers
    // read them.
    let held = w.to_device(&dev).expect("up").settled().with_candle_q4_1();
    assert!(held.uses_candle_q4_1() && !held.mlx_resident());
    for rows in [1, 3, 40] {
        let x = Tensor::randn(0f32, 1.0, (rows, 512), &Device::Cpu).expect("x");
        let want = qmatmul(&x, &w).expect("CPU reference");
        let got = qmatmul(&x.to_device(&dev).expect("up"), &held)
            .and_then(|t| Ok(t.to_device(&Device::Cpu)?))
            .expect("Metal product");
        let err = max_abs_diff(&got, &want);
        eprintln!("held as Q4_1 on Metal, {rows} rows: max abs error {err:.2e}");
        assert!(err <= 1e-2, "{rows} rows: {err}");
    }
    let ids = Tensor::new(&[5u32, 0, 95], &Device::Cpu).expect("ids");
    let want = qembedding(&ids, &w, DType::F32).expect("CPU gather");
    let got = qembedding(&ids.to_device(&dev).expect("up"), &held, DType::F32)
        .and_then(|t| Ok(t.to_device(&Device::Cpu)?))
        .expect("Metal gather");
    assert!(max_abs_diff(&got, &want) <= 1e-6, "Q4_1 gather");
}

#[test]
fn moe_routing_and_routed_products_match_the_cpu_on_the_device() {
    let Some(dev) = metal() else { return };
    let (experts, top_k, rows, width, tokens) = (128, 8, 16, 2816, 12);
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).expect("down");
    // Experts 0..6 lifted above the rest: six experts take every token (two 8-pair passes).
    let lift = Tensor::new(
        (0..experts)
            .map(|e| if e < 6 { 10f32 } else { 0.0 })
            .collect::<Vec<_>>(),
        &Device::Cpu,
    )
    .expect("lift");
    let logits = Tensor::randn(0f32, 1.5, (tokens, experts), &Device::Cpu)
        .and_then(|t| t.broadcast_add(&lift))
        .expect("logits");
    let scale: Vec<f32> = (0..experts).map(|e| 0.5 + e as f32 / 64.0).collect();
    let scale_t = Tensor::new(scale.as_slice(), &dev).expect("scale");
    let routing = moe_route(&logits.to_device(&dev).expect("up"), &scale_t, top_k)
        .expect("Metal routing")
        .expect("the routing kernels apply");
    let want: Vec<(usize, f32)> = logits
        .to_vec2::<f32>()
        .expect("logits")
        .iter()
        .flat_map(|row| moe_route_row(row, top_k, &scale))
        .collect();
    let idx: Vec<u32> = cpu(&routing.idx)
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("idx");
    let w: Vec<f32> = cpu(&routing.weights)
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("weights");
    for (p, &(e, wt)) in want.iter().enumerate() {
        assert_eq!(idx[p] as usize, e, "pair {p}: pick");
        assert!(
            (w[p] - wt).abs() <= 1e-6 * wt.abs().max(1.0),
            "pair {p}: weight"
        );
    }
    for dtype in [DType::F32, DType::BF16] {
        let stack = quantize(
            &Tensor::randn(0f32, 0.05, (experts * rows, width), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .expect("stack"),
            QuantBits::Four,
            64,
        )
        .expect("packed");
        let stack = PackedAffine::new(
            stack.codes,
            stack.scales,
            stack.biases,
            experts * rows,
            width,
        )
        .expect("p");
        let x = Tensor::randn(0f32, 1.0, (tokens, width), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .expect("x");
        let held = stack.to_device(&dev).expect("up");
        let got = moe_product(
            &routing,
            &x.to_device(&dev).expect("up"),
            true,
            MoeExperts::Packed {
                weight: &held,
                experts,
            },
        )
        .expect("Metal product")
        .expect("the product kernel applies");
        let want: Vec<Tensor> = want
            .iter()
            .enumerate()
            .map(|(p, &(e, _))| {
                let xr = x.narrow(0, p / top_k, 1).expect("row");
                qmatmul(&xr, &stack.narrow_rows(e * rows, rows).expect("rows")).expect("CPU")
            })
            .collect();
        let want = Tensor::cat(&want, 0).expect("cat");
        let err = max_abs_diff(&cpu(&got), &want);
        eprintln!("MoE routed product on Metal, {dtype:?}: max abs error {err:.2e}");
        assert!(err <= 5e-2, "{dtype:?}: {err}");
    }
}
