//! Quantized KV caches on the tiny Gemma 4 fixtures.
//!
//! * Against mlx-lm: every KV-owning layer quantized from the first token (8 and 4 bits,
//!   group 32) reproduces mlx-lm 0.32.2's `QuantizedKVCache` generation (CPU f32). mlx-lm cannot
//!   quantize its rotating cache, so the reference used growing quantized caches with the window
//!   mask on sliding layers (the same visible keys as our quantized ring), and fed KV-shared
//!   layers the producer's packed K/V through the quantized SDPA (stock mlx-lm crashes there).
//! * Every layer kind quantizes: sliding layers as a bounded quantized ring, KV-shared layers
//!   read packed K/V.
//! * `start` keeps a prompt shorter than it exact; bad options are typed errors.

mod common;

use candle_gemma::kv::{
    CacheError, CacheKind, CacheMode, KvCache, LayerCache, ModelCache, QuantBits, QuantSpec,
};
use candle_gemma::CacheConfig;
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

fn bits_of(b: usize) -> QuantBits {
    QuantBits::from_bits(b).expect("4 or 8")
}

/// (fixture, bits, case, greedy ids, comparable steps, first-step top-5 (id, log-prob)).
type MlxCase = (
    &'static str,
    usize,
    usize,
    [u32; 24],
    usize,
    [(u32, f64); 5],
);

