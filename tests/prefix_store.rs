//! The prefix store on the tiny Gemma 4 fixtures (sliding window 8): a decode continued from a
//! looked-up prefix gives exactly the tokens of a full prefill (dense, rotating, 8- and 4-bit
//! layouts, prompts longer than the window, a conversation's next turn and a shared prefix, and
//! from ring checkpoints where a wrapped ring cannot be cut back); layouts never share states;
//! eviction keeps the bytes under the budget, least recently used first; a match never covers
//! the whole prompt.

mod common;

use candle_core::DType;
use candle_gemma::kv::{CacheKind, CacheMode, ModelCache, QuantBits, QuantSpec};
use candle_gemma::serve::prefix::{LayoutKey, PrefixStore};
use candle_gemma::{CacheConfig, Model};
use common::*;

fn quant(bits: QuantBits, group_size: usize, start: usize) -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Quantized(QuantSpec {
            bits,
            group_size,
            start,
        }),
    }
}

fn simple() -> CacheConfig {
    CacheConfig {
        mode: CacheMode::Simple,
    }
}

fn modes() -> Vec<(&'static str, CacheConfig)> {
    vec![
        ("simple", simple()),
        ("rotating", CacheConfig::default()),
        ("8-bit", quant(QuantBits::Eight, 32, 0)),
        ("4-bit", quant(QuantBits::Four, 32, 0)),
    ]
}

/// A cache that has prefilled `tokens` in one forward.
fn prefilled(model: &Model, cfg: &CacheConfig, tokens: &[u32]) -> ModelCache {
    let mut cache = model.new_cache(cfg).expect("cache");
    step(model, &mut cache, tokens);
    cache
}

/// `n` greedy tokens after a full prefill of `prompt` in a fresh cache.
fn fresh(model: &Model, cfg: &CacheConfig, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.new_cache(cfg).expect("cache");
    run(model, &mut cache, prompt, n, None).0
}

/// Looks `prompt` up, expects `want` tokens reused, prefills the rest into the copy and decodes
/// `n` greedy tokens.
fn continued(
    model: &Model,
    store: &mut PrefixStore,
    layout: &LayoutKey,
    prompt: &[u32],
    want: usize,
    n: usize,
    label: &str,
) -> Vec<u32> {
    let (mut cache, held) = store
        .lookup(prompt, layout)
        .expect("lookup")
        .unwrap_or_else(|| panic!("{label}: no prefix found"));
    assert_eq!(held, want, "{label}: tokens reused");
    assert_eq!(
        cache.offsets(),
        vec![held],
        "{label}: cache cut to the match"
    );
    run(model, &mut cache, &prompt[held..], n, None).0
}

#[test]
fn continued_decode_equals_a_full_prefill() {
    for name in ["e2b-hf", "e4b-text"] {
        let model = load(name);
        let prompt = &golden(name)[1].prompt; // 19 tokens: every ring has wrapped
        for (label, cfg) in modes() {
            let label = format!("{name} {label}");
            let layout = LayoutKey::for_model(&model, &cfg);
            let mut store = PrefixStore::new(1 << 30);

            // Turn 1: the prompt and 6 answer tokens; the cache holds the K/V of the prompt and
            // the first 5 (the last one was sampled, not fed).
            let mut cache = model.new_cache(&cfg).expect("cache");
            let answer = run(&model, &mut cache, prompt, 6, None).0;
            let held: Vec<u32> = prompt.iter().chain(&answer[..5]).copied().collect();
            store
                .insert(held.clone(), layout, cache)
                .expect("insert turn 1");

            // Turn 2 extends turn 1: everything held is reused, nothing is cut.
            let mut turn2 = held.clone();
            turn2.extend([answer[5], 300, 301, 302]);
            let got = continued(&model, &mut store, &layout, &turn2, held.len(), 8, &label);
            assert_eq!(got, fresh(&model, &cfg, &turn2, 8), "{label}: next turn");

            // Exactly the held tokens again: one token is cut so that it yields logits.
            let got = continued(
                &model,
                &mut store,
                &layout,
                &held,
                held.len() - 1,
                8,
                &label,
            );
            assert_eq!(got, fresh(&model, &cfg, &held, 8), "{label}: same prompt");
        }
    }
}

