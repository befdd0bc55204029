//! The absolute positions of a view's keys, kept as ascending runs.
//!
//! Caches hand attention one or two runs (a plain cache: `0..n`; a ring that wrapped: its
//! newer slots, then its older ones), so a decode step describes tens of thousands of keys in a
//! few words instead of building, copying and scanning a `Vec<usize>` per layer (at 32k keys
//! that cost ~25 µs of host time per attention call, more than the GPU's share of a 4-bit
//! call). Any other order is still allowed: it becomes more runs.

use std::ops::Range;

/// `len` consecutive positions from `start`: keys `j..j + len` of a view sit at positions
/// `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PositionRun {
    /// Position of the run's first key.
    pub start: usize,
    /// Keys in the run (at least one).
    pub len: usize,
}

/// Absolute token position of every key of a view, in storage order, as ascending runs.
///
/// Build it from a range ([`KeyPositions::range`]), run by run ([`KeyPositions::push_run`]), or
/// from any list of positions (`From<Vec<usize>>`, `FromIterator`). Two values are equal when
/// they hold the same positions in the same order; the settled mark
/// ([`KeyPositions::settled_below`]) is a scheduling hint and does not count.
#[derive(Debug, Clone, Default)]
pub struct KeyPositions {
    runs: Vec<PositionRun>,
    len: usize,
    /// Keys at positions below this were in storage before the update that made the view
    /// (see [`KeyPositions::settled_below`]).
    settled_below: Option<usize>,
}

impl KeyPositions {
    /// No keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys `0..r.len()` at positions `r` (one run).
    pub fn range(r: Range<usize>) -> Self {
        let mut p = Self::new();
        p.push_run(r.start, r.len());
        p
    }

    /// Appends `len` keys at positions `start..start + len`, merged into the last run when they
    /// continue it. An empty run adds nothing.
    pub fn push_run(&mut self, start: usize, len: usize) {
        if len == 0 {
            return;
        }
        self.len += len;
        if let Some(last) = self.runs.last_mut() {
            if last.start.checked_add(last.len) == Some(start) {
                last.len += len;
                return;
            }
        }
        self.runs.push(PositionRun { start, len });
    }

    /// Appends one key at `position`.
    pub fn push(&mut self, position: usize) {
        self.push_run(position, 1);
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ascending runs, in storage order (adjacent runs never continue each other).
    pub fn runs(&self) -> &[PositionRun] {
        &self.runs
    }

    /// Every key's position, in storage order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.runs.iter().flat_map(|r| r.start..r.start + r.len)
    }

    /// Every key's position as a vector.
    pub fn to_vec(&self) -> Vec<usize> {
        self.iter().collect()
    }

    /// The largest position, or `None` without keys.
    pub fn max(&self) -> Option<usize> {
        self.runs.iter().map(|r| r.start + (r.len - 1)).max()
    }

    /// Declares that the keys at positions below `position` are settled: they were in storage
    /// before the cache update that made this view, so the only kernels that may still write
    /// storage when attention is enqueued are that update's own writes of the newer keys.
    /// The CUDA tensor-core attention then reads a split's first tile of settled keys before
    /// it waits for the kernel ahead of it (programmatic dependent launch), so those loads
    /// overlap that kernel's tail. The model's caches mark every view with the offset the
    /// update started at (the cache's offset read before the update); an unmarked view is read
    /// only after the wait.
    ///
    /// This holds because every kernel of this crate that may start before its predecessor
    /// ends waits for that predecessor before it lets its own successor start (except the
    /// one-row `_u2le` matvec, which may run beside its predecessor but writes only its
    /// output), and kernels launched without that attribute start only after their
    /// predecessor ends. Do not mark keys that a kernel enqueued just before the attention
    /// writes (a quantization of the whole view, say).
    pub fn settled_below(mut self, position: usize) -> Self {
        self.settled_below = Some(position);
        self
    }

    /// The longest run of keys (storage indices) marked settled by
    /// [`KeyPositions::settled_below`]: all at positions below the mark, in one run of
    /// storage. Empty for an unmarked view.
    pub fn settled_keys(&self) -> Range<usize> {
        let Some(mark) = self.settled_below else {
            return 0..0;
        };
        let (mut best, mut streak, mut start) = (0..0, None, 0);
        for r in &self.runs {
            // A run's positions ascend: its keys below the mark are a prefix, which continues
            // a streak when the run before lay wholly below.
            let below = mark.saturating_sub(r.start).min(r.len);
            let from = streak.unwrap_or(start);
            if below > 0 && start + below - from > best.len() {
                best = from..start + below;
            }
            streak = (below == r.len).then_some(from);
            start += r.len;
        }
        best
    }
}

impl PartialEq for KeyPositions {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.runs == other.runs
    }
}

impl Eq for KeyPositions {}

impl FromIterator<usize> for KeyPositions {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        let mut p = Self::new();
        for x in iter {
            p.push(x);
        }
        p
    }
}

impl From<Vec<usize>> for KeyPositions {
    fn from(v: Vec<usize>) -> Self {
        v.into_iter().collect()
    }
}

impl From<&[usize]> for KeyPositions {
    fn from(v: &[usize]) -> Self {
        v.iter().copied().collect()
    }
}

impl From<Range<usize>> for KeyPositions {
    fn from(r: Range<usize>) -> Self {
        Self::range(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_expand_back_to_the_positions() {
        let list: Vec<usize> = (600..1000).chain(300..600).chain([7, 9, 10]).collect();
        let p = KeyPositions::from(list.clone());
        assert_eq!(p.len(), list.len());
        assert_eq!(p.to_vec(), list);
        assert_eq!(
            p.runs(),
            &[
                PositionRun {
                    start: 600,
                    len: 400
                },
                PositionRun {
                    start: 300,
                    len: 300
                },
                PositionRun { start: 7, len: 1 },
                PositionRun { start: 9, len: 2 },
            ]
        );
        assert_eq!(p.max(), Some(999));
        let mut q = KeyPositions::range(0..5);
        q.push_run(5, 3);
        q.push_run(20, 0);
        assert_eq!(q, KeyPositions::range(0..8));
        assert!(KeyPositions::new().is_empty() && KeyPositions::new().max().is_none());
    }

    #[test]
    fn settled_keys_are_the_longest_run_below_the_mark() {
        assert_eq!(KeyPositions::range(0..10).settled_keys(), 0..0);
        assert_eq!(
            KeyPositions::range(0..10).settled_below(9).settled_keys(),
            0..9
        );
        assert_eq!(
            KeyPositions::range(0..10).settled_below(0).settled_keys(),
            0..0
        );
        // A wrapped ring: slots 0..4 hold the newest positions (12 just written), 4..10 the
        // oldest.
        let mut ring = KeyPositions::new();
        ring.push_run(9, 4);
        ring.push_run(3, 6);
        assert_eq!(ring.clone().settled_below(12).settled_keys(), 4..10);
        assert_eq!(ring.clone().settled_below(13).settled_keys(), 0..10);
        // Runs wholly below the mark join the next run's prefix.
        let mut two = KeyPositions::new();
        two.push_run(0, 3);
        two.push_run(10, 5);
        assert_eq!(two.clone().settled_below(12).settled_keys(), 0..5);
        assert_eq!(
            two.clone().settled_below(12),
            two,
            "the mark is not part of the value"
        );
    }
}
