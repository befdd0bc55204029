//! The MLX-packed matrices of a quantized fixture, read straight from its safetensors file.

use candle_core::{Device, Tensor};
use candle_gemma::kv::PackedAffine;

/// Every MLX-packed matrix of a fixture as `(name, packed [rows, in])`, leading axes of an
/// expert stack flattened into rows, sorted by name. Bits and group size come from the
/// `quantization` entry of config.json (a module's own entry, else the defaults), as mlx-lm
/// reads them: the packed shapes alone cannot tell 8-bit groups of 64 from 4-bit groups of 128.
pub fn packed_matrices(name: &str) -> Vec<(String, PackedAffine)> {
    let dir = super::fixture(name);
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json")).expect("config readable"),
    )
    .expect("config parses");
    let quant = &config["quantization"];
    let setting = |module: &str, key: &str| -> usize {
        quant[module][key]
            .as_u64()
            .or_else(|| quant[key].as_u64())
            .expect("quantization settings") as usize
    };
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
        .expect("fixture loads");
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
        let (bits, group) = (setting(module, "bits"), setting(module, "group_size"));
        let in_dim = words * 32 / bits;
        assert_eq!(
            in_dim,
            groups * group,
            "{name} {module}: packing and settings"
        );
        let p = PackedAffine::new(codes, scales, biases, rows, in_dim).expect("packed");
        assert_eq!(p.bits.bits(), bits, "{name} {module}: bits");
        out.push((module.to_string(), p));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}