#[test]
fn a_shared_prefix_is_reused_while_the_cut_fits_the_window() {
    let model = load("e2b-hf");
    let long = &golden("e2b-hf")[1].prompt; // 19 tokens
    for (label, cfg) in modes() {
        let layout = LayoutKey::for_model(&model, &cfg);
        let mut store = PrefixStore::new(1 << 30);

        // 5 shared tokens + 3 of request A: 8 tokens, no ring has wrapped, any cut works.
        let system = &long[..5];
        let a: Vec<u32> = system.iter().copied().chain([400, 401, 402]).collect();
        store
            .insert(a.clone(), layout, prefilled(&model, &cfg, &a))
            .expect("insert");
        let b: Vec<u32> = system.iter().copied().chain([500, 501, 502, 503]).collect();
        let got = continued(&model, &mut store, &layout, &b, 5, 8, label);
        assert_eq!(
            got,
            fresh(&model, &cfg, &b, 8),
            "{label}: short shared prefix"
        );

        // 19 shared tokens + 2 of request C: the rings have wrapped past the divergence.
        let c: Vec<u32> = long.iter().copied().chain([400, 401]).collect();
        store
            .insert(c.clone(), layout, prefilled(&model, &cfg, &c))
            .expect("insert");
        let d: Vec<u32> = long.iter().copied().chain([500, 501]).collect();
        if cfg.mode == CacheMode::Simple {
            let got = continued(&model, &mut store, &layout, &d, long.len(), 8, label);
            assert_eq!(
                got,
                fresh(&model, &cfg, &d, 8),
                "{label}: long shared prefix"
            );
        } else {
            // Rings of W slots roll back one token once wrapped: only the short entry's 5
            // tokens can serve.
            let (_, held) = store.lookup(&d, &layout).expect("lookup").expect("hit");
            assert_eq!(held, 5, "{label}: a wrapped ring is not cut back 2 tokens");
        }
    }
}

fn layer_kinds(cache: &ModelCache) -> Vec<CacheKind> {
    cache.layers.iter().flatten().map(|c| c.kind()).collect()
}

#[test]
fn layouts_never_share_states() {
    let model = load("e2b-hf");
    let prompt = &golden("e2b-hf")[0].prompt;
    let four = quant(QuantBits::Four, 32, 0);
    let key = |cfg: &CacheConfig| LayoutKey::for_model(&model, cfg);
    let mut store = PrefixStore::new(1 << 30);
    store
        .insert(prompt.clone(), key(&four), prefilled(&model, &four, prompt))
        .expect("insert");

    let others = [
        ("8-bit", key(&quant(QuantBits::Eight, 32, 0))),
        ("group 64", key(&quant(QuantBits::Four, 64, 0))),
        ("start 4", key(&quant(QuantBits::Four, 32, 4))),
        ("dense", key(&simple())),
        ("rotating", key(&CacheConfig::default())),
        (
            "bf16",
            LayoutKey::new(&four, DType::BF16).with_window(model.config().sliding_window),
        ),
        (
            "window 16",
            LayoutKey::new(&four, model.dtype()).with_window(16),
        ),
    ];
    for (label, other) in &others {
        assert_ne!(other, &key(&four), "{label}");
        assert!(
            store.lookup(prompt, other).expect("lookup").is_none(),
            "{label} request served from the 4-bit entry"
        );
    }
    let (cache, _) = store
        .lookup(prompt, &key(&four))
        .expect("lookup")
        .expect("the 4-bit entry");
    assert!(layer_kinds(&cache)
        .iter()
        .all(|k| matches!(k, CacheKind::Quantized { bits: 4, .. })));

    // Entries of other layouts for the same tokens: each request gets its own layout's state.
    for cfg in [simple(), quant(QuantBits::Eight, 32, 0)] {
        store
            .insert(prompt.clone(), key(&cfg), prefilled(&model, &cfg, prompt))
            .expect("insert");
    }
    assert_eq!(store.len(), 3);
    let (cache, _) = store.lookup(prompt, &key(&simple())).unwrap().unwrap();
    assert!(layer_kinds(&cache).iter().all(|k| *k == CacheKind::Simple));
    let (cache, _) = store
        .lookup(prompt, &key(&quant(QuantBits::Eight, 32, 0)))
        .unwrap()
        .unwrap();
    assert!(layer_kinds(&cache)
        .iter()
        .all(|k| matches!(k, CacheKind::Quantized { bits: 8, .. })));

    // A state filed under a layout it was not built with, or with another token count, is
    // refused.
    let cache = prefilled(&model, &four, prompt);
    let wrong = key(&quant(QuantBits::Eight, 32, 0));
    assert!(store.insert(prompt.clone(), wrong, cache).is_err());
    let cache = prefilled(&model, &four, prompt);
    assert!(store
        .insert(prompt[1..].to_vec(), key(&four), cache)
        .is_err());
    assert_eq!(store.len(), 3);
}