/// mlx-lm 0.32.2 / mlx 0.32.4, CPU f32, every KV-owning layer a `QuantizedKVCache(group_size=32,
/// bits)` from the first token, the golden prompts of each fixture: (fixture, bits, case, greedy
/// ids, steps before the first top-2 margin < 0.01, first-step top-5 (id, log-prob)).
#[rustfmt::skip]
const MLX_QUANTIZED_KV: &[MlxCase] = &[
    ("e2b-hf", 8, 0, [157, 390, 296, 7, 265, 94, 249, 182, 386, 282, 43, 212, 345, 174, 445, 94, 73, 296, 170, 261, 194, 32, 509, 53], 6, [(157, -1.13876), (386, -1.72808), (240, -2.47667), (351, -2.50936), (339, -2.60298)]),
    ("e2b-hf", 8, 1, [423, 335, 148, 90, 335, 28, 249, 73, 265, 437, 88, 482, 482, 345, 394, 453, 109, 195, 390, 148, 390, 148, 390, 109], 5, [(423, -0.77026), (195, -1.65788), (46, -1.93740), (5, -2.27317), (112, -4.01625)]),
    ("e2b-hf", 8, 2, [511, 27, 263, 437, 174, 122, 447, 447, 408, 448, 294, 345, 52, 325, 468, 511, 202, 84, 273, 67, 47, 35, 377, 6], 24, [(511, -0.49689), (172, -1.18879), (57, -3.25704), (347, -3.73167), (295, -5.05797)]),
    ("e2b-hf", 4, 0, [240, 347, 26, 240, 285, 509, 53, 285, 370, 384, 36, 482, 496, 414, 511, 240, 174, 148, 284, 40, 148, 482, 446, 249], 24, [(240, -0.95444), (323, -1.52176), (291, -2.52829), (386, -2.61685), (318, -2.68477)]),
    ("e2b-hf", 4, 1, [195, 7, 438, 310, 307, 424, 7, 7, 103, 403, 7, 472, 91, 43, 40, 110, 7, 141, 483, 16, 132, 294, 58, 265], 7, [(195, -0.63696), (46, -1.95262), (7, -2.13475), (112, -2.32487), (224, -3.57974)]),
    ("e2b-hf", 4, 2, [511, 442, 33, 465, 67, 171, 43, 296, 326, 320, 269, 253, 208, 30, 73, 107, 73, 129, 2, 316, 73, 474, 339, 282], 2, [(511, -0.27020), (67, -1.79138), (3, -3.74551), (139, -4.23978), (387, -4.74054)]),
    ("e4b-text", 8, 0, [232, 232, 388, 366, 275, 251, 378, 251, 338, 165, 457, 428, 239, 301, 435, 3, 386, 344, 436, 320, 46, 46, 165, 348], 24, [(232, -0.98192), (381, -1.93423), (424, -2.02126), (342, -2.73207), (190, -3.15533)]),
    ("e4b-text", 8, 1, [283, 27, 380, 419, 172, 378, 348, 193, 355, 283, 489, 283, 477, 220, 275, 59, 213, 73, 213, 148, 328, 355, 213, 90], 24, [(283, -0.75136), (422, -1.79112), (193, -1.98736), (355, -2.10079), (419, -3.17281)]),
    ("e4b-text", 8, 2, [286, 148, 4, 162, 398, 29, 59, 489, 147, 110, 31, 480, 338, 388, 344, 213, 250, 173, 177, 173, 130, 219, 59, 405], 24, [(286, -0.88756), (234, -1.38505), (201, -2.42808), (264, -3.23149), (126, -3.25413)]),
    ("e4b-text", 4, 0, [474, 165, 166, 388, 217, 388, 255, 308, 457, 449, 335, 284, 186, 59, 123, 423, 409, 247, 47, 398, 29, 144, 173, 335], 24, [(474, -1.19683), (340, -1.29820), (337, -1.36093), (335, -3.21278), (228, -3.34572)]),
    ("e4b-text", 4, 1, [283, 145, 118, 27, 505, 48, 214, 283, 156, 162, 503, 457, 284, 12, 10, 177, 31, 11, 469, 489, 104, 388, 409, 27], 24, [(283, -0.78684), (193, -1.20882), (422, -2.50268), (355, -2.77820), (89, -3.27856)]),
    ("e4b-text", 4, 2, [227, 119, 147, 306, 378, 281, 367, 503, 59, 275, 59, 377, 147, 188, 415, 398, 328, 25, 135, 146, 169, 275, 59, 275], 24, [(227, -0.41596), (378, -1.78270), (46, -3.02272), (499, -3.46833), (388, -3.52883)]),
    ("moe-mlx", 8, 0, [481, 481, 88, 74, 74, 438, 465, 182, 260, 260, 260, 260, 75, 75, 284, 505, 505, 505, 505, 505, 253, 239, 239, 239], 24, [(481, -0.33498), (433, -2.14853), (415, -2.79689), (334, -3.66635), (157, -4.34904)]),
    ("moe-mlx", 8, 1, [349, 96, 177, 223, 223, 223, 358, 191, 191, 191, 191, 191, 191, 191, 168, 37, 37, 37, 37, 37, 37, 10, 345, 501], 24, [(349, -0.51687), (352, -1.94973), (9, -2.38164), (253, -3.16206), (174, -3.41238)]),
    ("moe-mlx", 8, 2, [323, 57, 236, 236, 202, 236, 236, 236, 479, 483, 458, 243, 287, 287, 287, 287, 392, 392, 392, 392, 249, 400, 393, 135], 24, [(323, -0.62351), (461, -2.14127), (239, -2.57122), (432, -2.84095), (214, -2.88846)]),
    ("moe-mlx", 4, 0, [481, 334, 344, 467, 330, 467, 467, 387, 88, 88, 88, 88, 88, 330, 400, 400, 400, 135, 135, 135, 135, 135, 135, 135], 24, [(481, -0.59437), (334, -1.08529), (433, -3.16770), (367, -4.04200), (215, -4.60444)]),
    ("moe-mlx", 4, 1, [349, 249, 504, 504, 107, 191, 191, 99, 107, 107, 107, 107, 99, 494, 388, 332, 256, 256, 413, 134, 326, 215, 330, 330], 24, [(349, -0.27706), (352, -1.97243), (253, -2.91766), (57, -4.20131), (468, -4.42578)]),
    ("moe-mlx", 4, 2, [80, 80, 88, 88, 168, 168, 168, 168, 509, 337, 135, 135, 135, 418, 236, 57, 57, 483, 135, 135, 135, 135, 135, 135], 24, [(80, -0.40225), (349, -1.66392), (167, -2.29043), (214, -3.80747), (325, -5.61865)]),
    ("dense-sharded", 8, 0, [328, 93, 309, 309, 144, 342, 342, 342, 342, 188, 193, 193, 188, 182, 93, 449, 368, 368, 266, 464, 314, 314, 288, 288], 24, [(328, -0.37958), (175, -2.68100), (51, -3.00822), (206, -3.10460), (499, -3.32958)]),
    ("dense-sharded", 8, 1, [139, 122, 122, 122, 122, 265, 170, 170, 170, 238, 194, 346, 63, 491, 491, 156, 156, 367, 289, 302, 496, 419, 155, 419], 24, [(139, -0.57233), (76, -1.18260), (355, -2.99144), (408, -3.77828), (149, -3.88835)]),
    ("dense-sharded", 8, 2, [188, 369, 369, 328, 368, 266, 328, 73, 461, 461, 481, 390, 188, 149, 144, 496, 435, 435, 156, 419, 353, 353, 173, 122], 24, [(188, -0.75115), (328, -1.04486), (100, -3.15897), (464, -3.17747), (174, -3.95359)]),
    ("dense-sharded", 4, 0, [328, 309, 309, 144, 144, 342, 342, 342, 342, 342, 342, 375, 375, 375, 375, 326, 182, 478, 421, 353, 353, 353, 353, 353], 24, [(328, -0.81600), (175, -1.68604), (144, -2.54325), (347, -2.88130), (51, -2.91746)]),
    ("dense-sharded", 4, 1, [395, 63, 30, 90, 328, 93, 93, 93, 365, 249, 249, 123, 390, 390, 123, 365, 13, 13, 13, 483, 13, 143, 93, 368], 24, [(395, -0.43962), (76, -1.99624), (390, -2.47282), (328, -3.57498), (355, -3.66796)]),
    ("dense-sharded", 4, 2, [289, 289, 331, 328, 328, 369, 328, 328, 328, 291, 409, 389, 328, 183, 183, 261, 188, 116, 90, 289, 489, 489, 489, 413], 24, [(289, -1.47157), (328, -1.70165), (174, -2.02493), (196, -2.16377), (375, -2.35706)]),
    ("e2b-q4", 8, 0, [386, 141, 354, 172, 53, 227, 403, 157, 408, 296, 220, 294, 174, 174, 498, 36, 408, 487, 422, 357, 273, 67, 67, 67], 24, [(386, -0.44021), (157, -1.33069), (240, -3.53921), (436, -4.31540), (125, -4.43147)]),
    ("e2b-q4", 8, 1, [236, 103, 285, 98, 265, 138, 442, 51, 484, 68, 258, 402, 390, 166, 464, 464, 464, 390, 81, 28, 510, 510, 226, 40], 12, [(236, -0.42069), (443, -1.97429), (423, -2.38932), (112, -2.94683), (214, -4.23637)]),
    ("e2b-q4", 8, 2, [67, 189, 68, 174, 125, 68, 407, 452, 216, 245, 205, 209, 74, 174, 127, 345, 296, 174, 127, 458, 6, 427, 37, 261], 24, [(67, -1.08368), (258, -1.20189), (375, -1.84171), (477, -2.74205), (57, -3.34530)]),
    ("e2b-q4", 4, 0, [386, 399, 153, 328, 484, 163, 237, 15, 171, 473, 102, 15, 473, 120, 29, 28, 348, 310, 285, 73, 103, 74, 181, 203], 24, [(386, -0.13162), (291, -2.73011), (436, -4.25725), (249, -4.36284), (456, -4.56333)]),
    ("e2b-q4", 4, 1, [443, 118, 73, 385, 263, 427, 401, 55, 81, 465, 112, 408, 390, 390, 227, 190, 350, 403, 7, 7, 7, 7, 345, 167], 24, [(443, -0.96864), (236, -1.15712), (482, -2.20105), (16, -3.02819), (43, -3.31261)]),
    ("e2b-q4", 4, 2, [67, 511, 132, 345, 157, 372, 486, 212, 67, 171, 399, 253, 253, 362, 325, 363, 141, 244, 23, 141, 483, 172, 274, 73], 8, [(67, -0.81094), (174, -1.78114), (387, -1.78717), (375, -2.42554), (171, -2.63436)]),
    ("e2b-q8", 8, 0, [351, 206, 349, 149, 306, 140, 160, 294, 32, 113, 24, 28, 237, 28, 511, 85, 310, 498, 498, 215, 73, 384, 361, 24], 11, [(351, -0.60120), (323, -1.91287), (339, -2.74895), (355, -2.79374), (240, -3.26622)]),
    ("e2b-q8", 8, 1, [423, 335, 28, 488, 167, 109, 390, 148, 453, 252, 300, 88, 274, 88, 377, 220, 345, 437, 421, 88, 427, 438, 361, 399], 24, [(423, -0.53648), (490, -1.51282), (195, -3.26589), (222, -3.30619), (452, -3.57841)]),
    ("e2b-q8", 8, 2, [381, 4, 118, 353, 77, 287, 335, 511, 35, 293, 323, 420, 306, 472, 191, 456, 328, 435, 345, 456, 323, 383, 141, 508], 24, [(381, -0.45337), (241, -1.96783), (214, -2.49537), (67, -2.96132), (33, -3.36597)]),
    ("e2b-q8", 4, 0, [355, 53, 32, 408, 249, 306, 497, 419, 482, 345, 194, 62, 249, 141, 313, 212, 489, 463, 265, 227, 437, 443, 83, 390], 11, [(355, -1.30051), (351, -1.45255), (240, -1.51175), (386, -3.10894), (32, -3.25597)]),
    ("e2b-q8", 4, 1, [155, 280, 345, 109, 458, 502, 51, 447, 505, 25, 265, 54, 205, 30, 188, 43, 296, 88, 51, 472, 107, 7, 438, 431], 24, [(155, -0.59415), (355, -1.64701), (423, -1.96275), (7, -2.77380), (490, -3.64703)]),
    ("e2b-q8", 4, 2, [511, 227, 460, 372, 309, 318, 347, 232, 269, 296, 174, 265, 437, 174, 174, 468, 431, 232, 141, 48, 174, 181, 257, 279], 24, [(511, -0.85855), (67, -1.65002), (57, -1.89616), (295, -2.88773), (489, -3.00272)]),
];

