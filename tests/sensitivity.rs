//! The goldens catch each architectural detail: change one detail of a fixture and the
//! reference no longer matches. Together with tests/golden.rs this shows each detail is both
//! implemented and tested.

mod common;

use candle_core::Tensor;
use common::*;

/// A detail counts as caught when the first-step log-probs move by more than this (the
/// unmodified fixtures stay below 2e-3).
const CAUGHT: f64 = 0.05;

fn assert_caught(label: &str, model: &candle_gemma::Model, fixture_name: &str, case: usize) {
    let cases = golden(fixture_name);
    let dev = first_step_deviation(model, &cases[case]);
    assert!(
        dev > CAUGHT,
        "{label}: the golden did not notice (max |dlogprob| {dev})"
    );
}

#[test]
fn sliding_window_edge_is_exact() {
    // One more key in the window changes prompts longer than W.
    let s = Scratch::copy_of("e2b-hf", "window");
    s.edit_config(|v| v["text_config"]["sliding_window"] = 9.into());
    assert_caught("window W+1", &s.build().expect("loads"), "e2b-hf", 1);
}

#[test]
fn per_layer_embeddings_matter() {
    let s = Scratch::copy_of("e2b-hf", "ple");
    s.edit_tensors("model.safetensors", |t| {
        let w = &t["model.language_model.per_layer_projection_norm.weight"];
        let doubled = (w * 3.0).expect("scale");
        t.insert(
            "model.language_model.per_layer_projection_norm.weight".into(),
            doubled,
        );
    });
    assert_caught("PLE norm", &s.build().expect("loads"), "e2b-hf", 0);
}

#[test]
fn moe_per_expert_scale_matters() {
    let s = Scratch::copy_of("moe-mlx", "moe");
    s.edit_tensors("model.safetensors", |t| {
        for l in 0..6 {
            let name = format!("language_model.model.layers.{l}.router.per_expert_scale");
            let ones = Tensor::ones_like(&t[&name]).expect("ones");
            t.insert(name, ones);
        }
    });
    assert_caught(
        "per_expert_scale = 1",
        &s.build().expect("loads"),
        "moe-mlx",
        0,
    );
}

#[test]
fn layer_scalar_matters() {
    let s = Scratch::copy_of("dense-sharded", "scalar");
    s.edit_tensors("model-00001-of-00003.safetensors", |t| {
        let name = "model.language_model.layers.0.layer_scalar";
        let ones = Tensor::ones_like(&t[name]).expect("ones");
        t.insert(name.into(), ones);
    });
    assert_caught(
        "layer_scalar = 1",
        &s.build().expect("loads"),
        "dense-sharded",
        0,
    );
}

#[test]
fn k_eq_v_full_layers_need_no_v_proj_and_refuse_without_the_flag() {
    // The dense-sharded fixture's full layer 5 ships no v_proj (and one global KV head):
    // declaring k_eq_v false must fail loudly, naming the layer-5 tensor that does not fit.
    let s = Scratch::copy_of("dense-sharded", "keqv");
    s.edit_config(|v| {
        v["text_config"]["attention_k_eq_v"] = false.into();
        v["text_config"]["per_layer_config"] =
            serde_json::json!({"05": {"num_key_value_heads": 1}});
    });
    match s.build() {
        Err(candle_gemma::Error::MissingTensor { name, layer }) => {
            assert!(name.ends_with("layers.5.self_attn.v_proj.weight"), "{name}");
            assert_eq!(layer, Some(5));
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn kv_consumers_read_their_own_kind_of_producer() {
    // Perturbing the full producer (layer 4)'s k_norm changes what full consumer layer 9 reads;
    // if consumers read the wrong producer the fixture's golden would already fail, and this
    // shows the full path is exercised.
    let s = Scratch::copy_of("e2b-hf", "producer");
    s.edit_tensors("model.safetensors", |t| {
        let name = "model.language_model.layers.4.self_attn.k_norm.weight";
        let w = (&t[name] * 2.0).expect("scale");
        t.insert(name.into(), w);
    });
    assert_caught(
        "full producer k_norm",
        &s.build().expect("loads"),
        "e2b-hf",
        2,
    );
}

#[test]
fn qat_pruned_consumers_load_and_shipped_ones_are_ignored() {
    // e4b-text ships no k/v/k_norm on consumer layers 8..11; e2b-hf ships them. Garbage in the
    // shipped ones must not change anything.
    let pruned = load("e4b-text");
    assert!(first_step_deviation(&pruned, &golden("e4b-text")[0]) < 2e-3);
    let s = Scratch::copy_of("e2b-hf", "ignored");
    s.edit_tensors("model.safetensors", |t| {
        for l in 6..10 {
            let name = format!("model.language_model.layers.{l}.self_attn.k_proj.weight");
            if let Some(w) = t.get(&name) {
                let junk = (w * 100.0).expect("scale");
                t.insert(name, junk);
            }
        }
    });
    let m = s.build().expect("loads");
    assert!(first_step_deviation(&m, &golden("e2b-hf")[0]) < 2e-3);
}
