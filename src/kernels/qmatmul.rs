//! Matrix products and embedding lookups with MLX affine-quantized weights that stay packed in
//! memory: `W[o, g*G + i] = scales[o, g] * code[o, g*G + i] + biases[o, g]`, codes little-endian
//! in `u32` words (element 0 in the lowest bits of word 0), 4 or 8 bits, groups of 32/64/128.
//!
//! [`qmatmul`] and [`qembedding`] dispatch on the device: the CPU runs the plain-Rust reference
//! below (never a dense copy of `W`); CUDA runs a matrix-vector kernel for up to
//! [`MATVEC_MAX_ROWS`] rows (32 for 4-bit weights with scales in the activations' dtype) and
//! dequantize-then-GEMM beyond. On Metal, a 4-bit matrix that
//! maps exactly onto candle's `Q4_1` blocks ([`PackedAffine::with_candle_q4_1`]) takes
//! candle's matrix-vector kernel for up to [`MATVEC_MAX_ROWS`] rows and its row gather; other
//! products and gathers take the crate's Metal kernels when
//! [`super::policy::LaunchPolicy::metal_kernels`] is on (`kernels::metal::route`), else the
//! host.
//!
//! Per output element the reference computes, with `x` in f32:
//! ```text
//! y[r, o] = Σ_g scales[o,g] * Σ_{e∈g} code[o,e] * x[r,e]  +  biases[o,g] * Σ_{e∈g} x[r,e]
//! ```

use candle_core::{DType, Device, Tensor};

use super::quant::{dequantize_host, host_f32};
use super::{KernelError, PackedAffine};

/// Activation rows up to which the GPU uses the matrix-vector kernels for every weight format;
/// more rows dequantize the weight and call the dense GEMM, except that 4-bit weights whose
/// scales have the activations' dtype keep a matrix-vector kernel up to 32 rows.
pub const MATVEC_MAX_ROWS: usize = 8;

/// `x · Wᵀ` with a packed `W`: `x` `[.., in_dim]` → `[.., out_dim]` in `x`'s dtype, on `x`'s
/// device (which must be `w`'s).
///
/// # Errors
/// [`KernelError::Shape`] when the last dimension of `x` is not `in_dim`; candle errors
/// (devices differ, unsupported dtype).
pub fn qmatmul(x: &Tensor, w: &PackedAffine) -> Result<Tensor, KernelError> {
    let dims = x.dims().to_vec();
    let in_dim = dims.last().copied().unwrap_or(0);
    if in_dim != w.in_dim() {
        return Err(KernelError::Shape {
            what: "qmatmul input",
            expected: format!("[.., {}]", w.in_dim()),
            found: dims,
        });
    }
    let rows = x.elem_count() / in_dim.max(1);
    let x2 = x.reshape((rows, in_dim))?;
    // A test switch: every CPU product of the `Q4_1` blocks on candle's own quantized matmul.
    let candle_cpu = x.device().is_cpu() && super::policy::current().candle_qmatmul_on_cpu;
    let y = match (&w.q4_1, x.device()) {
        (Some(q), _) if rows <= MATVEC_MAX_ROWS || candle_cpu => q.matmul(&x2)?,
        (_, Device::Cpu) => cpu_qmatmul(&x2, w)?,
        #[cfg(feature = "cuda")]
        (_, Device::Cuda(_)) => {
            if rows > 0 && rows <= super::cuda::matvec::qmatvec_max_rows(x.dtype(), w) {
                super::cuda::matvec::qmatvec(
                    &x2,
                    &w.codes,
                    &w.scales,
                    &w.biases,
                    w.bits.bits(),
                    w.group_size,
                    w.is_settled(),
                )?
            } else {
                let dense = w.dequantize(x.dtype())?; // [out, in]
                x2.matmul(&dense.t()?)?
            }
        }
        #[cfg(feature = "metal")]
        (_, Device::Metal(_)) => super::metal::qmatmul(&x2, w)?,
        #[allow(unreachable_patterns)]
        _ => {
            let dense = w.dequantize(x.dtype())?;
            x2.matmul(&dense.t()?)?
        }
    };
    let mut out_dims = dims;
    if let Some(last) = out_dims.last_mut() {
        *last = w.out_dim();
    }
    Ok(y.reshape(out_dims)?)
}

