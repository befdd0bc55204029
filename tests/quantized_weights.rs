//! MLX-quantized checkpoints stay packed in memory: resident weight bytes within 1.15x of the
//! packed checkpoint, far below the dense size.

mod common;

use candle_core::DType;
use candle_gemma::Model;
use common::*;

#[test]
fn quantized_weights_stay_packed() {
    for (name, float_twin) in [
        ("e2b-q4", "e2b-hf"),
        ("e2b-q8", "e2b-hf"),
        ("moe-q4", "moe-mlx"),
    ] {
        let dir = fixture(name);
        let model = Model::builder()
            .path(&dir)
            .dtype(DType::BF16)
            .build()
            .expect("loads");
        let resident = model.text_model().resident_bytes();
        let file = std::fs::metadata(dir.join("model.safetensors"))
            .expect("file")
            .len() as usize;
        let dense = {
            let m = Model::builder()
                .path(fixture(float_twin))
                .dtype(DType::BF16)
                .build()
                .expect("loads");
            m.text_model().resident_bytes()
        };
        let ratio = resident as f64 / file as f64;
        eprintln!(
            "{name}: resident {resident} B, packed checkpoint {file} B ({ratio:.3}x), dense bf16 model {dense} B"
        );
        assert!(ratio <= 1.15, "{name}: resident/packed = {ratio}");
        assert!(
            resident < dense,
            "{name}: packed weights are not smaller than dense ones"
        );
    }
}

#[test]
fn random_packed_models_report_their_packed_size() {
    use candle_gemma::config::Config;
    use candle_gemma::kv::QuantBits;
    let dir = fixture("e2b-hf");
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config");
    let cfg = Config::from_json(&serde_json::from_str(&text).expect("json"), None).expect("cfg");
    let dev = candle_core::Device::Cpu;
    let dense = Model::random(cfg.clone(), &dev, DType::BF16, 3).expect("dense");
    let packed =
        Model::random_packed(cfg.clone(), &dev, DType::BF16, 3, QuantBits::Four, 32).expect("q4");
    // Everything generated is resident, at its stored size.
    assert_eq!(
        dense.checkpoint_bytes(),
        dense.text_model().resident_bytes()
    );
    assert_eq!(
        packed.checkpoint_bytes(),
        packed.text_model().resident_bytes()
    );
    assert!(packed.checkpoint_bytes() * 2 < dense.checkpoint_bytes());
    // And it runs.
    let mut cache = packed
        .new_cache(&candle_gemma::CacheConfig::default())
        .expect("cache");
    let logits = packed
        .forward(&[vec![2, 5, 9]], &mut cache)
        .expect("forward");
    assert_eq!(logits.dims(), &[1, cfg.vocab_size]);
    assert!(Model::random_packed(cfg, &dev, DType::BF16, 3, QuantBits::Four, 48).is_err());
}
