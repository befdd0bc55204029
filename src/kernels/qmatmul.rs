//! Matrix products and embedding lookups with MLX affine-quantized weights that stay packed in
//! memory: `W[o, g*G + i] = scales[o, g] * code[o, g*G + i] + biases[o, g]`, codes little-endian
//! in `u32` words (element 0 in the lowest bits of word 0), 4 or 8 bits, groups of 32/64/128.
//!
//! [`qmatmul`] and [`qembedding`] dispatch on the device: the CPU runs the plain-Rust reference
//! below (never a dense copy of `W`); CUDA runs a matrix-vector kernel for up to
//! [`MATVEC_MAX_ROWS`] rows and dequantize-then-GEMM beyond; on Metal the weight is
//! dequantized per product for now (the `.metal` kernels exist but are not launched yet).
//!
//! Per output element the reference computes, with `x` in f32:
//! ```text
//! y[r, o] = Σ_g scales[o,g] * Σ_{e∈g} code[o,e] * x[r,e]  +  biases[o,g] * Σ_{e∈g} x[r,e]
//! ```

use candle_core::{DType, Device, Tensor};

use crate::kv::QuantBits;
use crate::{Error, Result};

/// Activation rows up to which the GPU uses the matrix-vector kernel; more rows dequantize the
/// weight and call the dense GEMM.
pub const MATVEC_MAX_ROWS: usize = 8;

/// One packed weight matrix `[out_dim, in_dim]` in MLX's affine layout.
#[derive(Debug, Clone)]
pub struct PackedWeight {
    /// `[out_dim, in_dim * bits / 32]`, `u32`.
    pub codes: Tensor,
    /// `[out_dim, in_dim / group_size]`, f32, f16 or bf16.
    pub scales: Tensor,
    /// `[out_dim, in_dim / group_size]`, same dtype as `scales`.
    pub biases: Tensor,
    /// Bit width of the codes.
    pub bits: QuantBits,
    /// Inputs per scale/bias group (32, 64 or 128).
    pub group_size: usize,
    /// Output features (rows).
    pub out_dim: usize,
    /// Input features (columns).
    pub in_dim: usize,
    /// Whether the tensors are complete on their device ([`PackedWeight::settled`]).
    settled: bool,
}

fn bad(tensor: &str, reason: String) -> Error {
    Error::Quantized {
        tensor: tensor.to_string(),
        reason,
    }
}