/// Embedding lookup with a packed table `[vocab, hidden]`: `ids` (any integer dtype, any shape
/// `[..]`) → `[.., hidden]` in `dtype`, dequantizing only the rows looked up. The ids are read
/// to the host to check them against the table (the model checks its ids before the forward and
/// gathers without this read).
///
/// # Errors
/// [`KernelError::Shape`] when an id is not below `w.out_dim()`; candle errors.
pub fn qembedding(ids: &Tensor, w: &PackedAffine, dtype: DType) -> Result<Tensor, KernelError> {
    let flat: Vec<u32> = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    let vocab = w.out_dim();
    if let Some(&bad_id) = flat.iter().find(|&&i| i as usize >= vocab) {
        return Err(KernelError::Shape {
            what: "qembedding ids",
            expected: format!("ids below {vocab}"),
            found: vec![bad_id as usize],
        });
    }
    let ids = ids.to_dtype(DType::U32)?.to_device(w.codes.device())?;
    qembedding_checked_ids(&ids, w, dtype)
}

/// [`qembedding`] for ids the caller has already checked against the table. On a GPU the rows
/// are gathered straight from the device ids, with no copy to the host (a decode step stays
/// free of host synchronisation, and can be captured into a CUDA graph): candle's `Q4_1`
/// gather for a table that maps exactly ([`PackedAffine::with_candle_q4_1`]), else the
/// dequantize kernel's row selection. An id past the table gives an unspecified row there.
/// On the CPU, and on Metal with the crate's kernels off, the rows are dequantized on the host.
///
/// # Errors
/// Candle errors; off the GPU, [`KernelError::Shape`] for an id past the table.
pub(crate) fn qembedding_checked_ids(
    ids: &Tensor,
    w: &PackedAffine,
    dtype: DType,
) -> Result<Tensor, KernelError> {
    let mut out_dims = ids.dims().to_vec();
    out_dims.push(w.in_dim());
    if let Some(q) = &w.q4_1 {
        return Ok(q.embedding(ids, dtype)?.reshape(out_dims)?);
    }
    #[cfg(feature = "cuda")]
    if w.codes.device().is_cuda() {
        let dense = super::cuda::quantize::dequant_rows(
            &w.codes,
            &w.scales,
            &w.biases,
            w.bits.bits(),
            w.group_size,
            Some(ids),
            dtype,
        )?;
        return Ok(dense.reshape(out_dims)?);
    }
    #[cfg(feature = "metal")]
    if w.codes.device().is_metal() {
        if let Some(rows) = super::metal::qembedding(ids, w, dtype)? {
            return Ok(rows.reshape(out_dims)?);
        }
    }
    let flat: Vec<u32> = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    let rows: Vec<usize> = flat.iter().map(|&i| i as usize).collect();
    let dense = dequantize_host(w, &rows)?;
    Ok(
        Tensor::from_vec(dense, (rows.len(), w.in_dim()), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(w.codes.device())?
            .reshape(out_dims)?,
    )
}

/// Host copies of a packed weight: codes `[out, words]`, scales and biases `[out, groups]` f32.
struct HostWeight {
    codes: Vec<u32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
    words: usize,
    groups: usize,
}

impl HostWeight {
    fn read(w: &PackedAffine) -> Result<Self, KernelError> {
        w.require_mlx("packed weight read on the host")?;
        Ok(Self {
            codes: w.codes.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?,
            scales: host_f32(&w.scales)?,
            biases: host_f32(&w.biases)?,
            words: w.in_dim() * w.bits.bits() / 32,
            groups: w.in_dim() / w.group_size,
        })
    }
}

/// The CPU reference: `x` `[rows, in]` → `[rows, out]`, output features spread over threads.
fn cpu_qmatmul(x: &Tensor, w: &PackedAffine) -> Result<Tensor, KernelError> {
    let (rows, in_dim) = x.dims2()?;
    let xs: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?; // [rows, in]
    let h = HostWeight::read(w)?;
    let (bits, group) = (w.bits.bits(), w.group_size);
    let out_dim = w.out_dim();
    // Σ x per group, shared by every output row: [rows, groups].
    let xsum: Vec<f32> = xs.chunks(group).map(|c| c.iter().sum()).collect();
    let mut y = vec![0f32; rows * out_dim]; // [out, rows] while computing, transposed below
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .max(1);
    let per = out_dim.div_ceil(threads).max(1) * rows.max(1);
    std::thread::scope(|scope| {
        for (t, chunk) in y.chunks_mut(per).enumerate() {
            let (xs, xsum, h) = (&xs, &xsum, &h);
            scope.spawn(move || {
                for (i, yo) in chunk.chunks_mut(rows.max(1)).enumerate() {
                    let o = t * (per / rows.max(1)) + i;
                    let codes = &h.codes[o * h.words..(o + 1) * h.words];
                    for (r, acc) in yo.iter_mut().enumerate() {
                        let xr = &xs[r * in_dim..(r + 1) * in_dim];
                        let mut sum = 0f32;
                        for g in 0..h.groups {
                            let mut dot = 0f32;
                            for (e, &xe) in xr.iter().enumerate().skip(g * group).take(group) {
                                dot += super::quant::code_at(codes, e, bits) as f32 * xe;
                            }
                            let gi = o * h.groups + g;
                            sum += h.scales[gi] * dot + h.biases[gi] * xsum[r * h.groups + g];
                        }
                        *acc = sum;
                    }
                }
            });
        }
    });
    let y = Tensor::from_vec(y, (out_dim, rows), &Device::Cpu)?
        .t()?
        .contiguous()?;
    Ok(y.to_dtype(x.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::max_abs_diff;
    use crate::kernels::{quantize, QuantBits};

    fn packed(rows: usize, bits: QuantBits, seed: f64) -> PackedAffine {
        let w = (Tensor::arange(0f32, (rows * 64) as f32, &Device::Cpu)
            .unwrap()
            .reshape((rows, 64))
            .unwrap()
            * seed)
            .unwrap()
            .sin()
            .unwrap();
        let p = quantize(&w, bits, 32).unwrap();
        PackedAffine::new(p.codes, p.scales, p.biases, rows, 64).unwrap()
    }

    #[test]
    fn settled_mark_is_opt_in_and_kept_by_views_and_copies() {
        let w = packed(8, QuantBits::Four, 0.1);
        assert!(!w.is_settled());
        let s = w.settled();
        assert!(s.is_settled());
        assert!(s.narrow_rows(2, 4).unwrap().is_settled());
        assert!(s.to_device(&Device::Cpu).unwrap().is_settled());
        let other = packed(4, QuantBits::Four, 0.2);
        let mixed = PackedAffine::stack_rows(&[&s, &other], 1).unwrap().unwrap();
        assert!(
            !mixed.is_settled(),
            "a stack is settled when all its parts are"
        );
        let both = PackedAffine::stack_rows(&[&s, &other.settled()], 1)
            .unwrap()
            .unwrap();
        assert!(both.is_settled());
    }

    #[test]
    fn rows_stacked_alike_compute_every_part_in_one_product() {
        let (a, b, c) = (
            packed(8, QuantBits::Four, 0.1),
            packed(4, QuantBits::Four, 0.2),
            packed(4, QuantBits::Four, 0.3),
        );
        let all = PackedAffine::stack_rows(&[&a, &b, &c], 1)
            .unwrap()
            .expect("alike");
        assert_eq!((all.out_dim(), all.in_dim()), (16, 64));
        let x = Tensor::arange(0f32, 64.0, &Device::Cpu)
            .unwrap()
            .reshape((1, 64))
            .unwrap();
        let got = qmatmul(&x, &all).unwrap();
        let want = Tensor::cat(
            &[
                qmatmul(&x, &a).unwrap(),
                qmatmul(&x, &b).unwrap(),
                qmatmul(&x, &c).unwrap(),
            ],
            1,
        )
        .unwrap();
        let diff = max_abs_diff(&got, &want);
        assert_eq!(diff, 0.0);
        // Another bit width does not stack.
        let d = packed(4, QuantBits::Eight, 0.4);
        assert!(PackedAffine::stack_rows(&[&a, &d], 1).unwrap().is_none());
    }
}