/// First-step log-probs must agree this closely (f32 summation order moves them by ~1e-4 on
/// these fixtures).
const LOGPROB_TOL: f64 = 2e-3;

#[test]
fn reproduces_mlx_lm_quantized_kv_generation() {
    // Quantization is discontinuous: a K/V value that differs from mlx-lm's by one f32 ulp (the
    // matmuls sum in another order) can land on the other side of a rounding boundary, and these
    // random-weight fixtures amplify a one-code change ~1000x. That is rare (and rarer at 4 bits,
    // whose boundaries are 17x sparser), so most cases must match exactly; a few may not.
    let (mut agree, mut same_ids) = (0, 0);
    let mut report = Vec::new();
    for name in FIXTURES {
        let model = load(name);
        let cases = golden(name);
        for &(_, bits, i, ids, comparable, top) in MLX_QUANTIZED_KV.iter().filter(|r| r.0 == *name)
        {
            let mut cache = model
                .new_cache(&quant(bits_of(bits), 32, 0))
                .expect("cache");
            let (got, logits) = run(&model, &mut cache, &cases[i].prompt, 24, None);
            let lp = log_softmax(&logits[0]);
            let dev = top
                .iter()
                .map(|&(t, want)| (lp[t as usize] - want).abs())
                .fold(0.0, f64::max);
            let same = got[..comparable] == ids[..comparable];
            report.push(format!(
                "{name} {bits}-bit case {i}: top-5 |dlogprob| {dev:.1e}, ids {}",
                if same { "agree" } else { "differ" }
            ));
            if dev < LOGPROB_TOL && same {
                agree += 1;
            }
            same_ids += usize::from(same);
        }
    }
    eprintln!("{}", report.join("\n"));
    // Measured (weights of the q4/q8 fixtures kept packed): ids agree in 34 of 36 cases, and 28
    // of 36 also agree on the first step within LOGPROB_TOL. Every miss is a single K/V code
    // landing one step away (an input one f32 ulp from a rounding boundary), which these
    // random-weight fixtures amplify to 3e-3 .. 2e-1 in log-probs.
    assert!(
        same_ids >= 34 && agree >= 28,
        "ids agree in {same_ids}, ids and first step in {agree} of {} cases:\n{}",
        MLX_QUANTIZED_KV.len(),
        report.join("\n")
    );
}

