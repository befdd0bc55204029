//! The sampler's randomness: Gumbel noise from a counter-based generator, so that any token's
//! noise at any draw can be computed on its own, in any order, on the host or on a device.
//!
//! A tempered draw takes the token with the largest `logit / temperature + g(token)` among
//! those the filters keep, where `g` is standard Gumbel noise: the Gumbel-max trick, which
//! draws exactly from the softmax of the kept tokens. The noise of token `id` at a sampler's
//! `n`-th draw is [`gumbel`] of Philox4x32-10 (Salmon et al., "Parallel random numbers: as
//! easy as 1, 2, 3", 2011) with the counter `(id, n, n >> 32, 0)` and a key taken from the
//! seed. The CUDA draw (`reduce.cu`) computes the same bits and the same float operations, so
//! a device and the host pick the same token except where two keys lie within the rounding
//! of `logf` (one unit in the last place).

/// The Philox key of a seed: its splitmix64 finalization, in two halves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoiseKey(pub [u32; 2]);

impl NoiseKey {
    /// The key of `seed`.
    pub fn from_seed(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Self([z as u32, (z >> 32) as u32])
    }
}

/// Philox4x32 with 10 rounds: four random words of `counter` under `key`.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u32 = 0xD251_1F53;
    const M1: u32 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// Standard Gumbel noise from one random word: `-ln(-ln(u))` with `u = (bits >> 9 + 0.5) /
/// 2^23`, strictly inside (0, 1) and exact in f32, so the host and a device start from the
/// same float.
pub fn gumbel_of_bits(bits: u32) -> f32 {
    let u = ((bits >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0);
    -(-u.ln()).ln()
}

/// Above every value [`gumbel_of_bits`] returns (its largest is about 16.6): a token whose
/// `key + GUMBEL_MAX` is below the best key so far cannot win a draw.
pub const GUMBEL_MAX: f32 = 17.0;

/// The noise of token `id` at draw `draw` of a sampler keyed `key`.
pub fn gumbel(key: NoiseKey, draw: u64, id: u32) -> f32 {
    let bits = philox4x32([id, draw as u32, (draw >> 32) as u32, 0], key.0);
    gumbel_of_bits(bits[0])
}

/// The Gumbel-max draw over `(id, key)` pairs (`key = logit / temperature`): the id whose
/// `key + gumbel(..)` is largest, the lowest id among equal sums; `None` for no pairs. Pairs
/// that cannot reach the best sum so far skip their noise (the result is the same).
pub fn gumbel_argmax(pairs: &[(u32, f32)], key: NoiseKey, draw: u64) -> Option<u32> {
    let first = pairs
        .iter()
        .copied()
        .reduce(|a, b| if b.1 > a.1 { b } else { a })?;
    let mut best = (first.0, first.1 + gumbel(key, draw, first.0));
    for &(id, s) in pairs {
        if s + GUMBEL_MAX < best.1 {
            continue;
        }
        let v = s + gumbel(key, draw, id);
        if v > best.1 || (v == best.1 && id < best.0) {
            best = (id, v);
        }
    }
    Some(best.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_published_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(
            philox4x32([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn gumbel_noise_is_bounded_and_has_the_right_mean() {
        assert!(gumbel_of_bits(u32::MAX) < GUMBEL_MAX);
        assert!(gumbel_of_bits(0).is_finite());
        let key = NoiseKey::from_seed(5);
        let n = 200_000;
        let mean = (0..n).map(|i| gumbel(key, 3, i) as f64).sum::<f64>() / n as f64;
        // The Euler-Mascheroni constant; the standard error is about 0.003.
        assert!((mean - 0.5772).abs() < 0.015, "{mean}");
    }

    #[test]
    fn pruned_argmax_equals_the_full_one() {
        let key = NoiseKey::from_seed(9);
        for draw in 0..200u64 {
            let pairs: Vec<(u32, f32)> = (0..300u32)
                .map(|i| (i, ((i * 7919 + draw as u32) % 97) as f32 * 0.4 - 20.0))
                .collect();
            let full = pairs
                .iter()
                .map(|&(i, s)| (i, s + gumbel(key, draw, i)))
                .fold(None::<(u32, f32)>, |b, (i, v)| match b {
                    Some(b) if !(v > b.1 || (v == b.1 && i < b.0)) => Some(b),
                    _ => Some((i, v)),
                })
                .map(|b| b.0);
            assert_eq!(gumbel_argmax(&pairs, key, draw), full, "draw {draw}");
        }
        assert_eq!(gumbel_argmax(&[], key, 0), None);
    }
}
