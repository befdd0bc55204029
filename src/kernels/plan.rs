//! Launch planning shared by the CUDA and Metal backends, free of device types: the
//! `#[repr(C)]` parameter blocks both kernels read (`QsdpaParams`, `QmatParams`; field order as
//! in `cuda/attention.cuh`, `cuda/quantize.cuh` and `metal/qkernels.metal`), the encoding of key
//! positions, and the flash-decoding split of a view's keys.

use crate::kernels::QueryPlan;
use crate::kernels::{KernelError, KeyPositions};

/// Warps per quantized-attention block (`QS_WARPS` in the kernels).
pub const QSDPA_WARPS: usize = 4;
/// Keys a warp loads per step (`QS_U`; 2 for head dim 512).
pub const QSDPA_UNROLL: usize = 4;

/// Most key splits the combine kernel merges (`QS_MAX_SPLIT`).
pub const QSDPA_MAX_SPLIT: usize = 1024;
/// Head dimensions the quantized attention kernels are instantiated for.
pub const QSDPA_HEAD_DIMS: [usize; 5] = [32, 64, 128, 256, 512];

/// Parameters of one quantized-attention launch (one sequence).
///
/// Strides are in elements of the tensor they describe (`u32` words for codes, scale elements
/// for scales/biases); the last axis of each is dense.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QsdpaParams {
    /// K codes: stride between KV heads.
    pub k_codes_sh: u64,
    /// K codes: stride between keys.
    pub k_codes_sk: u64,
    /// K scales and biases: stride between KV heads.
    pub k_sc_sh: u64,
    /// K scales and biases: stride between keys.
    pub k_sc_sk: u64,
    /// V codes: stride between KV heads.
    pub v_codes_sh: u64,
    /// V codes: stride between keys.
    pub v_codes_sk: u64,
    /// V scales and biases: stride between KV heads.
    pub v_sc_sh: u64,
    /// V scales and biases: stride between keys.
    pub v_sc_sk: u64,
    /// Query heads.
    pub n_heads: u32,
    /// KV heads (divides `n_heads`).
    pub kv_heads: u32,
    /// Queries per head.
    pub q_len: u32,
    /// Head dimension (one of [`QSDPA_HEAD_DIMS`]).
    pub head_dim: u32,
    /// Keys in the view.
    pub keys: u32,
    /// Elements per scale/bias group (32, 64 or 128), the same for K and V.
    pub group_size: u32,
    /// Sliding window `W` (0: causal only).
    pub window: u32,
    /// Absolute position of query 0.
    pub q_offset: u32,
    /// How key positions are encoded: see [`PositionCode`].
    pub pos_mode: u32,
    /// First position of the first run.
    pub pos_base: u32,
    /// Keys in the first run (mode 1).
    pub pos_split: u32,
    /// First position of the second run (mode 1).
    pub pos_base2: u32,
    /// Key splits (flash-decoding); 1 writes the output directly.
    pub n_split: u32,
    /// Keys per split.
    pub keys_per_split: u32,
    /// Score multiplier, folded into the queries.
    pub scale: f32,
    /// Splits `0..long_splits` take [`QSDPA_SPLIT_STEP`] keys more than `keys_per_split`
    /// (see [`KeySplit`]).
    pub long_splits: u32,
}

/// One side's (K or V) strides as the attention kernels read them, in elements: codes (`u32`
/// words, or the dense elements) and scales/biases, between KV heads and between keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SideStrides {
    pub(crate) codes_sh: u64,
    pub(crate) codes_sk: u64,
    pub(crate) sc_sh: u64,
    pub(crate) sc_sk: u64,
}

/// The query and cache geometry of one sequence's attention launch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionGeometry {
    pub(crate) n_heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) q_len: usize,
    pub(crate) head_dim: usize,
    pub(crate) keys: usize,
    /// Elements per scale group (any non-zero value for dense operands, which have none).
    pub(crate) group_size: usize,
}

