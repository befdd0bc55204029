//! Prompt caches: save and load round trips, configuration checks, prefix reuse.

use super::*;

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
