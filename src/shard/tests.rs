//! The plan against the real Gemma 4 shapes and the fixtures, and the cuts against the whole
//! tensors they come from (dense and packed).

use std::ops::Range;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use super::slice::{apply_dense, apply_packed};
use super::*;
use crate::kernels::testutil::max_abs_diff;
use crate::kernels::{dequantize, quantize, QuantBits};
use crate::weights::{LoadedMatrix, WeightStore};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn real(name: &str) -> Config {
    let path = fixtures().join(format!("real-configs/{name}-config.json"));
    let text = std::fs::read_to_string(path).unwrap();
    Config::from_json(&serde_json::from_str(&text).unwrap(), None).unwrap()
}

/// Ranges that tile `0..len` in order.
fn assert_tiles(parts: &[Range<usize>], len: usize, what: &str) {
    let mut at = 0;
    for p in parts {
        assert_eq!(p.start, at, "{what}: {parts:?} do not tile 0..{len}");
        assert!(p.end > p.start, "{what}: empty part in {parts:?}");
        at = p.end;
    }
    assert_eq!(at, len, "{what}: {parts:?} do not tile 0..{len}");
}

fn one_range(s: &TensorSlice) -> Range<usize> {
    assert_eq!(s.ranges.len(), 1, "{s:?}");
    s.ranges[0].clone()
}

#[test]
fn partitions_tile_the_width_at_group_boundaries() {
    for (len, world) in [
        (21504, 2),
        (21504, 4),
        (704, 2),
        (2112, 2),
        (6144, 4),
        (96, 2),
        (32, 2),
    ] {
        let parts = partition(len, world);
        assert_tiles(&parts, len, &format!("{len} over {world}"));
    }
    // 31B's MLP splits evenly; 26B-A4B's experts at the 128 boundary nearest the middle, so a
    // packed group of 32, 64 or 128 is never cut.
    assert_eq!(partition(21504, 2), vec![0..10752, 10752..21504]);
    assert_eq!(partition(704, 2), vec![0..384, 384..704]);
    for p in partition(704, 2).iter().chain(&partition(21504, 4)) {
        assert_eq!(p.start % 128, 0);
    }
    // Too narrow for 128 per rank: smaller units.
    assert_eq!(partition(32, 2), vec![0..16, 16..32]);
}

#[test]
fn every_weight_of_the_real_shapes_is_tiled_by_the_ranks() {
    for (name, worlds) in [
        ("31b", &[2usize, 4][..]),
        ("26b-a4b", &[2, 4]),
        ("e2b", &[2, 4]),
        ("e4b", &[2, 4]),
    ] {
        let cfg = real(name);
        for &world in worlds {
            let plans: Vec<ShardPlan> = (0..world)
                .map(|r| ShardPlan::new(&cfg, r, world).unwrap())
                .collect();
            for (l, lp) in cfg.layers.iter().enumerate() {
                let hd = lp.head_dim;
                let get = |m: &str| -> Vec<TensorSlice> {
                    plans
                        .iter()
                        .map(|p| p.slice(&format!("layers.{l}.{m}")).unwrap())
                        .collect()
                };
                let q: Vec<_> = get("self_attn.q_proj").iter().map(one_range).collect();
                assert_tiles(&q, cfg.num_attention_heads * hd, "q rows");
                let o: Vec<_> = get("self_attn.o_proj").iter().map(one_range).collect();
                assert_eq!(
                    q, o,
                    "{name} layer {l}: o_proj columns follow the query heads"
                );
                let k: Vec<_> = get("self_attn.k_proj").iter().map(one_range).collect();
                if lp.kv_heads % world == 0 {
                    assert_tiles(&k, lp.kv_heads * hd, "kv rows");
                } else {
                    // Replicated: each rank holds the KV head its query heads read.
                    let group = cfg.num_attention_heads / lp.kv_heads;
                    for (r, p) in plans.iter().enumerate() {
                        let h = p.heads(l).unwrap();
                        assert_eq!(h.kv.len(), 1, "{name} rank {r}");
                        assert_eq!(h.kv.start, h.q.start / group);
                        assert_eq!(h.kv.start, (h.q.end - 1) / group);
                    }
                }
                let up: Vec<_> = get("mlp.up_proj").iter().map(one_range).collect();
                let down: Vec<_> = get("mlp.down_proj").iter().map(one_range).collect();
                assert_tiles(&up, lp.intermediate_size, "mlp width");
                assert_eq!(up, down, "down_proj columns follow gate/up rows");
                for s in get("mlp.down_proj") {
                    assert_eq!(s.axis, Axis::In);
                }
            }
            if let Some(m) = &cfg.moe {
                let get = |n: &str| -> Vec<TensorSlice> {
                    plans
                        .iter()
                        .map(|p| p.slice(&format!("layers.0.{n}")).unwrap())
                        .collect()
                };
                let down: Vec<_> = get("experts.down_proj").iter().map(one_range).collect();
                assert_tiles(&down, m.intermediate_size, "expert width");
                let gate: Vec<_> = get("experts.switch_glu.gate_proj")
                    .iter()
                    .map(one_range)
                    .collect();
                assert_eq!(gate, down);
                // HF's fused gate_up: the same part of the gate rows and of the up rows.
                for (fused, d) in get("experts.gate_up_proj").iter().zip(&down) {
                    let i = m.intermediate_size;
                    assert_eq!(fused.full, 2 * i);
                    assert_eq!(fused.ranges, vec![d.clone(), i + d.start..i + d.end]);
                }
            }
            for p in &plans {
                let local = p.local_config(&cfg);
                assert_eq!(local.num_attention_heads * world, cfg.num_attention_heads);
                for (l, lp) in local.layers.iter().enumerate() {
                    assert_eq!(lp.kv_heads, p.heads(l).unwrap().kv.len());
                }
                // Replicated weights have no slice.
                for n in ["embed_tokens", "lm_head", "layers.0.router.proj"] {
                    assert!(p.slice(n).is_none(), "{n}");
                }
                assert!(p.slice("layers.0.per_layer_input_gate").is_none());
            }
        }
    }
}

