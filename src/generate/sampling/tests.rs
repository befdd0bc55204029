//! The sampler's tests: draws, filters, penalties and bias, and the narrowed paths (device
//! candidates, device draws, nucleus from candidates) against whole rows.

use super::*;

fn opts(temperature: f32, seed: u64) -> SamplingOptions {
    SamplingOptions {
        temperature,
        seed,
        ..Default::default()
    }
}

fn draws(o: SamplingOptions, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(o);
    (0..n).map(|_| s.sample(logits, &[])).collect()
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplingOptions::default());
    assert_eq!(s.sample(&[0.0, 3.0, 1.0], &[]), 1);
    assert_eq!(s.sample(&[2.0, 5.0, 5.0, 1.0], &[]), 1);
    assert_eq!(s.sample(&[f32::NAN, -1.0], &[]), 1);
    assert_eq!(s.sample(&[], &[]), 0);
    assert_eq!(s.sample(&[f32::NEG_INFINITY; 3], &[]), 0);
}

#[test]
fn same_seed_same_tokens_other_seed_differs() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let a = draws(opts(1.0, 42), &logits, 64);
    let b = draws(opts(1.0, 42), &logits, 64);
    let c = draws(opts(1.0, 43), &logits, 64);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    let logits = [0.3, 1.2, 1.2, -0.5, 0.9];
    for seed in 0..20 {
        let k1 = SamplingOptions {
            top_k: Some(1),
            ..opts(1.5, seed)
        };
        let p0 = SamplingOptions {
            top_p: Some(1e-6),
            ..opts(1.5, seed)
        };
        assert_eq!(draws(k1, &logits, 5), vec![1; 5]);
        assert_eq!(draws(p0, &logits, 5), vec![1; 5]);
    }
}

#[test]
fn top_k_excludes_the_tail() {
    let logits = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0];
    let o = SamplingOptions {
        top_k: Some(3),
        ..opts(10.0, 1)
    };
    let got = draws(o, &logits, 500);
    assert!(got.iter().all(|&t| t < 3));
    assert!((0..3).all(|t| got.contains(&t)));
}

#[test]
fn top_p_keeps_the_smallest_covering_set() {
    // Probabilities ~ [0.5, 0.3, 0.2] at temperature 1.
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
    let o = SamplingOptions {
        top_p: Some(0.75),
        ..opts(1.0, 3)
    };
    let got = draws(o, &logits, 500);
    assert!(got.iter().all(|&t| t < 2));
    assert!(got.contains(&0) && got.contains(&1));
}

#[test]
fn min_p_drops_unlikely_tokens() {
    let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
    let o = SamplingOptions {
        min_p: Some(0.4),
        ..opts(1.0, 9)
    };
    let got = draws(o, &logits, 500);
    assert!(got.iter().all(|&t| t < 2));
    assert!(got.contains(&1));
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let mut scores = vec![2.0, -2.0, 1.0];
    Penalties::new(Some(2.0), None, None, &[]).apply(&mut scores, &[0, 1, 1, 99]);
    assert_eq!(scores, vec![1.0, -4.0, 1.0]);
    // Greedy with penalty: token 0 (2.0 -> 0.8) loses to token 2 (1.5).
    let mut s = Sampler::new(SamplingOptions {
        repetition_penalty: Some(2.5),
        ..Default::default()
    });
    assert_eq!(s.sample(&[2.0, 0.0, 1.5], &[0]), 2);
}

#[test]
fn logit_bias_bans_and_forces_tokens() {
    let logits = [2.0, 1.0, 0.5, -1.0];
    let bias = |b: Vec<(u32, f32)>, t: f32| SamplingOptions {
        logit_bias: b,
        ..opts(t, 3)
    };
    // Greedy: 0 banned, so 1; 3 forced.
    assert_eq!(draws(bias(vec![(0, -100.0)], 0.0), &logits, 3), vec![1; 3]);
    assert_eq!(draws(bias(vec![(3, 100.0)], 0.0), &logits, 3), vec![3; 3]);
    // Sampled: a banned token never comes; the last bias for an id counts.
    let got = draws(
        bias(vec![(1, 5.0), (1, -100.0), (2, -100.0)], 1.0),
        &logits,
        300,
    );
    assert!(got.iter().all(|&t| t == 0 || t == 3), "{got:?}");
    assert!(got.contains(&0) && got.contains(&3));
    // Biases that lower logits keep a top-k sampler on candidates; raising ones do not.
    let ranked = |b: Vec<(u32, f32)>| {
        Sampler::new(SamplingOptions {
            top_k: Some(2),
            ..bias(b, 1.0)
        })
        .best_needed(&[])
    };
    assert_eq!(ranked(vec![(0, -3.0), (9, -1.0)]), Some((4, 1.0)));
    assert_eq!(ranked(vec![(0, 3.0)]), None);
    assert_eq!(
        ranked(vec![(0, 0.0)]),
        Some((2, 1.0)),
        "a zero bias is a no-op"
    );
    let plain = Sampler::new(bias(vec![(0, -1.0)], 1.0));
    assert_eq!(
        plain.device_draw(&[]),
        None,
        "a bias is not drawn on the device"
    );
    assert!(!Sampler::new(bias(vec![(0, -1.0)], 0.0)).is_plain_greedy());
}

