//! The operands the kernels take: the affine quantization settings ([`QuantBits`],
//! [`AffineSpec`]), one packed tensor type for weights and K/V ([`PackedAffine`]), and the
//! attention operand ([`KvView`], [`KvData`]): dense or packed K/V plus the absolute position
//! of every key, so masks are built from positions and a ring buffer needs no reordering.

use candle_core::{DType, Device, Tensor};

use super::{KernelError, KeyPositions};

/// Group sizes MLX supports for affine quantization.
pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

/// Checks that `group_size` is one of [`GROUP_SIZES`] and divides `dim` (the quantized axis).
///
/// # Errors
/// [`KernelError::BadGroupSize`] otherwise.
pub fn check_group_size(group_size: usize, dim: usize) -> Result<(), KernelError> {
    if GROUP_SIZES.contains(&group_size) && dim.is_multiple_of(group_size) && dim > 0 {
        Ok(())
    } else {
        Err(KernelError::BadGroupSize { group_size, dim })
    }
}

/// Bit width of packed (affine-quantized) codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantBits {
    /// 4 bits per element, 8 elements per `u32` word.
    Four,
    /// 8 bits per element, 4 elements per `u32` word.
    Eight,
}

impl QuantBits {
    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            QuantBits::Four => 4,
            QuantBits::Eight => 8,
        }
    }

    /// Parses 4 or 8.
    ///
    /// # Errors
    /// [`KernelError::UnsupportedBits`] for any other value.
    pub fn from_bits(bits: usize) -> Result<Self, KernelError> {
        match bits {
            4 => Ok(QuantBits::Four),
            8 => Ok(QuantBits::Eight),
            _ => Err(KernelError::UnsupportedBits { bits }),
        }
    }
}

/// How a tensor is packed: bit width and group size along its last axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AffineSpec {
    /// Bits per element.
    pub bits: QuantBits,
    /// Elements per scale/bias group: 32, 64 or 128.
    pub group_size: usize,
}

impl AffineSpec {
    /// Checks that the group size is one of [`GROUP_SIZES`] and divides `dim`.
    ///
    /// # Errors
    /// [`KernelError::BadGroupSize`] otherwise.
    pub fn check(&self, dim: usize) -> Result<(), KernelError> {
        check_group_size(self.group_size, dim)
    }
}

/// One tensor packed in MLX's affine layout, groups running along the last axis:
/// `x[.., g*G + i] = scales[.., g] * code[.., g*G + i] + biases[.., g]`, codes stored as a
/// little-endian bit stream in `u32` words (element 0 in the lowest bits of word 0).
///
/// A weight matrix is `[out_dim, in_dim]` ([`PackedAffine::new`]); packed K/V are
/// `[batch, kv_heads, tokens, head_dim]` ([`PackedAffine::from_parts`]).
#[derive(Debug, Clone)]
pub struct PackedAffine {
    /// `[.., dim * bits / 32]`, `u32`.
    pub codes: Tensor,
    /// `[.., dim / group_size]`, f32, f16 or bf16.
    pub scales: Tensor,
    /// `[.., dim / group_size]`, same dtype as `scales`.
    pub biases: Tensor,
    /// Bit width of the codes.
    pub bits: QuantBits,
    /// Elements per scale/bias group (32, 64 or 128).
    pub group_size: usize,
    /// Whether the tensors are complete on their device ([`PackedAffine::settled`]).
    settled: bool,
    /// The same matrix as candle `Q4_1` blocks, where that mapping is exact
    /// ([`PackedAffine::with_candle_q4_1`]); products and row gathers then use candle's kernels.
    pub(crate) q4_1: Option<super::metal::q4_1::Q41Weight>,
}

fn packed_err(what: &'static str, reason: String) -> KernelError {
    KernelError::Packed { what, reason }
}