/// KL(p || q) of two log-prob vectors.
fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a.exp() * (a - b)).sum()
}

#[test]
fn eight_bits_stay_closer_to_dense_than_four_bits() {
    let (mut kl8, mut kl4, mut n) = (0.0, 0.0, 0);
    for name in FIXTURES {
        let model = load(name);
        for case in golden(name) {
            // Teacher-forced on the reference ids, so every cache sees the same tokens.
            let tokens: Vec<u32> = case.prompt.iter().chain(&case.greedy).copied().collect();
            let lps = |cfg: &CacheConfig| -> Vec<Vec<f64>> {
                let mut cache = model.new_cache(cfg).expect("cache");
                let mut out = vec![log_softmax(&step(&model, &mut cache, &case.prompt))];
                for &t in &tokens[case.prompt.len()..tokens.len() - 1] {
                    out.push(log_softmax(&step(&model, &mut cache, &[t])));
                }
                out
            };
            let dense = lps(&CacheConfig::default());
            let q8 = lps(&quant(QuantBits::Eight, 32, 0));
            let q4 = lps(&quant(QuantBits::Four, 32, 0));
            for ((d, a), b) in dense.iter().zip(&q8).zip(&q4) {
                kl8 += kl(d, a);
                kl4 += kl(d, b);
                n += 1;
            }
        }
    }
    let (kl8, kl4) = (kl8 / n as f64, kl4 / n as f64);
    eprintln!(
        "mean KL(dense || quantized) per step over {n} steps: 8-bit {kl8:.3e}, 4-bit {kl4:.3e}"
    );
    assert!(kl8.is_finite() && kl4.is_finite());
    assert!(
        kl8 * 4.0 < kl4,
        "8-bit ({kl8}) should be much closer to dense than 4-bit ({kl4})"
    );
}