#[test]
fn frequency_and_presence_penalties_count_the_drawn_tokens() {
    let mut s = Sampler::new(SamplingOptions {
        frequency_penalty: Some(0.5),
        presence_penalty: Some(0.25),
        ..Default::default()
    });
    assert!(!s.is_plain_greedy());
    // 0 wins, then pays 0.75; then 1 (2.6 against 2.25) pays 0.75; 0 (2.25) against 1
    // (1.85); then 0 pays 0.5 more (1.75) and 1 wins.
    let logits = [3.0, 2.6, 0.0];
    let got: Vec<u32> = (0..4).map(|_| s.sample(&logits, &[])).collect();
    assert_eq!(got, vec![0, 1, 0, 1]);
    // The prompt (history) does not count.
    let mut fresh = Sampler::new(s.options().clone());
    assert_eq!(fresh.sample(&logits, &[0, 0, 0]), 0);
}

#[test]
fn sampling_follows_the_distribution() {
    let logits = [0.7f32.ln(), 0.3f32.ln()];
    let got = draws(opts(1.0, 11), &logits, 4000);
    let zeros = got.iter().filter(|&&t| t == 0).count() as f64 / 4000.0;
    assert!((zeros - 0.7).abs() < 0.05, "{zeros}");
}

#[test]
fn tempered_and_filtered_draws_follow_the_softmax() {
    let logits = [1.0f32, 0.5, 0.0, -0.5, -1.0, -3.0];
    let softmax = |t: f32, keep: usize| -> Vec<f64> {
        let e: Vec<f64> = logits[..keep]
            .iter()
            .map(|&l| ((l / t) as f64).exp())
            .collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|x| x / z).collect()
    };
    let n = 20_000;
    for (o, keep) in [
        (opts(0.8, 4), logits.len()),
        (
            SamplingOptions {
                top_k: Some(3),
                ..opts(1.3, 5)
            },
            3,
        ),
    ] {
        let want = softmax(o.temperature, keep);
        let mut counts = vec![0usize; logits.len()];
        for t in draws(o, &logits, n) {
            counts[t as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let p = want.get(i).copied().unwrap_or(0.0);
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            let got = c as f64 / n as f64;
            assert!(
                (got - p).abs() <= 5.0 * sd + 1e-9,
                "token {i}: {got} against {p}"
            );
        }
    }
}

#[test]
fn a_device_draw_is_the_whole_rows_draw() {
    let row: Vec<f32> = (0..400)
        .map(|i| match i % 37 {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            _ => ((i * 7919) % 101) as f32 * 0.05 - 2.0,
        })
        .collect();
    let o = opts(0.7, 21);
    let (mut host, mut device) = (Sampler::new(o.clone()), Sampler::new(o));
    for _ in 0..50 {
        let want = host.sample(&row, &[]);
        let d = device.device_draw(&[]).expect("a plain tempered sampler");
        let key = super::super::noise::NoiseKey(d.key);
        let pairs: Vec<(u32, f32)> = (0..row.len() as u32)
            .zip(row.iter().copied())
            .filter(|p| p.1 > f32::NEG_INFINITY)
            .map(|(i, l)| (i, l / d.temperature))
            .collect();
        let got = gumbel_argmax(&pairs, key, d.draw).unwrap_or(0);
        device.accept_device_draw(got);
        assert_eq!(want, got);
    }
    for host_only in [
        SamplingOptions {
            top_p: Some(0.9),
            ..opts(1.0, 1)
        },
        SamplingOptions {
            min_p: Some(0.1),
            ..opts(1.0, 1)
        },
        SamplingOptions {
            top_k: Some(DEVICE_TOP_K_MAX + 1),
            ..opts(1.0, 1)
        },
        SamplingOptions {
            top_k: Some(5),
            presence_penalty: Some(0.5),
            ..opts(1.0, 1)
        },
        opts(0.0, 1),
    ] {
        assert_eq!(
            Sampler::new(host_only.clone()).device_draw(&[]),
            None,
            "{host_only:?}"
        );
    }
}

