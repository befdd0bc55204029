//! Batch caches: a batch equals its sequences run one by one; sequences join and leave.

use super::*;

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
                    let d = max_abs_diff(&got.narrow(0, b, 1).unwrap(), &want);
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

/// A ring layer, a growing layer and a KV-shared layer, holding `len` random tokens.
fn filled(len: usize) -> ModelCache {
    let specs = [Some(spec(Some(4))), Some(spec(None)), None];
    let mut m = ModelCache::new(&CacheConfig::default(), &specs, DType::F32, &Device::Cpu).unwrap();
    for c in m.layers.iter_mut().flatten() {
        c.update(
            &rand(len as u64, (1, KVH, len, HD)),
            &rand(1, (1, KVH, len, HD)),
        )
        .unwrap();
    }
    m
}

#[test]
fn model_cache_batching_helpers() {
    let specs = [Some(spec(Some(4))), Some(spec(None)), None];
    let mk = filled;
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
fn sequences_split_out_and_join_back_in_order_and_storage_ids_track_replacement() {
    let mk = filled;
    let mut b = ModelCache::batch(vec![mk(3), mk(7), mk(5)]).unwrap();
    let ids = b.storage_ids();
    // Two KV layers of three sequences each, and the shared layer's one empty entry.
    assert_eq!(ids.len(), 7);
    assert!(ids[..6].iter().all(Option::is_some));
    let marks = b.marks().unwrap();

    let mut seqs = b.split_sequences().unwrap();
    assert_eq!(seqs.len(), 3);
    assert_eq!(
        seqs.iter().map(|s| s.offsets()).collect::<Vec<_>>(),
        vec![vec![3], vec![7], vec![5]]
    );
    assert!(seqs.iter().all(|s| s.layers[2].is_none()));
    // Each sequence advances on its own, as a replayed step records it.
    for s in &mut seqs {
        for c in s.layers.iter_mut().flatten() {
            c.reserve_slots(1, &Device::Cpu).unwrap();
            let (k, v) = (rand(9, (1, KVH, 1, HD)), rand(9, (1, KVH, 1, HD)));
            c.update(&k, &v).unwrap();
        }
    }
    b.join_sequences(seqs);
    assert_eq!(b.offsets(), vec![4, 8, 6]);
    assert_eq!(b.batch_size(), 3);
    // The rings (layer 0) kept their storage.
    assert_eq!(b.storage_ids()[..3], ids[..3]);

    // Counters go back; storage that only grew or stayed keeps its identity per sequence.
    b.restore(&marks);
    assert_eq!(b.offsets(), vec![3, 7, 5]);
    // Replacing a sequence with one of the same length changes its storage identity.
    let removed = b.remove_sequence(1).unwrap();
    assert_eq!(removed.offsets(), vec![7]);
    b.push_sequence(mk(7)).unwrap();
    assert_eq!(b.offsets(), vec![3, 5, 7]);
    assert_ne!(b.storage_ids()[2], ids[1]);

    // A cache that is not batched splits into nothing and is left as it was.
    let mut single = mk(2);
    assert!(single.split_sequences().is_none());
    assert_eq!(single.offsets(), vec![2]);
}
