//! The Metal kernels under CPU emulation (see `tests/metal_emulation.rs` for how) at the shapes
//! of the four Gemma 4 models' layers (E2B, E4B, 26B-A4B, 31B; `fixtures/real-configs`):
//!
//! - `quant_*`: K/V quantization into the cache, codes, scales and biases equal to the CPU's
//!   bit for bit, for every model's sliding and global K/V geometry;
//! - `dequant_*` with a row index: the embedding and PLE row gather;
//! - prefill attention over packed K/V (more queries than the fused kernel takes): K/V
//!   dequantized by the kernel, then dense attention, against the CPU's packed reference;
//! - decode attention (`qsdpa_*`) at every model's head geometry, plus head dims 64 and 128;
//! - `dequant_q41_*`: `Q4_1` blocks (a 4-bit matrix held only as candle blocks on a Mac) to
//!   dense, against candle's CPU dequantization, at every layer's input width;
//! - `qmatvec_*` (every row variant) and `dequant_*` at every layer's input width (output rows
//!   cut to a few threadgroups: each output row is its own simdgroup, so more rows repeat the
//!   same work).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::metal::plan::{
    plan_attention, plan_dequant_q41, plan_dequant_rows, plan_matvec, plan_quantize,
    ATTENTION_THREADS, COMBINE_THREADS, DEQUANT_THREADS, MATVEC_WARPS, QUANT_THREADS,
};
use candle_gemma::kernels::metal::q4_1::{q4_1_blocks, Q41Weight};
use candle_gemma::kernels::qmatmul::qembedding;
use candle_gemma::kernels::qmatmul::qmatmul;
use candle_gemma::kernels::{attend, quantize, AffineSpec, QueryPlan};
use candle_gemma::kv::{KeyPositions, KvData, KvView, PackedAffine, QuantBits};
use common::close::max_abs_diff;
use emulator::{emulator, pod_bytes, Job};

mod common;
#[path = "metal_emulation/emulator.rs"]
mod emulator;

/// One model's attention and MLP geometry.
struct Model {
    name: &'static str,
    hidden: usize,
    /// Dense MLP width (the MoE model's shared MLP).
    intermediate: usize,
    /// The MoE expert width, where there are experts.
    expert: Option<usize>,
    /// PLE table width (`layers * 256`), where there is one.
    ple: Option<usize>,
    n_heads: usize,
    /// (KV heads, head dim) of the sliding and the global layers.
    sliding: (usize, usize),
    global: (usize, usize),
}

const MODELS: [Model; 4] = [
    Model {
        name: "E2B",
        hidden: 1536,
        intermediate: 6144,
        expert: None,
        ple: Some(35 * 256),
        n_heads: 8,
        sliding: (1, 256),
        global: (1, 512),
    },
    Model {
        name: "E4B",
        hidden: 2560,
        intermediate: 10240,
        expert: None,
        ple: Some(42 * 256),
        n_heads: 8,
        sliding: (2, 256),
        global: (2, 512),
    },
    Model {
        name: "26B-A4B",
        hidden: 2816,
        intermediate: 2112,
        expert: Some(704),
        ple: None,
        n_heads: 16,
        sliding: (8, 256),
        global: (2, 512),
    },
    Model {
        name: "31B",
        hidden: 5376,
        intermediate: 21504,
        expert: None,
        ple: None,
        n_heads: 32,
        sliding: (16, 256),
        global: (4, 512),
    },
];

/// The KV-cache packings the crate offers (bits, group), one per model in turn.
const PACKINGS: [(QuantBits, usize); 4] = [
    (QuantBits::Four, 64),
    (QuantBits::Eight, 64),
    (QuantBits::Four, 32),
    (QuantBits::Eight, 128),
];
const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// Largest error an output in `dtype` may show against the f32 reference (as in
/// `metal_emulation.rs`): the rounding of values of magnitude up to ~2, plus f32 noise.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