#[test]
fn a_top_k_sampler_is_drawn_on_the_device_with_its_filters() {
    let filter = |o: SamplingOptions| Sampler::new(o).device_draw(&[]).and_then(|d| d.filter);
    assert_eq!(
        filter(SamplingOptions {
            top_k: Some(64),
            top_p: Some(0.95),
            min_p: Some(0.05),
            ..opts(1.0, 3)
        }),
        Some(DrawFilter {
            top_k: 64,
            top_p: Some(0.95),
            min_p: Some(0.05),
        })
    );
    // Filters that keep everything are off; a top-k of 0 is no top-k.
    assert_eq!(
        filter(SamplingOptions {
            top_k: Some(DEVICE_TOP_K_MAX),
            top_p: Some(1.0),
            min_p: Some(0.0),
            ..opts(0.5, 3)
        }),
        Some(DrawFilter {
            top_k: DEVICE_TOP_K_MAX,
            top_p: None,
            min_p: None,
        })
    );
    let unfiltered = Sampler::new(SamplingOptions {
        top_k: Some(0),
        ..opts(0.5, 3)
    })
    .device_draw(&[]);
    assert!(unfiltered.is_some_and(|d| d.filter.is_none()));
}

/// Test data only: xoshiro256** seeded through splitmix64.
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn seed_from_u64(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
}

/// The documented order of the device's candidates, on the host: key `logit / t` (the
/// logit plus 0 where `t` is 0), largest first by `total_cmp`, the lowest id first, NaN and
/// -inf logits last.
fn best_by_order(logits: &[f32], t: f32, k: usize) -> Vec<(u32, f32)> {
    let key = |l: f32| -> Option<f32> {
        (l > f32::NEG_INFINITY).then(|| if t > 0.0 { l / t } else { l + 0.0 })
    };
    let mut all: Vec<(u32, f32)> = (0..logits.len() as u32)
        .zip(logits.iter().copied())
        .collect();
    all.sort_by(|a, b| match (key(a.1), key(b.1)) {
        (Some(x), Some(y)) => y.total_cmp(&x).then(a.0.cmp(&b.0)),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => a.0.cmp(&b.0),
    });
    all.truncate(k);
    all
}

