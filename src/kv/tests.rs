//! Cache tests: every cache kind against the simplest correct version (attention over the full
//! history with the window mask), for chunked prefill, long generation, trims, save/restore and
//! batching; plus a proptest driving random operation sequences.

use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;

use super::*;
use crate::kernels::{attend, dequantize, quantize};

const KVH: usize = 2;
const NH: usize = 4;
const HD: usize = 32;

fn rand(seed: u64, shape: (usize, usize, usize, usize)) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    flat(a)
        .iter()
        .zip(flat(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The full history of one sequence: what a perfect cache would hold.
struct History {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

impl History {
    fn new() -> Self {
        Self { k: None, v: None }
    }
    fn len(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dim(2).unwrap())
    }
    fn push(&mut self, k: &Tensor, v: &Tensor) {
        let cat = |a: &Option<Tensor>, b: &Tensor| match a {
            Some(a) => Tensor::cat(&[a, b], 2).unwrap(),
            None => b.clone(),
        };
        self.k = Some(cat(&self.k, k));
        self.v = Some(cat(&self.v, v));
    }
    fn trim(&mut self, n: usize) {
        let keep = self.len() - n;
        if keep == 0 {
            *self = Self::new();
        } else {
            self.k = Some(self.k.as_ref().unwrap().narrow(2, 0, keep).unwrap());
            self.v = Some(self.v.as_ref().unwrap().narrow(2, 0, keep).unwrap());
        }
    }
    /// Attention of `q` (queries at `q_off..`) over the whole history with the window mask;
    /// `quant`: the history as a quantized cache would hold it.
    fn attend(
        &self,
        q: &Tensor,
        q_off: usize,
        window: Option<usize>,
        quant: Option<QuantSpec>,
    ) -> Tensor {
        let (mut k, mut v) = (self.k.clone().unwrap(), self.v.clone().unwrap());
        if let Some(qs) = quant {
            k = dequantize(&quantize(&k, qs.bits, qs.group_size).unwrap()).unwrap();
            v = dequantize(&quantize(&v, qs.bits, qs.group_size).unwrap()).unwrap();
        }
        let view = KvView::Single {
            data: KvData::Dense { k, v },
            positions: (0..self.len()).collect(),
        };
        attend(q, &view, &[q_off], window, 1.0).unwrap()
    }
}

fn spec(window: Option<usize>) -> LayerCacheSpec {
    LayerCacheSpec {
        kv_heads: KVH,
        head_dim: HD,
        window,
    }
}

/// One step on a cache and the reference; returns the max |difference| of the outputs.
fn step(
    cache: &mut LayerCache,
    hist: &mut History,
    window: Option<usize>,
    n: usize,
    seed: u64,
) -> f32 {
    let q_off = cache.offsets()[0];
    assert_eq!(q_off, hist.len());
    let k = rand(seed, (1, KVH, n, HD));
    let v = rand(seed + 1, (1, KVH, n, HD));
    let q = rand(seed + 2, (1, NH, n, HD));
    let view = cache.update(&k, &v).unwrap();
    hist.push(&k, &v);
    let quant = match (&view, cache.kind()) {
        (
            KvView::Single {
                data: KvData::Packed { .. },
                ..
            },
            CacheKind::Quantized {
                bits,
                group_size,
                start,
                ..
            },
        ) => Some(QuantSpec {
            bits: QuantBits::from_bits(bits).unwrap(),
            group_size,
            start,
        }),
        _ => None,
    };
    let got = attend(&q, &view, &[q_off], window, 1.0).unwrap();
    let want = hist.attend(&q, q_off, window, quant);
    max_diff(&got, &want)
}

fn all_kinds(window: usize) -> Vec<(LayerCache, Option<usize>)> {
    let w = Some(window);
    let q = |bits, start| QuantSpec {
        bits,
        group_size: 32,
        start,
    };
    vec![
        (
            LayerCache::Simple(SimpleCache::new(&spec(None), DType::F32)),
            None,
        ),
        (
            LayerCache::Simple(SimpleCache::new(&spec(None), DType::F32)),
            w,
        ),
        (
            LayerCache::Rotating(RotatingCache::new(&spec(w), DType::F32).unwrap()),
            w,
        ),
        (
            LayerCache::Rotating(RotatingCache::with_slack(&spec(w), 3, DType::F32).unwrap()),
            w,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(None), &q(QuantBits::Eight, 0), DType::F32).unwrap(),
            ),
            None,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(None), &q(QuantBits::Four, 5), DType::F32).unwrap(),
            ),
            None,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(w), &q(QuantBits::Four, 0), DType::F32).unwrap(),
            ),
            w,
        ),
        (
            LayerCache::Quantized(
                QuantizedCache::new(&spec(w), &q(QuantBits::Eight, 7), DType::F32).unwrap(),
            ),
            w,
        ),
    ]
}