impl QsdpaParams {
    /// One sequence's attention parameters, the split left at zero for the launcher, and the
    /// position table to upload (empty when the positions run in one or two runs). `what`
    /// names the launcher in errors.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when a size, position or the last query's position does not fit
    /// in `u32`.
    pub(crate) fn for_sequence(
        what: &'static str,
        g: &AttentionGeometry,
        k: SideStrides,
        v: SideStrides,
        positions: &KeyPositions,
        plan: &QueryPlan,
    ) -> Result<(Self, Vec<u32>), KernelError> {
        let too_big = || KernelError::Shape {
            what,
            expected: "keys, positions and the last query's position below 2^32".into(),
            found: vec![g.keys, plan.q_offset + g.q_len],
        };
        let u32_of = |x: usize| u32::try_from(x).map_err(|_| too_big());
        u32_of(plan.q_offset + g.q_len)?;
        let mut params = Self {
            k_codes_sh: k.codes_sh,
            k_codes_sk: k.codes_sk,
            k_sc_sh: k.sc_sh,
            k_sc_sk: k.sc_sk,
            v_codes_sh: v.codes_sh,
            v_codes_sk: v.codes_sk,
            v_sc_sh: v.sc_sh,
            v_sc_sk: v.sc_sk,
            n_heads: u32_of(g.n_heads)?,
            kv_heads: u32_of(g.kv_heads)?,
            q_len: u32_of(g.q_len)?,
            head_dim: u32_of(g.head_dim)?,
            keys: u32_of(g.keys)?,
            group_size: u32_of(g.group_size)?,
            window: u32_of(plan.window.unwrap_or(0))?,
            q_offset: u32_of(plan.q_offset)?,
            scale: plan.scale as f32,
            ..Default::default()
        };
        let code = PositionCode::of(positions).ok_or_else(too_big)?;
        let table = code
            .apply(&mut params)
            .map(|t| t.to_vec())
            .unwrap_or_default();
        Ok((params, table))
    }

    /// Sets the flash-decoding split.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when a count does not fit in `u32`.
    pub(crate) fn set_split(&mut self, split: KeySplit) -> Result<(), KernelError> {
        let err = || KernelError::Shape {
            what: "attention split (splits, keys a split, longer splits)",
            expected: "values below 2^32".into(),
            found: vec![split.n, split.per, split.long],
        };
        self.n_split = u32::try_from(split.n).map_err(|_| err())?;
        self.keys_per_split = u32::try_from(split.per).map_err(|_| err())?;
        self.long_splits = u32::try_from(split.long).map_err(|_| err())?;
        Ok(())
    }
}

/// Parameters of one quantized weight launch (matrix-vector or dequantization).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QmatParams {
    /// Activation rows (matvec) or output rows (dequantization).
    pub rows: u32,
    /// Output features (rows of W).
    pub out_dim: u32,
    /// Input features (columns of W).
    pub in_dim: u32,
    /// Elements per scale/bias group.
    pub group_size: u32,
}

/// Key positions as the kernels read them, so the common cases upload nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PositionCode {
    /// `positions[j] = base + j` (a plain cache).
    Linear {
        /// Position of key 0.
        base: u32,
    },
    /// Two ascending runs (a ring buffer that wrapped): `j < split` at `base + j`, the rest at
    /// `base2 + (j - split)`.
    TwoRuns {
        /// Position of key 0.
        base: u32,
        /// Keys in the first run.
        split: u32,
        /// Position of key `split`.
        base2: u32,
    },
    /// Anything else: the positions are uploaded.
    Table(Vec<u32>),
}

impl PositionCode {
    /// Encodes a list of positions, or `None` when one does not fit in `u32`.
    pub fn encode(positions: &[usize]) -> Option<Self> {
        Self::of(&KeyPositions::from(positions))
    }

    /// Encodes `positions` from their runs (no per-key work unless there are more than two
    /// runs), or `None` when one does not fit in `u32`.
    pub fn of(positions: &KeyPositions) -> Option<Self> {
        let small = |x: usize| u32::try_from(x).ok();
        small(positions.max().unwrap_or(0))?;
        match positions.runs() {
            [] => Some(Self::Linear { base: 0 }),
            [r] => Some(Self::Linear {
                base: small(r.start)?,
            }),
            [r1, r2] => Some(Self::TwoRuns {
                base: small(r1.start)?,
                split: small(r1.len)?,
                base2: small(r2.start)?,
            }),
            _ => positions
                .iter()
                .map(small)
                .collect::<Option<Vec<u32>>>()
                .map(Self::Table),
        }
    }

