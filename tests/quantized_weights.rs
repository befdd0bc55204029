//! MLX-quantized checkpoints stay packed in memory: resident weight bytes within 1.15x of the
//! packed checkpoint, far below the dense size.

mod common;

use candle_core::DType;
use candle_gemma::Model;
use common::*;

#[test]
fn quantized_weights_stay_packed() {
    for name in ["e2b-q4", "e2b-q8"] {
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
                .path(fixture("e2b-hf"))
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
