//! Reserved slots written in place (as the CUDA kernels write them), committed slots undone by
//! marks, and the settled mark on views.

use super::*;

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
            assert!(max_abs_diff(&got, &want) < 1e-6, "{kind} step {i}");
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
        assert!(max_abs_diff(&got, &want) < 1e-6, "{kind} after restore");
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
            assert!(max_abs_diff(&got, &want) < 1e-5, "{kind} step {i}");
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
        assert!(max_abs_diff(&got, &want) < 1e-5, "{kind}");
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