#[test]
fn heads_that_do_not_split_are_refused() {
    let cfg = real("31b");
    assert!(matches!(
        ShardPlan::new(&cfg, 0, 3),
        Err(Error::Config { .. })
    ));
    assert!(matches!(
        ShardPlan::new(&cfg, 2, 2),
        Err(Error::Config { .. })
    ));
}

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

#[test]
fn column_then_row_parallel_products_sum_to_the_whole() {
    // [out, in] weights: y = x · Wᵀ split by rows is the concatenation of the parts; split by
    // columns, the sum of the parts' products.
    let (x, w) = (randn(&[3, 256]), randn(&[96, 256]));
    let whole = x.matmul(&w.t().unwrap()).unwrap();
    for world in [2, 4] {
        let parts = partition(96, world);
        let rows: Vec<Tensor> = parts
            .iter()
            .map(|r| {
                let s = TensorSlice {
                    axis: Axis::Out,
                    full: 96,
                    ranges: vec![r.clone()],
                };
                x.matmul(&apply_dense(&w, &s).unwrap().t().unwrap())
                    .unwrap()
            })
            .collect();
        assert!(max_abs_diff(&Tensor::cat(&rows, 1).unwrap(), &whole) < 1e-3);
        let mut sum = whole.zeros_like().unwrap();
        for r in partition(256, world) {
            let s = TensorSlice {
                axis: Axis::In,
                full: 256,
                ranges: vec![r.clone()],
            };
            let xs = x.narrow(1, r.start, r.end - r.start).unwrap();
            let part = xs
                .matmul(&apply_dense(&w, &s).unwrap().t().unwrap())
                .unwrap();
            sum = (sum + part).unwrap();
        }
        assert!(max_abs_diff(&sum, &whole) < 1e-3);
    }
}

#[test]
fn packed_cuts_equal_cuts_of_the_dequantized_matrix() {
    for bits in [QuantBits::Four, QuantBits::Eight] {
        for group in [32, 64, 128] {
            // A stack of 2 experts of [16, 512], flattened as a checkpoint's is on load.
            let p = quantize(&randn(&[32, 512]), bits, group).unwrap();
            let dense = dequantize(&p).unwrap();
            let stack = dense.reshape((2, 16, 512)).unwrap();
            let rows = TensorSlice {
                axis: Axis::Out,
                full: 16,
                ranges: vec![2..6, 10..12],
            };
            let got = apply_packed(&p, &rows).unwrap().unwrap();
            assert_eq!(got.out_dim(), 12);
            let want = apply_dense(&stack, &rows)
                .unwrap()
                .reshape((12, 512))
                .unwrap();
            assert_eq!(max_abs_diff(&dequantize(&got).unwrap(), &want), 0.0);
            let cols = TensorSlice {
                axis: Axis::In,
                full: 512,
                ranges: std::iter::once(256..512).collect(),
            };
            let got = apply_packed(&p, &cols).unwrap().unwrap();
            assert_eq!(got.in_dim(), 256);
            let want = apply_dense(&dense, &cols).unwrap();
            assert_eq!(max_abs_diff(&dequantize(&got).unwrap(), &want), 0.0);
            // A cut inside a group is declined (the loader dequantizes).
            let inside = TensorSlice {
                axis: Axis::In,
                full: 512,
                ranges: std::iter::once(0..16).collect(),
            };
            assert!(apply_packed(&p, &inside).unwrap().is_none());
        }
    }
}