impl PackedWeight {
    /// Wraps checkpoint tensors, inferring bits and group size from the shapes as mlx-lm does.
    ///
    /// # Errors
    /// [`Error::Quantized`] when the shapes or dtypes do not describe a 4/8-bit affine matrix
    /// with group 32, 64 or 128.
    pub fn new(
        codes: Tensor,
        scales: Tensor,
        biases: Tensor,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Self> {
        let (co, words) = codes.dims2().map_err(|e| bad("codes", e.to_string()))?;
        let (so, groups) = scales.dims2().map_err(|e| bad("scales", e.to_string()))?;
        if co != out_dim
            || so != out_dim
            || biases.dims() != scales.dims()
            || in_dim == 0
            || groups == 0
        {
            return Err(bad(
                "packed weight",
                format!(
                    "codes {:?}, scales {:?}, biases {:?} do not fit [{out_dim}, {in_dim}]",
                    codes.dims(),
                    scales.dims(),
                    biases.dims()
                ),
            ));
        }
        if codes.dtype() != DType::U32
            || !matches!(scales.dtype(), DType::F32 | DType::F16 | DType::BF16)
            || biases.dtype() != scales.dtype()
        {
            return Err(bad(
                "packed weight",
                format!(
                    "dtypes codes {:?} scales {:?} biases {:?}; expected u32 and one float dtype",
                    codes.dtype(),
                    scales.dtype(),
                    biases.dtype()
                ),
            ));
        }
        let bits = if (words * 32) % in_dim == 0 {
            words * 32 / in_dim
        } else {
            0
        };
        let bits = QuantBits::from_bits(bits).map_err(|e| bad("packed weight", e.to_string()))?;
        let group_size = if in_dim % groups == 0 {
            in_dim / groups
        } else {
            0
        };
        if !super::GROUP_SIZES.contains(&group_size) {
            return Err(bad(
                "packed weight",
                format!("{groups} groups over {in_dim} inputs: group size must be 32, 64 or 128"),
            ));
        }
        Ok(Self {
            codes,
            scales,
            biases,
            bits,
            group_size,
            out_dim,
            in_dim,
            settled: false,
        })
    }

    /// Declares the tensors complete on their device: no kernel that may still be running
    /// writes them, nor will one while the matrix is in use. One-row CUDA products may then
    /// issue their first weight loads before the previous kernel on the stream has finished
    /// (that kernel's tail then hides their memory latency; x is still read after it).
    /// Model loading marks its weights so, and synchronizes the device before it returns. Leave
    /// a matrix unmarked when a kernel launched just before may have written it (for example
    /// [`super::quantize`]'s output on a GPU, used at once): its product could read stale codes.
    pub fn settled(mut self) -> Self {
        self.settled = true;
        self
    }

    /// Whether [`PackedWeight::settled`] marked this matrix (views and copies keep the mark).
    pub fn is_settled(&self) -> bool {
        self.settled
    }

    /// Rows `start .. start + len` as a packed matrix of their own (views, no copy): one expert
    /// of a flattened stack.
    ///
    /// # Errors
    /// [`Error::Shape`] when the rows are not inside the matrix.
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<Self> {
        if start + len > self.out_dim {
            return Err(Error::Shape {
                tensor: "packed weight rows".into(),
                expected: vec![self.out_dim],
                found: vec![start, start + len],
            });
        }
        Ok(Self {
            codes: self.codes.narrow(0, start, len)?,
            scales: self.scales.narrow(0, start, len)?,
            biases: self.biases.narrow(0, start, len)?,
            out_dim: len,
            ..self.clone()
        })
    }

    /// Joins packed matrices by rows, block by block: each part is `blocks` equal blocks of
    /// rows, and block `i` of the result is every part's block `i`, one above the other. With
    /// one block this stacks the parts (q over k over v); with `n` it joins two stacks of `n`
    /// matrices matrix by matrix (each MoE expert's gate over its up). `None` when the parts
    /// differ in bits, group size, scale dtype or inputs, do not split into `blocks`, or are
    /// none.
    ///
    /// # Errors
    /// Candle errors.
    pub fn stack_rows(parts: &[&Self], blocks: usize) -> Result<Option<Self>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let alike = blocks > 0
            && parts.iter().all(|p| {
                p.bits == first.bits
                    && p.group_size == first.group_size
                    && p.in_dim == first.in_dim
                    && p.scales.dtype() == first.scales.dtype()
                    && p.out_dim % blocks == 0
            });
        if !alike {
            return Ok(None);
        }
        let join = |pick: fn(&Self) -> &Tensor| -> Result<Tensor> {
            let (mut rows, mut width) = (0, 0);
            let mut ts = Vec::with_capacity(parts.len());
            for p in parts {
                let (r, c) = pick(p).dims2()?;
                (rows, width) = (rows + r, c);
                ts.push(pick(p).reshape((blocks, r / blocks, c))?);
            }
            Ok(Tensor::cat(&ts, 1)?.reshape((rows, width))?)
        };
        Ok(Some(Self {
            codes: join(|p| &p.codes)?,
            scales: join(|p| &p.scales)?,
            biases: join(|p| &p.biases)?,
            out_dim: parts.iter().map(|p| p.out_dim).sum(),
            settled: parts.iter().all(|p| p.settled),
            ..(*first).clone()
        }))
    }

