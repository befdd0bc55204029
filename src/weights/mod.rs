//! Checkpoint weights: memory-mapped safetensors (one file or shards listed in
//! `model.safetensors.index.json`), the three key layouts Gemma 4 ships in, and MLX affine
//! quantized tensors (kept packed as [`PackedAffine`] where the packed kernels take them, else
//! dequantized on load by [`affine`]).
//!
//! Names passed to [`WeightStore`] are *logical*: the text-stack name without any layout prefix
//! (`layers.3.self_attn.q_proj`). The store adds the prefix of the detected [`KeyLayout`].

pub mod affine;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::kernels::{PackedAffine, QuantBits};
use crate::shard::{slice, ShardPlan};

/// How the text-stack tensors are named in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyLayout {
    /// `model.language_model.*` (transformers' multimodal `Gemma4ForConditionalGeneration`).
    HfMultimodal,
    /// `model.*` (transformers' text-only `Gemma4ForCausalLM`).
    HfText,
    /// `language_model.model.*` (mlx-lm / mlx-vlm conversions; experts split as `switch_glu`).
    Mlx,
}

impl KeyLayout {
    /// The prefix this layout puts before every text-stack name.
    pub fn prefix(self) -> &'static str {
        match self {
            KeyLayout::HfMultimodal => "model.language_model.",
            KeyLayout::HfText => "model.",
            KeyLayout::Mlx => "language_model.model.",
        }
    }
}

/// The tensors of a checkpoint folder, memory-mapped, addressed by logical name.
pub struct WeightStore {
    files: Vec<(PathBuf, MmapedSafetensors)>,
    routing: HashMap<String, usize>,
    /// `Some(seed)`: no files; every tensor is generated (benchmarks at real shapes).
    random: Option<u64>,
    /// With `random`: generate 2-D matrices MLX-packed at `(bits, group_size)`.
    random_packing: Option<(QuantBits, usize)>,
    /// With `random`: bytes of every generated tensor as a checkpoint would store it.
    generated_bytes: std::sync::atomic::AtomicUsize,
    layout: KeyLayout,
    device: Device,
    dtype: DType,
    /// A tensor-parallel rank's plan: sharded matrices load as the rank's part only.
    shard: Option<ShardPlan>,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStore")
            .field(
                "files",
                &self.files.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("tensors", &self.routing.len())
            .field("layout", &self.layout)
            .finish()
    }
}

/// A loaded weight matrix: dense, or MLX affine-quantized and kept packed.
#[derive(Debug, Clone)]
pub enum LoadedMatrix {
    /// `[.., out, in]` in the store's dtype (a float checkpoint, or a quantized one whose bits,
    /// group size or layout the packed kernels do not take: dequantized on load).
    Dense(Tensor),
    /// A 4/8-bit matrix with group 32, 64 or 128, resident packed. A stack `[n, out, in]` (the
    /// MoE experts) is held as one `[n * out, in]` matrix: matrix `i` owns rows `i * out ..`.
    Packed(PackedAffine),
}

impl LoadedMatrix {
    /// The dense weight, dequantizing a packed one (a packed stack comes out flattened to
    /// `[n * out, in]`).
    ///
    /// # Errors
    /// Candle errors.
    pub fn into_dense(self, dtype: DType) -> Result<Tensor> {
        match self {
            LoadedMatrix::Dense(t) => Ok(t),
            LoadedMatrix::Packed(p) => Ok(p.dequantize(dtype)?),
        }
    }
}