#[test]
fn fused_and_split_expert_layouts_cut_alike() {
    // HF: gate_up [E, 2I, H]; MLX: gate and up [E, I, H] each. A rank's fused part equals its
    // gate part over its up part, expert by expert.
    let (e, i, h) = (3, 64, 32);
    let (gate, up) = (randn(&[e, i, h]), randn(&[e, i, h]));
    let fused = Tensor::cat(&[&gate, &up], 1).unwrap();
    let mut cfg = real("26b-a4b");
    if let Some(m) = cfg.moe.as_mut() {
        m.intermediate_size = i;
    }
    for rank in 0..2 {
        let plan = ShardPlan::new(&cfg, rank, 2).unwrap();
        let f = plan.slice("layers.0.experts.gate_up_proj").unwrap();
        let g = plan.slice("layers.0.experts.switch_glu.gate_proj").unwrap();
        let got = apply_dense(&fused, &f).unwrap();
        let want = Tensor::cat(
            &[
                apply_dense(&gate, &g).unwrap(),
                apply_dense(&up, &g).unwrap(),
            ],
            1,
        )
        .unwrap();
        assert_eq!(max_abs_diff(&got, &want), 0.0);
    }
}

/// Every fixture loads on every rank of 2 (rank-local shapes line up with the checkpoint's),
/// and the parts of a sharded matrix join back into the whole.
#[test]
fn every_fixture_loads_sharded_over_two_ranks() {
    for fixture in [
        "dense-sharded",
        "e2b-hf",
        "e4b-text",
        "moe-mlx",
        "moe-q4",
        "e2b-q4",
        "e2b-q8",
    ] {
        let dir = fixtures().join(fixture);
        let cfg = Config::from_dir(&dir).unwrap();
        let whole = WeightStore::open(&dir, &Device::Cpu, DType::F32).unwrap();
        let mut parts = Vec::new();
        for rank in 0..2 {
            let plan = ShardPlan::new(&cfg, rank, 2).unwrap();
            let local = plan.local_config(&cfg);
            let store = WeightStore::open(&dir, &Device::Cpu, DType::F32)
                .unwrap()
                .with_shard(plan.clone());
            crate::gemma4::TextModel::new(local.clone(), &store)
                .unwrap_or_else(|e| panic!("{fixture} rank {rank}: {e}"));
            let w = local.layers[0].intermediate_size;
            let down = store
                .matrix("layers.0.mlp.down_proj", Some(0), &[cfg.hidden_size, w])
                .unwrap()
                .into_dense(DType::F32)
                .unwrap();
            parts.push(down);
        }
        let full_w = cfg.layers[0].intermediate_size;
        let want = whole
            .matrix(
                "layers.0.mlp.down_proj",
                Some(0),
                &[cfg.hidden_size, full_w],
            )
            .unwrap();
        let want = match want {
            LoadedMatrix::Dense(t) => t,
            LoadedMatrix::Packed(p) => p.dequantize(DType::F32).unwrap(),
        };
        let got = Tensor::cat(&parts, 1).unwrap();
        assert_eq!(max_abs_diff(&got, &want), 0.0, "{fixture}");
    }
}

#[test]
fn dense_widths_split_evenly_and_packed_ones_keep_their_groups() {
    // 26B-A4B's experts (704) and MLP (2112) in bf16: equal halves at the dense unit.
    let unit = cut_unit(None);
    assert_eq!(partition_in(704, 2, unit), vec![0..352, 352..704]);
    assert_eq!(partition_in(2112, 2, unit), vec![0..1056, 1056..2112]);
    // Packed at group 64: halves of 352 would cut a group, so the 128 cut stays.
    assert_eq!(partition_in(704, 2, cut_unit(Some(64))), partition(704, 2));
    assert_eq!(
        partition_in(2112, 2, cut_unit(Some(64))),
        partition(2112, 2)
    );
    // Group 32 packs split evenly too (352 = 11 groups).
    assert_eq!(
        partition_in(704, 2, cut_unit(Some(32))),
        vec![0..352, 352..704]
    );
    // Widths that do not split evenly keep the coarse cut.
    assert_eq!(partition_in(720, 2, unit), partition(720, 2));
    for (len, world, finest) in [(704, 2, 32), (2112, 4, 32), (6144, 4, 64), (96, 2, 32)] {
        let parts = partition_in(len, world, finest);
        assert_tiles(&parts, len, &format!("{len} over {world} at {finest}"));
        for p in &parts {
            assert_eq!(p.start % 32, 0, "{parts:?}");
        }
    }
    // A plan made with the dense unit gives rank 0 of 26B-A4B the even halves.
    let cfg = real("26b-a4b");
    let plan = ShardPlan::with_cut_unit(&cfg, 0, 2, unit).unwrap();
    let local = plan.local_config(&cfg);
    assert_eq!(local.moe.as_ref().unwrap().intermediate_size, 352);
    assert_eq!(local.layers[0].intermediate_size, 1056);
}