    /// The same matrix on `device`.
    ///
    /// # Errors
    /// Candle errors.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            codes: self.codes.to_device(device)?,
            scales: self.scales.to_device(device)?,
            biases: self.biases.to_device(device)?,
            ..self.clone()
        })
    }

    /// Bytes the packed matrix occupies (codes + scales + biases).
    pub fn packed_bytes(&self) -> usize {
        self.codes.elem_count() * 4
            + (self.scales.elem_count() + self.biases.elem_count())
                * self.scales.dtype().size_in_bytes()
    }

    /// The dense matrix `[out_dim, in_dim]` in `dtype` (tests and prefill GEMM).
    ///
    /// # Errors
    /// Candle errors.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        match self.codes.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Ok(super::cuda::launch::dequant_rows(
                &self.codes,
                &self.scales,
                &self.biases,
                self.bits.bits(),
                self.group_size,
                None,
                dtype,
            )?),
            _ => {
                let rows: Vec<u32> = (0..self.out_dim as u32).collect();
                let dense = cpu_gather(self, &rows)?;
                Ok(
                    Tensor::from_vec(dense, (self.out_dim, self.in_dim), &Device::Cpu)?
                        .to_dtype(dtype)?
                        .to_device(self.codes.device())?,
                )
            }
        }
    }
}

/// `x · Wᵀ` with a packed `W`: `x` `[.., in_dim]` → `[.., out_dim]` in `x`'s dtype, on `x`'s
/// device (which must be `w`'s).
///
/// # Errors
/// [`Error::Shape`] when the last dimension of `x` is not `in_dim`; candle errors (devices
/// differ, unsupported dtype).
pub fn qmatmul(x: &Tensor, w: &PackedWeight) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let in_dim = dims.last().copied().unwrap_or(0);
    if in_dim != w.in_dim {
        return Err(Error::Shape {
            tensor: "qmatmul input".into(),
            expected: vec![w.in_dim],
            found: dims,
        });
    }
    let rows = x.elem_count() / in_dim.max(1);
    let x2 = x.reshape((rows, in_dim))?;
    let y = match x.device() {
        Device::Cpu => cpu_qmatmul(&x2, w)?,
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            if rows <= MATVEC_MAX_ROWS && rows > 0 {
                super::cuda::launch::qmatvec(
                    &x2,
                    &w.codes,
                    &w.scales,
                    &w.biases,
                    w.bits.bits(),
                    w.group_size,
                    w.settled,
                )?
            } else {
                let dense = w.dequantize(x.dtype())?; // [out, in]
                x2.matmul(&dense.t()?)?
            }
        }
        #[cfg(feature = "metal")]
        Device::Metal(_) => super::metal::qmatmul(&x2, w)?,
        #[allow(unreachable_patterns)]
        _ => {
            let dense = w.dequantize(x.dtype())?;
            x2.matmul(&dense.t()?)?
        }
    };
    let mut out_dims = dims;
    if let Some(last) = out_dims.last_mut() {
        *last = w.out_dim;
    }
    Ok(y.reshape(out_dims)?)
}

/// Embedding lookup with a packed table `[vocab, hidden]`: `ids` (any integer dtype, any shape
/// `[..]`) → `[.., hidden]` in `dtype`, dequantizing only the rows looked up.
///
/// # Errors
/// [`Error::Shape`] when an id is not below `w.out_dim`; candle errors.
pub fn qembedding(ids: &Tensor, w: &PackedWeight, dtype: DType) -> Result<Tensor> {
    let flat: Vec<u32> = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    if let Some(&bad_id) = flat.iter().find(|&&i| i as usize >= w.out_dim) {
        return Err(Error::Shape {
            tensor: "qembedding ids".into(),
            expected: vec![w.out_dim],
            found: vec![bad_id as usize],
        });
    }
    let mut out_dims = ids.dims().to_vec();
    out_dims.push(w.in_dim);
    let dense = match w.codes.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let idx = Tensor::from_vec(flat, ids.elem_count(), w.codes.device())?;
            super::cuda::launch::dequant_rows(
                &w.codes,
                &w.scales,
                &w.biases,
                w.bits.bits(),
                w.group_size,
                Some(&idx),
                dtype,
            )?
        }
        dev => {
            let n = flat.len();
            let rows = cpu_gather(w, &flat)?;
            Tensor::from_vec(rows, (n, w.in_dim), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(dev)?
        }
    };
    Ok(dense.reshape(out_dims)?)
}

