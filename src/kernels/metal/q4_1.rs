//! MLX affine 4-bit weights as candle's `Q4_1` blocks, so that their products run on candle's
//! quantized matmul (the kernels candle-transformers' quantized models have used on Macs).
//!
//! An MLX group of 32, 64 or 128 elements is one, two or four `Q4_1` blocks of 32 sharing a
//! scale and a bias: `scale → d`, `bias → m`, each code unchanged. candle's block
//! (`k_quants::BlockQ4_1`, 20 bytes) is `d: f16, m: f16, qs: [u8; 16]`, byte `j` holding
//! element `j` in its low nibble and element `j + 16` in its high nibble; MLX packs element `e`
//! of a row into bits `4 * (e % 8)` of word `e / 8`.
//!
//! Both dequantize as `code * scale + bias` in f32 (candle: `x as f32 * d + m`; the crate's
//! reference: `scale * code + bias`, the same two roundings). So the mapping is exact, and the
//! dequantized weights bit-identical, exactly when every scale and bias survives the trip to
//! f16 unchanged: always for f16 scales; for bf16 or f32 ones only when each value lies in
//! f16's range and its low mantissa bits are zero (a bf16 value below 2^-14 may lose bits as an
//! f16 subnormal, one above 65504 overflows). [`q4_1_blocks`] checks every value and declines
//! a weight that does not map exactly; such a weight keeps the crate's own kernels.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use half::f16;

use crate::kernels::quant::host_f32;
use crate::kernels::{KernelError, PackedAffine, QuantBits};

/// Elements of one `Q4_1` block.
pub const BLOCK: usize = 32;
/// Bytes of one `Q4_1` block: `d` and `m` as f16, then 16 bytes of nibbles.
pub const BLOCK_BYTES: usize = 20;

/// Matrices given a `Q4_1` form in this process ([`conversions`]).
static CONVERSIONS: AtomicUsize = AtomicUsize::new(0);

/// How many matrices [`PackedAffine::with_candle_q4_1`] has converted in this process, so a
/// test can tell that a model's products really run on candle's `Q4_1` kernels.
pub fn conversions() -> usize {
    CONVERSIONS.load(Ordering::Relaxed)
}

/// Whether `v` is unchanged by a trip through f16 (the same bits back).
fn f16_exact(v: f32) -> bool {
    f16::from_f32(v).to_f32().to_bits() == v.to_bits()
}

/// The `Q4_1` blocks of a packed 4-bit `[out, in]` matrix, row after row (`out * in / 32`
/// blocks of [`BLOCK_BYTES`]), or `None` when the mapping is not exact: not 4 bits, or a scale
/// or bias that f16 does not hold exactly. Reads the weight to the host (a load-time step).
///
/// # Errors
/// Candle errors reading the tensors; [`KernelError::Shape`] when codes and scales disagree.
pub fn q4_1_blocks(p: &PackedAffine) -> Result<Option<Vec<u8>>, KernelError> {
    if p.bits != QuantBits::Four
        || !p.in_dim().is_multiple_of(BLOCK)
        || !p.group_size.is_multiple_of(BLOCK)
    {
        return Ok(None);
    }
    let (out, dim) = (p.out_dim(), p.in_dim());
    let groups = dim / p.group_size;
    let scales = host_f32(&p.scales)?; // [out, groups]
    let biases = host_f32(&p.biases)?; // [out, groups]
    if scales.len() != out * groups || biases.len() != out * groups {
        return Err(KernelError::Shape {
            what: "Q4_1 mapping: scales",
            expected: format!("[{out}, {groups}]"),
            found: p.scales.dims().to_vec(),
        });
    }
    if !scales.iter().chain(&biases).all(|&v| f16_exact(v)) {
        return Ok(None);
    }
    let codes: Vec<u32> = p.codes.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?; // [out, dim / 8]
    let words = dim / 8;
    let mut bytes = Vec::with_capacity(out * dim / BLOCK * BLOCK_BYTES);
    for o in 0..out {
        let row = &codes[o * words..(o + 1) * words];
        let code = |e: usize| ((row[e / 8] >> (4 * (e % 8))) & 0xF) as u8;
        for b in 0..dim / BLOCK {
            let g = o * groups + b * BLOCK / p.group_size;
            bytes.extend_from_slice(&f16::from_f32(scales[g]).to_le_bytes());
            bytes.extend_from_slice(&f16::from_f32(biases[g]).to_le_bytes());
            let e0 = b * BLOCK;
            bytes.extend((0..BLOCK / 2).map(|j| code(e0 + j) | (code(e0 + j + BLOCK / 2) << 4)));
        }
    }
    Ok(Some(bytes))
}

