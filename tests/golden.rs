//! Every fixture loads and reproduces mlx-lm's greedy ids and first-step log-probs.

mod common;

use common::*;

fn check_fixture(name: &str) {
    let model = load(name);
    for (i, case) in golden(name).iter().enumerate() {
        let max_diff = first_step_deviation(&model, case);
        assert!(
            max_diff < LOGPROB_TOL,
            "{name} case {i}: first-step log-probs differ by {max_diff}"
        );

        let got = greedy_case(&model, case);
        let n = comparable_steps(&case.margins, 0.01);
        assert_matches_reference(&format!("{name} case {i}"), &got, case, 0.01);
        eprintln!(
            "{name} case {i}: prompt {} tokens, {n}/{} ids compared, max |dlogprob| {max_diff:.2e}",
            case.prompt.len(),
            case.greedy.len()
        );
    }
}

#[test]
fn e2b_hf_multimodal_layout_bf16_ple_kv_sharing_double_wide() {
    check_fixture("e2b-hf");
}

#[test]
fn e4b_text_layout_per_layer_config_qat_pruned() {
    check_fixture("e4b-text");
}

#[test]
fn moe_mlx_layout_k_eq_v() {
    check_fixture("moe-mlx");
}

#[test]
fn dense_k_eq_v_sharded() {
    check_fixture("dense-sharded");
}

#[test]
fn mlx_4bit_quantized() {
    check_fixture("e2b-q4");
}

#[test]
fn mlx_8bit_quantized() {
    check_fixture("e2b-q8");
}

#[test]
fn mlx_quantized_moe_experts_stay_packed() {
    check_fixture("moe-q4");
}

#[test]
fn e2b_kvq_gentle_gains_f32() {
    check_fixture("e2b-kvq");
}

#[test]
fn every_fixture_has_at_least_eight_comparable_tokens_per_prompt() {
    for name in FIXTURES {
        for (i, case) in golden(name).iter().enumerate() {
            let n = comparable_steps(&case.margins, 0.01);
            assert!(n >= 8, "{name} case {i}: only {n} steps before a near-tie");
        }
    }
}
