//! Each cache kind alone against the full history: chunked prefill, long generation, trims,
//! typed errors, memory use, and random operation sequences.

use proptest::prelude::*;

use super::*;

#[test]
fn chunked_prefill_and_long_generation_match_full_history() {
    for window in [1, 2, 5, 8] {
        for (mut cache, win) in all_kinds(window) {
            let mut hist = History::new();
            let kind = cache.kind();
            // Chunks smaller, equal and larger than the window, then decode far past it.
            let chunks = [3, 1, window, 2 * window + 1, 1, 7];
            let mut seed = 100;
            for &n in chunks.iter().chain(std::iter::repeat_n(&1, 3 * window + 4)) {
                let d = step(&mut cache, &mut hist, win, n, seed);
                assert!(
                    d < TOL,
                    "{kind} window {window} chunk {n} at {}: diff {d}",
                    hist.len()
                );
                seed += 3;
            }
            if let CacheKind::Rotating { slots, .. } = kind {
                assert!(
                    cache.memory_bytes() <= slots * KVH * HD * 4 * 2,
                    "ring memory bounded by its slots"
                );
            }
        }
    }
}

#[test]
fn one_token_decode_on_a_full_ring_returns_exactly_the_window() {
    let mut c = RotatingCache::new(&spec(Some(4)), DType::F32).unwrap();
    c.update(&rand(1, (1, KVH, 9, HD)), &rand(2, (1, KVH, 9, HD)))
        .unwrap();
    let view = c
        .update(&rand(3, (1, KVH, 1, HD)), &rand(4, (1, KVH, 1, HD)))
        .unwrap();
    let KvView::Single { positions, .. } = view else {
        panic!("single")
    };
    let mut p = positions.to_vec();
    p.sort();
    assert_eq!(p, vec![6, 7, 8, 9]);
    assert_eq!(c.offsets(), vec![10]);
}

#[test]
fn trims() {
    let mut s = LayerCache::Simple(SimpleCache::new(&spec(None), DType::F32));
    let mut h = History::new();
    step(&mut s, &mut h, None, 6, 1);
    s.trim(4).unwrap();
    h.trim(4);
    assert_eq!(s.offsets(), vec![2]);
    assert!(step(&mut s, &mut h, None, 3, 5) < TOL);
    assert!(matches!(
        s.trim(9),
        Err(CacheError::CannotTrim {
            requested: 9,
            available: 5,
            ..
        })
    ));

    // A ring that has not wrapped trims freely; after wrapping only what the window still has.
    let mut r = LayerCache::Rotating(RotatingCache::new(&spec(Some(4)), DType::F32).unwrap());
    let mut h = History::new();
    step(&mut r, &mut h, Some(4), 3, 9);
    r.trim(2).unwrap();
    h.trim(2);
    assert!(step(&mut r, &mut h, Some(4), 2, 11) < TOL);
    step(&mut r, &mut h, Some(4), 6, 13);
    assert_eq!(r.trimmable(), 1);
    let err = r.trim(2).unwrap_err();
    assert!(
        matches!(
            err,
            CacheError::CannotTrim {
                requested: 2,
                available: 1,
                ..
            }
        ),
        "{err}"
    );
    r.trim(1).unwrap();
    h.trim(1);
    assert!(step(&mut r, &mut h, Some(4), 1, 15) < TOL);

    // Slack slots buy rollback after wrapping.
    let mut r =
        LayerCache::Rotating(RotatingCache::with_slack(&spec(Some(4)), 3, DType::F32).unwrap());
    let mut h = History::new();
    step(&mut r, &mut h, Some(4), 20, 17);
    assert_eq!(r.trimmable(), 4);
    r.trim(4).unwrap();
    h.trim(4);
    for i in 0..3 {
        assert!(step(&mut r, &mut h, Some(4), 1 + i, 19 + i as u64) < TOL);
    }
}

