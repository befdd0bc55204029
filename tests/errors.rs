//! Bad input gets a typed error that names the problem, never a panic.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_gemma::{CacheConfig, Error};
use common::*;

#[test]
fn missing_tensor_names_the_tensor_and_layer() {
    let s = Scratch::copy_of("e2b-hf", "missing");
    s.edit_tensors("model.safetensors", |t| {
        t.remove("model.language_model.layers.3.mlp.up_proj.weight");
    });
    match s.build() {
        Err(Error::MissingTensor { name, layer }) => {
            assert!(name.ends_with("layers.3.mlp.up_proj.weight"), "{name}");
            assert_eq!(layer, Some(3));
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn wrong_shape_reports_expected_and_found() {
    let s = Scratch::copy_of("e2b-hf", "shape");
    s.edit_tensors("model.safetensors", |t| {
        let bad = Tensor::zeros((7, 64), DType::BF16, &Device::Cpu).expect("zeros");
        t.insert(
            "model.language_model.layers.2.self_attn.q_proj.weight".into(),
            bad,
        );
    });
    match s.build() {
        Err(Error::Shape {
            tensor,
            expected,
            found,
        }) => {
            assert!(
                tensor.ends_with("layers.2.self_attn.q_proj.weight"),
                "{tensor}"
            );
            assert_eq!(expected, vec![128, 64]);
            assert_eq!(found, vec![7, 64]);
        }
        other => panic!("expected Shape, got {other:?}"),
    }
}

#[test]
fn config_missing_field_is_named() {
    let s = Scratch::copy_of("e2b-hf", "nofield");
    s.edit_config(|v| {
        v["text_config"]
            .as_object_mut()
            .expect("obj")
            .remove("hidden_size");
    });
    match s.build() {
        Err(Error::Config { field, .. }) => assert_eq!(field, "text_config.hidden_size"),
        other => panic!("expected Config, got {other:?}"),
    }
}

#[test]
fn config_unknown_layer_type_is_named() {
    let s = Scratch::copy_of("e4b-text", "layertype");
    s.edit_config(|v| v["layer_types"][2] = "chunked_attention".into());
    match s.build() {
        Err(Error::Config { field, reason }) => {
            assert_eq!(field, "layer_types[2]");
            assert!(reason.contains("chunked_attention"), "{reason}");
        }
        other => panic!("expected Config, got {other:?}"),
    }
}

#[test]
fn truncated_safetensors_names_the_file() {
    let s = Scratch::copy_of("dense-sharded", "truncated");
    let path = s.dir.join("model-00002-of-00003.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("write");
    match s.build() {
        Err(Error::Safetensors { path: p, .. }) => assert_eq!(p, path),
        other => panic!("expected Safetensors, got {other:?}"),
    }
}

#[test]
fn prompt_ids_outside_the_vocabulary_are_rejected() {
    let model = load("e2b-hf");
    let mut g = model.generator(Default::default());
    match g.generate(&[2, 17, 512]) {
        Err(Error::TokenOutOfVocab {
            id,
            position,
            vocab_size,
        }) => {
            assert_eq!((id, position, vocab_size), (512, 2, 512));
        }
        other => panic!("expected TokenOutOfVocab, got {other:?}"),
    }
}

#[test]
fn prompt_longer_than_the_context_is_rejected() {
    let s = Scratch::copy_of("e2b-hf", "context");
    s.edit_config(|v| v["text_config"]["max_position_embeddings"] = 16.into());
    let model = s.build().expect("loads");
    let mut cache = model.new_cache(&CacheConfig::default()).expect("cache");
    match model.forward(&[vec![5; 17]], &mut cache) {
        Err(Error::ContextTooLong { length, max }) => assert_eq!((length, max), (17, 16)),
        other => panic!("expected ContextTooLong, got {other:?}"),
    }
}

#[test]
fn a_second_launch_policy_in_one_process_is_a_config_error() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/e2b-hf");
    let first = candle_gemma::Model::builder().path(dir).build();
    assert!(first.is_ok(), "{:?}", first.err());
    let other = candle_gemma::LaunchPolicy::from_env();
    let mut other_policy = other;
    other_policy.cuda_graph = !other.cuda_graph;
    match candle_gemma::Model::builder()
        .path(dir)
        .launch_policy(other_policy)
        .build()
    {
        Err(candle_gemma::Error::Config { field, .. }) => assert_eq!(field, "launch_policy"),
        other => panic!(
            "expected a launch_policy config error, got {:?}",
            other.err()
        ),
    }
    // The policy in force is accepted again.
    assert!(candle_gemma::Model::builder()
        .path(dir)
        .launch_policy(other)
        .build()
        .is_ok());
}