/// A packed 4-bit matrix held as candle `Q4_1` blocks on one device, for candle's quantized
/// matmul and row gather.
#[derive(Clone)]
pub struct Q41Weight {
    qtensor: Arc<QTensor>,
    matmul: QMatMul,
    /// The blocks' Metal buffer (shared with `qtensor`), for the crate's `dequant_q41` kernel.
    #[cfg(feature = "metal")]
    blocks: Option<candle_metal_kernels::metal::Buffer>,
    /// Whether the blocks are the matrix's only copy: the MLX packing of the `PackedAffine`
    /// holding it was replaced by placeholders ([`PackedAffine::with_candle_q4_1`]).
    replaces_mlx: bool,
}

impl std::fmt::Debug for Q41Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q41Weight")
            .field("shape", self.qtensor.shape())
            .finish()
    }
}

impl Q41Weight {
    /// `p` as `Q4_1` blocks on `device`, or `None` where the mapping is not exact
    /// ([`q4_1_blocks`]).
    ///
    /// # Errors
    /// Candle errors.
    pub fn from_packed(p: &PackedAffine, device: &Device) -> Result<Option<Self>, KernelError> {
        let Some(bytes) = q4_1_blocks(p)? else {
            return Ok(None);
        };
        // candle reinterprets the bytes as blocks whose `d` is an f16: start on an even address.
        // The capacity covers the one byte of padding, so `extend` does not move the buffer.
        let mut buf: Vec<u8> = Vec::with_capacity(bytes.len() + 1);
        let at = buf.as_ptr().align_offset(2).min(1);
        buf.resize(at, 0);
        buf.extend_from_slice(&bytes);
        let storage = QStorage::from_data(Cow::Borrowed(&buf[at..]), device, GgmlDType::Q4_1)?;
        #[cfg(feature = "metal")]
        let blocks = match &storage {
            QStorage::Metal(m) => Some(m.buffer().clone()),
            _ => None,
        };
        let qtensor = Arc::new(QTensor::new(storage, (p.out_dim(), p.in_dim()))?);
        let matmul = QMatMul::from_arc(qtensor.clone())?;
        Ok(Some(Self {
            qtensor,
            matmul,
            #[cfg(feature = "metal")]
            blocks,
            replaces_mlx: false,
        }))
    }

    /// Bytes of the blocks.
    pub fn bytes(&self) -> usize {
        self.qtensor.storage_size_in_bytes()
    }

    /// The dense `[out, in]` matrix in `dtype` on the Metal device, by the crate's
    /// `dequant_q41` kernel (the prefill products of a matrix held only as blocks); `None` off
    /// Metal or for a dtype without a kernel.
    ///
    /// # Errors
    /// Candle and launch errors.
    pub fn dequantize_on_device(&self, dtype: DType) -> Result<Option<Tensor>, KernelError> {
        #[cfg(feature = "metal")]
        if let (Some(blocks), Device::Metal(dev)) = (&self.blocks, self.qtensor.device()) {
            let (rows, in_dim) = self.qtensor.shape().dims2()?;
            return super::launch::dequantize_q41(&dev, blocks, rows, in_dim, dtype);
        }
        let _ = dtype;
        Ok(None)
    }

    /// The dense `[out, in]` matrix in f32 on the host (candle's dequantization).
    ///
    /// # Errors
    /// Candle errors.
    pub fn dequantize_host(&self) -> Result<Tensor, KernelError> {
        Ok(self.qtensor.dequantize(&Device::Cpu)?)
    }

