//! MLX's group-wise affine quantization: `x ≈ scale * code + bias` per group of `group_size`
//! elements along the last axis, codes packed little-endian into `u32` words. [`quantize`]
//! packs a tensor; [`dequantize`], [`PackedAffine::dequantize`] and the weight loader all
//! unpack through [`dequantize_rows`].
//!
//! The arithmetic mirrors MLX 0.32's CPU `quantize` exactly (f32 throughout, the group's
//! larger-magnitude end snapped onto a code, round half to even), so codes written here equal
//! `mx.quantize`'s for the same input and the packed tensors can be exchanged with mlx-lm.
//! On CUDA and Metal (with the crate's kernels on) quantization runs on the device; elsewhere
//! on the host: the input is copied to the CPU and the packed result copied back.

use candle_core::{DType, Device, Tensor};

use super::operand::check_group_size;
use super::{AffineSpec, KernelError, PackedAffine, QuantBits};

/// Scale and bias of one group, as MLX computes them (in f32, before rounding to the storage
/// dtype). Codes are chosen with these f32 values; the stored scale/bias are then rounded.
pub(crate) fn group_params(group: &[f32], bits: QuantBits) -> (f32, f32) {
    let n_bins = ((1u32 << bits.bits()) - 1) as f32;
    let eps = 1e-7f32;
    let mut w_min = f32::INFINITY;
    let mut w_max = f32::NEG_INFINITY;
    for &x in group {
        w_max = w_max.max(x);
        w_min = w_min.min(x);
    }
    // Code 0 sits on whichever end has the larger magnitude; the scale's sign follows, so a
    // group whose maximum dominates gets a negative scale with `bias = max`.
    let mask = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(eps);
    if !mask {
        scale = -scale;
    }
    let edge = if mask { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        // Snap the end point, not the scale: the largest magnitude stays exact.
        scale = edge / q0;
        bias = edge;
    }
    (scale, bias)
}