#[test]
fn quantized_start_converts_once_and_returns_packed() {
    let q = QuantSpec {
        bits: QuantBits::Eight,
        group_size: 32,
        start: 4,
    };
    let mut c = QuantizedCache::new(&spec(None), &q, DType::F32).unwrap();
    let v1 = c
        .update(&rand(1, (1, KVH, 3, HD)), &rand(2, (1, KVH, 3, HD)))
        .unwrap();
    assert!(matches!(
        v1,
        KvView::Single {
            data: KvData::Dense { .. },
            ..
        }
    ));
    let v2 = c
        .update(&rand(3, (1, KVH, 2, HD)), &rand(4, (1, KVH, 2, HD)))
        .unwrap();
    assert!(
        matches!(
            v2,
            KvView::Single {
                data: KvData::Dense { .. },
                ..
            }
        ),
        "3 < start: still dense"
    );
    let v3 = c
        .update(&rand(5, (1, KVH, 1, HD)), &rand(6, (1, KVH, 1, HD)))
        .unwrap();
    let KvView::Single {
        data: KvData::Packed { k, .. },
        positions,
    } = v3
    else {
        panic!("packed after start")
    };
    assert_eq!(positions.to_vec(), (0..6).collect::<Vec<_>>());
    assert_eq!(k.codes.dims(), &[1, KVH, 6, HD * 8 / 32]);
    assert!(c.is_packed());
}

#[test]
fn config_errors_are_typed() {
    let quant = |bits, group_size| CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size,
            start: 0,
        }),
    };
    let s = LayerCacheSpec {
        kv_heads: 1,
        head_dim: 96,
        window: None,
    };
    assert!(matches!(
        quant(QuantBits::Four, 64).build(&s, DType::BF16, &Device::Cpu),
        Err(CacheError::BadGroupSize {
            group_size: 64,
            head_dim: 96
        })
    ));
    assert!(matches!(
        quant(QuantBits::Four, 16).build(&spec(None), DType::BF16, &Device::Cpu),
        Err(CacheError::BadGroupSize { .. })
    ));
    assert!(matches!(
        QuantBits::from_bits(3),
        Err(KernelError::UnsupportedBits { bits: 3 })
    ));
    let zero_window = LayerCacheSpec {
        kv_heads: 1,
        head_dim: 32,
        window: Some(0),
    };
    assert!(matches!(
        CacheConfig::default().build(&zero_window, DType::BF16, &Device::Cpu),
        Err(CacheError::Config { .. })
    ));
    assert!(matches!(
        quant(QuantBits::Eight, 32).build(&spec(None), DType::U32, &Device::Cpu),
        Err(CacheError::DType { .. })
    ));
    // Each mode picks the documented cache per layer.
    let kinds = |mode| {
        let c = CacheConfig { mode };
        (
            c.build(&spec(Some(4)), DType::F32, &Device::Cpu)
                .unwrap()
                .kind(),
            c.build(&spec(None), DType::F32, &Device::Cpu)
                .unwrap()
                .kind(),
        )
    };
    assert_eq!(
        kinds(CacheMode::Simple),
        (CacheKind::Simple, CacheKind::Simple)
    );
    assert_eq!(
        kinds(CacheMode::default()),
        (
            CacheKind::Rotating {
                window: 4,
                slots: 4
            },
            CacheKind::Simple
        )
    );
    let (s, f) = kinds(CacheMode::Quantized(QuantSpec {
        bits: QuantBits::Four,
        group_size: 32,
        start: 0,
    }));
    assert_eq!(
        s,
        CacheKind::Quantized {
            bits: 4,
            group_size: 32,
            start: 0,
            window: Some(4)
        }
    );
    assert_eq!(
        f,
        CacheKind::Quantized {
            bits: 4,
            group_size: 32,
            start: 0,
            window: None
        }
    );
}

#[test]
fn bad_updates_are_typed() {
    let mut c = SimpleCache::new(&spec(None), DType::F32);
    let bad = rand(1, (1, KVH + 1, 2, HD));
    assert!(matches!(
        c.update(&bad, &bad),
        Err(CacheError::Shape { .. })
    ));
    let two = rand(1, (2, KVH, 2, HD));
    assert!(matches!(
        c.update(&two, &two),
        Err(CacheError::Shape { .. })
    ));
    let bf = rand(1, (1, KVH, 2, HD)).to_dtype(DType::BF16).unwrap();
    assert!(matches!(c.update(&bf, &bf), Err(CacheError::DType { .. })));
    assert_eq!(c.offsets(), vec![0]);
}