    /// `x` `[rows, in]` · `Wᵀ` → `[rows, out]` in `x`'s dtype, for a few rows (the caller
    /// sends more than [`crate::kernels::qmatmul::MATVEC_MAX_ROWS`] elsewhere). On Metal,
    /// candle's matrix-vector kernel once per row: it takes the activations in f32 as they are
    /// (candle's tiled GEMM would stage activations and weights in half precision). On the CPU
    /// the blocks are dequantized by candle and multiplied in f32: candle's CPU quantized
    /// product rounds each block of activations to 8 bits (`Q8_1`), which moves the 4-bit
    /// fixtures' first-step log-probs by 1.4 to 5.6 (`tests/q4_1_candle_matmul.rs`). The test
    /// switch [`crate::kernels::policy::LaunchPolicy`]`::candle_qmatmul_on_cpu` runs that CPU
    /// product instead, for any number of rows.
    ///
    /// # Errors
    /// Candle errors (devices differ, shapes).
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor, KernelError> {
        let (rows, k) = x.dims2()?;
        let xf = x.to_dtype(DType::F32)?.contiguous()?;
        let y = match x.device() {
            Device::Cpu if crate::kernels::policy::current().candle_qmatmul_on_cpu => {
                self.matmul.forward(&xf)?
            }
            Device::Cpu => xf.matmul(&self.qtensor.dequantize(&Device::Cpu)?.t()?)?,
            _ => self
                .matmul
                .forward(&xf.reshape((rows, 1, k))?)?
                .reshape((rows, self.qtensor.shape().dims2()?.0))?,
        };
        Ok(y.to_dtype(x.dtype())?)
    }

    /// Rows `ids` (`[n]`, u32, on the weight's device, each below `out`) → `[n, in]` in
    /// `dtype`, gathered on the device.
    ///
    /// # Errors
    /// Candle errors.
    pub fn embedding(&self, ids: &Tensor, dtype: DType) -> Result<Tensor, KernelError> {
        let ids = ids.to_dtype(DType::U32)?.flatten_all()?;
        Ok(self.qtensor.embedding(&ids)?.to_dtype(dtype)?)
    }
}

impl PackedAffine {
    /// The matrix with its `Q4_1` form attached where candle's kernels should run its products
    /// and row gathers: a loaded (settled) 4-bit matrix that maps exactly ([`q4_1_blocks`]),
    /// on a Metal device, or on the CPU when
    /// [`crate::kernels::policy::LaunchPolicy::candle_q4_1_on_cpu`] (or `candle_qmatmul_on_cpu`)
    /// is on and the input width is an even number of blocks (candle's CPU dot product takes
    /// them in pairs; every real Gemma 4 width is a multiple of 64). Anything else, and
    /// a matrix whose conversion fails, comes back unchanged and keeps the crate's kernels.
    /// The conversion reads the matrix to the host once, at load. MoE expert stacks, which the
    /// crate's kernels read by expert, are not converted.
    pub fn with_candle_q4_1(mut self) -> Self {
        let device = self.codes.device().clone();
        // candle's CPU dot product takes blocks in pairs (it asserts an even block count).
        let even_blocks = (self.in_dim() / BLOCK).is_multiple_of(2);
        let wanted = match &device {
            Device::Metal(_) => true,
            Device::Cpu => {
                let policy = crate::kernels::policy::current();
                (policy.candle_q4_1_on_cpu || policy.candle_qmatmul_on_cpu) && even_blocks
            }
            _ => false,
        };
        if !wanted || !self.is_settled() || self.bits != QuantBits::Four || self.q4_1.is_some() {
            return self;
        }
        let Ok(Some(mut q)) = Q41Weight::from_packed(&self, &device) else {
            return self;
        };
        CONVERSIONS.fetch_add(1, Ordering::Relaxed);
        // On Metal with the crate's kernels on, every read of the matrix goes through the
        // blocks (candle's kernels, and `dequant_q41` for prefill): the MLX packing is
        // replaced by placeholders of its shape (one element each, broadcast), so the matrix
        // is resident once. Elsewhere the MLX packing stays for the paths that read it.
        if device.is_metal() && crate::kernels::policy::current().metal_kernels {
            let placeholder = |t: &Tensor| {
                Tensor::zeros(1, t.dtype(), t.device()).and_then(|z| z.broadcast_as(t.dims()))
            };
            if let (Ok(codes), Ok(scales), Ok(biases)) = (
                placeholder(&self.codes),
                placeholder(&self.scales),
                placeholder(&self.biases),
            ) {
                (self.codes, self.scales, self.biases) = (codes, scales, biases);
                q.replaces_mlx = true;
            }
        }
        self.q4_1 = Some(q);
        self
    }