impl WeightStore {
    /// Opens every safetensors file of a checkpoint folder.
    ///
    /// # Errors
    /// [`Error::Safetensors`] naming a file that is missing, truncated or malformed;
    /// [`Error::MissingTensor`] when no known key layout is recognised.
    pub fn open(dir: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let paths = shard_paths(dir)?;
        let mut files = Vec::with_capacity(paths.len());
        let mut routing = HashMap::new();
        for (index, path) in paths.into_iter().enumerate() {
            // SAFETY: the file is mapped read-only; like every mmap-based loader we rely on the
            // checkpoint not being modified while the model is alive.
            let st = unsafe { MmapedSafetensors::new(&path) }.map_err(|e| Error::Safetensors {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            for (name, _) in st.tensors() {
                routing.insert(name, index);
            }
            files.push((path, st));
        }
        let layout = detect_layout(&routing)?;
        Ok(Self {
            files,
            routing,
            random: None,
            random_packing: None,
            generated_bytes: Default::default(),
            layout,
            device: device.clone(),
            dtype,
            shard: None,
        })
    }

    /// Loads only `plan`'s part of every sharded matrix (one rank of a tensor-parallel group):
    /// callers ask for the rank-local shape, the store checks the checkpoint's full shape,
    /// cuts the part on the host ([`crate::shard::slice`]) and moves only that to the device.
    /// A random store generates the local shapes directly.
    pub fn with_shard(mut self, plan: ShardPlan) -> Self {
        self.shard = Some(plan);
        self
    }

    /// A store with no files that generates every requested tensor on `device`: norms,
    /// scalars and scales are ones, matrices are N(0, 0.02²). For benchmarks at real shapes,
    /// where no checkpoint can be downloaded.
    pub fn random(device: &Device, dtype: DType, seed: u64) -> Self {
        Self {
            files: Vec::new(),
            routing: HashMap::new(),
            random: Some(seed),
            random_packing: None,
            generated_bytes: Default::default(),
            layout: KeyLayout::HfText,
            device: device.clone(),
            dtype,
            shard: None,
        }
    }

    /// Like [`WeightStore::random`], but 2-D matrices (projections, embedding table) come out
    /// MLX-packed at `bits` and `group_size`, as in a quantized checkpoint: uniformly random
    /// codes, scales and biases spanning about ±0.04; 3-D expert stacks likewise, flattened as a
    /// checkpoint's are on load. Norms and scalars stay dense.
    pub fn random_packed(
        device: &Device,
        dtype: DType,
        seed: u64,
        bits: QuantBits,
        group_size: usize,
    ) -> Self {
        Self {
            random_packing: Some((bits, group_size)),
            ..Self::random(device, dtype, seed)
        }
    }

    /// Bytes of the checkpoint files (0 for a random store).
    pub fn file_bytes(&self) -> usize {
        self.files
            .iter()
            .filter_map(|(p, _)| std::fs::metadata(p).ok())
            .map(|m| m.len() as usize)
            .sum()
    }

    /// For a random store: bytes of every tensor generated so far, at their stored size (packed
    /// matrices as codes + scales + biases), i.e. the size of the checkpoint it stands for.
    pub fn generated_bytes(&self) -> usize {
        self.generated_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count_generated(&self, bytes: usize) {
        self.generated_bytes
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// A random packed `[out, in]` matrix, or `None` when `in` is not a multiple of the group.
    fn generate_packed(&self, out: usize, inp: usize) -> Result<Option<PackedAffine>> {
        let Some((bits, group)) = self.random_packing else {
            return Ok(None);
        };
        let b = bits.bits();
        if !inp.is_multiple_of(group) || !(inp * b).is_multiple_of(32) {
            return Ok(None);
        }
        let words = inp * b / 32;
        // Random u32 words: f32 uniforms scaled to [0, 2^32) and truncated (the low bits of
        // large values are zero, which is still a spread of codes for a benchmark).
        let codes = Tensor::rand(0f32, 4_294_967_040f32, (out, words), &self.device)?
            .to_dtype(DType::U32)?;
        let levels = ((1u32 << b) - 1) as f64;
        let scales =
            (Tensor::ones((out, inp / group), self.dtype, &self.device)? * (0.08 / levels))?;
        let biases = (Tensor::ones((out, inp / group), self.dtype, &self.device)? * -0.04)?;
        let p = PackedAffine::new(codes, scales, biases, out, inp)?.settled();
        self.count_generated(p.packed_bytes());
        Ok(Some(p))
    }

    /// Generates a tensor for the random store.
    fn generate(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let is_scale =
            name.contains("norm") || name.ends_with("layer_scalar") || name.ends_with("scale");
        let t = if is_scale {
            Tensor::ones(shape, self.dtype, &self.device)?
        } else {
            Tensor::randn(0f32, 0.02, shape, &self.device)?.to_dtype(self.dtype)?
        };
        self.count_generated(t.elem_count() * self.dtype.size_in_bytes());
        Ok(t)
    }

    /// The detected key layout.
    pub fn layout(&self) -> KeyLayout {
        self.layout
    }

    /// The device tensors are loaded to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype tensors are converted to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether a logical name exists.
    pub fn contains(&self, name: &str) -> bool {
        if self.random.is_some() {
            return name.ends_with(".weight");
        }
        self.routing.contains_key(&self.full_name(name))
    }

    fn full_name(&self, name: &str) -> String {
        format!("{}{name}", self.layout.prefix())
    }

    /// Loads a raw tensor by logical name, checking its shape, without dtype conversion.
    fn raw(&self, name: &str, layer: Option<usize>, shape: Option<&[usize]>) -> Result<Tensor> {
        let full = self.full_name(name);
        let &index = self
            .routing
            .get(&full)
            .ok_or_else(|| Error::MissingTensor {
                name: full.clone(),
                layer,
            })?;
        let (path, st) = &self.files[index];
        let view = st.get(&full).map_err(|e| Error::Safetensors {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if let Some(expected) = shape {
            if view.shape() != expected {
                return Err(Error::Shape {
                    tensor: full,
                    expected: expected.to_vec(),
                    found: view.shape().to_vec(),
                });
            }
        }
        st.load(&full, &Device::Cpu)
            .map_err(|e| Error::Safetensors {
                path: path.clone(),
                reason: format!("tensor `{full}`: {e}"),
            })
    }

    /// Loads a float tensor (norm weights, scalars) of the given shape, in the store's dtype.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Shape`].
    pub fn tensor(&self, name: &str, layer: Option<usize>, shape: &[usize]) -> Result<Tensor> {
        if self.random.is_some() {
            return self.generate(name, shape);
        }
        let t = self.raw(name, layer, Some(shape))?;
        self.finish(name, t, &self.device)
    }

    fn finish(&self, name: &str, t: Tensor, device: &Device) -> Result<Tensor> {
        if !t.dtype().is_float() {
            return Err(Error::DType {
                tensor: self.full_name(name),
                expected: "a float dtype".to_string(),
                found: format!("{:?}", t.dtype()),
            });
        }
        Ok(t.to_dtype(self.dtype)?.to_device(device)?)
    }

    /// Loads a weight matrix stored either dense under `<module>.weight` (or `<module>` itself
    /// when `suffix_free`) or MLX-quantized as `<module>.weight` (u32 codes) + `.scales` +
    /// `.biases`. `shape` is the dense shape `[.., out, in]`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Shape`] (dense or packed), [`Error::DType`].
    pub fn matrix(
        &self,
        module: &str,
        layer: Option<usize>,
        shape: &[usize],
    ) -> Result<LoadedMatrix> {
        self.matrix_on(module, layer, shape, &self.device)
    }

    /// Two stacks `[n, out, in]` of one layer joined matrix by matrix into `[n, 2 * out, in]`
    /// (matrix `i` is `first`'s matrix `i` over `second`'s: the MoE gate and up projections as
    /// one product). Both are joined on the host and moved to the device once, so the device
    /// never holds the halves beside the whole. Packed when both are packed alike (bits, group
    /// size, scale dtype); otherwise dense. A random store generates the joined stack directly.
    ///
    /// # Errors
    /// As [`WeightStore::matrix`].
    pub fn matrix_pair(
        &self,
        first: &str,
        second: &str,
        layer: Option<usize>,
        shape: [usize; 3],
    ) -> Result<LoadedMatrix> {
        let [n, out, inp] = shape;
        let joined = [n, 2 * out, inp];
        if self.random.is_some() {
            return self.matrix(first, layer, &joined);
        }
        let host = Device::Cpu;
        let a = self.matrix_on(first, layer, &shape, &host)?;
        let b = self.matrix_on(second, layer, &shape, &host)?;
        if let (LoadedMatrix::Packed(pa), LoadedMatrix::Packed(pb)) = (&a, &b) {
            if let Some(p) = PackedAffine::stack_rows(&[pa, pb], n)? {
                return Ok(LoadedMatrix::Packed(p.to_device(&self.device)?));
            }
        }
        let dense = |m: LoadedMatrix| -> Result<Tensor> {
            Ok(m.into_dense(self.dtype)?.reshape((n, out, inp))?)
        };
        Ok(LoadedMatrix::Dense(
            Tensor::cat(&[dense(a)?, dense(b)?], 1)?.to_device(&self.device)?,
        ))
    }

    /// Matrices `[out_i, in_dim]` of one layer (`(module, out_i)` each) stacked row-wise into
    /// one `[sum out_i, in_dim]` matrix, so one product computes them all. They are joined on
    /// the host and moved to the device once, so the device never holds the parts beside the
    /// whole. `None` unless all are dense or all packed alike (bits, group size, scale dtype):
    /// the caller then loads them one by one. A random store generates the stacked matrix
    /// directly.
    ///
    /// # Errors
    /// As [`WeightStore::matrix`].
    pub fn matrix_rows(
        &self,
        parts: &[(String, usize)],
        layer: Option<usize>,
        in_dim: usize,
    ) -> Result<Option<LoadedMatrix>> {
        let Some((first, _)) = parts.first() else {
            return Ok(None);
        };
        let rows: usize = parts.iter().map(|(_, out)| out).sum();
        if self.random.is_some() {
            return Ok(Some(self.matrix(first, layer, &[rows, in_dim])?));
        }
        let host = Device::Cpu;
        let loaded = parts
            .iter()
            .map(|(module, out)| self.matrix_on(module, layer, &[*out, in_dim], &host))
            .collect::<Result<Vec<_>>>()?;
        let dense: Option<Vec<&Tensor>> = loaded
            .iter()
            .map(|m| match m {
                LoadedMatrix::Dense(t) => Some(t),
                LoadedMatrix::Packed(_) => None,
            })
            .collect();
        if let Some(ts) = dense {
            let joined = Tensor::cat(&ts, 0)?.to_device(&self.device)?;
            return Ok(Some(LoadedMatrix::Dense(joined)));
        }
        let packed: Option<Vec<&PackedAffine>> = loaded
            .iter()
            .map(|m| match m {
                LoadedMatrix::Packed(p) => Some(p),
                LoadedMatrix::Dense(_) => None,
            })
            .collect();
        Ok(match packed {
            Some(ps) => PackedAffine::stack_rows(&ps, 1)?
                .map(|p| p.to_device(&self.device))
                .transpose()?
                .map(LoadedMatrix::Packed),
            None => None,
        })
    }

    /// [`WeightStore::matrix`] onto `device`: with a shard plan, the rank's part of a sharded
    /// matrix (`shape` is then the rank-local shape).
    fn matrix_on(
        &self,
        module: &str,
        layer: Option<usize>,
        shape: &[usize],
        device: &Device,
    ) -> Result<LoadedMatrix> {
        let cut = match &self.shard {
            Some(plan) if self.random.is_none() => plan.slice(module),
            _ => None,
        };
        let Some(cut) = cut else {
            return self.matrix_whole(module, layer, shape, device);
        };
        let full = cut.full_shape(&self.full_name(module), shape)?;
        let whole = self.matrix_whole(module, layer, &full, &Device::Cpu)?;
        let part = match whole {
            LoadedMatrix::Dense(t) => LoadedMatrix::Dense(slice::apply_dense(&t, &cut)?),
            LoadedMatrix::Packed(p) => match slice::apply_packed(&p, &cut)? {
                Some(q) => LoadedMatrix::Packed(q),
                // A column cut inside a quantization group: the part is dequantized.
                None => LoadedMatrix::Dense(slice::apply_dense(
                    &p.dequantize(self.dtype)?.reshape(full)?,
                    &cut,
                )?),
            },
        };
        Ok(match part {
            LoadedMatrix::Dense(t) => LoadedMatrix::Dense(t.to_device(device)?),
            LoadedMatrix::Packed(p) => LoadedMatrix::Packed(p.to_device(device)?),
        })
    }

    /// A whole matrix of the checkpoint (or a generated one) onto `device`.
    fn matrix_whole(
        &self,
        module: &str,
        layer: Option<usize>,
        shape: &[usize],
        device: &Device,
    ) -> Result<LoadedMatrix> {
        let weight_name = if self.contains(&format!("{module}.weight")) || !self.contains(module) {
            format!("{module}.weight")
        } else {
            module.to_string()
        };
        // A stack `[n, out, in]` packs as one `[n * out, in]` matrix; vectors stay dense.
        let (inp, lead) = shape.split_last().map_or((0, &[][..]), |(&i, l)| (i, l));
        let rows: usize = lead.iter().product();
        let packable = !lead.is_empty();
        if self.random.is_some() {
            if packable {
                if let Some(p) = self.generate_packed(rows, inp)? {
                    return Ok(LoadedMatrix::Packed(p));
                }
            }
            return Ok(LoadedMatrix::Dense(self.generate(&weight_name, shape)?));
        }
        let scales_name = format!("{module}.scales");
        if !self.contains(&scales_name) {
            let t = self.raw(&weight_name, layer, Some(shape))?;
            return Ok(LoadedMatrix::Dense(self.finish(&weight_name, t, device)?));
        }
        let codes = self.raw(&weight_name, layer, None)?;
        let scales = self.raw(&scales_name, layer, None)?;
        let biases = self.raw(&format!("{module}.biases"), layer, Some(scales.dims()))?;
        let leads_match = |t: &Tensor| t.rank() == shape.len() && &t.dims()[..lead.len()] == lead;
        if packable && leads_match(&codes) && leads_match(&scales) {
            let flat = |t: &Tensor| -> Result<Tensor> {
                let last = t.dims()[lead.len()];
                Ok(t.reshape((rows, last))?.to_device(device)?)
            };
            if let Ok(p) =
                PackedAffine::new(flat(&codes)?, flat(&scales)?, flat(&biases)?, rows, inp)
            {
                return Ok(LoadedMatrix::Packed(p.settled()));
            }
        }
        let (dense, _bits, _group) =
            affine::dequantize(&codes, &scales, &biases, shape).map_err(|reason| {
                Error::Quantized {
                    tensor: self.full_name(&weight_name),
                    reason,
                }
            })?;
        Ok(LoadedMatrix::Dense(
            dense.to_dtype(self.dtype)?.to_device(device)?,
        ))
    }
}

/// The safetensors files of a checkpoint: the shards of `model.safetensors.index.json`, or every
/// `*.safetensors` in the folder.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let json = crate::config::read_json(&index)?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Json {
                path: index.clone(),
                reason: "no `weight_map` object".to_string(),
            })?;
        let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let entries = std::fs::read_dir(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(Error::Safetensors {
            path: dir.join("model.safetensors"),
            reason: "no safetensors file in the checkpoint folder".to_string(),
        });
    }
    Ok(paths)
}

fn detect_layout(routing: &HashMap<String, usize>) -> Result<KeyLayout> {
    for layout in [KeyLayout::HfMultimodal, KeyLayout::Mlx, KeyLayout::HfText] {
        if routing.contains_key(&format!("{}embed_tokens.weight", layout.prefix())) {
            return Ok(layout);
        }
    }
    Err(Error::MissingTensor {
        name: "embed_tokens.weight (under model.language_model., language_model.model. or model.)"
            .to_string(),
        layer: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::max_abs_diff;
    use crate::kernels::{dequantize, quantize};

    /// Writes an MLX-layout file holding random matrices `m.{name}` of the given shapes,
    /// quantized at group 32 where bits are given, dense f32 otherwise, and opens it; returns
    /// the store and each matrix's dense values (dequantized).
    fn mlx_store(
        tag: &str,
        parts: &[(&str, &[usize], Option<QuantBits>)],
    ) -> (WeightStore, HashMap<String, Tensor>) {
        let dev = Device::Cpu;
        let dir = std::env::temp_dir().join(format!("candle-gemma-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prefix = KeyLayout::Mlx.prefix();
        let mut tensors = HashMap::new();
        tensors.insert(
            format!("{prefix}embed_tokens.weight"),
            Tensor::zeros((4, 64), DType::F32, &dev).unwrap(),
        );
        let mut dense = HashMap::new();
        for &(name, shape, bits) in parts {
            let w = Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
            let base = format!("{prefix}m.{name}");
            match bits {
                Some(bits) => {
                    let p = quantize(&w, bits, 32).unwrap();
                    dense.insert(name.to_string(), dequantize(&p).unwrap());
                    tensors.insert(format!("{base}.weight"), p.codes);
                    tensors.insert(format!("{base}.scales"), p.scales);
                    tensors.insert(format!("{base}.biases"), p.biases);
                }
                None => {
                    dense.insert(name.to_string(), w.clone());
                    tensors.insert(format!("{base}.weight"), w);
                }
            }
        }
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
        let store = WeightStore::open(&dir, &dev, DType::F32).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        (store, dense)
    }

    /// `m.gate_proj` over `m.up_proj`, expert stacks `[2, 4, 64]`, and their dense join.
    fn expert_pair(tag: &str, gate: QuantBits, up: QuantBits) -> (LoadedMatrix, Tensor) {
        let shape: &[usize] = &[2, 4, 64];
        let (store, dense) = mlx_store(
            tag,
            &[
                ("gate_proj", shape, Some(gate)),
                ("up_proj", shape, Some(up)),
            ],
        );
        let pair = store
            .matrix_pair("m.gate_proj", "m.up_proj", Some(0), [2, 4, 64])
            .unwrap();
        let want = Tensor::cat(&[&dense["gate_proj"], &dense["up_proj"]], 1).unwrap();
        (pair, want)
    }

    #[test]
    fn expert_pairs_alike_stay_packed_and_join_matrix_by_matrix() {
        let (pair, want) = expert_pair("pair-alike", QuantBits::Four, QuantBits::Four);
        let LoadedMatrix::Packed(p) = pair else {
            panic!("two 4-bit stacks should stay packed");
        };
        assert_eq!((p.out_dim(), p.in_dim()), (16, 64));
        assert!(
            p.is_settled(),
            "joined loaded weights keep the settled mark"
        );
        let got = p
            .dequantize(DType::F32)
            .unwrap()
            .reshape((2, 8, 64))
            .unwrap();
        assert_eq!(max_abs_diff(&got, &want), 0.0);
    }

    #[test]
    fn expert_pairs_of_different_bits_are_joined_dense() {
        let (pair, want) = expert_pair("pair-mixed", QuantBits::Four, QuantBits::Eight);
        let LoadedMatrix::Dense(got) = pair else {
            panic!("4-bit over 8-bit cannot be one packed matrix");
        };
        assert_eq!(got.dims(), &[2, 8, 64]);
        assert!(max_abs_diff(&got, &want) < 1e-6);
    }

    #[test]
    fn rows_stack_when_alike_and_decline_otherwise() {
        let (store, dense) = mlx_store(
            "rows",
            &[
                ("a", &[4, 64], Some(QuantBits::Four)),
                ("b", &[2, 64], Some(QuantBits::Four)),
                ("c", &[2, 64], Some(QuantBits::Eight)),
                ("d", &[3, 64], None),
            ],
        );
        let rows = |names: &[&str]| {
            let parts: Vec<(String, usize)> = names
                .iter()
                .map(|n| (format!("m.{n}"), dense[*n].dim(0).unwrap()))
                .collect();
            store.matrix_rows(&parts, Some(0), 64).unwrap()
        };
        let want = |names: &[&str]| {
            let ts: Vec<&Tensor> = names.iter().map(|n| &dense[*n]).collect();
            Tensor::cat(&ts, 0).unwrap()
        };
        // Packed alike: one packed matrix, the parts one above the other.
        match rows(&["a", "b"]) {
            Some(LoadedMatrix::Packed(p)) => {
                assert_eq!(p.out_dim(), 6);
                assert!(p.is_settled(), "loaded weights are marked settled");
                let got = p.dequantize(DType::F32).unwrap();
                assert_eq!(max_abs_diff(&got, &want(&["a", "b"])), 0.0);
            }
            other => panic!("expected one packed matrix, got {other:?}"),
        }
        // Dense parts stack dense.
        match rows(&["d", "d"]) {
            Some(LoadedMatrix::Dense(t)) => assert_eq!(max_abs_diff(&t, &want(&["d", "d"])), 0.0),
            other => panic!("expected one dense matrix, got {other:?}"),
        }
        // Different bit widths, or packed beside dense, do not stack.
        assert!(rows(&["a", "c"]).is_none());
        assert!(rows(&["a", "d"]).is_none());
    }
}
