//! `LaunchPolicy::from_env`: each variable of the `kernels::policy` table sets its field, and a
//! count that does not parse leaves the default. One test in its own binary, since the
//! environment belongs to the whole process.

use candle_gemma::LaunchPolicy;

/// A count variable, the field it sets, and a value other than the default.
type Count = (&'static str, fn(&LaunchPolicy) -> usize, usize);

const COUNTS: [Count; 6] = [
    ("CANDLE_GEMMA_PREFILL_CHUNK", |p| p.prefill_chunk, 333),
    (
        "CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS",
        |p| p.moe_grouped_max_tokens,
        7,
    ),
    (
        "CANDLE_GEMMA_MOE_PADDED_MAX_PCT",
        |p| p.moe_padded_max_pct,
        0,
    ),
    ("CANDLE_GEMMA_MOE_TC_MIN_PAIRS", |p| p.moe_tc_min_pairs, 0),
    (
        "CANDLE_GEMMA_MOE_TC_MIN_PAIRS_DENSE",
        |p| p.moe_tc_min_pairs_dense,
        17,
    ),
    (
        "CANDLE_GEMMA_PEER_ALL_REDUCE_MAX_BYTES",
        |p| p.peer_all_reduce_max_bytes,
        4096,
    ),
];

/// A switch variable, the value that turns its field from the default, and the field.
type Switch = (&'static str, &'static str, fn(&LaunchPolicy) -> bool);

const SWITCHES: [Switch; 7] = [
    ("CANDLE_GEMMA_UNFUSED", "1", |p| p.fused),
    ("CANDLE_GEMMA_CUDA_GRAPH", "0", |p| p.cuda_graph),
    ("CANDLE_GEMMA_PDL", "0", |p| p.dependent_launch),
    ("CANDLE_GEMMA_EARLY_LOADS", "0", |p| p.early_loads),
    ("CANDLE_GEMMA_FLASH_PREFILL", "0", |p| p.flash_prefill),
    ("CANDLE_GEMMA_PREFILL_WGMMA", "0", |p| p.prefill_wgmma),
    ("CANDLE_GEMMA_METAL_KERNELS", "0", |p| p.metal_kernels),
];

#[test]
fn each_variable_sets_its_field_and_bad_counts_keep_the_default() {
    let default = LaunchPolicy::default();
    for (name, _, _) in COUNTS {
        std::env::remove_var(name);
    }
    for (name, _, _) in SWITCHES {
        std::env::remove_var(name);
    }
    assert_eq!(LaunchPolicy::from_env(), default, "no variable set");

    for (name, field, value) in COUNTS {
        std::env::set_var(name, value.to_string());
        let p = LaunchPolicy::from_env();
        assert_ne!(
            value,
            field(&default),
            "{name}: the test's value is the default"
        );
        assert_eq!(field(&p), value, "{name}={value}");
        std::env::set_var(name, "many");
        assert_eq!(
            field(&LaunchPolicy::from_env()),
            field(&default),
            "{name}=many keeps the default"
        );
        std::env::remove_var(name);
    }

    for (name, value, field) in SWITCHES {
        std::env::set_var(name, value);
        let p = LaunchPolicy::from_env();
        assert_eq!(field(&p), !field(&default), "{name}={value}");
        std::env::remove_var(name);
    }
    assert_eq!(LaunchPolicy::from_env(), default, "every variable removed");
}