    /// Whether the MLX packing (`codes`, `scales`, `biases`) holds the matrix; `false` when
    /// its `Q4_1` blocks replaced it ([`PackedAffine::with_candle_q4_1`] on Metal).
    pub fn mlx_resident(&self) -> bool {
        !self.q4_1.as_ref().is_some_and(|q| q.replaces_mlx)
    }

    /// [`KernelError::Packed`] unless the MLX packing holds the matrix: the guard of every
    /// path that reads `codes`, `scales` and `biases`.
    pub(crate) fn require_mlx(&self, what: &'static str) -> Result<(), KernelError> {
        if self.mlx_resident() {
            Ok(())
        } else {
            Err(KernelError::Packed {
                what,
                reason: "the matrix is held only as Q4_1 blocks; read it through them".into(),
            })
        }
    }

    /// Whether products and row gathers of this matrix run on candle's `Q4_1` kernels.
    pub fn uses_candle_q4_1(&self) -> bool {
        self.q4_1.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{quantize, AffineSpec};

    /// A 4-bit matrix whose scales are in `dtype`, quantized from a smooth pattern.
    fn packed(out: usize, dim: usize, group: usize, dtype: DType, amp: f64) -> PackedAffine {
        let w = (Tensor::arange(0f32, (out * dim) as f32, &Device::Cpu)
            .and_then(|t| t.reshape((out, dim)))
            .and_then(|t| (t * 0.37)?.sin())
            .and_then(|t| t * amp)
            .and_then(|t| t.to_dtype(dtype)))
        .unwrap();
        let p = quantize(&w, QuantBits::Four, group).unwrap();
        PackedAffine::from_parts(
            p.codes,
            p.scales,
            p.biases,
            AffineSpec {
                bits: QuantBits::Four,
                group_size: group,
            },
        )
    }

    fn host(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    #[test]
    fn blocks_dequantize_bit_for_bit_for_every_group_and_scale_dtype() {
        for group in [32, 64, 128] {
            for dtype in [DType::F16, DType::BF16, DType::F32] {
                let p = packed(6, 256, group, dtype, 0.05);
                let want = crate::kernels::quant::dequantize_host(&p, &[0, 1, 2, 3, 4, 5]).unwrap();
                let want: Vec<u32> = want.into_iter().map(f32::to_bits).collect();
                match Q41Weight::from_packed(&p, &Device::Cpu).unwrap() {
                    Some(q) => assert_eq!(host(&q.dequantize_host().unwrap()), want),
                    // Only f32 scales may fall outside f16.
                    None => assert_eq!(dtype, DType::F32, "group {group} {dtype:?}"),
                }
            }
        }
    }

    #[test]
    fn a_scale_f16_cannot_hold_declines_the_mapping() {
        // bf16 2^-20 + 2^-27 is an f16 subnormal only after rounding: not exact.
        let p = packed(2, 64, 64, DType::BF16, 0.05);
        let tiny = half::bf16::from_f32(2f32.powi(-20) + 2f32.powi(-27)).to_f32();
        let scales = Tensor::full(tiny, (2, 1), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let q = PackedAffine::from_parts(p.codes.clone(), scales, p.biases.clone(), p.spec());
        assert!(q4_1_blocks(&q).unwrap().is_none());
        // 8 bits never map.
        let w = Tensor::zeros((2, 64), DType::F16, &Device::Cpu).unwrap();
        assert!(q4_1_blocks(&quantize(&w, QuantBits::Eight, 64).unwrap())
            .unwrap()
            .is_none());
    }
}

#[cfg(test)]
mod product_tests {
    use super::*;
    use crate::kernels::quantize;

    #[test]
    fn candle_products_and_gathers_track_the_reference_on_the_cpu() {
        let w = Tensor::randn(0f32, 0.05, (40, 256), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let p = quantize(&w, QuantBits::Four, 64).unwrap();
        let p = PackedAffine::new(p.codes, p.scales, p.biases, 40, 256).unwrap();
        let q = Q41Weight::from_packed(&p, &Device::Cpu).unwrap().unwrap();
        for rows in [1, 5] {
            let x = Tensor::randn(0f32, 1.0, (rows, 256), &Device::Cpu).unwrap();
            let want = crate::kernels::qmatmul::qmatmul(&x, &p).unwrap();
            let got = q.matmul(&x).unwrap();
            let err = crate::kernels::testutil::max_abs_diff(&got, &want);
            let scale = crate::kernels::testutil::max_abs_diff(&want, &want.zeros_like().unwrap());
            eprintln!("{rows} rows: max abs error {err} of outputs up to {scale}");
            assert!(err <= 0.02 * scale, "{rows} rows: {err} vs {scale}");
        }
        let ids = Tensor::new(&[3u32, 0, 39], &Device::Cpu).unwrap();
        let want = crate::kernels::qmatmul::qembedding(&ids, &p, DType::F32).unwrap();
        let got = q.embedding(&ids, DType::F32).unwrap();
        assert_eq!(crate::kernels::testutil::max_abs_diff(&got, &want), 0.0);
    }

    #[test]
    fn a_matrix_held_only_as_blocks_is_read_through_them_or_refused() {
        let w = Tensor::randn(0f32, 0.05, (16, 128), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F16))
            .unwrap();
        let p = quantize(&w, QuantBits::Four, 64).unwrap();
        let p = PackedAffine::new(p.codes, p.scales, p.biases, 16, 128).unwrap();
        let x = Tensor::randn(0f32, 1.0, (2, 128), &Device::Cpu).unwrap();
        let want = crate::kernels::qmatmul::qmatmul(&x, &p).unwrap();
        // What `with_candle_q4_1` does on Metal: blocks attached, MLX packing replaced.
        let mut q = Q41Weight::from_packed(&p, &Device::Cpu).unwrap().unwrap();
        q.replaces_mlx = true;
        let blocks = q.bytes();
        let placeholder = |t: &Tensor| {
            Tensor::zeros(1, t.dtype(), t.device())
                .unwrap()
                .broadcast_as(t.dims())
                .unwrap()
        };
        let mut held = p.clone();
        (held.codes, held.scales, held.biases) = (
            placeholder(&p.codes),
            placeholder(&p.scales),
            placeholder(&p.biases),
        );
        held.q4_1 = Some(q);
        assert!(!held.mlx_resident());
        assert_eq!((held.out_dim(), held.in_dim()), (16, 128));
        assert_eq!(held.packed_bytes(), blocks);
        // Read through the blocks: products of a few rows, gathers.
        let got = crate::kernels::qmatmul::qmatmul(&x, &held).unwrap();
        assert!(crate::kernels::testutil::max_abs_diff(&got, &want) < 1e-5);
        let ids = Tensor::new(&[1u32, 15], &Device::Cpu).unwrap();
        let rows = crate::kernels::qmatmul::qembedding(&ids, &held, DType::F32).unwrap();
        let want_rows = crate::kernels::qmatmul::qembedding(&ids, &p, DType::F32).unwrap();
        assert_eq!(
            crate::kernels::testutil::max_abs_diff(&rows, &want_rows),
            0.0
        );
        // Every path that would read the placeholders refuses with a typed error.
        let many = Tensor::randn(0f32, 1.0, (9, 128), &Device::Cpu).unwrap();
        let refused = |r: Result<Tensor, KernelError>| matches!(r, Err(KernelError::Packed { .. }));
        assert!(refused(crate::kernels::qmatmul::qmatmul(&many, &held)));
        assert!(refused(held.dequantize(DType::F32)));
        assert!(matches!(
            held.narrow_rows(0, 8),
            Err(KernelError::Packed { .. })
        ));
        assert!(PackedAffine::stack_rows(&[&held, &p], 1).unwrap().is_none());
    }
}
