//! Rotary embeddings, rotate-half layout. Sliding layers rotate every pair (`default`); full
//! layers use `proportional` RoPE: only the first `partial_rotary_factor * D / 2` frequency
//! pairs rotate, with exponents over the *full* head dim D, and the rest pass through unchanged.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::RopeParams;

/// Inverse frequencies of one layer kind.
#[derive(Debug, Clone)]
pub struct Rope {
    /// `[head_dim / 2]`; zero for pairs that do not rotate.
    inv_freq: Vec<f64>,
}

impl Rope {
    /// Builds the table for a head dimension.
    pub fn new(params: &RopeParams, head_dim: usize) -> Self {
        let half = head_dim / 2;
        let rotated = ((params.partial_rotary_factor * head_dim as f64) / 2.0).floor() as usize;
        let inv_freq = (0..half)
            .map(|j| {
                if j < rotated.min(half) {
                    1.0 / params.theta.powf(2.0 * j as f64 / head_dim as f64) / params.factor
                } else {
                    0.0
                }
            })
            .collect();
        Self { inv_freq }
    }

    /// `cos`, `sin` tables `[batch, seq_len, head_dim / 2]` for sequences whose first token sits
    /// at `offsets[b]`. Angles are computed in f32 (positions are exact
    /// there up to 2^24), then cast to `dtype`.
    ///
    /// # Errors
    /// Allocation failure.
    pub fn tables(
        &self,
        offsets: &[usize],
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let n = offsets.len() * seq_len * half;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &start in offsets {
            for s in 0..seq_len {
                // Like the references: f32 inverse frequencies times an exact f32 position.
                let pos = (start + s) as f32;
                for &f in &self.inv_freq {
                    let angle = pos * f as f32;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let shape = (offsets.len(), seq_len, half);
        let cos = Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }
}

/// Applies rotate-half RoPE to `x` `[batch, heads, seq_len, head_dim]`.
///
/// # Errors
/// Shapes that disagree with the tables.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proportional_rotates_only_the_first_pairs_with_full_dim_exponents() {
        let p = RopeParams {
            theta: 1e6,
            partial_rotary_factor: 0.25,
            factor: 1.0,
        };
        let r = Rope::new(&p, 512);
        assert_eq!(r.inv_freq.len(), 256);
        assert!(r.inv_freq[..64].iter().all(|&f| f > 0.0));
        assert!(r.inv_freq[64..].iter().all(|&f| f == 0.0));
        let want = 1.0 / 1e6f64.powf(2.0 * 63.0 / 512.0);
        assert!((r.inv_freq[63] - want).abs() < 1e-15);
    }
}