#[test]
fn memory_per_token() {
    // Bytes per token per KV head of one layer, K and V, scales and biases included.
    for hd in [256usize, 512] {
        let s = LayerCacheSpec {
            kv_heads: 1,
            head_dim: hd,
            window: None,
        };
        let tokens = 512; // a multiple of the growth step: capacity == tokens
        let x = Tensor::zeros((1, 1, tokens, hd), DType::BF16, &Device::Cpu).unwrap();
        let mut line = format!("head_dim {hd}:");
        for (name, cfg) in [
            (
                "bf16",
                CacheConfig {
                    mode: CacheMode::Simple,
                },
            ),
            ("8-bit", quant_cfg(QuantBits::Eight, 0)),
            ("4-bit", quant_cfg(QuantBits::Four, 0)),
        ] {
            let cfg = match cfg.mode {
                CacheMode::Quantized(mut q) => {
                    q.group_size = 64;
                    CacheConfig {
                        mode: CacheMode::Quantized(q),
                    }
                }
                m => CacheConfig { mode: m },
            };
            let mut c = cfg.build(&s, DType::BF16, &Device::Cpu).unwrap();
            c.update(&x, &x).unwrap();
            let per_token = c.memory_bytes() / tokens;
            let expected = match name {
                "bf16" => 2 * hd * 2,
                "8-bit" => 2 * (hd + 2 * (hd / 64) * 2),
                _ => 2 * (hd / 2 + 2 * (hd / 64) * 2),
            };
            assert_eq!(per_token, expected, "{name} hd {hd}");
            line += &format!(" {name} {per_token} B/token/kv-head;");
        }
        eprintln!("{line}");
    }
}

#[derive(Debug, Clone)]
enum Op {
    Update(usize),
    Trim(usize),
    SaveRestore,
    Clone,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1usize..12).prop_map(Op::Update),
        2 => (0usize..6).prop_map(Op::Trim),
        1 => Just(Op::SaveRestore),
        1 => Just(Op::Clone),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_operations_match_the_full_history(window in 1usize..7, kind in 0usize..8, ops in proptest::collection::vec(op(), 1..14)) {
        let (cache, win) = all_kinds(window).into_iter().nth(kind).unwrap();
        let mut cache = Some(cache);
        let mut hist = History::new();
        let mut seed = 1u64;
        for op in ops {
            let c = cache.as_mut().unwrap();
            match op {
                Op::Update(n) => {
                    let d = step(c, &mut hist, win, n, seed);
                    seed += 3;
                    prop_assert!(d < TOL, "{} window {window}: update {n} at {}: {d}", c.kind(), hist.len());
                }
                Op::Trim(n) => {
                    let can = c.trimmable();
                    match c.trim(n) {
                        Ok(()) => { prop_assert!(n <= can); hist.trim(n); }
                        Err(CacheError::CannotTrim { .. }) => prop_assert!(n > can),
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                    prop_assert_eq!(c.offsets()[0], hist.len());
                }
                Op::SaveRestore => {
                    let m = ModelCache { layers: vec![cache.take()] };
                    let tokens = (0..hist.len() as u32).collect();
                    let back = prompt_roundtrip(m, tokens, &format!("p{kind}-{seed}"));
                    cache = back.cache.layers.into_iter().next().flatten();
                }
                Op::Clone => {
                    let copy = c.deep_clone().unwrap();
                    // Write into the original; the copy, which carries on, must not see it.
                    let junk = rand(999, (1, KVH, 2, HD));
                    c.update(&junk, &junk).unwrap();
                    if c.trimmable() >= 1 {
                        c.trim(1).unwrap();
                        c.update(&junk.narrow(2, 0, 1).unwrap(), &junk.narrow(2, 0, 1).unwrap()).unwrap();
                    }
                    cache = Some(copy);
                }
            }
        }
    }
}