impl PackedAffine {
    /// Wraps checkpoint tensors of a `[out_dim, in_dim]` matrix, inferring bits and group size
    /// from the shapes as mlx-lm does.
    ///
    /// # Errors
    /// [`KernelError::Packed`] when the shapes or dtypes do not describe a 4/8-bit affine
    /// matrix with group 32, 64 or 128.
    pub fn new(
        codes: Tensor,
        scales: Tensor,
        biases: Tensor,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Self, KernelError> {
        let (co, words) = codes
            .dims2()
            .map_err(|e| packed_err("codes", e.to_string()))?;
        let (so, groups) = scales
            .dims2()
            .map_err(|e| packed_err("scales", e.to_string()))?;
        if co != out_dim
            || so != out_dim
            || biases.dims() != scales.dims()
            || in_dim == 0
            || groups == 0
        {
            return Err(packed_err(
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
            return Err(packed_err(
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
        let bits =
            QuantBits::from_bits(bits).map_err(|e| packed_err("packed weight", e.to_string()))?;
        let group_size = if in_dim.is_multiple_of(groups) {
            in_dim / groups
        } else {
            0
        };
        if !GROUP_SIZES.contains(&group_size) {
            return Err(packed_err(
                "packed weight",
                format!("{groups} groups over {in_dim} inputs: group size must be 32, 64 or 128"),
            ));
        }
        Ok(Self::from_parts(
            codes,
            scales,
            biases,
            AffineSpec { bits, group_size },
        ))
    }

    /// Wraps codes, scales and biases packed as `spec` says, of any rank. The shapes are not
    /// checked here: the kernels that read the tensor check them against their other operands.
    pub fn from_parts(codes: Tensor, scales: Tensor, biases: Tensor, spec: AffineSpec) -> Self {
        Self {
            codes,
            scales,
            biases,
            bits: spec.bits,
            group_size: spec.group_size,
            settled: false,
            q4_1: None,
        }
    }

    /// Bit width and group size.
    pub fn spec(&self) -> AffineSpec {
        AffineSpec {
            bits: self.bits,
            group_size: self.group_size,
        }
    }

    /// The shape of the dense tensor the codes stand for: the codes' shape with the last axis
    /// unpacked.
    pub fn dims(&self) -> Vec<usize> {
        let mut d = self.codes.dims().to_vec();
        if let Some(last) = d.last_mut() {
            *last = *last * 32 / self.bits.bits();
        }
        d
    }

    /// Rows of the dense tensor: every axis but the last (a matrix's output features).
    pub fn out_dim(&self) -> usize {
        let d = self.codes.dims();
        d[..d.len().saturating_sub(1)].iter().product()
    }

    /// Length of the last (quantized) axis of the dense tensor (a matrix's input features).
    pub fn in_dim(&self) -> usize {
        self.codes.dims().last().copied().unwrap_or(0) * 32 / self.bits.bits()
    }

    /// Declares the tensors complete on their device: no kernel that may still be running
    /// writes them, nor will one while the tensor is in use. One-row CUDA products may then
    /// issue their first weight loads before the previous kernel on the stream has finished
    /// (that kernel's tail then hides their memory latency; x is still read after it).
    /// Model loading marks its weights so, and synchronizes the device before it returns. Leave
    /// a tensor unmarked when a kernel launched just before may have written it (for example
    /// [`super::quantize`]'s output on a GPU, used at once): its product could read stale codes.
    pub fn settled(mut self) -> Self {
        self.settled = true;
        self
    }

    /// Whether [`PackedAffine::settled`] marked this tensor (views and copies keep the mark).
    pub fn is_settled(&self) -> bool {
        self.settled
    }

    /// Rows `start .. start + len` of a matrix as a packed matrix of their own (views, no
    /// copy): one expert of a flattened stack.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the rows are not inside the matrix.
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<Self, KernelError> {
        self.require_mlx("rows of a packed weight")?;
        let out_dim = self.out_dim();
        if start + len > out_dim {
            return Err(KernelError::Shape {
                what: "packed weight rows",
                expected: format!("rows within 0..{out_dim}"),
                found: vec![start, start + len],
            });
        }
        Ok(Self {
            codes: self.codes.narrow(0, start, len)?,
            scales: self.scales.narrow(0, start, len)?,
            biases: self.biases.narrow(0, start, len)?,
            q4_1: None,
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
    pub fn stack_rows(parts: &[&Self], blocks: usize) -> Result<Option<Self>, KernelError> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let alike = blocks > 0
            && parts.iter().all(|p| {
                p.mlx_resident()
                    && p.bits == first.bits
                    && p.group_size == first.group_size
                    && p.in_dim() == first.in_dim()
                    && p.scales.dtype() == first.scales.dtype()
                    && p.out_dim() % blocks == 0
            });
        if !alike {
            return Ok(None);
        }
        let join = |pick: fn(&Self) -> &Tensor| -> Result<Tensor, KernelError> {
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
            settled: parts.iter().all(|p| p.settled),
            q4_1: None,
            ..(*first).clone()
        }))
    }

    /// The same tensor on `device`.
    ///
    /// # Errors
    /// Candle errors.
    pub fn to_device(&self, device: &Device) -> Result<Self, KernelError> {
        let same = self.codes.device().same_device(device);
        if !same {
            self.require_mlx("packed weight moved to another device")?;
        }
        Ok(Self {
            codes: self.codes.to_device(device)?,
            scales: self.scales.to_device(device)?,
            biases: self.biases.to_device(device)?,
            q4_1: if same { self.q4_1.clone() } else { None },
            ..self.clone()
        })
    }

    /// Bytes the packed tensor occupies (codes + scales + biases, or its `Q4_1` blocks where
    /// they replaced them).
    pub fn packed_bytes(&self) -> usize {
        if let Some(q) = self.q4_1.as_ref().filter(|_| !self.mlx_resident()) {
            return q.bytes();
        }
        self.codes.elem_count() * 4
            + (self.scales.elem_count() + self.biases.elem_count())
                * self.scales.dtype().size_in_bytes()
    }
}

/// K/V of one sequence as attention must read them.
#[derive(Debug, Clone)]
pub enum KvData {
    /// Plain tensors `[1, kv_heads, keys, head_dim]`.
    Dense {
        /// Keys, already normed and rotated.
        k: Tensor,
        /// Values, already normed.
        v: Tensor,
    },
    /// Affine-quantized keys and values; read them with the quantized attention.
    Packed {
        /// Packed keys.
        k: PackedAffine,
        /// Packed values.
        v: PackedAffine,
    },
}

/// The K/V operand of attention: what a cache update returns for the tokens just appended.
///
/// The tensors read the cache's storage in place (no copy per step), so a view is valid until
/// the next write to that storage: use it within the step (the layer and its KV-shared
/// consumers), never keep it across steps.
#[derive(Debug, Clone)]
pub enum KvView {
    /// One sequence: its K/V and the absolute position of each key, in storage order (a ring
    /// buffer's keys are not sorted; softmax does not care and the mask is built from positions).
    Single {
        /// Dense or packed K/V.
        data: KvData,
        /// The absolute token index of each key, in storage order.
        positions: KeyPositions,
    },
    /// One view per sequence of a batch, in batch order.
    Batch(Vec<KvView>),
}

impl KvView {
    /// The view with every sequence's keys below its offset before the update (`offsets`, one
    /// per sequence in batch order) marked settled ([`KeyPositions::settled_below`]).
    pub(crate) fn settled_below(self, offsets: &[usize]) -> Self {
        match self {
            KvView::Single { data, positions } => KvView::Single {
                data,
                positions: match offsets.first() {
                    Some(&o) => positions.settled_below(o),
                    None => positions,
                },
            },
            KvView::Batch(views) => KvView::Batch(
                views
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| v.settled_below(offsets.get(i..i + 1).unwrap_or(&[])))
                    .collect(),
            ),
        }
    }
}