#[test]
fn start_keeps_short_prompts_exact_then_packs() {
    let model = load("e2b-hf");
    let case = &golden("e2b-hf")[1]; // 19 tokens
    let mut dense = model.new_cache(&CacheConfig::default()).expect("cache");
    let (dense_ids, dense_logits) = run(&model, &mut dense, &case.prompt, 12, None);

    // Never reaching `start`: the same storage and kernels as the dense rotating cache.
    let mut never = model
        .new_cache(&quant(QuantBits::Four, 32, 1000))
        .expect("cache");
    let (ids, logits) = run(&model, &mut never, &case.prompt, 12, None);
    assert_eq!(ids, dense_ids);
    assert_eq!(
        logits, dense_logits,
        "below start the quantized cache is exactly dense"
    );

    // start 10: the prompt is attended dense, the cache converts before the first decode step.
    let mut late = model
        .new_cache(&quant(QuantBits::Four, 32, 10))
        .expect("cache");
    let first = step(&model, &mut late, &case.prompt);
    assert_eq!(first, dense_logits[0], "the prefill ran dense");
    let packed = |c: &ModelCache| {
        c.layers
            .iter()
            .flatten()
            .all(|l| matches!(l, LayerCache::Quantized(q) if q.is_packed()))
    };
    assert!(!packed(&late));
    step(&model, &mut late, &[argmax(&first)]);
    assert!(packed(&late), "every layer packed once it reached start");
}