/// [`qembedding`] for ids the caller has already checked against the table: on CUDA the rows
/// are gathered straight from the device ids, with no copy to the host (a decode step stays
/// free of host synchronisation, and can be captured into a CUDA graph); an id past the table
/// would give a row of zeros there. Elsewhere, as [`qembedding`].
///
/// # Errors
/// As [`qembedding`] off CUDA; candle errors.
pub(crate) fn qembedding_checked_ids(
    ids: &Tensor,
    w: &PackedWeight,
    dtype: DType,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if w.codes.device().is_cuda() {
        let mut out_dims = ids.dims().to_vec();
        out_dims.push(w.in_dim);
        let dense = super::cuda::launch::dequant_rows(
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
    qembedding(ids, w, dtype)
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
    fn read(w: &PackedWeight) -> Result<Self> {
        let f = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?)
        };
        Ok(Self {
            codes: w.codes.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?,
            scales: f(&w.scales)?,
            biases: f(&w.biases)?,
            words: w.in_dim * w.bits.bits() / 32,
            groups: w.in_dim / w.group_size,
        })
    }
}

/// Dequantized rows `rows` of `w`, row-major `[rows.len(), in_dim]` f32.
fn cpu_gather(w: &PackedWeight, rows: &[u32]) -> Result<Vec<f32>> {
    let h = HostWeight::read(w)?;
    let bits = w.bits.bits();
    let mut out = Vec::with_capacity(rows.len() * w.in_dim); // [rows, in]
    for &r in rows {
        let r = r as usize;
        let codes = &h.codes[r * h.words..(r + 1) * h.words];
        for e in 0..w.in_dim {
            let g = r * h.groups + e / w.group_size;
            let c = super::quant::code_at(codes, e, bits) as f32;
            out.push(h.scales[g] * c + h.biases[g]);
        }
    }
    Ok(out)
}

/// The CPU reference: `x` `[rows, in]` → `[rows, out]`, output features spread over threads.
fn cpu_qmatmul(x: &Tensor, w: &PackedWeight) -> Result<Tensor> {
    let (rows, in_dim) = x.dims2()?;
    let xs: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?; // [rows, in]
    let h = HostWeight::read(w)?;
    let (bits, group) = (w.bits.bits(), w.group_size);
    let out_dim = w.out_dim;
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
    use crate::kernels::quantize;

    fn packed(rows: usize, bits: QuantBits, seed: f64) -> PackedWeight {
        let w = (Tensor::arange(0f32, (rows * 64) as f32, &Device::Cpu)
            .unwrap()
            .reshape((rows, 64))
            .unwrap()
            * seed)
            .unwrap()
            .sin()
            .unwrap();
        let p = quantize(&w, bits, 32).unwrap();
        PackedWeight::new(p.codes, p.scales, p.biases, rows, 64).unwrap()
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
        let mixed = PackedWeight::stack_rows(&[&s, &other], 1).unwrap().unwrap();
        assert!(
            !mixed.is_settled(),
            "a stack is settled when all its parts are"
        );
        let both = PackedWeight::stack_rows(&[&s, &other.settled()], 1)
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
        let all = PackedWeight::stack_rows(&[&a, &b, &c], 1)
            .unwrap()
            .expect("alike");
        assert_eq!((all.out_dim, all.in_dim), (16, 64));
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
        let diff = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0);
        // Another bit width does not stack.
        let d = packed(4, QuantBits::Eight, 0.4);
        assert!(PackedWeight::stack_rows(&[&a, &d], 1).unwrap().is_none());
    }
}
