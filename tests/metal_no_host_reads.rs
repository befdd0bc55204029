//! A Metal forward reads nothing back from the device but what the sampler needs.
//!
//! Two checks, both without a Mac:
//! - the routes the Metal entry points take (`kernels::metal::route`, which the dispatchers
//!   match on) are enumerated for one decode step and one prefill chunk, for every weight
//!   format, cache kind, activation dtype and model shape (plain, PLE, MoE): no operation
//!   takes the host route, the MoE routing and expert products included;
//! - the source of the Metal modules, and of the Metal branches of the packed products,
//!   embedding gathers, quantization and the MoE layer, calls no host read (`to_device(&Device::Cpu)`,
//!   `to_vec1`/`to_vec2`/`to_vec3`, `to_scalar`, `HostWeight::read`, `host_f32`,
//!   `dequantize_host`) outside the load-time `Q4_1` conversion.

use candle_core::DType;
use candle_gemma::kernels::metal::route::{
    decode_and_prefill_steps, CacheKind, Route, StepModel, WeightFormat,
};
use candle_gemma::kernels::policy::LaunchPolicy;
use candle_gemma::kv::QuantBits;

/// Every weight format a checkpoint loads as: dense, exact 4-bit (`Q4_1`), inexact 4-bit
/// (scales f16 cannot hold), 8-bit; scales in the activation dtype as mlx-lm writes them.
fn weight_formats(dtype: DType) -> Vec<Option<WeightFormat>> {
    let packed = |bits, q4_1| {
        Some(WeightFormat {
            bits,
            q4_1,
            scale_dtype: dtype,
            in_dim: 1536,
        })
    };
    vec![
        None,
        packed(QuantBits::Four, true),
        packed(QuantBits::Four, false),
        packed(QuantBits::Eight, false),
    ]
}

const CACHES: [CacheKind; 3] = [
    CacheKind::Dense,
    CacheKind::Packed(QuantBits::Four),
    CacheKind::Packed(QuantBits::Eight),
];