#[test]
fn eviction_keeps_bytes_under_the_budget_least_recently_used_first() {
    let model = load("e2b-hf");
    let cfg = simple();
    let layout = LayoutKey::for_model(&model, &cfg);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| vec![100 + i, 7, 8, 9, 10, 11]).collect();
    let caches = || prompts.iter().map(|p| prefilled(&model, &cfg, p));
    let each = prefilled(&model, &cfg, &prompts[0]).memory_bytes();
    assert!(each > 0);

    let budget = 2 * each + each / 2;
    let mut store = PrefixStore::new(budget);
    let mut it = caches();
    store
        .insert(prompts[0].clone(), layout, it.next().unwrap())
        .unwrap();
    store
        .insert(prompts[1].clone(), layout, it.next().unwrap())
        .unwrap();
    assert_eq!((store.len(), store.bytes()), (2, 2 * each));
    // Use the older entry; the third insert then evicts the second.
    let query = |i: usize| -> Vec<u32> { prompts[i].iter().copied().chain([50]).collect() };
    assert!(store.lookup(&query(0), &layout).unwrap().is_some());
    store
        .insert(prompts[2].clone(), layout, it.next().unwrap())
        .unwrap();
    assert_eq!(store.len(), 2);
    assert!(store.bytes() <= budget);
    assert!(store.lookup(&query(1), &layout).unwrap().is_none());
    assert!(store.lookup(&query(0), &layout).unwrap().is_some());
    assert!(store.lookup(&query(2), &layout).unwrap().is_some());

    // An entry larger than the whole budget is not kept.
    let mut small = PrefixStore::new(each / 2);
    small
        .insert(
            prompts[0].clone(),
            layout,
            prefilled(&model, &cfg, &prompts[0]),
        )
        .unwrap();
    assert!(small.is_empty());
    assert_eq!(small.bytes(), 0);

    store.clear();
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

#[test]
fn an_extended_state_replaces_the_one_it_covers_or_keeps_its_rings() {
    let model = load("e2b-hf");
    let prompt = &golden("e2b-hf")[1].prompt; // 19 tokens
    let longer: Vec<u32> = prompt.iter().copied().chain([40, 41, 42]).collect();
    for cfg in [simple(), CacheConfig::default()] {
        let layout = LayoutKey::for_model(&model, &cfg);
        let mut store = PrefixStore::new(1 << 30);
        let short_state = prefilled(&model, &cfg, prompt);
        let short_bytes = short_state.memory_bytes();
        store.insert(prompt.clone(), layout, short_state).unwrap();
        let long_state = prefilled(&model, &cfg, &longer);
        let long_bytes = long_state.memory_bytes();
        store.insert(longer.clone(), layout, long_state).unwrap();
        // One entry either way: a growing cache cuts back anywhere, so the shorter state goes;
        // a wrapped ring cannot be cut back 3 tokens, so the shorter state's rings stay as a
        // checkpoint (less than the whole state: its full-attention layers are dropped).
        assert_eq!(store.len(), 1, "{:?}", cfg.mode);
        let total = store.bytes();
        if cfg.mode == CacheMode::Simple {
            assert_eq!(total, long_bytes);
        } else {
            assert!(total > long_bytes && total < long_bytes + short_bytes);
        }
        // Re-inserting a covered prefix adds nothing.
        store
            .insert(prompt.clone(), layout, prefilled(&model, &cfg, prompt))
            .unwrap();
        assert_eq!((store.len(), store.bytes()), (1, total));
        let q: Vec<u32> = prompt.iter().copied().chain([99, 98]).collect();
        let got = continued(
            &model,
            &mut store,
            &layout,
            &q,
            prompt.len(),
            8,
            "checkpoint",
        );
        assert_eq!(got, fresh(&model, &cfg, &q, 8), "{:?}", cfg.mode);
    }
}

/// How a chat turn hands its prompt's state to the store.
#[derive(Debug, Clone, Copy)]
enum Keep {
    /// A deep copy inserted after the prefill, then the final state.
    InsertPromptFirst,
    /// The final state, then the prompt's copy.
    InsertFinalFirst,
    /// `PrefixStore::checkpoint` after the prefill, then the final state.
    Checkpoint,
}