    /// Writes the mode fields of `params`; returns the table to upload, if any.
    pub fn apply(&self, params: &mut QsdpaParams) -> Option<&[u32]> {
        match self {
            Self::Linear { base } => {
                params.pos_mode = 0;
                params.pos_base = *base;
                None
            }
            Self::TwoRuns { base, split, base2 } => {
                params.pos_mode = 1;
                params.pos_base = *base;
                params.pos_split = *split;
                params.pos_base2 = *base2;
                None
            }
            Self::Table(t) => {
                params.pos_mode = 2;
                Some(t)
            }
        }
    }
}

/// The most splits [`split_keys`] gives `base_blocks` blocks on a device holding
/// `resident_blocks` at once, whatever the number of keys (a captured decode step launches this
/// many and the extra ones return at once). Rounded down: one block past a full wave waits for
/// a whole block's time, leaving most multiprocessors idle meanwhile.
pub fn split_bound(base_blocks: usize, resident_blocks: usize) -> usize {
    (resident_blocks / base_blocks.max(1)).clamp(1, QSDPA_MAX_SPLIT)
}

/// The fewest keys a flash-decoding split takes, for `keys` keys over `base_blocks` blocks
/// (KV heads x row blocks) on a device holding `resident_blocks`, whose query rows hold
/// `row_dims` values (heads x queries x head dim): 16 (one tile) where the rows are few (at
/// most 4096 values, E4B's decode shapes) and 32-key splits would fill at most a quarter of
/// the device; else 32.
///
/// Fewer, longer splits save combine work but leave the device less filled, which costs more
/// than the combine saves. One-tile splits pay off only while the device stays short of blocks
/// and the rows are few: with many heads, or once 32-key splits fill the device, the partials
/// they add make the combine the larger cost.
pub fn split_min_keys_for(
    row_dims: usize,
    keys: usize,
    base_blocks: usize,
    resident_blocks: usize,
) -> usize {
    let blocks_at_32 = base_blocks * keys.div_ceil(32);
    if row_dims <= 4096 && 4 * blocks_at_32 <= resident_blocks {
        16
    } else {
        32
    }
}

/// Keys a split's length is a multiple of (`QS_SPLIT_STEP` in the kernels): one tensor-core
/// tile, one round of the CUDA-core kernel's warps.
pub const QSDPA_SPLIT_STEP: usize = QSDPA_WARPS * QSDPA_UNROLL;

/// A flash-decoding split of a view's keys: `n` splits of `per` keys (a multiple of
/// [`QSDPA_SPLIT_STEP`]), the first `long` of them [`QSDPA_SPLIT_STEP`] keys longer; the last
/// split ends at the last key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySplit {
    /// Splits.
    pub n: usize,
    /// Keys of a short split.
    pub per: usize,
    /// Splits (the first ones) that take one step more.
    pub long: usize,
}

impl KeySplit {
    /// `n` splits of `keys` keys with the steps shared out as evenly as they go (at most
    /// one step apart, the longer ones first); `n` is clamped to `1..=` the steps.
    pub fn even(keys: usize, n: usize) -> Self {
        let steps = keys.div_ceil(QSDPA_SPLIT_STEP).max(1);
        let n = n.clamp(1, steps);
        Self {
            n,
            per: steps / n * QSDPA_SPLIT_STEP,
            long: steps % n,
        }
    }

    /// Keys `[start, end)` of split `s` (clamped to `keys`), as the kernels compute them.
    pub fn range(&self, s: usize, keys: usize) -> (usize, usize) {
        let start = s * self.per + s.min(self.long) * QSDPA_SPLIT_STEP;
        let len = self.per + if s < self.long { QSDPA_SPLIT_STEP } else { 0 };
        (start.min(keys), (start + len).min(keys))
    }
}

