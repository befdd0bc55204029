//! Loading MLX affine-quantized weights that the packed kernels do not take (other widths
//! than 4 and 8 bits, tensors that are not matrices): codes packed little-endian into `u32`
//! words (element 0 in the lowest bits of word 0), one scale and one bias per group of
//! `group_size` inputs, `w[o, g*G + i] = scales[o, g] * code[o, g*G + i] + biases[o, g]`,
//! dequantized on load by [`crate::kernels`]' one implementation.

use candle_core::{DType, Device, Tensor};

use crate::kernels::dequantize_rows;

/// Dequantizes MLX affine codes to a dense f32 tensor of `shape` (`[.., out, in]`), inferring
/// bits and group size from the packed shapes as mlx-lm does. Returns `(dense, bits, group)`.
///
/// # Errors
/// A reason string when the packed shapes do not fit `shape`.
pub fn dequantize(
    codes: &Tensor,
    scales: &Tensor,
    biases: &Tensor,
    shape: &[usize],
) -> Result<(Tensor, usize, usize), String> {
    let in_dim = *shape.last().ok_or("empty expected shape")?;
    let lead = &shape[..shape.len() - 1];
    let (cdims, sdims) = (codes.dims(), scales.dims());
    if cdims.len() != shape.len()
        || sdims.len() != shape.len()
        || &cdims[..lead.len()] != lead
        || &sdims[..lead.len()] != lead
    {
        return Err(format!(
            "codes {cdims:?} / scales {sdims:?} do not match the dense shape {shape:?}"
        ));
    }
    if codes.dtype() != DType::U32 {
        return Err(format!(
            "codes have dtype {:?}, expected u32",
            codes.dtype()
        ));
    }
    let words = cdims[cdims.len() - 1];
    let groups = sdims[sdims.len() - 1];
    if in_dim == 0 || groups == 0 || (words * 32) % in_dim != 0 || in_dim % groups != 0 {
        return Err(format!(
            "{words} words per row and {groups} groups cannot hold {in_dim} inputs"
        ));
    }
    let bits = words * 32 / in_dim;
    let group = in_dim / groups;
    if !(2..=8).contains(&bits) {
        return Err(format!(
            "inferred {bits} bits per element; supported: 2..=8"
        ));
    }
    let rows: usize = lead.iter().product();
    let to_vec = |t: &Tensor| -> Result<Vec<f32>, String> {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| e.to_string())
    };
    let codes = codes
        .flatten_all()
        .and_then(|t| t.to_vec1::<u32>())
        .map_err(|e| e.to_string())?;
    let (scales, biases) = (to_vec(scales)?, to_vec(biases)?);
    let out = dequantize_rows(&codes, &scales, &biases, in_dim, bits, group, 0..rows);
    let dense = Tensor::from_vec(out, shape, &Device::Cpu).map_err(|e| e.to_string())?;
    Ok((dense, bits, group))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_zero_sits_in_the_lowest_bits() {
        // One row of 8 four-bit codes 0..7 in one word, group 8, scale 2, bias -1.
        let word: u32 = (0..8u32).map(|i| i << (4 * i)).sum();
        let codes = Tensor::new(&[[word]], &Device::Cpu).unwrap();
        let scales = Tensor::new(&[[2f32]], &Device::Cpu).unwrap();
        let biases = Tensor::new(&[[-1f32]], &Device::Cpu).unwrap();
        let (w, bits, group) = dequantize(&codes, &scales, &biases, &[1, 8]).unwrap();
        assert_eq!((bits, group), (4, 8));
        let got = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want: Vec<f32> = (0..8).map(|i| 2.0 * i as f32 - 1.0).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn mismatched_shapes_are_reported() {
        let codes = Tensor::zeros((2, 3), DType::U32, &Device::Cpu).unwrap();
        let scales = Tensor::zeros((2, 1), DType::F32, &Device::Cpu).unwrap();
        assert!(dequantize(&codes, &scales, &scales, &[2, 7]).is_err());
    }
}
