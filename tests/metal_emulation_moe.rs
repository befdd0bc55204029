//! The Metal MoE kernels under CPU emulation (see `tests/metal_emulation.rs` for how), at the
//! 26B-A4B MoE shapes (`../shared/gemma4/configs/26b-a4b-config.json`: 128 experts, top 8,
//! hidden 2816, expert width 704), chained as `kernels::metal::launch::moe_route` and
//! `moe_product` dispatch them in one job:
//!
//! - `moe_route_f32`: the picks equal the CPU routing's (`kernels::cpu::moe_route_row`, what
//!   the host path computes) and their weights equal it bit for bit, on logits with many ties
//!   and signed zeros;
//! - `moe_group`: every pair appears once, in its expert's segment, in token order, and the
//!   picked experts are listed in ascending order;
//! - `moe_qmatvec_*` (4 and 8 bits, scales in f32, f16 and bf16) and `moe_matvec_*` (dense
//!   stacks): the gate/up product (activations per token) and the down product (activations
//!   per pair) of every pair equal the host path's per-expert product (`qmatmul` over the
//!   expert's rows, or a dense matmul) within rounding. Output rows per expert are cut to 16
//!   (two threadgroups; each row is its own simdgroup, so more rows repeat the same work).
//!
//! One decode token (8 pairs, one per expert) and a 12-token chunk in which six experts take
//! every token (12 pairs each: two passes of the kernel's 8-pair step).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_gemma::kernels::cpu::moe_route_row;
use candle_gemma::kernels::metal::plan::{
    plan_moe_product, plan_moe_route, ExpertFormat, MoeProductLaunch, MATVEC_WARPS,
    MOE_GROUP_THREADS, MOE_ROUTE_THREADS,
};
use candle_gemma::kernels::qmatmul::qmatmul;
use candle_gemma::kernels::quantize;
use candle_gemma::kv::{PackedAffine, QuantBits};
use common::close::max_abs_diff;
use emulator::{emulator, pod_bytes, Job};

mod common;
#[path = "metal_emulation/emulator.rs"]
mod emulator;

const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const HIDDEN: usize = 2816;
const WIDTH: usize = 704;
/// Output rows per expert in the test stacks.
const ROWS: usize = 16;

fn random(dims: &[usize], std: f32, dtype: DType) -> Tensor {
    Tensor::randn(0f32, std, dims, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("random tensor")
}

fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

/// An expert stack `[EXPERTS * ROWS, in_dim]`: dense `[EXPERTS, ROWS, in_dim]`, or packed.
enum Stack {
    Dense(Tensor),
    Packed(PackedAffine),
}

impl Stack {
    fn new(in_dim: usize, packing: Option<(QuantBits, usize)>, dtype: DType) -> Self {
        let w = random(&[EXPERTS * ROWS, in_dim], 0.05, dtype);
        match packing {
            None => Stack::Dense(w.reshape((EXPERTS, ROWS, in_dim)).expect("reshape")),
            Some((bits, group)) => {
                let p = quantize(&w, bits, group).expect("quantize");
                Stack::Packed(
                    PackedAffine::new(p.codes, p.scales, p.biases, EXPERTS * ROWS, in_dim)
                        .expect("packed"),
                )
            }
        }
    }

    fn format(&self) -> ExpertFormat {
        match self {
            Stack::Dense(_) => ExpertFormat::Dense,
            Stack::Packed(p) => ExpertFormat::Packed {
                bits: p.bits,
                group_size: p.group_size,
                scale_dtype: p.scales.dtype(),
            },
        }
    }

    /// The host path's product of expert `e` (`ExpertWeights::product`): `x` `[n, in]`.
    fn product(&self, e: usize, x: &Tensor) -> Tensor {
        match self {
            Stack::Dense(t) => x
                .matmul(&t.get(e).and_then(|w| w.t()).expect("expert"))
                .expect("dense product"),
            Stack::Packed(p) => {
                qmatmul(x, &p.narrow_rows(e * ROWS, ROWS).expect("rows")).expect("qmatmul")
            }
        }
    }

    /// Loads the stack's buffers into `job` under `prefix`; the binds in kernel order.
    fn load(&self, job: &mut Job, prefix: &str) -> Vec<(String, usize)> {
        let parts: Vec<&Tensor> = match self {
            Stack::Dense(t) => vec![t],
            Stack::Packed(p) => vec![&p.codes, &p.scales, &p.biases],
        };
        parts
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let name = format!("{prefix}{i}");
                let offset = job.tensor(&name, &t.contiguous().expect("contiguous"));
                (name, offset)
            })
            .collect()
    }
}

/// Logits `[tokens, EXPERTS]` on a grid of halves (many ties, and both signed zeros), with
/// experts 0..6 lifted by 10 (above any other) for every token when `shared`.
fn logits(tokens: usize, shared: bool) -> Tensor {
    let l = random(&[tokens, EXPERTS], 1.5, DType::F32);
    let l = (l * 2.0).and_then(|t| t.round()).and_then(|t| t / 2.0);
    let mut rows = l.and_then(|t| t.to_vec2::<f32>()).expect("logits");
    for row in &mut rows {
        if shared {
            row.iter_mut().take(6).for_each(|v| *v += 10.0);
        }
        row[100] = -0.0;
        row[101] = 0.0;
    }
    Tensor::new(rows, &Device::Cpu).expect("logits")
}