/// Every (model, cache, step) combination with its operations under `kernels_on`.
fn every_step(kernels_on: bool) -> Vec<(String, Vec<(&'static str, Route)>)> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for weights in weight_formats(dtype) {
            for (ple, moe) in [(false, false), (true, false), (false, true)] {
                let model = StepModel {
                    weights,
                    ple,
                    moe,
                    dtype,
                };
                for cache in CACHES {
                    for q_len in [1, 40] {
                        let ops = decode_and_prefill_steps(&model, cache, q_len, kernels_on)
                            .into_iter()
                            .map(|o| (o.op, o.route))
                            .collect();
                        let label = format!(
                            "{dtype:?} weights {weights:?} ple {ple} moe {moe} cache {cache:?} q_len {q_len}"
                        );
                        out.push((label, ops));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn no_operation_of_a_decode_step_or_prefill_reads_the_device_back() {
    let kernels_on = LaunchPolicy::default().metal_kernels;
    assert!(kernels_on, "the crate's Metal kernels are on by default");
    let steps = every_step(kernels_on);
    let mut ops = 0;
    let mut moe_ops = 0;
    for (label, step) in &steps {
        for (op, route) in step {
            ops += 1;
            moe_ops += usize::from(op.starts_with("MoE"));
            assert_ne!(*route, Route::Host, "{label}: {op} reads the device back");
        }
    }
    assert!(moe_ops > 0, "the enumeration covers MoE layers");
    eprintln!(
        "{} steps, {ops} operations ({moe_ops} of MoE layers): no host read",
        steps.len()
    );
}

#[test]
fn with_the_kernels_off_the_host_fallback_is_what_the_routes_report() {
    // The enumeration can fail: with the crate's kernels off, packed products, gathers and
    // quantized caches fall back to the host (exact 4-bit matrices stay on candle's Q4_1 in a
    // decode step).
    let steps = every_step(false);
    let host = |want: &str| {
        steps
            .iter()
            .any(|(_, s)| s.iter().any(|(op, r)| *op == want && *r == Route::Host))
    };
    assert!(host("q/k/v product"));
    assert!(host("K/V quantize"));
    assert!(host("embedding gather"));
    assert!(host("MoE routing"));
    for (label, step) in &steps {
        // A decode step's products of an exactly-mapped matrix stay on candle's Q4_1 kernels.
        if label.contains("q4_1: true") && label.ends_with("q_len 1") {
            let product = step.iter().find(|(op, _)| *op == "q/k/v product");
            assert_eq!(product.map(|p| p.1), Some(Route::CandleQ4_1), "{label}");
        }
    }
}

/// The body of every `fn` in `source`, by name (a brace count from each `fn NAME`).
fn functions(source: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("fn ") {
        let after = &rest[at + 3..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let Some(open) = after.find('{') else { break };
        let semi = after.find(';').unwrap_or(usize::MAX);
        if name.is_empty() || semi < open {
            rest = after;
            continue;
        }
        let mut depth = 0;
        let mut end = open;
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((name, after[..end].to_string()));
        rest = &after[end..];
    }
    out
}

const HOST_READS: [&str; 8] = [
    "to_device(&Device::Cpu)",
    ".to_vec1",
    ".to_vec2",
    ".to_vec3",
    "to_scalar",
    "HostWeight::read",
    "host_f32(",
    "dequantize_host(",
];

/// The Metal branches of a file: each item, statement, block or match arm that follows a
/// `#[cfg(feature = "metal")]`, up to its closing brace or the `,`/`;` that ends it.
fn metal_branches(source: &str) -> Vec<String> {
    source
        .split("#[cfg(feature = \"metal\")]")
        .skip(1)
        .map(|piece| {
            let (mut depth, mut braces) = (0i32, false);
            let mut end = piece.len();
            for (i, c) in piece.char_indices() {
                match c {
                    '{' | '(' | '[' => {
                        depth += 1;
                        braces |= c == '{';
                    }
                    '}' | ')' | ']' => {
                        depth -= 1;
                        if c == '}' && depth == 0 {
                            end = i + 1;
                            break;
                        }
                    }
                    ',' | ';' if depth == 0 && !braces => {
                        end = i + 1;
                        break;
                    }
                    _ => {}
                }
            }
            piece[..end].to_string()
        })
        .collect()
}

#[test]
fn metal_sources_call_no_host_read_on_a_forward_path() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
    // Load time or test only: the Q4_1 conversion reads the MLX packing once, at load.
    let allowed = [("q4_1.rs", "q4_1_blocks"), ("q4_1.rs", "dequantize_host")];
    let mut checked = 0;
    for file in ["mod.rs", "launch.rs", "plan.rs", "route.rs", "q4_1.rs"] {
        let source = std::fs::read_to_string(root.join("metal").join(file)).expect("source");
        let source = source.split("#[cfg(test)]").next().unwrap_or_default();
        for (name, body) in functions(source) {
            if allowed.contains(&(file, name.as_str())) {
                continue;
            }
            checked += 1;
            for read in HOST_READS {
                assert!(
                    !body.contains(read),
                    "metal/{file}: fn {name} calls `{read}` on a forward path"
                );
            }
        }
    }
    for file in [
        "qmatmul.rs",
        "quant.rs",
        "kv_write.rs",
        "mod.rs",
        "ops/moe.rs",
    ] {
        let source = std::fs::read_to_string(root.join(file)).expect("source");
        let branches = metal_branches(&source);
        if file == "ops/moe.rs" {
            // The dispatch into the Metal MoE path and the path itself.
            assert!(
                branches.iter().any(|b| b.contains("fn on_metal")),
                "ops/moe.rs: the Metal MoE path is found"
            );
        }
        for branch in branches {
            checked += 1;
            for read in HOST_READS {
                assert!(
                    !branch.contains(read),
                    "{file}: a Metal branch calls `{read}`:\n{branch}"
                );
            }
        }
    }
    eprintln!("{checked} Metal functions and branches call no host read");
}
