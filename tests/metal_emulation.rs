//! The Metal kernels run on CPU threads against the CPU reference.
//!
//! No Mac and no Metal compiler exist where CI runs, so `qkernels.metal` is compiled as C++20
//! against `shim.h` (threadgroups as OS threads, barriers, SIMD sums) into the small driver of
//! `emulate.cpp`, and each case runs the launch plan the Metal launcher would dispatch
//! (`kernels::metal::plan`): the same parameters, grids, kernel names, buffer offsets and strides. This
//! checks the kernels' algorithm and the host's planning; it cannot check Metal's compiler,
//! fast math or the encoder calls.
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`). Without one the tests say so and pass, unless
//! `CANDLE_GEMMA_REQUIRE_METAL_EMU=1` (set by `.ci/run`) makes that a failure.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::metal::plan::{
    plan_attention, plan_dequant, plan_matvec, ATTENTION_THREADS, COMBINE_THREADS, DEQUANT_THREADS,
    MATVEC_WARPS,
};
use candle_gemma::kernels::qmatmul::qmatmul;
use candle_gemma::kernels::{attend, quantize, QueryPlan};
use candle_gemma::kv::{KeyPositions, KvData, KvView, PackedAffine, QuantBits};
use common::close::max_abs_diff;
use emulator::{emulator, pod_bytes, Job};

mod common;
#[path = "metal_emulation/emulator.rs"]
mod emulator;

/// Largest error a kernel output in `dtype` may show against the f32 reference: the rounding of
/// values of magnitude up to ~2, plus f32 noise.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

/// One attention case: a cache of `capacity` slots of which the first `keys` are viewed, at
/// `positions`, attended by `q_len` queries from `q_offset`.
struct AttentionCase {
    n_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    bits: QuantBits,
    group: usize,
    dtype: DType,
    keys: usize,
    capacity: usize,
    positions: KeyPositions,
    q_len: usize,
    q_offset: usize,
    window: Option<usize>,
    target_groups: usize,
}

/// Packed K or V `[1, kv_heads, keys, ..]` viewed from a cache of `capacity` slots (strided
/// unless `keys == capacity`).
fn packed_view(c: &AttentionCase, seed: f32) -> PackedAffine {
    let dense = Tensor::randn(
        0f32,
        1.0,
        (1, c.kv_heads, c.capacity, c.head_dim),
        &Device::Cpu,
    )
    .and_then(|t| t.affine(1.0, seed as f64))
    .and_then(|t| t.to_dtype(c.dtype))
    .expect("random K/V");
    let p = quantize(&dense, c.bits, c.group).expect("quantize");
    let view = |t: &Tensor| t.narrow(2, 0, c.keys).expect("narrow");
    PackedAffine::from_parts(
        view(&p.codes),
        view(&p.scales),
        view(&p.biases),
        candle_gemma::kernels::AffineSpec {
            bits: c.bits,
            group_size: c.group,
        },
    )
}

/// Random queries and packed K/V for a case, on the CPU.
fn attention_inputs(c: &AttentionCase) -> (Tensor, PackedAffine, PackedAffine) {
    let q = Tensor::randn(0f32, 0.3, (1, c.n_heads, c.q_len, c.head_dim), &Device::Cpu)
        .and_then(|t| t.to_dtype(c.dtype))
        .expect("random q");
    (q, packed_view(c, 0.0), packed_view(c, 0.1))
}

fn query_plan(c: &AttentionCase) -> QueryPlan {
    QueryPlan {
        q_offset: c.q_offset,
        window: c.window,
        scale: 1.0,
    }
}

/// The CPU reference kernel's output for a case.
fn cpu_reference(c: &AttentionCase, q: &Tensor, k: &PackedAffine, v: &PackedAffine) -> Tensor {
    let view = KvView::Single {
        data: KvData::Packed {
            k: k.clone(),
            v: v.clone(),
        },
        positions: c.positions.clone(),
    };
    attend(q, &view, &[c.q_offset], c.window, 1.0).expect("CPU reference")
}

/// The Metal kernels' output for a case, run on CPU threads from the launcher's plan.
fn emulate_attention(
    emulator: &Path,
    c: &AttentionCase,
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
) -> Tensor {
    let launch =
        plan_attention(q, k, v, &c.positions, &query_plan(c), c.target_groups).expect("plan");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    let offsets: Vec<usize> = [
        ("q", &launch.q),
        ("kc", &launch.k.codes),
        ("ks", &launch.k.scales),
        ("kb", &launch.k.biases),
        ("vc", &launch.v.codes),
        ("vs", &launch.v.scales),
        ("vb", &launch.v.biases),
    ]
    .iter()
    .map(|(name, t)| job.tensor(name, t))
    .collect();
    let table: Vec<u8> = launch.table.iter().flat_map(|x| x.to_le_bytes()).collect();
    job.load("table", &table);
    let out_len: usize = launch.out_dims.iter().product();
    job.alloc("out", out_len * c.dtype.size_in_bytes());
    job.alloc("ml", launch.partial_ml_len * 4);
    job.alloc("acc", launch.partial_acc_len * 4);
    let mut binds = vec![(0, "params", 0)];
    for (i, name) in ["q", "kc", "ks", "kb", "vc", "vs", "vb"].iter().enumerate() {
        binds.push((i + 1, name, offsets[i]));
    }
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
    job.run(emulator, "out", c.dtype, &launch.out_dims)
}

/// Positions of `keys` slots of a ring of `keys` that wrapped: the newest keys sit at the
/// start. `newest` is the position of the last key written.
fn wrapped(keys: usize, newest: usize, at: usize) -> KeyPositions {
    // Slot `at` holds `newest`; slots after it hold the oldest keys.
    let mut p = KeyPositions::new();
    let oldest = newest + 1 - keys;
    p.push_run(newest - at, at + 1);
    p.push_run(oldest, keys - at - 1);
    p
}

/// Attention cases covering the kernels' shapes, dtypes, masks, position encodings, strided
/// views and split counts.
fn attention_cases() -> Vec<AttentionCase> {
    let base = AttentionCase {
        n_heads: 8,
        kv_heads: 2,
        head_dim: 256,
        bits: QuantBits::Four,
        group: 64,
        dtype: DType::F32,
        keys: 300,
        capacity: 320,
        positions: KeyPositions::range(0..300),
        q_len: 1,
        q_offset: 300,
        window: None,
        target_groups: 256,
    };
    let table: KeyPositions = (0..300).map(|j| (j * 7) % 300).collect();
    vec![
        // Decode over a strided view (300 of 320 slots) and over whole buffers.
        base.clone_with(),
        AttentionCase {
            bits: QuantBits::Eight,
            group: 32,
            ..base.clone_with()
        },
        AttentionCase {
            keys: 1000,
            capacity: 1000,
            positions: KeyPositions::range(0..1000),
            q_offset: 1000,
            ..base.clone_with()
        },
        AttentionCase {
            keys: 1000,
            capacity: 1024,
            positions: KeyPositions::range(0..1000),
            q_offset: 1000,
            bits: QuantBits::Eight,
            group: 128,
            dtype: DType::BF16,
            ..base.clone_with()
        },
        // Head dims 512, 128 and 32; MQA and one query head per KV head.
        AttentionCase {
            head_dim: 512,
            n_heads: 4,
            kv_heads: 1,
            group: 128,
            dtype: DType::F16,
            ..base.clone_with()
        },
        AttentionCase {
            head_dim: 128,
            n_heads: 4,
            kv_heads: 4,
            group: 32,
            ..base.clone_with()
        },
        AttentionCase {
            head_dim: 32,
            n_heads: 6,
            kv_heads: 2,
            group: 32,
            bits: QuantBits::Eight,
            ..base.clone_with()
        },
        // A sliding window over a ring that wrapped (two position runs), decode and 3 queries.
        AttentionCase {
            keys: 64,
            capacity: 64,
            positions: wrapped(64, 499, 20),
            q_offset: 500,
            window: Some(64),
            dtype: DType::BF16,
            ..base.clone_with()
        },
        AttentionCase {
            keys: 64,
            capacity: 64,
            positions: wrapped(64, 501, 22),
            q_len: 3,
            q_offset: 499,
            window: Some(64),
            ..base.clone_with()
        },
        // Causal queries over the last keys, and positions from a table.
        AttentionCase {
            q_len: 5,
            q_offset: 295,
            ..base.clone_with()
        },
        AttentionCase {
            positions: table,
            q_len: 2,
            q_offset: 299,
            window: Some(100),
            bits: QuantBits::Eight,
            dtype: DType::F16,
            ..base.clone_with()
        },
    ]
}

/// Runs every attention case at two split targets (256 threadgroups, the launcher's, and 16,
/// which splits every view) through `run` and checks its max abs error against the tolerance.
fn check_attention_cases(what: &str, run: impl Fn(&AttentionCase) -> f32) {
    let mut worst = Vec::new();
    for (i, mut c) in attention_cases().into_iter().enumerate() {
        for target in [256, 16] {
            c.target_groups = target;
            let err = run(&c);
            let tol = tolerance(c.dtype);
            assert!(
                err <= tol,
                "{what}: case {i} ({:?}, {}-bit, head_dim {}, {} keys, target {target} groups): max abs error {err} > {tol}",
                c.dtype,
                c.bits.bits(),
                c.head_dim,
                c.keys
            );
            worst.push(err);
        }
    }
    eprintln!("{what}: max abs errors {worst:?}");
}

#[test]
fn metal_attention_kernels_match_the_cpu_reference_under_emulation() {
    let Some(emulator) = emulator() else { return };
    check_attention_cases("Metal attention under emulation", |c| {
        let (q, k, v) = attention_inputs(c);
        let reference = cpu_reference(c, &q, &k, &v);
        let got = emulate_attention(emulator, c, &q, &k, &v);
        max_abs_diff(&got, &reference)
    });
}

impl AttentionCase {
    fn clone_with(&self) -> Self {
        Self {
            positions: self.positions.clone(),
            ..*self
        }
    }
}

/// A packed `[out, in]` weight with scales in `scale_dtype`.
fn packed_weight(
    out: usize,
    inp: usize,
    bits: QuantBits,
    group: usize,
    scale_dtype: DType,
) -> PackedAffine {
    let dense = Tensor::randn(0f32, 0.05, (out, inp), &Device::Cpu)
        .and_then(|t| t.to_dtype(scale_dtype))
        .expect("random weight");
    let p = quantize(&dense, bits, group).expect("quantize");
    PackedAffine::new(p.codes, p.scales, p.biases, out, inp).expect("packed weight")
}

fn run_matvec_case(emulator: &Path, rows: usize, x_dtype: DType, w: &PackedAffine) -> f32 {
    let x = random_rows(rows, w, x_dtype);
    let reference = qmatmul(&x, w).expect("CPU reference");
    let launch = plan_matvec(rows, x_dtype, w).expect("matvec applies");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    let binds: Vec<(usize, &str, usize)> = [
        ("x", &x),
        ("c", &w.codes),
        ("s", &w.scales),
        ("b", &w.biases),
    ]
    .iter()
    .enumerate()
    .map(|(i, (name, t))| (i + 1, *name, job.tensor(name, t)))
    .collect();
    job.alloc("y", rows * w.out_dim() * x_dtype.size_in_bytes());
    let mut binds = [vec![(0, "params", 0)], binds, vec![(5, "y", 0)]].concat();
    binds.sort();
    job.dispatch(
        &launch.kernel,
        [launch.groups, 1, 1],
        MATVEC_WARPS * 32,
        &binds,
    );
    let got = job.run(emulator, "y", x_dtype, &[rows, w.out_dim()]);
    max_abs_diff(&got, &reference)
}

fn run_dequant_case(emulator: &Path, dtype: DType, w: &PackedAffine) -> f32 {
    let reference = w.dequantize(dtype).expect("CPU reference");
    let launch = plan_dequant(w, dtype).expect("dequant applies");
    let mut job = Job::new(&launch.kernel);
    job.load("params", &pod_bytes(&launch.params));
    job.load("use_idx", &0u32.to_le_bytes());
    let c = job.tensor("c", &w.codes);
    let s = job.tensor("s", &w.scales);
    let b = job.tensor("b", &w.biases);
    job.alloc("out", w.out_dim() * w.in_dim() * dtype.size_in_bytes());
    let groups = launch.threads.div_ceil(DEQUANT_THREADS);
    job.dispatch(
        &launch.kernel,
        [groups, 1, 1],
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
    let got = job.run(emulator, "out", dtype, &[w.out_dim(), w.in_dim()]);
    max_abs_diff(&got, &reference)
}

/// The weight cases: 4/8-bit codes, groups 32-128, scales in each float type, 36 outputs (the
/// last matvec threadgroup partly empty), 1, 3 and 8 activation rows.
fn check_weight_cases(
    what: &str,
    matvec: impl Fn(usize, DType, &PackedAffine) -> f32,
    dequant: impl Fn(DType, &PackedAffine) -> f32,
) {
    let mut worst = Vec::new();
    for (bits, group, scale_dtype) in [
        (QuantBits::Four, 64, DType::BF16),
        (QuantBits::Four, 32, DType::F16),
        (QuantBits::Eight, 128, DType::F32),
        (QuantBits::Eight, 64, DType::BF16),
    ] {
        let w = packed_weight(36, 256, bits, group, scale_dtype);
        for (rows, x_dtype) in [(1, DType::BF16), (3, DType::F32), (8, DType::F16)] {
            let err = matvec(rows, x_dtype, &w);
            // Sums of 256 products of ~0.05: the output rounding dominates.
            let tol = 2.0 * tolerance(x_dtype);
            assert!(
                err <= tol,
                "{what}: qmatvec {}-bit group {group}, scales {scale_dtype:?}, {rows} rows of {x_dtype:?}: max abs error {err} > {tol}",
                bits.bits()
            );
            worst.push(err);
        }
        for dtype in [DType::F32, DType::BF16] {
            let err = dequant(dtype, &w);
            let tol = 0.1 * tolerance(dtype);
            assert!(
                err <= tol,
                "{what}: dequant {}-bit group {group} to {dtype:?}: max abs error {err} > {tol}",
                bits.bits()
            );
            worst.push(err);
        }
    }
    eprintln!("{what}: max abs errors {worst:?}");
}

fn random_rows(rows: usize, w: &PackedAffine, dtype: DType) -> Tensor {
    Tensor::randn(0f32, 1.0, (rows, w.in_dim()), &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("random x")
}

#[test]
fn metal_weight_kernels_match_the_cpu_reference_under_emulation() {
    let Some(emulator) = emulator() else { return };
    check_weight_cases(
        "Metal weight kernels under emulation",
        |rows, dtype, w| run_matvec_case(emulator, rows, dtype, w),
        |dtype, w| run_dequant_case(emulator, dtype, w),
    );
    let w = packed_weight(8, 256, QuantBits::Four, 64, DType::F32);
    assert!(
        plan_matvec(9, DType::F32, &w).is_none(),
        "9 rows have no matvec kernel"
    );
}

/// The same cases on a real Metal device, through the launcher (runs on a Mac with
/// `cargo test --features metal`; elsewhere there is no device and it says so).
#[cfg(feature = "metal")]
#[test]
fn metal_kernels_match_the_cpu_reference_on_the_device() {
    let Ok(dev) = Device::new_metal(0) else {
        eprintln!("no Metal device: skipped");
        return;
    };
    let on = |t: &Tensor| t.to_device(&dev).expect("to Metal");
    let on_kv = |p: &PackedAffine| p.to_device(&dev).expect("to Metal");
    check_attention_cases("Metal attention on the device", |c| {
        let (q, k, v) = attention_inputs(c);
        let reference = cpu_reference(c, &q, &k, &v);
        let got = candle_gemma::kernels::metal::launch::attend_packed_with(
            &on(&q),
            &on_kv(&k),
            &on_kv(&v),
            &c.positions,
            &query_plan(c),
            c.target_groups,
        )
        .expect("Metal attention");
        max_abs_diff(&got.to_device(&Device::Cpu).expect("to CPU"), &reference)
    });
    let on_w = |w: &PackedAffine| {
        PackedAffine::new(
            on(&w.codes),
            on(&w.scales),
            on(&w.biases),
            w.out_dim(),
            w.in_dim(),
        )
        .expect("packed weight")
    };
    check_weight_cases(
        "Metal weight kernels on the device",
        |rows, dtype, w| {
            let x = random_rows(rows, w, dtype);
            let reference = qmatmul(&x, w).expect("CPU reference");
            let got = candle_gemma::kernels::metal::launch::qmatvec(&on(&x), &on_w(w))
                .expect("Metal matvec")
                .expect("matvec applies");
            max_abs_diff(&got.to_device(&Device::Cpu).expect("to CPU"), &reference)
        },
        |dtype, w| {
            let reference = w.dequantize(dtype).expect("CPU reference");
            let got = candle_gemma::kernels::metal::launch::dequantize_weight(&on_w(w), dtype)
                .expect("Metal dequantize")
                .expect("dequantize applies");
            max_abs_diff(&got.to_device(&Device::Cpu).expect("to CPU"), &reference)
        },
    );
}