fn dispatch_product(
    job: &mut Job,
    launch: &MoeProductLaunch,
    x: (&str, usize),
    stack: &[(String, usize)],
    y: &str,
) {
    let mut binds: Vec<(usize, &str, usize)> = vec![(0, "pa", 0), (1, x.0, x.1)];
    for (i, (name, offset)) in stack.iter().enumerate() {
        binds.push((2 + i, name.as_str(), *offset));
    }
    let next = 2 + stack.len();
    binds.extend([
        (next, "offsets", 0),
        (next + 1, "order", 0),
        (next + 2, "used", 0),
        (next + 3, y, 0),
    ]);
    job.load("pa", &pod_bytes(&launch.params));
    let [gx, gy] = launch.groups;
    job.dispatch(&launch.kernel, [gx, gy, 1], MATVEC_WARPS * 32, &binds);
}

/// What one emulated MoE layer gives back.
struct Emulated {
    idx: Vec<u32>,
    weights: Vec<f32>,
    offsets: Vec<u32>,
    order: Vec<u32>,
    used: Vec<u32>,
    gate_up: Tensor,
    down: Tensor,
}

/// Routing, grouping, the gate/up product of `x` `[tokens, HIDDEN]` and the down product of
/// `h` `[pairs, WIDTH]`, as the launcher chains them.
fn emulate_layer(
    emu: &Path,
    logits: &Tensor,
    scale: &Tensor,
    x: &Tensor,
    h: &Tensor,
    stacks: (&Stack, &Stack),
) -> Emulated {
    let tokens = x.dim(0).expect("tokens");
    let pairs = tokens * TOP_K;
    let dtype = x.dtype();
    let route = plan_moe_route(tokens, EXPERTS, TOP_K).expect("route applies");
    let mut job = Job::new("moe");
    job.load("params", &pod_bytes(&route.params));
    job.tensor("logits", logits);
    job.tensor("scale", scale);
    job.alloc("idx", pairs * 4);
    job.alloc("w", pairs * 4);
    job.dispatch(
        route.route_kernel,
        [route.route_groups, 1, 1],
        MOE_ROUTE_THREADS,
        &[
            (0, "params", 0),
            (1, "logits", 0),
            (2, "scale", 0),
            (3, "idx", 0),
            (4, "w", 0),
        ],
    );
    job.alloc("offsets", (EXPERTS + 1) * 4);
    job.alloc("order", pairs * 4);
    job.alloc("used", (EXPERTS + 1) * 4);
    job.alloc("cursor", EXPERTS * 4);
    job.dispatch(
        route.group_kernel,
        [1, 1, 1],
        MOE_GROUP_THREADS,
        &[
            (0, "params", 0),
            (1, "idx", 0),
            (2, "offsets", 0),
            (3, "order", 0),
            (4, "used", 0),
            (5, "cursor", 0),
        ],
    );
    let xo = job.tensor("x", x);
    let ho = job.tensor("h", h);
    let size = dtype.size_in_bytes();
    let gate_up = stacks.0.load(&mut job, "gu");
    let down = stacks.1.load(&mut job, "dn");
    let plan = |in_dim, per_token, stack: &Stack| {
        plan_moe_product(
            &route.params,
            ROWS,
            in_dim,
            dtype,
            per_token,
            stack.format(),
        )
        .expect("product applies")
    };
    job.alloc("y_gu", pairs * ROWS * size);
    dispatch_product(
        &mut job,
        &plan(HIDDEN, true, stacks.0),
        ("x", xo),
        &gate_up,
        "y_gu",
    );
    job.alloc("y_dn", pairs * ROWS * size);
    dispatch_product(
        &mut job,
        &plan(WIDTH, false, stacks.1),
        ("h", ho),
        &down,
        "y_dn",
    );
    let out = job.run_many(
        emu,
        &[
            ("idx", DType::U32, &[pairs]),
            ("w", DType::F32, &[pairs]),
            ("offsets", DType::U32, &[EXPERTS + 1]),
            ("order", DType::U32, &[pairs]),
            ("used", DType::U32, &[EXPERTS + 1]),
            ("y_gu", dtype, &[pairs, ROWS]),
            ("y_dn", dtype, &[pairs, ROWS]),
        ],
    );
    let u32s = |t: &Tensor| t.to_vec1::<u32>().expect("u32");
    Emulated {
        idx: u32s(&out[0]),
        weights: out[1].to_vec1::<f32>().expect("f32"),
        offsets: u32s(&out[2]),
        order: u32s(&out[3]),
        used: u32s(&out[4]),
        gate_up: out[5].clone(),
        down: out[6].clone(),
    }
}