#[test]
fn drawing_from_a_rows_best_logits_draws_what_the_whole_row_draws() {
    let mut rng = Xoshiro256::seed_from_u64(11);
    let mut checked = 0;
    for case in 0..60u64 {
        let vocab = 50 + (case as usize % 7) * 40;
        // Coarse values, so that keys tie; a few NaN, -inf, +-0 and huge logits.
        let row: Vec<f32> = (0..vocab)
            .map(|_| match rng.next_u64() % 40 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => -0.0,
                3 => 0.0,
                4 if case % 5 == 0 => 3.0e38,
                _ => (rng.next_u64() % 24) as f32 * 0.25 - 3.0,
            })
            .collect();
        let o = SamplingOptions {
            temperature: [0.0, 0.3, 1.0, 1.7, 1e-30][case as usize % 5],
            top_k: Some([1, 3, 8, 40, 1000][case as usize % 4 + (case as usize / 20) % 2]),
            top_p: (case % 3 == 0).then_some(0.6),
            min_p: (case % 4 == 1).then_some(0.2),
            repetition_penalty: [None, Some(1.0), Some(1.3), Some(4.0)][case as usize % 4],
            frequency_penalty: (case % 3 == 1).then_some(0.4),
            presence_penalty: (case % 5 == 2).then_some(0.7),
            // Biases that lower logits (one bans its token), twice for one id.
            logit_bias: match case % 6 {
                4 => vec![(3, -1.5), (7, 2.0), (7, -100.0), (vocab as u32 + 5, -1.0)],
                _ => Vec::new(),
            },
            seed: case,
        };
        let (mut whole, mut narrowed) = (Sampler::new(o.clone()), Sampler::new(o));
        let history: Vec<u32> = (0..case as u32 % 9)
            .map(|i| (i * 37 + case as u32) % vocab as u32)
            .collect();
        // A batch may pick more candidates than this row's sampler keeps.
        for extra in [0, 5] {
            for _ in 0..20 {
                // Each draw counts for the next one's penalties: ask again every time.
                let (k, t) = whole
                    .best_needed(&history)
                    .expect("a top-k sampler with lowering penalties needs only the best");
                let best = best_by_order(&row, t, k + extra);
                let want = whole.sample(&row, &history);
                let got = narrowed.sample_from_best(&best, &history);
                assert_eq!(want, got, "case {case}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 60 * 2 * 20);
}

#[test]
fn nucleus_draws_from_the_best_logits_and_the_mass_equal_whole_row_draws() {
    let mut rng = Xoshiro256::seed_from_u64(5);
    let (mut narrowed_draws, mut fallbacks) = (0, 0);
    for case in 0..48u64 {
        let vocab = 300 + (case as usize % 5) * 350;
        // Peaked rows (a few large logits) and flat ones; a few NaN and -inf.
        let peaked = case % 2 == 0;
        let row: Vec<f32> = (0..vocab)
            .map(|_| match rng.next_u64() % 60 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 | 3 if peaked => 8.0 + (rng.next_u64() % 16) as f32 * 0.25,
                _ => (rng.next_u64() % 24) as f32 * 0.25 - 3.0,
            })
            .collect();
        let o = SamplingOptions {
            top_p: (case % 3 != 1).then_some([0.5, 0.9, 0.99][case as usize % 3]),
            min_p: (case % 3 != 0).then_some([0.05, 0.3][case as usize % 2]),
            ..opts([0.7, 1.0, 1.6][case as usize % 3], case)
        };
        let (mut whole, mut narrowed) = (Sampler::new(o.clone()), Sampler::new(o));
        for k in [8, 64, 1000] {
            for _ in 0..10 {
                let t = narrowed.nucleus_needed(&[]).expect("a nucleus sampler");
                let best = best_by_order(&row, t, k);
                let pool: Vec<f32> = best_by_order(&row, t, vocab)
                    .iter()
                    .filter(|p| p.1 > f32::NEG_INFINITY)
                    .map(|p| p.1 / t)
                    .collect();
                let mass: f64 = pool.iter().map(|&s| ((s - pool[0]) as f64).exp()).sum();
                let want = whole.sample(&row, &[]);
                let got = match narrowed.sample_from_nucleus(&best, mass, vocab) {
                    Some(id) => {
                        narrowed_draws += 1;
                        id
                    }
                    None => {
                        fallbacks += 1;
                        narrowed.sample(&row, &[])
                    }
                };
                assert_eq!(want, got, "case {case} k {k}");
            }
        }
    }
    assert!(
        narrowed_draws > 200 && fallbacks > 50,
        "{narrowed_draws} / {fallbacks}"
    );
    let mut greedy = Sampler::new(opts(0.0, 1));
    assert_eq!(greedy.nucleus_needed(&[]), None);
    assert_eq!(greedy.sample_from_nucleus(&[(0, 1.0)], 1.0, 1), None);
    let plain = Sampler::new(opts(1.0, 1));
    assert_eq!(plain.nucleus_needed(&[]), None, "no filter: a device draw");
}

#[test]
fn samplers_that_rank_logits_themselves_read_the_whole_row() {
    let mut o = opts(0.8, 1);
    assert_eq!(Sampler::new(o.clone()).best_needed(&[]), None, "no top-k");
    o.top_k = Some(0);
    let off = Sampler::new(o.clone()).best_needed(&[]);
    assert_eq!(off, None, "a top-k of 0 is off");
    o.top_k = Some(5);
    assert_eq!(Sampler::new(o.clone()).best_needed(&[]), Some((5, 0.8)));
    o.repetition_penalty = Some(1.3);
    let history = [4, 4, 9];
    let needed = Sampler::new(o.clone()).best_needed(&history);
    assert_eq!(needed, Some((7, 0.8)), "k and the two repeated tokens");
    o.repetition_penalty = Some(0.7);
    let raising = Sampler::new(o.clone()).best_needed(&history);
    assert_eq!(raising, None, "a raising repetition penalty");
    o.repetition_penalty = None;
    o.frequency_penalty = Some(-0.5);
    let raising = Sampler::new(o.clone()).best_needed(&history);
    assert_eq!(raising, None, "a raising frequency penalty");
    let greedy = Sampler::new(opts(0.0, 1));
    assert_eq!(greedy.best_needed(&history), Some((1, 0.0)));
}
