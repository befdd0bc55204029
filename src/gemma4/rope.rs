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
        let both = self.both(offsets, seq_len, dtype, device)?;
        Ok((both.get(0)?, both.get(1)?))
    }

    /// Both tables as one tensor `[2, batch, seq_len, head_dim / 2]` (cos, then sin): what
    /// [`Rope::tables`] returns the two halves of.
    ///
    /// # Errors
    /// Allocation failure.
    pub fn both(
        &self,
        offsets: &[usize],
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = (2, offsets.len(), seq_len, self.inv_freq.len());
        // Both tables in one upload, rounded to the activations' dtype on the host (the same
        // rounding as a device cast, without two cast launches a step).
        upload_in_dtype(self.values(offsets, seq_len), shape, dtype, device)
    }

    /// The bytes of [`Rope::both`] in `dtype` (f32, f16 or bf16), little-endian, for writing
    /// into an existing table.
    ///
    /// # Errors
    /// Another dtype.
    pub fn both_bytes(&self, offsets: &[usize], seq_len: usize, dtype: DType) -> Result<Vec<u8>> {
        let values = self.values(offsets, seq_len);
        Ok(match dtype {
            DType::BF16 => values
                .into_iter()
                .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            DType::F16 => values
                .into_iter()
                .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            DType::F32 => values.into_iter().flat_map(f32::to_le_bytes).collect(),
            other => candle_core::bail!("rotary tables in {other:?}: f32, f16 or bf16 only"),
        })
    }

    /// Every cos, then every sin, in f32 (`[2, batch, seq_len, head_dim / 2]` order).
    ///
    /// A prefill chunk's tables are hundreds of thousands of angles (E4B: 1024 positions x 384
    /// pairs), several milliseconds of one core's time a chunk: above [`PARALLEL_MIN_ANGLES`]
    /// the rows are split over up to [`MAX_TABLE_THREADS`] threads. Each value is computed
    /// alike either way.
    fn values(&self, offsets: &[usize], seq_len: usize) -> Vec<f32> {
        let half = self.inv_freq.len();
        let rows: Vec<f32> = offsets
            .iter()
            .flat_map(|&start| (0..seq_len).map(move |s| (start + s) as f32))
            .collect();
        let n = rows.len() * half;
        let mut out = vec![0f32; 2 * n];
        if half == 0 {
            return out;
        }
        let (cos, sin) = out.split_at_mut(n);
        let fill = |positions: &[f32], cos: &mut [f32], sin: &mut [f32]| {
            for (i, &pos) in positions.iter().enumerate() {
                // Like the references: f32 inverse frequencies times an exact f32 position.
                for (j, &f) in self.inv_freq.iter().enumerate() {
                    let angle = pos * f as f32;
                    cos[i * half + j] = angle.cos();
                    sin[i * half + j] = angle.sin();
                }
            }
        };
        let threads = std::thread::available_parallelism()
            .map_or(1, |t| t.get())
            .min(MAX_TABLE_THREADS)
            .min(n.div_ceil(PARALLEL_MIN_ANGLES / 2));
        if threads <= 1 {
            fill(&rows, cos, sin);
            return out;
        }
        let per = rows.len().div_ceil(threads);
        std::thread::scope(|scope| {
            for ((positions, cos), sin) in rows
                .chunks(per)
                .zip(cos.chunks_mut(per * half))
                .zip(sin.chunks_mut(per * half))
            {
                scope.spawn(move || fill(positions, cos, sin));
            }
        });
        out
    }
}

/// Angles from which [`Rope`] tables are computed on several threads (below, a thread's start
/// costs more than it saves).
const PARALLEL_MIN_ANGLES: usize = 32 * 1024;

/// Most threads one table is computed on.
const MAX_TABLE_THREADS: usize = 8;

/// `values` (f32) as a tensor of `dtype` on `device`, converted on the host.
fn upload_in_dtype(
    values: Vec<f32>,
    shape: (usize, usize, usize, usize),
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    match dtype {
        DType::BF16 => {
            let v: Vec<half::bf16> = values.into_iter().map(half::bf16::from_f32).collect();
            Tensor::from_vec(v, shape, device)
        }
        DType::F16 => {
            let v: Vec<half::f16> = values.into_iter().map(half::f16::from_f32).collect();
            Tensor::from_vec(v, shape, device)
        }
        _ => Tensor::from_vec(values, shape, device)?.to_dtype(dtype),
    }
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

    #[test]
    fn tables_rounded_on_the_host_equal_f32_tables_cast_on_the_device() -> Result<()> {
        let p = RopeParams {
            theta: 10_000.0,
            partial_rotary_factor: 1.0,
            factor: 1.0,
        };
        let r = Rope::new(&p, 64);
        let dev = Device::Cpu;
        let (cos32, sin32) = r.tables(&[3, 1000], 5, DType::F32, &dev)?;
        for dtype in [DType::BF16, DType::F16] {
            let (cos, sin) = r.tables(&[3, 1000], 5, dtype, &dev)?;
            assert_eq!(cos.dims(), &[2, 5, 32]);
            for (got, want) in [(cos, &cos32), (sin, &sin32)] {
                let want = want.to_dtype(dtype)?.to_dtype(DType::F32)?;
                let got = got.to_dtype(DType::F32)?;
                assert_eq!(
                    got.flatten_all()?.to_vec1::<f32>()?,
                    want.flatten_all()?.to_vec1::<f32>()?
                );
            }
        }
        Ok(())
    }

    #[test]
    fn a_chunk_table_split_over_threads_equals_one_computed_in_order() {
        let p = RopeParams {
            theta: 1_000_000.0,
            partial_rotary_factor: 0.25,
            factor: 1.0,
        };
        let r = Rope::new(&p, 512);
        let (offsets, seq_len) = ([5usize, 3000], 1021);
        assert!(offsets.len() * seq_len * 256 >= 2 * PARALLEL_MIN_ANGLES);
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for &start in &offsets {
            for s in 0..seq_len {
                for &f in &r.inv_freq {
                    let angle = (start + s) as f32 * f as f32;
                    cos.push(angle.cos().to_bits());
                    sin.push(angle.sin().to_bits());
                }
            }
        }
        cos.extend(sin);
        let got: Vec<u32> = r
            .values(&offsets, seq_len)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, cos);
    }

    #[test]
    fn table_bytes_equal_the_uploaded_tables() -> Result<()> {
        let p = RopeParams {
            theta: 1_000_000.0,
            partial_rotary_factor: 0.25,
            factor: 1.0,
        };
        let r = Rope::new(&p, 32);
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let both = r.both(&[77], 1, dtype, &Device::Cpu)?;
            let bytes = r.both_bytes(&[77], 1, dtype)?;
            let from_bytes = Tensor::from_raw_buffer(&bytes, dtype, both.dims(), &Device::Cpu)?;
            let flat = |t: &Tensor| -> Result<Vec<f32>> {
                t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
            };
            assert_eq!(flat(&from_bytes)?, flat(&both)?);
            // Not all ones and zeros: position 77 rotates the first pairs.
            assert!(flat(&both)?.iter().any(|&v| v != 0.0 && v != 1.0));
        }
        assert!(r.both_bytes(&[1], 1, DType::U8).is_err());
        Ok(())
    }
}