/// Chooses the flash-decoding split: about `resident_blocks` blocks in all (what the GPU holds
/// at once), each split keeping at least `min_keys` keys, all splits of one length. Returns
/// `(n_split, keys_per_split)`.
pub fn split_keys(
    keys: usize,
    base_blocks: usize,
    resident_blocks: usize,
    min_keys: usize,
) -> (usize, usize) {
    let step = QSDPA_SPLIT_STEP;
    let target = split_bound(base_blocks, resident_blocks);
    // Short views split too (down to `min_keys` a split): a decode over a few hundred keys
    // otherwise runs on a handful of blocks.
    let max_split = keys.div_ceil(min_keys.max(1)).clamp(1, QSDPA_MAX_SPLIT);
    let n = target.clamp(1, max_split);
    let per = keys.div_ceil(n).div_ceil(step).max(1) * step;
    (keys.div_ceil(per).max(1), per)
}

/// [`split_keys`], rebalanced where splits one step apart in length spread the steps more
/// evenly over `sms` multiprocessors holding `resident_blocks` blocks between them: a wave of
/// equal splits rounded up to whole steps can leave some multiprocessors a block more than
/// others (E4B sliding at 32k keys: 342 splits of 6 tiles x 2 heads = 684 blocks on 132
/// multiprocessors, 24 of them holding 36 tiles and the rest 30; 384 splits of 5-6 tiles take
/// at most 32).
///
/// The cost of a split is the most steps one multiprocessor takes when block `b` (splits in
/// order, KV heads and row blocks within) lands on multiprocessor `b % sms`: `per` steps times
/// its blocks plus its long blocks. Among the splits of at most one wave, the one of least cost
/// with the fewest splits (the fewest partials to combine) is taken if it costs at most 95% of
/// [`split_keys`]' own.
pub fn balanced_split(
    keys: usize,
    base_blocks: usize,
    resident_blocks: usize,
    min_keys: usize,
    sms: usize,
) -> KeySplit {
    let (n0, per0) = split_keys(keys, base_blocks, resident_blocks, min_keys);
    let even = KeySplit {
        n: n0,
        per: per0,
        long: 0,
    };
    let steps = keys.div_ceil(QSDPA_SPLIT_STEP);
    let (base, sms) = (base_blocks.max(1), sms.max(1));
    let cost = |n: usize, per_steps: usize, long: usize| {
        per_steps * (n * base).div_ceil(sms) + (long * base).div_ceil(sms)
    };
    let bound = split_bound(base, resident_blocks)
        .min(keys.div_ceil(min_keys.max(1)))
        .min(steps);
    // (cost, splits): the least cost, and the fewest splits among its ties.
    let Some((least, n)) = (n0 + 1..=bound)
        .map(|n| (cost(n, steps / n, steps % n), n))
        .min()
    else {
        return even;
    };
    // More splits write more partials for the combine: a small predicted gain is not worth
    // them.
    if 20 * least > 19 * cost(n0, per0 / QSDPA_SPLIT_STEP, 0) {
        return even;
    }
    KeySplit::even(keys, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_encoded_without_tables_when_they_run() {
        assert_eq!(
            PositionCode::encode(&[5, 6, 7]),
            Some(PositionCode::Linear { base: 5 })
        );
        assert_eq!(
            PositionCode::encode(&[8, 9, 3, 4, 5]),
            Some(PositionCode::TwoRuns {
                base: 8,
                split: 2,
                base2: 3
            })
        );
        assert_eq!(
            PositionCode::encode(&[1, 3, 2, 9]),
            Some(PositionCode::Table(vec![1, 3, 2, 9]))
        );
    }

    #[test]
    fn long_runs_are_found_across_chunks() {
        let linear: Vec<usize> = (7..7 + 1000).collect();
        assert_eq!(
            PositionCode::encode(&linear),
            Some(PositionCode::Linear { base: 7 })
        );
        let ring: Vec<usize> = (600..1000).chain(300..600).collect();
        assert_eq!(
            PositionCode::encode(&ring),
            Some(PositionCode::TwoRuns {
                base: 600,
                split: 400,
                base2: 300
            })
        );
        let mut broken = linear.clone();
        broken[130] = 3;
        assert!(matches!(
            PositionCode::encode(&broken),
            Some(PositionCode::Table(t)) if t.len() == 1000 && t[130] == 3
        ));
        assert_eq!(
            PositionCode::encode(&[u32::MAX as usize, 1usize << 32]),
            None
        );
    }

    #[test]
    fn splits_cover_every_key() {
        for keys in [1, 100, 1000, 32768, 131072] {
            let (n, per) = split_keys(keys, 4, 4 * 132, 32);
            assert!(
                n * per >= keys && (n - 1) * per < keys,
                "{keys}: {n} x {per}"
            );
        }
    }

    #[test]
    fn balanced_splits_cover_every_key_once() {
        for keys in [1, 17, 100, 1000, 8192, 32768, 32769, 131072] {
            for (base, resident, min_keys) in
                [(2, 792, 16), (2, 684, 32), (16, 792, 32), (4, 528, 32)]
            {
                let s = balanced_split(keys, base, resident, min_keys, 132);
                assert!(s.n >= 1 && s.n <= split_bound(base, resident) && s.long < s.n.max(2));
                for s in [s, KeySplit::even(keys, resident / base)] {
                    assert_eq!(s.per % QSDPA_SPLIT_STEP, 0, "{keys} keys: {s:?}");
                    let mut next = 0;
                    for i in 0..s.n {
                        let (a, b) = s.range(i, keys);
                        assert!(
                            a == next && b > a,
                            "{keys} keys, split {i} of {s:?}: {a}..{b}"
                        );
                        next = b;
                    }
                    assert_eq!(next, keys, "{keys} keys: {s:?}");
                }
            }
        }
    }

    #[test]
    fn balanced_splits_even_out_the_multiprocessors() {
        // E4B sliding decode at 32k keys, 4-bit tiles in registers (6 blocks a multiprocessor
        // of 132, 2 KV heads): equal splits give 342 x 6 tiles, 36 tiles on the busiest
        // multiprocessor; 384 splits of 5-6 tiles take at most 32.
        let even = split_keys(32768, 2, 792, 16);
        assert_eq!(even, (342, 96));
        let s = balanced_split(32768, 2, 792, 16, 132);
        assert_eq!((s.n, s.per, s.long), (384, 80, 128));
        // Where equal splits are already even, they stay.
        let s = balanced_split(8192, 2, 792, 32, 132);
        assert_eq!((s.n, s.per, s.long), (256, 32, 0));
        // A gain under 5% keeps them too (64 splits x 4 heads on 2 blocks a multiprocessor:
        // 64 -> 63 tiles).
        let s = balanced_split(32768, 4, 264, 32, 132);
        assert_eq!((s.n, s.per, s.long), (64, 512, 0));
    }

    #[test]
    fn one_tile_splits_only_for_few_rows_on_a_short_view() {
        // E4B decode (8 heads x 256/512 dims, 2 KV heads) at 1k keys, 8 and 4 blocks a
        // multiprocessor on 132.
        assert_eq!(split_min_keys_for(8 * 256, 1024, 2, 1056), 16);
        assert_eq!(split_min_keys_for(8 * 512, 1024, 2, 528), 16);
        // The same at 8k keys: 512 blocks of 32 keys, half the device.
        assert_eq!(split_min_keys_for(8 * 256, 8192, 2, 1056), 32);
        // 31B decode (32 heads): partials dominate.
        assert_eq!(split_min_keys_for(32 * 256, 1024, 16, 1056), 32);
        // Prefill rows.
        assert_eq!(split_min_keys_for(8 * 512 * 256, 1024, 2, 528), 32);
    }

    #[test]
    fn splits_fit_in_one_wave() {
        for (base, resident) in [
            (16, 792),
            (2, 396),
            (4, 396),
            (2, 792),
            (7, 100),
            (500, 264),
        ] {
            let bound = split_bound(base, resident);
            assert!(
                bound >= 1 && (bound == 1 || base * bound <= resident),
                "{base} {resident}"
            );
            for keys in [1000, 32768, 131072] {
                let (n, _) = split_keys(keys, base, resident, 32);
                assert!(n <= bound, "{keys} keys: {n} splits, bound {bound}");
            }
        }
    }

    #[test]
    fn params_have_the_c_layout() {
        assert_eq!(std::mem::size_of::<QsdpaParams>(), 8 * 8 + 16 * 4);
        assert_eq!(std::mem::size_of::<QmatParams>(), 16);
    }
}