fn random(dims: &[usize], std: f32, dtype: DType) -> Tensor {
    Tensor::randn(0f32, std, dims, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("random tensor")
}

/// The quantize kernel's codes, scales and biases for `x` `[.., dim]`.
fn emulate_quantize(emu: &Path, x: &Tensor, bits: QuantBits, group: usize) -> [Tensor; 3] {
    let dims = x.dims().to_vec();
    let dim = *dims.last().expect("rank");
    let rows = x.elem_count() / dim;
    let launch = plan_quantize(rows, dim, bits, group, x.dtype()).expect("quantize applies");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    let xo = job.tensor("x", &x.contiguous().expect("contiguous"));
    let (words, groups) = (dim * bits.bits() / 32, dim / group);
    let size = x.dtype().size_in_bytes();
    job.alloc("c", rows * words * 4);
    job.alloc("s", rows * groups * size);
    job.alloc("b", rows * groups * size);
    job.dispatch(
        &launch.kernel,
        [launch.threads.div_ceil(QUANT_THREADS), 1, 1],
        QUANT_THREADS,
        &[
            (0, "params", 0),
            (1, "x", xo),
            (2, "c", 0),
            (3, "s", 0),
            (4, "b", 0),
        ],
    );
    let with_last = |last: usize| {
        let mut d = dims.clone();
        *d.last_mut().expect("rank") = last;
        d
    };
    let (cd, sd) = (with_last(words), with_last(groups));
    let out = job.run_many(
        emu,
        &[
            ("c", DType::U32, cd.as_slice()),
            ("s", x.dtype(), sd.as_slice()),
            ("b", x.dtype(), sd.as_slice()),
        ],
    );
    [out[0].clone(), out[1].clone(), out[2].clone()]
}

fn same_bits(a: &Tensor, b: &Tensor) -> bool {
    let f = |t: &Tensor| -> Vec<u32> {
        match t.dtype() {
            DType::U32 => t.flatten_all().and_then(|t| t.to_vec1()).expect("u32"),
            _ => t
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("float")
                .into_iter()
                .map(f32::to_bits)
                .collect(),
        }
    };
    a.dims() == b.dims() && f(a) == f(b)
}

#[test]
fn kv_quantization_equals_the_cpu_bit_for_bit_at_every_models_kv_shape() {
    let Some(emu) = emulator() else { return };
    let mut cases = 0;
    for (m, (model, (bits, group))) in MODELS.iter().zip(PACKINGS).enumerate() {
        for (i, (kv_heads, head_dim)) in [model.sliding, model.global].into_iter().enumerate() {
            let dtype = DTYPES[(m + i) % 3];
            // K of a 7-token prefill chunk `[1, kv_heads, 7, head_dim]`, seen through a
            // transpose as the attention produces it.
            let x = random(&[1, 7, kv_heads, head_dim], 1.5, dtype)
                .transpose(1, 2)
                .expect("transpose");
            let want = quantize(&x, bits, group).expect("CPU quantize");
            let [c, s, b] = emulate_quantize(emu, &x, bits, group);
            let label = format!(
                "{} {kv_heads}x{head_dim} {dtype:?} {bits:?}/{group}",
                model.name
            );
            assert!(same_bits(&c, &want.codes), "{label}: codes");
            assert!(same_bits(&s, &want.scales), "{label}: scales");
            assert!(same_bits(&b, &want.biases), "{label}: biases");
            cases += 1;
        }
    }
    eprintln!("quant_*: {cases} K/V shapes equal the CPU bit for bit");
}

/// Rows `ids` of `table` gathered by the dequantize kernel's row selection.
fn emulate_gather(emu: &Path, table: &PackedAffine, ids: &[u32], dtype: DType) -> Tensor {
    let launch = plan_dequant_rows(table, Some(ids.len()), dtype).expect("gather applies");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    job.load("use_idx", &launch.use_idx.to_le_bytes());
    let idx: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    job.load("idx", &idx);
    let c = job.tensor("c", &table.codes);
    let s = job.tensor("s", &table.scales);
    let b = job.tensor("b", &table.biases);
    job.alloc("out", ids.len() * table.in_dim() * dtype.size_in_bytes());
    job.dispatch(
        &launch.kernel,
        [launch.threads.div_ceil(DEQUANT_THREADS), 1, 1],
        DEQUANT_THREADS,
        &[
            (0, "params", 0),
            (1, "c", c),
            (2, "s", s),
            (3, "b", b),
            (4, "idx", 0),
            (5, "use_idx", 0),
            (6, "out", 0),
        ],
    );
    job.run(emu, "out", dtype, &[ids.len(), table.in_dim()])
}

fn packed_table(
    rows: usize,
    width: usize,
    bits: QuantBits,
    group: usize,
    dtype: DType,
) -> PackedAffine {
    let p = quantize(&random(&[rows, width], 0.05, dtype), bits, group).expect("quantize");
    PackedAffine::new(p.codes, p.scales, p.biases, rows, width).expect("packed")
}

#[test]
fn embedding_and_ple_row_gather_matches_the_cpu_at_every_models_table_width() {
    let Some(emu) = emulator() else { return };
    let ids = [5u32, 0, 63, 5, 17, 40];
    let mut worst: Vec<f32> = Vec::new();
    for (m, model) in MODELS.iter().enumerate() {
        for width in std::iter::once(model.hidden).chain(model.ple) {
            let (bits, group) = PACKINGS[m];
            let dtype = DTYPES[m % 3];
            let table = packed_table(64, width, bits, group, dtype);
            let idx = Tensor::new(&ids[..], &Device::Cpu).expect("ids");
            let want = qembedding(&idx, &table, dtype).expect("CPU gather");
            let got = emulate_gather(emu, &table, &ids, dtype);
            let err = max_abs_diff(&got, &want);
            // The kernel's fma against the reference's multiply-then-add: within rounding.
            let tol = 0.1 * tolerance(dtype);
            assert!(
                err <= tol,
                "{} table width {width}: gather off by {err}",
                model.name
            );
            worst.push(err);
        }
    }
    eprintln!("dequant_* row gather: max abs errors {worst:?}");
}

/// Packed K or V `[1, kv_heads, keys, head_dim]` viewed in a cache of `capacity` slots.
fn packed_kv(
    kv_heads: usize,
    keys: usize,
    head_dim: usize,
    pack: (QuantBits, usize),
    dtype: DType,
) -> PackedAffine {
    let p = quantize(
        &random(&[1, kv_heads, keys + 16, head_dim], 1.0, dtype),
        pack.0,
        pack.1,
    )
    .expect("quantize");
    let view = |t: &Tensor| t.narrow(2, 0, keys).expect("view");
    PackedAffine::from_parts(view(&p.codes), view(&p.scales), view(&p.biases), p.spec())
}

/// K or V dequantized by the kernel the way the Metal prefill path does it (the view made
/// contiguous, flattened to rows, every row dequantized).
fn emulate_dequantize_view(emu: &Path, p: &PackedAffine, dtype: DType) -> Tensor {
    let rows = p.out_dim();
    let flat = |t: &Tensor| {
        let last = *t.dims().last().expect("rank");
        t.contiguous()
            .and_then(|t| t.reshape((rows, last)))
            .expect("flat")
    };
    let m = PackedAffine::from_parts(flat(&p.codes), flat(&p.scales), flat(&p.biases), p.spec());
    let launch = plan_dequant_rows(&m, None, dtype).expect("dequant applies");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    job.load("use_idx", &launch.use_idx.to_le_bytes());
    let c = job.tensor("c", &m.codes);
    let s = job.tensor("s", &m.scales);
    let b = job.tensor("b", &m.biases);
    job.alloc("out", rows * m.in_dim() * dtype.size_in_bytes());
    job.dispatch(
        &launch.kernel,
        [launch.threads.div_ceil(DEQUANT_THREADS), 1, 1],
        DEQUANT_THREADS,
        &[
            (0, "params", 0),
            (1, "c", c),
            (2, "s", s),
            (3, "b", b),
            (4, "c", c),
            (5, "use_idx", 0),
            (6, "out", 0),
        ],
    );
    job.run(emu, "out", dtype, &p.dims())
}

fn packed_view(k: &PackedAffine, v: &PackedAffine, positions: &KeyPositions) -> KvView {
    KvView::Single {
        data: KvData::Packed {
            k: k.clone(),
            v: v.clone(),
        },
        positions: positions.clone(),
    }
}

#[test]
fn prefill_attention_over_packed_kv_matches_the_cpu_at_every_models_geometry() {
    let Some(emu) = emulator() else { return };
    let (keys, q_len) = (96, 40);
    let positions = KeyPositions::range(0..keys);
    let mut worst = Vec::new();
    for (m, model) in MODELS.iter().enumerate() {
        for (kv_heads, head_dim) in [model.sliding, model.global] {
            let dtype = DTYPES[m % 3];
            let k = packed_kv(kv_heads, keys, head_dim, PACKINGS[m], dtype);
            let v = packed_kv(kv_heads, keys, head_dim, PACKINGS[m], dtype);
            let q = random(&[1, model.n_heads, q_len, head_dim], 0.3, dtype);
            let offset = [keys - q_len];
            let dense = |k: Tensor, v: Tensor| KvView::Single {
                data: KvData::Dense { k, v },
                positions: positions.clone(),
            };
            // The path as a Mac runs it: K/V dequantized by the kernel, dense attention.
            let got = attend(
                &q,
                &dense(
                    emulate_dequantize_view(emu, &k, dtype),
                    emulate_dequantize_view(emu, &v, dtype),
                ),
                &offset,
                Some(64),
                1.0,
            )
            .expect("dense attention");
            // The same dense attention over the CPU's dequantization: the kernel's part.
            let cpu_dense = |p: &PackedAffine| {
                candle_gemma::kernels::dequantize(p)
                    .and_then(|t| Ok(t.to_dtype(dtype)?))
                    .expect("CPU dequantize")
            };
            let want = attend(
                &q,
                &dense(cpu_dense(&k), cpu_dense(&v)),
                &offset,
                Some(64),
                1.0,
            )
            .expect("CPU dense");
            let err = max_abs_diff(&got, &want);
            let tol = tolerance(dtype);
            let label = format!("{} {kv_heads}x{head_dim} {dtype:?}", model.name);
            assert!(err <= tol, "{label}: {err} > {tol}");
            // In f32 the dense path also equals the packed reference (in bf16/f16 the dense
            // attention itself rounds, as on CUDA, where prefill takes the same path).
            if dtype == DType::F32 {
                let packed = attend(&q, &packed_view(&k, &v, &positions), &offset, Some(64), 1.0)
                    .expect("CPU packed reference");
                // Two summation orders over up to 512 dims: a little above the kernels' bound.
                let err = max_abs_diff(&got, &packed);
                assert!(err <= 5e-5, "{label}: {err} against the packed reference");
            }
            worst.push(err);
        }
    }
    eprintln!("prefill over packed K/V: max abs errors {worst:?}");
}

/// Decode attention through the fused kernel's launch plan.
fn emulate_decode(
    emu: &Path,
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &KeyPositions,
    plan: &QueryPlan,
) -> Tensor {
    let launch = plan_attention(q, k, v, positions, plan, 256).expect("plan");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    let names = ["q", "kc", "ks", "kb", "vc", "vs", "vb"];
    let tensors = [
        &launch.q,
        &launch.k.codes,
        &launch.k.scales,
        &launch.k.biases,
        &launch.v.codes,
        &launch.v.scales,
        &launch.v.biases,
    ];
    let mut binds = vec![(0, "params", 0)];
    for (i, (name, t)) in names.iter().zip(tensors).enumerate() {
        binds.push((i + 1, *name, job.tensor(name, t)));
    }
    let table: Vec<u8> = launch.table.iter().flat_map(|x| x.to_le_bytes()).collect();
    job.load("table", &table);
    let out_len: usize = launch.out_dims.iter().product();
    job.alloc("out", out_len * q.dtype().size_in_bytes());
    job.alloc("ml", launch.partial_ml_len * 4);
    job.alloc("acc", launch.partial_acc_len * 4);
    binds.extend([
        (8, "table", 0),
        (9, "out", 0),
        (10, "ml", 0),
        (11, "acc", 0),
    ]);
    job.dispatch(&launch.kernel, launch.groups, ATTENTION_THREADS, &binds);
    if let Some(combine) = &launch.combine {
        job.dispatch(
            combine,
            [launch.combine_groups, 1, 1],
            COMBINE_THREADS,
            &[(0, "params", 0), (1, "ml", 0), (2, "acc", 0), (3, "out", 0)],
        );
    }
    job.run(emu, "out", q.dtype(), &launch.out_dims)
}

/// A model's sliding and global (KV heads, head dim), and for the first model also head dims
/// 64 and 128, which no Gemma 4 layer uses but the library instantiates: every `qsdpa_*`
/// head dim runs here or in `metal_emulation.rs`.
fn decode_geometries(m: usize, model: &Model) -> Vec<(usize, usize)> {
    let mut g = vec![model.sliding, model.global];
    if m == 0 {
        g.extend([(2, 64), (1, 128)]);
    }
    g
}

#[test]
fn decode_attention_matches_the_cpu_at_every_models_head_geometry() {
    let Some(emu) = emulator() else { return };
    let keys = 600;
    let positions = KeyPositions::range(0..keys);
    let mut worst = Vec::new();
    for (m, model) in MODELS.iter().enumerate() {
        for (kv_heads, head_dim) in decode_geometries(m, model) {
            let dtype = DTYPES[m % 3];
            let k = packed_kv(kv_heads, keys, head_dim, PACKINGS[m], dtype);
            let v = packed_kv(kv_heads, keys, head_dim, PACKINGS[m], dtype);
            let q = random(&[1, model.n_heads, 1, head_dim], 0.3, dtype);
            let plan = QueryPlan {
                q_offset: keys,
                window: None,
                scale: 1.0,
            };
            let want = attend(&q, &packed_view(&k, &v, &positions), &[keys], None, 1.0)
                .expect("CPU reference");
            let got = emulate_decode(emu, &q, &k, &v, &positions, &plan);
            let err = max_abs_diff(&got, &want);
            let tol = tolerance(dtype);
            assert!(
                err <= tol,
                "{} {kv_heads}x{head_dim} {dtype:?}: {err} > {tol}",
                model.name
            );
            worst.push(err);
        }
    }
    eprintln!("qsdpa_* at model geometries: max abs errors {worst:?}");
}

/// `x` `[rows, in]` · `Wᵀ` through the matvec kernel's launch plan.
fn emulate_matvec(emu: &Path, x: &Tensor, w: &PackedAffine) -> Tensor {
    let rows = x.dim(0).expect("rows");
    let launch = plan_matvec(rows, x.dtype(), w).expect("matvec applies");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    let xo = job.tensor("x", x);
    let c = job.tensor("c", &w.codes);
    let s = job.tensor("s", &w.scales);
    let b = job.tensor("b", &w.biases);
    job.alloc("y", rows * w.out_dim() * x.dtype().size_in_bytes());
    job.dispatch(
        &launch.kernel,
        [launch.groups, 1, 1],
        MATVEC_WARPS * 32,
        &[
            (0, "params", 0),
            (1, "x", xo),
            (2, "c", c),
            (3, "s", s),
            (4, "b", b),
            (5, "y", 0),
        ],
    );
    job.run(emu, "y", x.dtype(), &[rows, w.out_dim()])
}

#[test]
fn weight_products_match_the_cpu_at_every_models_layer_widths() {
    let Some(emu) = emulator() else { return };
    let mut worst = Vec::new();
    for (m, model) in MODELS.iter().enumerate() {
        // Inputs of q/k/v/o/gate/up (hidden), down (the MLP width), expert down (the expert
        // width) and the PLE projection (hidden again).
        let widths = [Some(model.hidden), Some(model.intermediate), model.expert];
        for (i, width) in widths.into_iter().flatten().enumerate() {
            let (bits, group) = [(QuantBits::Four, 64), (QuantBits::Eight, 64)][(m + i) % 2];
            let dtype = DTYPES[(m + i) % 3];
            let w = packed_table(24, width, bits, group, dtype);
            // Every row variant of the kernel (1, 2, 4 and 8; 3 takes the 4-row one).
            for rows in [1, 2, 3, 8] {
                let x = random(&[rows, width], 1.0, dtype);
                let want = qmatmul(&x, &w).expect("CPU reference");
                let got = emulate_matvec(emu, &x, &w);
                let err = max_abs_diff(&got, &want);
                // Sums of `width` products of ~0.05: tolerance grows with sqrt(width).
                let scale = (width as f32 / 256.0).sqrt();
                let tol = 2.0 * scale * tolerance(dtype);
                assert!(
                    err <= tol,
                    "{} width {width} {dtype:?} {rows} rows: {err} > {tol}",
                    model.name
                );
                worst.push(err);
            }
            let want = w.dequantize(dtype).expect("CPU dequantize");
            let spec = AffineSpec {
                bits,
                group_size: group,
            };
            assert_eq!(w.spec(), spec);
            let got = emulate_dequantize_view(emu, &w, dtype);
            let err = max_abs_diff(&got, &want);
            assert!(
                err <= 0.1 * tolerance(dtype),
                "{} width {width}: dequant off by {err}",
                model.name
            );
        }
    }
    eprintln!("qmatvec_* at model widths: max abs errors {worst:?}");
}

/// A 4-bit matrix's `Q4_1` blocks dequantized by `dequant_q41_*`.
fn emulate_dequant_q41(emu: &Path, w: &PackedAffine, dtype: DType) -> Tensor {
    let blocks = q4_1_blocks(w).expect("reads").expect("maps exactly");
    let (rows, in_dim) = (w.out_dim(), w.in_dim());
    let launch = plan_dequant_q41(rows, in_dim, dtype).expect("applies");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    job.load("blocks", &blocks);
    job.alloc("out", rows * in_dim * dtype.size_in_bytes());
    job.dispatch(
        &launch.kernel,
        [launch.threads.div_ceil(DEQUANT_THREADS), 1, 1],
        DEQUANT_THREADS,
        &[(0, "params", 0), (1, "blocks", 0), (2, "out", 0)],
    );
    job.run(emu, "out", dtype, &[rows, in_dim])
}

#[test]
fn q4_1_blocks_dequantize_like_candle_at_every_models_layer_widths() {
    let Some(emu) = emulator() else { return };
    let mut worst = Vec::new();
    for (m, model) in MODELS.iter().enumerate() {
        let widths = [
            Some(model.hidden),
            Some(model.intermediate),
            model.expert,
            model.ple,
        ];
        for (i, width) in widths.into_iter().flatten().enumerate() {
            let dtype = DTYPES[(m + i) % 3];
            let group = [32, 64, 128][(m + i) % 3];
            let w = packed_table(24, width, QuantBits::Four, group, DType::BF16);
            let want = Q41Weight::from_packed(&w, &Device::Cpu)
                .expect("converts")
                .expect("maps exactly")
                .dequantize_host()
                .and_then(|t| Ok(t.to_dtype(dtype)?))
                .expect("candle's dequantization");
            let got = emulate_dequant_q41(emu, &w, dtype);
            let err = max_abs_diff(&got, &want);
            // The kernel's fma against candle's multiply-then-add: within rounding.
            assert!(
                err <= 0.1 * tolerance(dtype),
                "{} width {width} {dtype:?}: {err}",
                model.name
            );
            worst.push(err);
        }
    }
    eprintln!("dequant_q41_* at model widths: max abs errors {worst:?}");
}