/// The CPU routing of every token: `(expert, weight)` per pair, in pair order.
fn cpu_routes(logits: &Tensor, scale: &[f32]) -> Vec<(usize, f32)> {
    logits
        .to_vec2::<f32>()
        .expect("logits")
        .iter()
        .flat_map(|row| moe_route_row(row, TOP_K, scale))
        .collect()
}

/// Checks the grouping against the picks: a stable sort of the pairs by expert.
fn check_grouping(label: &str, e: &Emulated) {
    let mut seen = vec![false; e.idx.len()];
    let mut listed = Vec::new();
    for expert in 0..EXPERTS {
        let (lo, hi) = (e.offsets[expert] as usize, e.offsets[expert + 1] as usize);
        assert!(
            lo <= hi && hi <= e.order.len(),
            "{label}: offsets of {expert}"
        );
        if hi > lo {
            listed.push(expert as u32);
        }
        let slots = &e.order[lo..hi];
        assert!(
            slots.windows(2).all(|w| w[0] < w[1]),
            "{label}: order of {expert}"
        );
        for &p in slots {
            assert_eq!(
                e.idx[p as usize], expert as u32,
                "{label}: pair {p} grouped wrong"
            );
            assert!(
                !std::mem::replace(&mut seen[p as usize], true),
                "{label}: pair {p} twice"
            );
        }
    }
    assert!(seen.iter().all(|&s| s), "{label}: a pair is missing");
    let n = e.used[0] as usize;
    assert_eq!(&e.used[1..=n], listed.as_slice(), "{label}: picked experts");
}

/// The host path's products of every pair, in pair order: `[pairs, ROWS]` in f32.
fn reference(stack: &Stack, x: &Tensor, rows: impl Fn(usize) -> usize, picks: &[usize]) -> Tensor {
    let out: Vec<Tensor> = picks
        .iter()
        .enumerate()
        .map(|(p, &e)| {
            let xr = x.narrow(0, rows(p), 1).expect("row");
            stack.product(e, &xr).to_dtype(DType::F32).expect("f32")
        })
        .collect();
    Tensor::cat(&out, 0).expect("cat")
}

#[test]
fn moe_routing_grouping_and_expert_products_match_the_cpu_at_26b_a4b_shapes() {
    let Some(emu) = emulator() else { return };
    let packings: [(DType, Option<(QuantBits, usize)>); 5] = [
        (DType::BF16, Some((QuantBits::Four, 64))),
        (DType::F16, Some((QuantBits::Eight, 64))),
        (DType::F32, Some((QuantBits::Four, 32))),
        (DType::BF16, None),
        (DType::F32, None),
    ];
    let scale_row: Vec<f32> = (0..EXPERTS).map(|e| 0.5 + e as f32 / 64.0).collect();
    let scale = Tensor::new(scale_row.as_slice(), &Device::Cpu).expect("scale");
    let mut worst: Vec<(DType, f32)> = Vec::new();
    for (dtype, packing) in packings {
        let gate_up = Stack::new(HIDDEN, packing, dtype);
        let down = Stack::new(WIDTH, packing, dtype);
        for (tokens, shared) in [(1, false), (12, true)] {
            let label = format!("{dtype:?} {packing:?} {tokens} tokens");
            let l = logits(tokens, shared);
            let x = random(&[tokens, HIDDEN], 1.0, dtype);
            let h = random(&[tokens * TOP_K, WIDTH], 1.0, dtype);
            let got = emulate_layer(emu, &l, &scale, &x, &h, (&gate_up, &down));

            let want = cpu_routes(&l, &scale_row);
            let picks: Vec<usize> = want.iter().map(|&(e, _)| e).collect();
            let got_picks: Vec<usize> = got.idx.iter().map(|&e| e as usize).collect();
            assert_eq!(got_picks, picks, "{label}: picks");
            let bits = |w: &[f32]| w.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let want_w: Vec<f32> = want.iter().map(|&(_, w)| w).collect();
            assert_eq!(
                bits(&got.weights),
                bits(&want_w),
                "{label}: routing weights"
            );
            check_grouping(&label, &got);
            if shared {
                let most = (0..EXPERTS)
                    .map(|e| got.offsets[e + 1] - got.offsets[e])
                    .max();
                assert!(most > Some(8), "{label}: an expert takes more than 8 pairs");
            }

            for (name, y, stack, input, width, rows) in [
                ("gate/up", &got.gate_up, &gate_up, &x, HIDDEN, true),
                ("down", &got.down, &down, &h, WIDTH, false),
            ] {
                let want = if rows {
                    reference(stack, input, |p| p / TOP_K, &picks)
                } else {
                    reference(stack, input, |p| p, &picks)
                };
                let err = max_abs_diff(y, &want);
                let tol = 2.0 * (width as f32 / 256.0).sqrt() * tolerance(dtype);
                assert!(err <= tol, "{label} {name}: {err} > {tol}");
                worst.push((dtype, err));
            }
        }
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let errs = worst.iter().filter(|(d, _)| *d == dtype).map(|(_, e)| *e);
        let (n, max) = errs.fold((0, 0f32), |(n, m), e| (n + 1, m.max(e)));
        eprintln!("{dtype:?}: {n} MoE products match the CPU, worst error {max:e}");
    }
}