#[test]
fn every_layer_quantizes_sliding_as_a_bounded_ring_and_shared_layers_read_packed() {
    // e2b-hf: sliding and full layers, KV-shared consumers (layers 6..9) that own no cache.
    let model = load("e2b-hf");
    let case = &golden("e2b-hf")[2]; // 33 tokens, longer than the window of 8
    for bits in [QuantBits::Eight, QuantBits::Four] {
        let mut cache = model.new_cache(&quant(bits, 32, 0)).expect("cache");
        run(&model, &mut cache, &case.prompt, 40, Some(5));
        let mut sliding = 0;
        for (l, c) in cache.layers.iter().enumerate() {
            let Some(c) = c else { continue };
            let LayerCache::Quantized(q) = c else {
                panic!("layer {l} is not quantized: {:?}", c.kind())
            };
            assert!(q.is_packed(), "layer {l}");
            if let CacheKind::Quantized {
                window: Some(w), ..
            } = c.kind()
            {
                sliding += 1;
                // Bounded by the window: codes + scales + biases of W tokens, K and V.
                let (kvh, hd) = c.geometry();
                let per_token = 2 * kvh * (hd * bits.bits() / 8 + 2 * (hd / 32) * 4);
                assert_eq!(
                    c.memory_bytes(),
                    w * per_token,
                    "layer {l}: ring of {w} slots"
                );
            }
        }
        assert!(sliding > 0);
        assert!(
            cache.layers.iter().any(Option::is_none),
            "the fixture has KV-shared layers"
        );
        assert_eq!(cache.offsets(), vec![33 + 39]);
    }
}

#[test]
fn quantized_memory_is_smaller() {
    let model = load("e4b-text");
    let case = &golden("e4b-text")[2];
    let bytes = |cfg: &CacheConfig| {
        let mut cache = model.new_cache(cfg).expect("cache");
        run(&model, &mut cache, &case.prompt, 8, None);
        cache.memory_bytes()
    };
    let (dense, q8, q4) = (
        bytes(&CacheConfig::default()),
        bytes(&quant(QuantBits::Eight, 32, 0)),
        bytes(&quant(QuantBits::Four, 32, 0)),
    );
    eprintln!("KV bytes after 41 tokens (f32 model): dense {dense}, 8-bit {q8}, 4-bit {q4}");
    assert!(q4 < q8 && q8 < dense);
}

#[test]
fn bad_options_are_typed_errors() {
    let model = load("e2b-hf");
    // Sliding layers have head_dim 32: a group of 64 cannot divide it.
    match model.new_cache(&quant(QuantBits::Eight, 64, 0)) {
        Err(candle_gemma::Error::Cache(CacheError::BadGroupSize {
            group_size: 64,
            head_dim: 32,
        })) => {}
        other => panic!("expected BadGroupSize, got {other:?}"),
    }
    assert!(matches!(
        model.new_cache(&quant(QuantBits::Four, 48, 0)),
        Err(candle_gemma::Error::Cache(CacheError::BadGroupSize { .. }))
    ));
    assert!(matches!(
        QuantBits::from_bits(3).map_err(CacheError::from),
        Err(CacheError::UnsupportedBits { bits: 3 })
    ));
}

#[test]
fn quantized_greedy_agrees_with_dense_until_the_reference_margin_threshold() {
    // The rule: on an E-series fixture with KV sharing, every layer quantized, 8-bit
    // agrees with the dense reference up to the first step whose top-2 margin is under 0.25,
    // 4-bit under 1.0. e2b-kvq has gentle residual gains; the other fixtures amplify a one-code
    // flip into >0.5 logit moves (mlx-lm's own quantized cache diverges from its dense run
    // there at the same steps, see MLX_QUANTIZED_KV), so they are checked against mlx-lm's
    // quantized generation instead.
    for name in ["e2b-kvq"] {
        let model = load(name);
        for (i, case) in golden(name).iter().enumerate() {
            for (bits, threshold) in [(QuantBits::Eight, 0.25), (QuantBits::Four, 1.0)] {
                let got = greedy(
                    &model,
                    &case.prompt,
                    case.greedy.len(),
                    quant(bits, 32, 0),
                    None,
                );
                let n = comparable_steps(&case.margins, threshold);
                assert_matches_reference(
                    &format!("{name} case {i} {bits:?}"),
                    &got,
                    case,
                    threshold,
                );
                eprintln!("{name} case {i} {bits:?}: {n} steps compared (margin >= {threshold})");
            }
        }
    }
}