const TOL: f32 = 1e-4;

#[test]
fn chunked_prefill_and_long_generation_match_full_history() {
    for window in [1, 2, 5, 8] {
        for (mut cache, win) in all_kinds(window) {
            let mut hist = History::new();
            let kind = cache.kind();
            // Chunks smaller, equal and larger than the window, then decode far past it.
            let chunks = [3, 1, window, 2 * window + 1, 1, 7];
            let mut seed = 100;
            for &n in chunks
                .iter()
                .chain(std::iter::repeat(&1).take(3 * window + 4))
            {
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
        Err(CacheError::UnsupportedBits { bits: 3 })
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
fn batch_equals_single_sequences_and_supports_push_remove() {
    for window in [3usize, 6] {
        let kinds: Vec<_> = (0..3).map(|_| all_kinds(window)).collect();
        for idx in 0..kinds[0].len() {
            let mut singles: Vec<(LayerCache, History)> = Vec::new();
            let mut batch_members = Vec::new();
            let win = kinds[0][idx].1;
            // Three sequences prefilled separately with different lengths.
            let mut all = kinds
                .iter()
                .map(|k| k.iter().map(|(c, _)| c.kind()).collect::<Vec<_>>())
                .collect::<Vec<_>>();
            let _ = &mut all;
            for (s, len) in [(0usize, 2usize), (1, 5), (2, 9)] {
                let mut fresh = all_kinds(window).into_iter().nth(idx).unwrap().0;
                let mut twin = all_kinds(window).into_iter().nth(idx).unwrap().0;
                let mut h = History::new();
                let k = rand(50 + s as u64, (1, KVH, len, HD));
                let v = rand(60 + s as u64, (1, KVH, len, HD));
                fresh.update(&k, &v).unwrap();
                twin.update(&k, &v).unwrap();
                h.push(&k, &v);
                batch_members.push(fresh);
                singles.push((twin, h));
            }
            let joiner = batch_members.pop().unwrap();
            let mut batch = LayerCache::Batch(BatchCache::new(batch_members).unwrap());
            for t in 0..6u64 {
                if t == 2 {
                    // Continuous batching: the third sequence joins between steps.
                    let LayerCache::Batch(b) = &mut batch else {
                        unreachable!()
                    };
                    b.push(joiner.deep_clone().unwrap()).unwrap();
                    assert!(matches!(
                        b.push(LayerCache::Batch(BatchCache::default())),
                        Err(CacheError::NestedBatch)
                    ));
                }
                let live = match &batch {
                    LayerCache::Batch(b) => b.len(),
                    _ => unreachable!(),
                };
                let offsets = batch.offsets();
                let k = rand(200 + t, (live, KVH, 1, HD));
                let v = rand(300 + t, (live, KVH, 1, HD));
                let q = rand(400 + t, (live, NH, 1, HD));
                let view = batch.update(&k, &v).unwrap();
                let got = attend(&q, &view, &offsets, win, 1.0).unwrap();
                for b in 0..live {
                    let (cache, _) = &mut singles[b];
                    assert_eq!(cache.offsets()[0], offsets[b]);
                    let sv = cache
                        .update(&k.narrow(0, b, 1).unwrap(), &v.narrow(0, b, 1).unwrap())
                        .unwrap();
                    let want =
                        attend(&q.narrow(0, b, 1).unwrap(), &sv, &[offsets[b]], win, 1.0).unwrap();
                    let d = max_diff(&got.narrow(0, b, 1).unwrap(), &want);
                    assert!(d == 0.0, "batch vs single, kind {idx}, seq {b}: {d}");
                }
                if t == 4 {
                    let LayerCache::Batch(bc) = &mut batch else {
                        unreachable!()
                    };
                    bc.remove(0).unwrap();
                    singles.remove(0);
                    assert!(matches!(
                        bc.remove(7),
                        Err(CacheError::SequenceIndex { index: 7, len: 2 })
                    ));
                }
            }
        }
    }
}

fn quant_cfg(bits: QuantBits, start: usize) -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 32,
            start,
        }),
    }
}