/// Prefills `prompt`, keeps that state as `keep` says, decodes 6 tokens and inserts the final
/// state; returns the 6 answer tokens.
fn chat_turn(
    model: &Model,
    cfg: &CacheConfig,
    store: &mut PrefixStore,
    prompt: &[u32],
    keep: Keep,
) -> Vec<u32> {
    let layout = LayoutKey::for_model(model, cfg);
    let mut cache = model.new_cache(cfg).expect("cache");
    let mut answer = vec![argmax(&step(model, &mut cache, prompt))];
    let prompt_state = cache.deep_clone().expect("copy");
    if let Keep::Checkpoint = keep {
        store
            .checkpoint(prompt, &layout, &cache)
            .expect("checkpoint");
    }
    for _ in 0..5 {
        let last = answer[answer.len() - 1];
        answer.push(argmax(&step(model, &mut cache, &[last])));
    }
    let held: Vec<u32> = prompt.iter().chain(&answer[..5]).copied().collect();
    let mut states = vec![(prompt.to_vec(), prompt_state), (held, cache)];
    match keep {
        Keep::InsertPromptFirst => {}
        Keep::InsertFinalFirst => states.reverse(),
        Keep::Checkpoint => {
            states.remove(0);
        }
    }
    for (tokens, state) in states {
        store.insert(tokens, layout, state).expect("insert");
    }
    answer
}

#[test]
fn a_prompt_checkpoint_serves_a_next_turn_that_rewrites_the_answer() {
    for name in ["e2b-hf", "e4b-text"] {
        let model = load(name);
        let prompt = &golden(name)[1].prompt; // 19 tokens: every ring has wrapped
        for (label, cfg) in modes() {
            for keep in [
                Keep::InsertPromptFirst,
                Keep::InsertFinalFirst,
                Keep::Checkpoint,
            ] {
                let label = format!("{name} {label} {keep:?}");
                let layout = LayoutKey::for_model(&model, &cfg);
                let mut store = PrefixStore::new(1 << 30);
                let answer = chat_turn(&model, &cfg, &mut store, prompt, keep);
                assert_eq!(store.len(), 1, "{label}");

                // The next turn's template renders the answer otherwise (thinking dropped):
                // the prompt's checkpoint serves its 19 tokens.
                let other = if answer[0] == 300 { 301 } else { 300 };
                let turn2: Vec<u32> = prompt.iter().copied().chain([other, 302, 303]).collect();
                let got = continued(&model, &mut store, &layout, &turn2, prompt.len(), 8, &label);
                assert_eq!(
                    got,
                    fresh(&model, &cfg, &turn2, 8),
                    "{label}: rewritten answer"
                );

                // Rendered as generated: the whole finished state serves.
                let turn2: Vec<u32> = prompt.iter().chain(&answer).copied().chain([7]).collect();
                let got = continued(
                    &model,
                    &mut store,
                    &layout,
                    &turn2,
                    prompt.len() + 5,
                    8,
                    &label,
                );
                assert_eq!(got, fresh(&model, &cfg, &turn2, 8), "{label}: same answer");
            }
        }
    }
}

#[test]
fn a_match_never_covers_the_whole_prompt() {
    let model = load("e2b-hf");
    let cfg = simple();
    let layout = LayoutKey::for_model(&model, &cfg);
    let tokens = golden("e2b-hf")[0].prompt.clone(); // 7 tokens
    let mut store = PrefixStore::new(1 << 30);
    store
        .insert(tokens.clone(), layout, prefilled(&model, &cfg, &tokens))
        .unwrap();
    for len in 2..=tokens.len() {
        let (cache, held) = store.lookup(&tokens[..len], &layout).unwrap().unwrap();
        assert_eq!(held, len - 1);
        assert_eq!(cache.offsets(), vec![len - 1]);
    }
    assert!(store.lookup(&tokens[..1], &layout).unwrap().is_none());
    assert!(store.lookup(&[], &layout).unwrap().is_none());
    assert!(store
        .lookup(&[tokens[0] + 1, 5, 6], &layout)
        .unwrap()
        .is_none());
    // The entry is intact after every cut copy.
    let extended: Vec<u32> = tokens.iter().copied().chain([1]).collect();
    let (_, held) = store.lookup(&extended, &layout).unwrap().unwrap();
    assert_eq!(held, tokens.len());
}