#[test]
fn quantized_teacher_forced_argmax_agrees_wherever_the_reference_is_decisive() {
    // Stronger form of the rule above, over every step: feed the reference ids and require the
    // quantized model's argmax to equal the reference wherever its margin clears the threshold.
    for name in ["e2b-kvq", "e2b-hf", "e4b-text"] {
        let model = load(name);
        for (bits, threshold) in [(QuantBits::Eight, 0.25), (QuantBits::Four, 1.0)] {
            let (mut checked, mut agreed) = (0, 0);
            for case in golden(name) {
                let mut cache = model.new_cache(&quant(bits, 32, 0)).expect("cache");
                let mut logits = step(&model, &mut cache, &case.prompt);
                for (i, &want) in case.greedy.iter().enumerate() {
                    if case.margins[i] >= threshold {
                        checked += 1;
                        agreed += usize::from(argmax(&logits) == want);
                    }
                    logits = step(&model, &mut cache, &[want]);
                }
            }
            eprintln!("{name} {bits:?}: argmax agrees on {agreed}/{checked} decisive steps");
            if name == "e2b-kvq" {
                // 8-bit: every decisive step. 4-bit on head_dim 32 (one group per head): one
                // step in 27 flips (measured), so at least 90%.
                match bits {
                    QuantBits::Eight => assert_eq!(agreed, checked, "{name} {bits:?}"),
                    QuantBits::Four => assert!(
                        agreed * 10 >= checked * 9,
                        "{name} {bits:?}: {agreed}/{checked}"
                    ),
                }
            }
            assert!(checked > 0);
        }
    }
}

#[test]
fn kv_bytes_per_token_on_real_shapes() {
    use candle_core::{DType, Device, Tensor};
    use candle_gemma::config::Config;
    use candle_gemma::KvCache;
    // Every KV-owning layer of the real E4B and 31B configs, 256 tokens each (the simple
    // cache's first allocation), bf16 activations; scales and biases counted.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/real-configs");
    for file in ["e4b-config.json", "31b-config.json"] {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).expect("read"))
                .expect("json");
        let cfg = Config::from_json(&json, None).expect("config");
        let specs: Vec<_> = cfg
            .layers
            .iter()
            .filter(|l| l.kv == candle_gemma::config::KvSource::Own)
            .map(|l| candle_gemma::kv::LayerCacheSpec {
                kv_heads: l.kv_heads,
                head_dim: l.head_dim,
                window: None,
            })
            .collect();
        let tokens = 256;
        let per_token = |cc: &CacheConfig| -> usize {
            specs
                .iter()
                .map(|spec| {
                    let mut c = cc.build(spec, DType::BF16, &Device::Cpu).expect("cache");
                    let x = Tensor::zeros(
                        (1, spec.kv_heads, tokens, spec.head_dim),
                        DType::BF16,
                        &Device::Cpu,
                    )
                    .expect("zeros");
                    c.update(&x, &x).expect("update");
                    c.memory_bytes() / tokens
                })
                .sum()
        };
        let dense = per_token(&CacheConfig {
            mode: CacheMode::Simple,
        });
        let q8 = per_token(&quant(QuantBits::Eight, 64, 0));
        let q4 = per_token(&quant(QuantBits::Four, 64, 0));
        eprintln!(
            "{file}: KV bytes per token over {} KV-owning layers: bf16 {dense}, 8-bit {q8} ({:.3}x), 4-bit {q4} ({:.3}x)",
            specs.len(),
            q8 as f64 / dense as f64,
            q4 as f64 / dense as f64
        );
        assert!(
            q4 as f64 <= 0.3 * dense as f64,
            "{file}: 4-bit {q4} vs bf16 {dense}"
        );
        assert!(q8 < dense);
    }
}
