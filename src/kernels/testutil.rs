//! Helpers shared by the crate's unit tests: the one closeness measure they compare with.

use candle_core::{DType, Tensor};

/// Values a test compares: a tensor (any dtype, shape or device) or host `f32`s.
pub(crate) trait Values {
    /// The values as host `f32`, flattened in row-major order.
    fn values(&self) -> Vec<f32>;
}

impl Values for Tensor {
    fn values(&self) -> Vec<f32> {
        self.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .expect("a tensor readable as f32")
    }
}

impl Values for [f32] {
    fn values(&self) -> Vec<f32> {
        self.to_vec()
    }
}

impl Values for Vec<f32> {
    fn values(&self) -> Vec<f32> {
        self.clone()
    }
}

/// The largest `|a[i] - b[i]|` (NaN when either side has one). Panics when the element counts
/// differ.
pub(crate) fn max_abs_diff<A, B>(a: &A, b: &B) -> f32
where
    A: Values + ?Sized,
    B: Values + ?Sized,
{
    let (a, b) = (a.values(), b.values());
    assert_eq!(a.len(), b.len(), "compared values differ in length");
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, |m, d| {
            if d.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// `t` as host `f32`, flattened in row-major order.
pub(crate) fn flat(t: &Tensor) -> Vec<f32> {
    t.values()
}
