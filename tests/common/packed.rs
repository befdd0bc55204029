//! The MLX-packed matrices of a quantized fixture, read straight from its safetensors file.

use candle_core::{Device, Tensor};
use candle_gemma::kv::PackedAffine;

/// Every MLX-packed matrix of a fixture as `(name, packed [rows, in])`, leading axes of an
/// expert stack flattened into rows, sorted by name.
pub fn packed_matrices(name: &str) -> Vec<(String, PackedAffine)> {
    let path = super::fixture(name).join("model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).expect("fixture loads");
    let mut out = Vec::new();
    for (key, scales) in &tensors {
        let Some(module) = key.strip_suffix(".scales") else {
            continue;
        };
        let codes = &tensors[&format!("{module}.weight")];
        let biases = &tensors[&format!("{module}.biases")];
        let flat = |t: &Tensor| {
            let last = *t.dims().last().expect("rank");
            t.reshape((t.elem_count() / last, last)).expect("flatten")
        };
        let (codes, scales, biases) = (flat(codes), flat(scales), flat(biases));
        let (rows, words) = codes.dims2().expect("codes");
        let groups = scales.dims2().expect("scales").1;
        // A 4-bit matrix has 8 codes a word; an 8-bit one 4. Group sizes tell them apart.
        let in_dim = [8, 4]
            .into_iter()
            .map(|per| words * per)
            .find(|d| [32, 64, 128].contains(&(d / groups)) && d % groups == 0)
            .expect("a packing mlx-lm writes");
        let p = PackedAffine::new(codes, scales, biases, rows, in_dim).expect("packed");
        out.push((module.to_string(), p));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}