#[test]
fn a_waiting_checkpoint_counts_in_the_budget_and_joins_its_entry() {
    let model = load("e2b-hf");
    let prompt = &golden("e2b-hf")[1].prompt; // 19 tokens
    let cfg = CacheConfig::default();
    let layout = LayoutKey::for_model(&model, &cfg);
    let state = prefilled(&model, &cfg, prompt);

    // Only the rings are copied, and they wait without serving.
    let mut store = PrefixStore::new(1 << 30);
    store.checkpoint(prompt, &layout, &state).unwrap();
    let rings = store.bytes();
    assert!(rings > 0 && rings < state.memory_bytes());
    assert!(store.is_empty());
    let q: Vec<u32> = prompt.iter().copied().chain([5]).collect();
    assert!(store.lookup(&q, &layout).unwrap().is_none());
    // Another layout's state of the same tokens does not adopt it.
    let dense = simple();
    let dense_key = LayoutKey::for_model(&model, &dense);
    let longer: Vec<u32> = q.iter().copied().chain([6, 7]).collect();
    store
        .insert(
            longer.clone(),
            dense_key,
            prefilled(&model, &dense, &longer),
        )
        .unwrap();
    let q2: Vec<u32> = prompt.iter().copied().chain([9, 9]).collect();
    let (_, held) = store.lookup(&q2, &dense_key).unwrap().unwrap();
    assert_eq!(held, prompt.len());
    assert!(store.lookup(&q2, &layout).unwrap().is_none());
    // Its own layout's state along the tokens does.
    store
        .insert(longer.clone(), layout, prefilled(&model, &cfg, &longer))
        .unwrap();
    let got = continued(&model, &mut store, &layout, &q2, prompt.len(), 8, "adopted");
    assert_eq!(got, fresh(&model, &cfg, &q2, 8));

    // A budget below the rings keeps nothing; a dense cache has no rings to keep.
    let mut small = PrefixStore::new(rings - 1);
    small.checkpoint(prompt, &layout, &state).unwrap();
    assert_eq!(small.bytes(), 0);
    let mut store = PrefixStore::new(1 << 30);
    store
        .checkpoint(prompt, &dense_key, &prefilled(&model, &dense, prompt))
        .unwrap();
    assert_eq!(store.bytes(), 0);
}

/// A small deterministic generator (no extra dependency).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

/// How far the log-probs after a reused state may be from a fresh prefill's. Dense caches: a
/// few f32 ulps of summation order (the goldens' tolerance). Quantized caches re-round every new
/// key: another summation order (a cut ring's keys are gathered in position order, a fresh
/// ring's are not) can move a new token's K/V across a rounding boundary, one code step, which
/// moves a tiny random model's log-probs by a few hundredths. A wrong state moves them by whole
/// units.
fn tolerance(cfg: &CacheConfig) -> f64 {
    match cfg.mode {
        CacheMode::Quantized(_) => 0.1,
        _ => 2e-3,
    }
}

#[test]
fn random_inserts_checkpoints_and_lookups_serve_correct_states_within_budget() {
    let model = load("e2b-hf");
    let base = &golden("e2b-hf")[1].prompt; // 19 tokens
    for (label, cfg) in modes() {
        let layout = LayoutKey::for_model(&model, &cfg);
        let budget = 4 * prefilled(&model, &cfg, base).memory_bytes();
        let mut store = PrefixStore::new(budget);
        let mut rng = Lcg(7);
        let mut kept: Vec<Vec<u32>> = Vec::new();
        let mut hits = 0;
        for op in 0..80 {
            // Prompts share prefixes of `base` and diverge over a small alphabet.
            let mut tokens = base[..3 + rng.below(17)].to_vec();
            tokens.extend((0..rng.below(6)).map(|_| 40 + rng.below(3) as u32));
            match rng.below(3) {
                0 => {
                    let state = prefilled(&model, &cfg, &tokens);
                    store.insert(tokens.clone(), layout, state).unwrap();
                    kept.push(tokens);
                }
                1 => {
                    let state = prefilled(&model, &cfg, &tokens);
                    store.checkpoint(&tokens, &layout, &state).unwrap();
                }
                _ => {
                    let Some((mut cache, held)) = store.lookup(&tokens, &layout).unwrap() else {
                        continue;
                    };
                    hits += 1;
                    let label = format!("{label} op {op}");
                    assert!(held < tokens.len(), "{label}");
                    assert_eq!(cache.offsets(), vec![held], "{label}");
                    let shared = kept
                        .iter()
                        .map(|k| k.iter().zip(&tokens).take_while(|(a, b)| a == b).count())
                        .max()
                        .unwrap_or(0);
                    assert!(
                        held <= shared,
                        "{label}: {held} tokens reused, {shared} shared"
                    );
                    let got = step(&model, &mut cache, &tokens[held..]);
                    let want = step(&model, &mut model.new_cache(&cfg).unwrap(), &tokens);
                    let diff = logprob_diff(&got, &want);
                    assert!(
                        diff < tolerance(&cfg),
                        "{label}: reused state off by {diff}"
                    );
                }
            }
            assert!(store.bytes() <= budget, "{label} op {op}");
        }
        assert!(hits > 0, "{label}: no lookup hit");
        store.clear();
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }
}