#[test]
fn model_cache_batching_helpers() {
    let specs = [Some(spec(Some(4))), Some(spec(None)), None];
    let mk = |len: usize| {
        let mut m =
            ModelCache::new(&CacheConfig::default(), &specs, DType::F32, &Device::Cpu).unwrap();
        for c in m.layers.iter_mut().flatten() {
            c.update(
                &rand(len as u64, (1, KVH, len, HD)),
                &rand(1, (1, KVH, len, HD)),
            )
            .unwrap();
        }
        m
    };
    let mut b = ModelCache::batch(vec![mk(3), mk(7)]).unwrap();
    assert_eq!(b.batch_size(), 2);
    assert_eq!(b.offsets(), vec![3, 7]);
    assert!(b.layers[2].is_none());
    b.push_sequence(mk(1)).unwrap();
    assert_eq!(b.offsets(), vec![3, 7, 1]);
    let single = b.remove_sequence(1).unwrap();
    assert_eq!(single.offsets(), vec![7]);
    assert_eq!(b.offsets(), vec![3, 1]);
    assert!(matches!(
        mk(2).push_sequence(mk(1)),
        Err(CacheError::NotBatched)
    ));
    let nested = ModelCache::batch(vec![mk(1)]).unwrap();
    assert!(matches!(
        b.push_sequence(nested),
        Err(CacheError::NestedBatch)
    ));
    let other = ModelCache::new(
        &quant_cfg(QuantBits::Four, 0),
        &specs,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert!(matches!(
        b.push_sequence(other),
        Err(CacheError::Layout { layer: 0, .. })
    ));
    // Trim is all-or-nothing across layers.
    let mut m = mk(9);
    let before = m.offsets();
    assert!(matches!(m.trim(3), Err(CacheError::CannotTrim { .. })));
    assert_eq!(m.offsets(), before);
    m.reset();
    assert_eq!(m.offsets(), vec![0]);
    assert_eq!(m.memory_bytes(), 0);
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

fn prompt_roundtrip(cache: ModelCache, tokens: Vec<u32>, name: &str) -> PromptCache {
    let meta = CacheMeta::of(&cache, DType::F32, "test-model");
    let pc = PromptCache::new(tokens, cache, meta);
    let dir = std::env::temp_dir().join(format!(
        "kv-prompt-{}-{name}.safetensors",
        std::process::id()
    ));
    pc.save(&dir).unwrap();
    let back = PromptCache::load(&dir, &Device::Cpu).unwrap();
    let _ = std::fs::remove_file(&dir);
    assert_eq!(back.tokens, pc.tokens);
    assert_eq!(back.meta, pc.meta);
    back
}

#[test]
fn prompt_cache_save_load_and_checks() {
    let w = 4;
    for (i, (cache, win)) in all_kinds(w).into_iter().enumerate() {
        let mut hist = History::new();
        let mut cache = cache;
        for (j, n) in [5usize, 1, 3].into_iter().enumerate() {
            step(&mut cache, &mut hist, win, n, 10 * j as u64 + 1);
        }
        let m = ModelCache {
            layers: vec![Some(cache), None],
        };
        let tokens: Vec<u32> = (0..9).collect();
        let back = prompt_roundtrip(m, tokens, &format!("k{i}"));
        let mut cache = back.cache.layers.into_iter().next().flatten().unwrap();
        for (j, n) in [1usize, 2, 6].into_iter().enumerate() {
            let d = step(&mut cache, &mut hist, win, n, 100 + 10 * j as u64);
            assert!(d < TOL, "after restore, kind {i}: {d}");
        }
    }
    // restore_check names the difference.
    let specs = [Some(spec(Some(4))), Some(spec(None))];
    let saved = CacheMeta::new(&quant_cfg(QuantBits::Four, 0), &specs, DType::F32, "m").unwrap();
    let want = |cfg: &CacheConfig, dtype, fp: &str| CacheMeta::new(cfg, &specs, dtype, fp).unwrap();
    let field = |r: Result<(), CacheError>| match r {
        Err(CacheError::Mismatch { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert!(saved
        .check(&want(&quant_cfg(QuantBits::Four, 0), DType::F32, "m"))
        .is_ok());
    assert_eq!(
        field(saved.check(&want(&quant_cfg(QuantBits::Eight, 0), DType::F32, "m"))),
        "bits of layer 0"
    );
    assert_eq!(
        field(saved.check(&want(&quant_cfg(QuantBits::Four, 9), DType::F32, "m"))),
        "start of layer 0"
    );
    assert_eq!(
        field(saved.check(&want(&CacheConfig::default(), DType::F32, "m"))),
        "kind of layer 0"
    );
    assert_eq!(
        field(saved.check(&want(&quant_cfg(QuantBits::Four, 0), DType::BF16, "m"))),
        "dtype"
    );
    assert_eq!(
        field(saved.check(&want(&quant_cfg(QuantBits::Four, 0), DType::F32, "other"))),
        "fingerprint"
    );
    // A batch cannot be saved.
    let batch = ModelCache::batch(vec![ModelCache::new(
        &CacheConfig::default(),
        &specs,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()])
    .unwrap();
    let pc = PromptCache::new(vec![], batch, saved.clone());
    assert!(matches!(
        pc.save(std::env::temp_dir().join("never.safetensors")),
        Err(CacheError::Batched { .. })
    ));
    // Not a prompt cache file.
    let bogus = std::env::temp_dir().join(format!("kv-bogus-{}.safetensors", std::process::id()));
    std::fs::write(&bogus, b"not safetensors").unwrap();
    assert!(matches!(
        PromptCache::load(&bogus, &Device::Cpu),
        Err(CacheError::Format { .. })
    ));
    let _ = std::fs::remove_file(&bogus);
    assert!(matches!(
        PromptCache::load("/nonexistent/x.safetensors", &Device::Cpu),
        Err(CacheError::Io { .. })
    ));
}

#[test]
fn prompt_cache_reuse_trims_to_the_common_prefix() {
    let specs = [Some(spec(None))];
    let cfg = CacheConfig::default();
    let mut m = ModelCache::new(&cfg, &specs, DType::F32, &Device::Cpu).unwrap();
    let mut hist = History::new();
    step(m.layers[0].as_mut().unwrap(), &mut hist, None, 6, 3);
    let meta = CacheMeta::new(&cfg, &specs, DType::F32, "m").unwrap();
    let pc = PromptCache::new(vec![1, 2, 3, 4, 5, 6], m, meta.clone());
    let copy = pc.deep_clone().unwrap();
    assert_eq!(pc.common_prefix(&[1, 2, 3, 9]), 3);
    let (cache, n) = pc.reuse(&meta, &[1, 2, 3, 9, 9]).unwrap();
    assert_eq!((n, cache.offsets()), (3, vec![3]));
    // The whole prompt cached: one token is left to feed.
    let (cache, n) = copy
        .deep_clone()
        .unwrap()
        .reuse(&meta, &[1, 2, 3, 4, 5, 6])
        .unwrap();
    assert_eq!((n, cache.offsets()), (5, vec![5]));
    // The deep copy is independent of the cache it came from.
    assert_eq!(copy.cache.offsets(), vec![6]);
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

/// Writes values into a (strided) view in place on the CPU, as the CUDA kernel writes a cache's
/// reserved slots.
enum FillView {
    /// Into an f32 view (dense K/V, scales, biases).
    F32(Vec<f32>),
    /// Into a u32 view (packed codes).
    U32(Vec<u32>),
}

/// Writes `values` into the view `layout` of `data`, row-major over the view's dims and
/// addressed through its strides.
fn fill_strided<T: Copy>(data: &mut [T], layout: &candle_core::Layout, values: &[T]) {
    let (dims, stride) = (layout.dims(), layout.stride());
    for (i, value) in values.iter().enumerate() {
        let (mut rest, mut at) = (i, layout.start_offset());
        for d in (0..dims.len()).rev() {
            at += (rest % dims[d]) * stride[d];
            rest /= dims[d];
        }
        data[at] = *value;
    }
}

impl candle_core::InplaceOp1 for FillView {
    fn name(&self) -> &'static str {
        "fill-view"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        match (storage, self) {
            (candle_core::CpuStorage::F32(data), FillView::F32(v)) => fill_strided(data, layout, v),
            (candle_core::CpuStorage::U32(data), FillView::U32(v)) => fill_strided(data, layout, v),
            _ => candle_core::bail!("fill-view: the view's dtype differs from the values'"),
        }
        Ok(())
    }
}

/// Writes the CPU reference quantization of `k`, `v` into packed slots (codes, scales, biases
/// of K then of V), as the CUDA kernel does in place.
fn write_packed_slots(slots: &[Tensor], k: &Tensor, v: &Tensor, bits: QuantBits) {
    let (pk, pv) = (
        quantize(k, bits, 32).unwrap(),
        quantize(v, bits, 32).unwrap(),
    );
    let parts = [
        &pk.codes, &pk.scales, &pk.biases, &pv.codes, &pv.scales, &pv.biases,
    ];
    for (slot, part) in slots.iter().zip(parts) {
        if part.dtype() == DType::U32 {
            let words = part.flatten_all().unwrap().to_vec1::<u32>().unwrap();
            slot.inplace_op1(&FillView::U32(words)).unwrap();
        } else {
            slot.inplace_op1(&FillView::F32(flat(part))).unwrap();
        }
    }
}

/// Packed quantized caches offer their next slots once packed (growing and ring, 4 and 8 bits,
/// packed from the start or later, alone or as a batch of one): tokens quantized into them
/// attend exactly as through `update` of a twin cache, and a mark taken once packed undoes
/// committed slots.
#[test]
fn packed_slots_written_in_place_match_update() {
    let q = |bits, start| QuantSpec {
        bits,
        group_size: 32,
        start,
    };
    let w = Some(4);
    let quantized = |window: Option<usize>, bits, start| {
        LayerCache::Quantized(
            QuantizedCache::new(&spec(window), &q(bits, start), DType::F32).unwrap(),
        )
    };
    let one = |c: LayerCache| LayerCache::Batch(BatchCache::new(vec![c]).unwrap());
    // (window, bits, start, as a batch of one)
    let kinds = [
        (None, QuantBits::Four, 0, false),
        (None, QuantBits::Eight, 3, false),
        (w, QuantBits::Four, 0, false),
        (w, QuantBits::Eight, 5, false),
        (w, QuantBits::Four, 0, true),
    ];
    for (window, bits, start, batch) in kinds {
        let make = || {
            let c = quantized(window, bits, start);
            if batch {
                one(c)
            } else {
                c
            }
        };
        let (mut cache, mut twin) = (make(), make());
        let kind = cache.kind();
        assert!(
            cache.reserve_slots(1, &Device::Cpu).unwrap().is_none(),
            "{kind}: dense slots"
        );
        let mut in_place = 0;
        for (i, n) in [2usize, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1]
            .into_iter()
            .enumerate()
        {
            let seed = 5000 + 10 * i as u64;
            let q_off = cache.offsets()[0];
            let k = rand(seed, (1, KVH, n, HD));
            let v = rand(seed + 1, (1, KVH, n, HD));
            let q = rand(seed + 2, (1, NH, n, HD));
            let view = match cache.reserve_packed_slots(n, &Device::Cpu).unwrap() {
                Some(slots) => {
                    assert!(cache.mark().is_some(), "{kind}: packed without a mark");
                    write_packed_slots(&slots, &k, &v, bits);
                    in_place += 1;
                    cache.commit_slots(n).unwrap()
                }
                None => {
                    if cache.mark().is_none() {
                        assert!(
                            cache.commit_slots(n).is_err(),
                            "{kind}: commit before packed"
                        );
                    }
                    cache.update(&k, &v).unwrap()
                }
            };
            let want_view = twin.update(&k, &v).unwrap();
            let got = attend(&q, &view, &[q_off], window, 1.0).unwrap();
            let want = attend(&q, &want_view, &[q_off], window, 1.0).unwrap();
            assert!(max_diff(&got, &want) < 1e-6, "{kind} step {i}");
        }
        assert!(in_place >= 6, "{kind}: {in_place} in-place writes");
        // A mark undoes two committed, never written, single-token steps.
        let mark = cache.mark().expect("packed caches have marks");
        let (offsets, trimmable) = (cache.offsets(), cache.trimmable());
        for _ in 0..2 {
            assert!(cache
                .reserve_packed_slots(1, &Device::Cpu)
                .unwrap()
                .is_some());
            cache.commit_slots(1).unwrap();
        }
        assert_ne!(cache.offsets(), offsets, "{kind}");
        cache.restore(&mark);
        assert_eq!(cache.offsets(), offsets, "{kind}");
        assert_eq!(cache.trimmable(), trimmable, "{kind}");
        let q_off = offsets[0];
        let k = rand(6000, (1, KVH, 1, HD));
        let v = rand(6001, (1, KVH, 1, HD));
        let q = rand(6002, (1, NH, 1, HD));
        let got = attend(&q, &cache.update(&k, &v).unwrap(), &[q_off], window, 1.0).unwrap();
        let want = attend(&q, &twin.update(&k, &v).unwrap(), &[q_off], window, 1.0).unwrap();
        assert!(max_diff(&got, &want) < 1e-6, "{kind} after restore");
    }
    // Dense caches offer no packed slots.
    let mut dense = LayerCache::Simple(SimpleCache::new(&spec(None), DType::F32));
    assert!(dense
        .reserve_packed_slots(1, &Device::Cpu)
        .unwrap()
        .is_none());
}

/// Keys and values written into reserved slots (where the cache offers them) attend exactly as
/// through `update`: single tokens, a prefill, and rings past their wrap.
#[test]
fn reserved_slots_written_in_place_match_update() {
    let mut kinds = all_kinds(4);
    // A batch of one sequence writes into that sequence's slots; a batch of two does not.
    let one = |c: LayerCache| LayerCache::Batch(BatchCache::new(vec![c]).unwrap());
    kinds.push((
        one(LayerCache::Simple(SimpleCache::new(
            &spec(None),
            DType::F32,
        ))),
        None,
    ));
    let w = Some(4);
    let ring = || LayerCache::Rotating(RotatingCache::new(&spec(w), DType::F32).unwrap());
    kinds.push((one(ring()), w));
    let mut two = LayerCache::Batch(BatchCache::new(vec![ring(), ring()]).unwrap());
    assert!(matches!(two.reserve_slots(1, &Device::Cpu), Ok(None)));
    assert!(two.commit_slots(1).is_err());
    for (mut cache, window) in kinds {
        let kind = cache.kind();
        let mut hist = History::new();
        let mut in_place = 0;
        for (i, n) in [3usize, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1]
            .into_iter()
            .enumerate()
        {
            let seed = 1000 + 10 * i as u64;
            let q_off = cache.offsets()[0];
            let k = rand(seed, (1, KVH, n, HD));
            let v = rand(seed + 1, (1, KVH, n, HD));
            let q = rand(seed + 2, (1, NH, n, HD));
            let view = match cache.reserve_slots(n, &Device::Cpu).unwrap() {
                Some((kd, vd)) => {
                    kd.inplace_op1(&FillView::F32(flat(&k))).unwrap();
                    vd.inplace_op1(&FillView::F32(flat(&v))).unwrap();
                    in_place += 1;
                    cache.commit_slots(n).unwrap()
                }
                None => cache.update(&k, &v).unwrap(),
            };
            hist.push(&k, &v);
            let got = attend(&q, &view, &[q_off], window, 1.0).unwrap();
            let quant = match kind {
                CacheKind::Quantized { .. } => continue, // no slots: `update` as everywhere
                _ => None,
            };
            let want = hist.attend(&q, q_off, window, quant);
            assert!(max_diff(&got, &want) < 1e-5, "{kind} step {i}");
        }
        match kind {
            CacheKind::Simple | CacheKind::Rotating { .. } | CacheKind::Batch { sequences: 1 } => {
                assert!(in_place >= 10, "{kind}: {in_place} in-place writes")
            }
            _ => assert_eq!(in_place, 0, "{kind} offered dense slots"),
        }
    }
}

/// A step abandoned after its slots were committed (a failed graph capture, a replay that
/// cannot run) leaves the cache as a mark taken before it found it: same offsets, same
/// trimmable count, and the next token attends exactly as if the step had never been tried,
/// also after a ring has wrapped.
#[test]
fn restoring_a_mark_undoes_committed_slots() {
    let one = |c: LayerCache| LayerCache::Batch(BatchCache::new(vec![c]).unwrap());
    let w = Some(4);
    let ring = || LayerCache::Rotating(RotatingCache::new(&spec(w), DType::F32).unwrap());
    let simple = || LayerCache::Simple(SimpleCache::new(&spec(None), DType::F32));
    let kinds = vec![
        (simple(), None),
        (ring(), w),
        (one(simple()), None),
        (one(ring()), w),
    ];
    for (mut cache, window) in kinds {
        let kind = cache.kind();
        let mut hist = History::new();
        for (i, n) in [3usize, 1, 1, 1, 1, 1].into_iter().enumerate() {
            let k = rand(2000 + i as u64, (1, KVH, n, HD));
            let v = rand(3000 + i as u64, (1, KVH, n, HD));
            cache.update(&k, &v).unwrap();
            hist.push(&k, &v);
        }
        let mark = cache.mark().expect("dense caches have marks");
        let (offsets, trimmable) = (cache.offsets(), cache.trimmable());
        // Two abandoned steps: slots committed, never written.
        for _ in 0..2 {
            assert!(cache.reserve_slots(1, &Device::Cpu).unwrap().is_some());
            cache.commit_slots(1).unwrap();
        }
        assert_ne!(cache.offsets(), offsets, "{kind}");
        cache.restore(&mark);
        assert_eq!(cache.offsets(), offsets, "{kind}");
        assert_eq!(cache.trimmable(), trimmable, "{kind}");
        let q_off = offsets[0];
        let k = rand(4000, (1, KVH, 1, HD));
        let v = rand(4001, (1, KVH, 1, HD));
        let q = rand(4002, (1, NH, 1, HD));
        let view = cache.update(&k, &v).unwrap();
        hist.push(&k, &v);
        let got = attend(&q, &view, &[q_off], window, 1.0).unwrap();
        let want = hist.attend(&q, q_off, window, None);
        assert!(max_diff(&got, &want) < 1e-5, "{kind}");
    }
    // A quantized cache has no mark before it is packed (its next update may convert it).
    let (quantized, _) = all_kinds(4)
        .into_iter()
        .find(|(c, _)| matches!(c.kind(), CacheKind::Quantized { .. }))
        .expect("all_kinds holds a quantized cache");
    assert!(quantized.mark().is_none());
}

#[test]
fn views_mark_only_keys_from_before_the_update_settled() {
    for (mut cache, _) in all_kinds(5) {
        for (i, n) in [3usize, 1, 1, 2, 1, 1, 1, 1, 1, 1].into_iter().enumerate() {
            let q_off = cache.offsets()[0];
            let k = rand(i as u64, (1, KVH, n, HD));
            let view = cache.update(&k, &k).unwrap();
            let KvView::Single { positions, .. } = view else {
                panic!("a single-sequence cache returned a batch view");
            };
            let settled = positions.settled_keys();
            let pos = positions.to_vec();
            assert!(
                pos[settled.clone()].iter().all(|&p| p < q_off),
                "{:?}: settled {settled:?} of {pos:?} at offset {q_off}",
                cache.kind()
            );
            if n == 1 && q_off > 0 {
                assert!(!settled.is_empty(), "{:?} at offset {q_off}", cache.kind());
            }
        }
    }
}
