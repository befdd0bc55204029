//! MLX 4-bit weights as candle `Q4_1` blocks (`kernels::metal::q4_1`): every 4-bit matrix of
//! the quantized fixtures maps exactly, candle's dequantization of the blocks equals the
//! crate's MLX dequantization bit for bit, and the fixture goldens hold, at golden.rs's
//! tolerance, when the model's products (up to 8 rows) and embedding gathers run through the
//! blocks on the CPU: candle's dequantization of them, and candle's `Q4_1` gather.
//!
//! candle's CPU quantized product itself is not used here: it rounds each block of activations
//! to 8 bits (`Q8_1`), which moves the first-step log-probs by 1.4 to 5.6 (candle's Metal
//! matrix-vector kernel, the one the crate uses on a Mac, takes f32 activations);
//! `tests/q4_1_candle_matmul.rs` measures the fixtures through it and decomposes the
//! deviation.
//!
//! The golden test installs a launch policy for this process (`candle_q4_1_on_cpu`), which is
//! why it lives in its own test binary.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::metal::q4_1::{conversions, q4_1_blocks, Q41Weight};
use candle_gemma::kernels::policy::LaunchPolicy;

use common::packed::packed_matrices;
use common::*;

fn bits_of(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("f32 values")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn fixture_4bit_weights_map_to_q4_1_bit_for_bit() {
    for name in ["e2b-q4", "moe-q4"] {
        let (mut mapped, mut four_bit) = (0, 0);
        for (module, p) in packed_matrices(name) {
            if p.bits.bits() != 4 {
                assert!(q4_1_blocks(&p).expect("reads").is_none(), "{module}: 8-bit");
                continue;
            }
            four_bit += 1;
            let q = Q41Weight::from_packed(&p, &Device::Cpu)
                .expect("converts")
                .unwrap_or_else(|| panic!("{name} {module}: bf16 scales outside f16"));
            let want = p.dequantize(DType::F32).expect("MLX dequantization");
            let got = q.dequantize_host().expect("candle dequantization");
            assert_eq!(got.dims(), want.dims(), "{module}");
            assert!(
                bits_of(&got) == bits_of(&want),
                "{name} {module}: Q4_1 dequantization differs from MLX's"
            );
            mapped += 1;
        }
        eprintln!("{name}: {mapped} of {four_bit} 4-bit matrices map to Q4_1 bit for bit");
        assert!(four_bit > 0, "{name} has 4-bit matrices");
        assert_eq!(mapped, four_bit);
    }
}

#[test]
fn fixture_goldens_hold_through_the_q4_1_blocks_on_the_cpu() {
    let mut policy = LaunchPolicy::default();
    policy.candle_q4_1_on_cpu = true;
    for name in ["e2b-q4", "moe-q4"] {
        let before = conversions();
        let model = load_with(name, policy);
        let converted = conversions() - before;
        assert!(converted > 0, "{name}: no matrix took the Q4_1 path");
        for (i, case) in golden(name).iter().enumerate() {
            let max_diff = first_step_deviation(&model, case);
            let got = greedy_case(&model, case);
            eprintln!(
                "{name} case {i}: {converted} matrices on Q4_1, max |dlogprob| {max_diff:.2e}"
            );
            assert!(
                max_diff < LOGPROB_TOL,
                "{name} case {i}: first-step log-probs differ by {max_diff}"
            );
            assert_matches_reference(&format!("{name} case {i}"), &got, case, 0.01);
        }
    }
}
