//! The one closeness rule of the tests: the largest absolute difference between two tensors
//! (any devices, any float dtypes, compared in f32), and a table of checks that records each
//! case against its tolerance and fails once, at the end, naming every case that missed.

use std::fmt::Display;

use candle_core::{DType, Device, Tensor};

/// Largest `|a - b|` over all elements, compared in f32 on the CPU; a NaN anywhere counts as
/// infinitely far. Panics on a shape mismatch (a test bug, not a kernel error).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let f32s = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("tensor readable as f32")
    };
    let (a, b) = (f32s(a), f32s(b));
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    a.iter().zip(&b).fold(0f32, |m, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() {
            f32::INFINITY
        } else {
            m.max(d)
        }
    })
}

/// A table of checks: each case prints one line (`PASS`/`FAIL`), and [`Checks::finish`] fails
/// the test naming every case that missed its tolerance.
pub struct Checks {
    what: String,
    cases: usize,
    worst: f32,
    failures: Vec<String>,
}

impl Checks {
    /// An empty table for the checks of `what` (named in the summary and the failure).
    pub fn new(what: impl Display) -> Self {
        Self {
            what: what.to_string(),
            cases: 0,
            worst: 0.0,
            failures: Vec::new(),
        }
    }

    /// Records `case` with max abs error `err` against `tol` (`err <= tol` passes; NaN fails).
    pub fn close(&mut self, case: impl Display, err: f32, tol: f32) -> bool {
        let pass = err <= tol;
        self.cases += 1;
        self.worst = self.worst.max(err);
        let line = format!("{case} max_abs={err:.3e} tol={tol:.3e}");
        println!("{line} {}", if pass { "PASS" } else { "FAIL" });
        if !pass {
            self.failures.push(line);
        }
        pass
    }

    /// Records `case` as an exact (yes/no) check.
    pub fn exact(&mut self, case: impl Display, pass: bool) -> bool {
        self.cases += 1;
        let line = case.to_string();
        println!("{line} {}", if pass { "PASS (exact)" } else { "FAIL" });
        if !pass {
            self.failures.push(line);
        }
        pass
    }

    /// Prints the summary and panics, listing the cases that failed, if any did.
    pub fn finish(self) {
        println!(
            "{}: {} checks, {} failed, worst max abs error {:.3e}",
            self.what,
            self.cases,
            self.failures.len(),
            self.worst
        );
        assert!(
            self.failures.is_empty(),
            "{}: {} of {} checks failed:\n  {}",
            self.what,
            self.failures.len(),
            self.cases,
            self.failures.join("\n  ")
        );
    }
}