/// Quantizes `rows` (`[n_rows, dim]`, row-major) into `codes` (`[n_rows, dim * bits / 32]`),
/// `scales` and `biases` (`[n_rows, dim / group_size]`, f32 as computed, before storage rounding).
pub(crate) fn quantize_rows(
    rows: &[f32],
    dim: usize,
    bits: QuantBits,
    group_size: usize,
) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let b = bits.bits();
    let per_word = 32 / b;
    let n_bins = ((1u32 << b) - 1) as f32;
    let n_groups_total = rows.len() / group_size;
    let mut codes = vec![0u32; rows.len() / per_word]; // [n_rows, dim * bits / 32]
    let mut scales = Vec::with_capacity(n_groups_total); // [n_rows, dim / group_size]
    let mut biases = Vec::with_capacity(n_groups_total); // [n_rows, dim / group_size]
    debug_assert_eq!(dim % group_size, 0);
    for (gi, group) in rows.chunks_exact(group_size).enumerate() {
        let (scale, bias) = group_params(group, bits);
        scales.push(scale);
        biases.push(bias);
        let word0 = gi * group_size / per_word;
        for (e, &x) in group.iter().enumerate() {
            let code = ((x - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32;
            codes[word0 + e / per_word] |= code << ((e % per_word) * b);
        }
    }
    (codes, scales, biases)
}

/// Reads element `e` of a packed row (`words`: the row's `u32` words).
#[inline]
pub(crate) fn code_at(words: &[u32], e: usize, bits: usize) -> u32 {
    let per_word = 32 / bits;
    let mask = (1u32 << bits) - 1;
    (words[e / per_word] >> ((e % per_word) * bits)) & mask
}

/// Quantizes `x` (`[..., dim]`, a float dtype) group-wise along its last axis.
///
/// Returns codes `[..., dim * bits / 32]` (`u32`) and scales/biases `[..., dim / group_size]` in
/// `x`'s dtype, on `x`'s device.
///
/// # Errors
/// [`KernelError::BadGroupSize`] when `group_size` is not 32, 64 or 128 or does not divide the
/// last dimension; [`KernelError::DType`] for a non-float input; candle errors.
pub fn quantize(
    x: &Tensor,
    bits: QuantBits,
    group_size: usize,
) -> Result<PackedAffine, KernelError> {
    let dims = x.dims().to_vec();
    let dim = dims.last().copied().unwrap_or(0);
    check_group_size(group_size, dim)?;
    let dtype = x.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(KernelError::DType {
            what: "tensor to quantize",
            expected: DType::BF16,
            found: dtype,
        });
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return Ok(super::cuda::quantize::quantize(x, bits, group_size)?);
    }
    #[cfg(feature = "metal")]
    if x.device().is_metal() {
        if let Some(p) = super::metal::quantize(x, bits, group_size)? {
            return Ok(p);
        }
    }
    let host = host_f32(x)?;
    let (codes, scales, biases) = quantize_rows(&host, dim, bits, group_size);
    let lead = &dims[..dims.len() - 1];
    let shape_with = |last: usize| {
        let mut s = lead.to_vec();
        s.push(last);
        s
    };
    let device = x.device();
    let codes = Tensor::from_vec(codes, shape_with(dim * bits.bits() / 32), &Device::Cpu)?
        .to_device(device)?;
    let n_groups = dim / group_size;
    let scales = Tensor::from_vec(scales, shape_with(n_groups), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    let biases = Tensor::from_vec(biases, shape_with(n_groups), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    Ok(PackedAffine::from_parts(
        codes,
        scales,
        biases,
        AffineSpec { bits, group_size },
    ))
}

/// `t` copied to the host as f32, flattened.
pub(crate) fn host_f32(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()
}

/// MLX affine dequantization on the host, the one implementation in the crate: rows `rows` of
/// packed `codes` (row-major `[n, dim * bits / 32]` words) with `scales`, `biases` (row-major
/// `[n, dim / group_size]`, f32) → row-major `[rows.len(), dim]` f32, each element
/// `scale * code + bias` computed in f32. Any width from 2 to 8 bits: a code may straddle two
/// words (3, 5 and 6 bits).
///
/// The caller checks the shapes: a row past `n` panics.
pub(crate) fn dequantize_rows(
    codes: &[u32],
    scales: &[f32],
    biases: &[f32],
    dim: usize,
    bits: usize,
    group_size: usize,
    rows: impl IntoIterator<Item = usize>,
) -> Vec<f32> {
    let words = dim * bits / 32;
    let groups = dim / group_size;
    let mask = (1u64 << bits) - 1;
    let rows = rows.into_iter();
    let mut out = Vec::with_capacity(rows.size_hint().0 * dim); // [rows, dim]
    for r in rows {
        let row = &codes[r * words..(r + 1) * words];
        for e in 0..dim {
            let bit = e * bits;
            let (word, shift) = (bit / 32, bit % 32);
            let lo = u64::from(row[word]);
            let hi = u64::from(row.get(word + 1).copied().unwrap_or(0));
            let q = (((hi << 32) | lo) >> shift) & mask;
            let g = r * groups + e / group_size;
            out.push(scales[g] * q as f32 + biases[g]);
        }
    }
    out
}

/// [`dequantize_rows`] of a packed tensor's rows `rows` (every axis but the last flattened),
/// read from its device: row-major `[rows.len(), p.in_dim()]` f32 on the host.
///
/// # Errors
/// [`KernelError::Shape`] when codes, scales and biases disagree, or a row is out of range;
/// candle errors.
pub(crate) fn dequantize_host(p: &PackedAffine, rows: &[usize]) -> Result<Vec<f32>, KernelError> {
    p.require_mlx("packed tensor read on the host")?;
    let b = p.bits.bits();
    let cdims = p.codes.dims().to_vec();
    let words = cdims.last().copied().unwrap_or(0);
    let dim = words * 32 / b;
    let n_groups = dim.checked_div(p.group_size).unwrap_or(0);
    let mut sdims = cdims.clone();
    if let Some(last) = sdims.last_mut() {
        *last = n_groups;
    }
    if p.group_size == 0
        || !dim.is_multiple_of(p.group_size)
        || p.scales.dims() != sdims
        || p.biases.dims() != sdims
    {
        return Err(KernelError::Shape {
            what: "packed scales/biases",
            expected: format!("{sdims:?} (codes {cdims:?}, group {})", p.group_size),
            found: p.scales.dims().to_vec(),
        });
    }
    let n = p.out_dim();
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        return Err(KernelError::Shape {
            what: "dequantized rows",
            expected: format!("rows below {n}"),
            found: vec![bad],
        });
    }
    let codes: Vec<u32> = p.codes.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
    let (scales, biases) = (host_f32(&p.scales)?, host_f32(&p.biases)?);
    Ok(dequantize_rows(
        &codes,
        &scales,
        &biases,
        dim,
        b,
        p.group_size,
        rows.iter().copied(),
    ))
}

/// Dequantizes a packed tensor: `[..., dim]` in the scales' dtype, on their device, computing
/// `scale * code + bias` in f32 and rounding once.
///
/// # Errors
/// [`KernelError::Shape`] when codes, scales and biases disagree; candle errors.
pub fn dequantize(p: &PackedAffine) -> Result<Tensor, KernelError> {
    #[cfg(feature = "metal")]
    if p.codes.device().is_metal() {
        if let Some(t) = super::metal::dequantize_on_device(p, p.scales.dtype())? {
            return Ok(t);
        }
    }
    let rows: Vec<usize> = (0..p.out_dim()).collect();
    let out = dequantize_host(p, &rows)?;
    let t = Tensor::from_vec(out, p.dims(), &Device::Cpu)?
        .to_dtype(p.scales.dtype())?
        .to_device(p.scales.device())?;
    Ok(t)
}

impl PackedAffine {
    /// The dense matrix `[out_dim, in_dim]` in `dtype`, on the codes' device (the dequantize
    /// kernel on CUDA, and on Metal with the crate's kernels on; the host reference elsewhere).
    ///
    /// # Errors
    /// [`KernelError::Shape`] when codes, scales and biases disagree; candle errors.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor, KernelError> {
        match self.codes.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Ok(super::cuda::quantize::dequant_rows(
                &self.codes,
                &self.scales,
                &self.biases,
                self.bits.bits(),
                self.group_size,
                None,
                dtype,
            )?),
            #[cfg(feature = "metal")]
            Device::Metal(_) if super::metal::kernels_on() => {
                let on_device = match &self.q4_1 {
                    Some(q) if !self.mlx_resident() => q.dequantize_on_device(dtype)?,
                    _ => super::metal::dequantize_on_device(self, dtype)?,
                };
                match on_device {
                    Some(t) => Ok(t.reshape((self.out_dim(), self.in_dim()))?),
                    None => self.dequantize_via_host(dtype),
                }
            }
            _ => self.dequantize_via_host(dtype),
        }
    }

    /// [`PackedAffine::dequantize`] through the host reference.
    fn dequantize_via_host(&self, dtype: DType) -> Result<Tensor, KernelError> {
        let rows: Vec<usize> = (0..self.out_dim()).collect();
        let dense = dequantize_host(self, &rows)?;
        Ok(
            Tensor::from_vec(dense, (self.out_dim(), self.in_dim()), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(self.codes.device())?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn pack_bit_order_element0_lowest_bits() {
        // Values 0..7 in a group of 32 at 4 bits whose min is 0 and max 15: codes equal values.
        let mut row = vec![0f32; 32];
        for (i, x) in row.iter_mut().enumerate() {
            *x = (i % 16) as f32;
        }
        // max 15 dominates: negative scale, bias = 15 -> code = (x - 15) / -1 = 15 - x.
        let (codes, scales, biases) = quantize_rows(&row, 32, QuantBits::Four, 32);
        assert_eq!(scales[0], -1.0);
        assert_eq!(biases[0], 15.0);
        // element 0 -> code 15 in bits 0..4, element 1 -> code 14 in bits 4..8, ...
        assert_eq!(codes[0] & 0xF, 15);
        assert_eq!((codes[0] >> 4) & 0xF, 14);
        assert_eq!(codes[0] >> 28, 8);
        // A group dominated by its minimum: positive scale, bias = min.
        let row: Vec<f32> = (0..32).map(|i| -((i % 4) as f32) * 100.0 + 1.0).collect();
        let (codes, _, _) = quantize_rows(&row, 32, QuantBits::Eight, 32);
        // 8-bit: element 0 in bits 0..8 of word 0, element 3 in bits 24..32.
        let t = Tensor::from_vec(row.clone(), (1, 32), &Device::Cpu).unwrap();
        let p = quantize(&t, QuantBits::Eight, 32).unwrap();
        let c: Vec<u32> = p.codes.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(c, codes);
        let e0 = codes[0] & 0xFF;
        let e3 = codes[0] >> 24;
        assert!(
            e0 > e3,
            "element 0 (value 1) sits above element 3 (value -299): {e0} vs {e3}"
        );
    }

    /// Codes, scales and biases equal `mx.quantize`'s (MLX 0.32.4, CPU) bit for bit on inputs
    /// exactly representable in f32: `(lcg % 2001 - 1000) / 256`, 2 rows of 128.
    #[test]
    #[allow(clippy::excessive_precision)] // MLX's f32 values, printed exactly
    fn matches_mlx_quantize_bit_for_bit() {
        let mut s: u64 = 12345;
        let vals: Vec<f32> = (0..256)
            .map(|_| {
                s = (s * 1103515245 + 12345) % (1 << 31);
                ((s % 2001) as f32 - 1000.0) / 256.0
            })
            .collect();
        let x = Tensor::from_vec(vals, (2, 128), &Device::Cpu).unwrap();
        #[allow(clippy::type_complexity)]
        let cases: [(QuantBits, usize, &[u32], &[f32], &[f32]); 3] = [
            (
                QuantBits::Four,
                32,
                &[
                    1686537309, 1014231367, 1683640862, 3491222382, 4196332701, 1824311545,
                    2599732635, 2233954608, 1396149328, 127287658, 4192827999, 630106483,
                    3194394216, 2480291154, 3298721033, 3681416391, 1927265298, 4125536935,
                    500109086, 1614251372, 1002986162, 3763998027, 3411948717, 4226653428,
                    3485645161, 2157312540, 3690527564, 1907751907, 4286328083, 3751352726,
                    62354682, 896738251,
                ],
                &[
                    0.4228515625,
                    0.478515625,
                    -0.45458984375,
                    -0.4482421875,
                    0.4453125,
                    -0.4214409589767456,
                    -0.4736328125,
                    -0.46044921875,
                ],
                &[
                    -3.3828125, -3.828125, 3.63671875, 3.5859375, -3.5625, 3.79296875, 3.7890625,
                    3.68359375,
                ],
            ),
            (
                QuantBits::Eight,
                64,
                &[
                    2152092610, 1632533093, 4011543406, 985561147, 1411916761, 1565152421,
                    3460259792, 3339655800, 4047998668, 4238151142, 3196649366, 1673374407,
                    3310000042, 2426467909, 1763060224, 2119508332, 2311277312, 1227831146,
                    956979872, 107976285, 1822053623, 4288077711, 2659874870, 441026792,
                    2405787269, 3001441375, 919426848, 2452933475, 1808859786, 3174797273,
                    4282039924, 3501219027, 1346562278, 2397451797, 1323066257, 162210728,
                    4145607723, 4130753297, 2226628163, 2734609036, 1150851873, 647803256,
                    12796322, 3355724436, 641831613, 3013824462, 2259870776, 3819425726,
                    2995414414, 3337930275, 4288286407, 2080413261, 3903669443, 3635740286,
                    4105623849, 1762439505, 550574381, 4209930942, 311201635, 3488058773,
                    1967190941, 70628472, 624081587, 777546295,
                ],
                &[
                    0.02967538684606552,
                    -0.028191618621349335,
                    -0.02895396016538143,
                    -0.02960205078125,
                ],
                &[-3.828125, 3.63671875, 3.79296875, 3.7890625],
            ),
            (
                QuantBits::Four,
                128,
                &[
                    1703314524, 1282732631, 1700418093, 3240612973, 4196332701, 1824311545,
                    2599732635, 2233954608, 3184100543, 4185575334, 388470705, 3951191964,
                    1386904232, 2102052014, 1282642935, 899882057, 2654033134, 438984041,
                    4082233843, 2950269860, 699877778, 3226012746, 3126666396, 3940322275,
                    3485645161, 2157312540, 3690527564, 1907751907, 4286328099, 3734575510,
                    62354682, 913515467,
                ],
                &[0.478515625, -0.47412109375],
                &[-3.828125, 3.79296875],
            ),
        ];
        for (bits, gs, codes, scales, biases) in cases {
            let p = quantize(&x, bits, gs).unwrap();
            let got: Vec<u32> = p.codes.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(got, codes, "{bits:?} group {gs}: codes");
            let got: Vec<f32> = p.scales.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(got, scales, "{bits:?} group {gs}: scales");
            let got: Vec<f32> = p.biases.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(got, biases, "{bits:?} group {gs}: biases");
        }
    }

    #[test]
    fn round_trip_error_bounds() {
        let mut seed = 7u64;
        for &(bits, gs) in &[
            (QuantBits::Eight, 32),
            (QuantBits::Eight, 64),
            (QuantBits::Four, 64),
            (QuantBits::Four, 128),
        ] {
            let data: Vec<f32> = (0..4 * 256).map(|_| lcg(&mut seed) * 3.0).collect();
            let t = Tensor::from_vec(data.clone(), (1, 4, 256), &Device::Cpu).unwrap();
            let p = quantize(&t, bits, gs).unwrap();
            assert_eq!(p.codes.dims(), &[1, 4, 256 * bits.bits() / 32]);
            assert_eq!(p.scales.dims(), &[1, 4, 256 / gs]);
            let back: Vec<f32> = dequantize(&p)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let scales: Vec<f32> = p.scales.flatten_all().unwrap().to_vec1().unwrap();
            // MLX snaps the dominant end onto a code, which can stretch the range past the last
            // code: the far end is clamped and may be off by up to 1.5 steps. Everything else
            // is within half a step.
            let mut worst = 0f32;
            let mut beyond_half = 0;
            for (i, (a, b)) in data.iter().zip(&back).enumerate() {
                let steps = (a - b).abs() / scales[i / gs].abs();
                worst = worst.max(steps);
                if steps > 0.5 + 1e-3 {
                    beyond_half += 1;
                }
            }
            eprintln!("{bits:?} group {gs}: worst round-trip error {worst:.3} steps, {beyond_half} of {} beyond half a step", data.len());
            assert!(worst <= 1.5, "bits {bits:?} gs {gs}: {worst} steps");
            assert!(
                beyond_half * 20 <= data.len(),
                "only values near a clamped end: {beyond_half}"
            );
        }
    }

    #[test]
    fn constant_group_is_exact() {
        let t = Tensor::from_vec(vec![0.25f32; 64], (1, 64), &Device::Cpu).unwrap();
        let p = quantize(&t, QuantBits::Four, 64).unwrap();
        let back: Vec<f32> = dequantize(&p)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(back.iter().all(|&x| (x - 0.25).abs() < 1e-6), "{back:?}");
        let z = Tensor::zeros((1, 64), DType::F32, &Device::Cpu).unwrap();
        let back = dequantize(&quantize(&z, QuantBits::Eight, 64).unwrap()).unwrap();
        let back: Vec<f32> = back.flatten_all().unwrap().to_vec1().unwrap();
        assert!(back.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn bad_group_size_is_typed() {
        let t = Tensor::zeros((1, 96), DType::F32, &Device::Cpu).unwrap();
        assert!(matches!(
            quantize(&t, QuantBits::Four, 64),
            Err(KernelError::BadGroupSize {
                group_size: 64,
                dim: 96
            })
        ));
        assert!(matches!(
            quantize(&t, QuantBits::Four, 48),
            Err(KernelError::BadGroupSize { .. })
        ));
    }
}
