//! Stop strings over streamed text: decides which part of each chunk is safe to show now,
//! holding back any tail that might be the start of a stop string until the next chunk
//! settles it.
//!
//! ```
//! use candle_gemma::generate::stop::StopStrings;
//!
//! let mut stops = StopStrings::new(["###"]);
//! let a = stops.push("Hello #");
//! assert_eq!((a.text.as_str(), a.matched), ("Hello ", None)); // "#" may start "###"
//! let b = stops.push("## tail");
//! assert_eq!((b.text.as_str(), b.matched), ("", Some(0)));
//! ```

/// What [`StopStrings::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopChunk {
    /// Text that can be emitted now; never contains a stop string or anything after one.
    pub text: String,
    /// Index (into the list given to [`StopStrings::new`]) of the stop string that was hit.
    pub matched: Option<usize>,
}

impl StopChunk {
    /// Whether a stop string has been hit (now or by an earlier chunk).
    pub fn is_stopped(&self) -> bool {
        self.matched.is_some()
    }
}

/// A streaming matcher for a set of stop strings.
///
/// Text up to the first occurrence of any stop string is emitted; the stop string and
/// everything after it is not. Once stopped, further chunks are swallowed.
#[derive(Debug, Clone)]
pub struct StopStrings {
    /// `(index in the caller's list, string)`; empty strings are dropped.
    stops: Vec<(usize, String)>,
    /// Text received but not yet emitted: a possible prefix of a stop string.
    held: String,
    stopped: Option<usize>,
}

impl StopStrings {
    /// Builds a matcher; empty stop strings are ignored.
    pub fn new<I, S>(stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let stops = stops
            .into_iter()
            .map(Into::into)
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .collect();
        Self {
            stops,
            held: String::new(),
            stopped: None,
        }
    }

    /// Whether there is no (non-empty) stop string, so every chunk passes through unchanged.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The stop string that was hit, as an index into the list given to [`Self::new`].
    pub fn matched(&self) -> Option<usize> {
        self.stopped
    }

    /// Feeds one chunk; returns the text safe to emit and whether a stop string was hit.
    pub fn push(&mut self, chunk: &str) -> StopChunk {
        if self.stopped.is_some() {
            return StopChunk {
                text: String::new(),
                matched: self.stopped,
            };
        }
        self.held.push_str(chunk);
        if let Some((start, index)) = self.earliest_match() {
            self.held.truncate(start);
            self.stopped = Some(index);
            return StopChunk {
                text: std::mem::take(&mut self.held),
                matched: Some(index),
            };
        }
        let keep = self.partial_suffix_len();
        let rest = self.held.split_off(self.held.len() - keep);
        StopChunk {
            text: std::mem::replace(&mut self.held, rest),
            matched: None,
        }
    }

    /// Ends the stream: returns any held-back text (it did not turn into a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start byte and caller index of the leftmost stop string in `held` (the longest one
    /// when several start at the same byte).
    fn earliest_match(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None;
        for (index, stop) in &self.stops {
            if let Some(pos) = self.held.find(stop.as_str()) {
                let better = match best {
                    None => true,
                    Some((p, _, len)) => pos < p || (pos == p && stop.len() > len),
                };
                if better {
                    best = Some((pos, *index, stop.len()));
                }
            }
        }
        best.map(|(pos, index, _)| (pos, index))
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_bytes();
        let mut best = 0;
        for (_, stop) in &self.stops {
            let max = (stop.len() - 1).min(held.len());
            for k in (best + 1..=max).rev() {
                if held[held.len() - k..] == stop.as_bytes()[..k]
                    && self.held.is_char_boundary(held.len() - k)
                {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks` and returns (emitted text, matched index).
    fn run(stops: &[&str], chunks: &[&str]) -> (String, Option<usize>) {
        let mut m = StopStrings::new(stops.iter().copied());
        let mut out = String::new();
        for c in chunks {
            let r = m.push(c);
            out.push_str(&r.text);
            if r.matched.is_some() {
                return (out, r.matched);
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    #[test]
    fn stop_split_at_every_position() {
        let text = "say héllo<END>never shown";
        for i in 0..=text.len() {
            for j in i..=text.len() {
                if !(text.is_char_boundary(i) && text.is_char_boundary(j)) {
                    continue;
                }
                let chunks = [&text[..i], &text[i..j], &text[j..]];
                assert_eq!(
                    run(&["<END>"], &chunks),
                    ("say héllo".to_string(), Some(0)),
                    "split {i} {j}"
                );
            }
        }
    }

    #[test]
    fn held_prefix_is_released_when_it_does_not_complete() {
        let mut m = StopStrings::new(["<END>"]);
        assert_eq!(m.push("a <EN").text, "a ");
        assert_eq!(m.push("D? no").text, "<END? no");
        assert_eq!(m.push("<E").text, "");
        assert_eq!(m.finish(), "<E");
    }

    #[test]
    fn leftmost_stop_wins_and_index_is_reported() {
        assert_eq!(run(&["zz", "b"], &["a", "bzz"]), ("a".into(), Some(1)));
        assert_eq!(run(&["abc", "ab"], &["xabc"]), ("x".into(), Some(0)));
    }

    #[test]
    fn overlapping_prefixes_are_found() {
        // "aab" inside "aaab": the first "aa" candidate fails, the match starts one later.
        assert_eq!(
            run(&["aab"], &["a", "a", "a", "b", "c"]),
            ("a".into(), Some(0))
        );
    }

    #[test]
    fn no_stops_and_empty_stops_pass_everything() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), None));
    }

    #[test]
    fn after_a_stop_everything_is_swallowed() {
        let mut m = StopStrings::new(["x"]);
        assert!(m.push("ax").is_stopped());
        let r = m.push("more");
        assert_eq!((r.text.as_str(), r.matched), ("", Some(0)));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn multibyte_stop_strings() {
        let text = "前面🎉後面";
        let bytes: Vec<&str> = text
            .char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect();
        assert_eq!(run(&["🎉後"], &bytes), ("前面".into(), Some(0)));
    }
}
