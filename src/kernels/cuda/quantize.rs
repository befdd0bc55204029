//! MLX affine quantization on CUDA (`quantize.cu`): group-wise quantization bit-exact with the
//! CPU reference, and dequantization of packed rows (prefill GEMMs, embedding lookups, packed
//! K/V for the dense attention path).

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

use super::device::{cuda_dev, cuda_storage, kname, view, wrap};
use super::kernel_cache::{load_kernel, QUANTIZE};
use crate::kernels::plan::QmatParams;
use crate::kernels::{KernelError, PackedAffine};

/// Dense `[1, kvh, keys, head_dim]` in `dtype` from packed K or V, on the GPU.
///
/// # Errors
/// Shape, dtype and CUDA errors.
pub fn dequantize_kv(p: &PackedAffine, dtype: DType) -> Result<Tensor, KernelError> {
    let (b, kvh, keys, words) = p.codes.dims4()?;
    let bits = p.bits.bits();
    let hd = words * 32 / bits;
    let rows = b * kvh * keys;
    let codes = p.codes.contiguous()?.reshape((rows, words))?;
    let scales = p.scales.contiguous()?.reshape((rows, hd / p.group_size))?;
    let biases = p.biases.contiguous()?.reshape((rows, hd / p.group_size))?;
    let dense = dequant_rows(&codes, &scales, &biases, bits, p.group_size, None, dtype)?;
    Ok(dense.reshape((b, kvh, keys, hd))?)
}

/// Dequantizes rows of a packed matrix (`codes` `[n, in*bits/32]`, scales/biases
/// `[n, in/group]`) into dense `[m, in]` in `dtype`: row `i` is packed row `idx[i]`
/// (`idx`: u32 `[m]`), or row `i` when `idx` is `None` (`m = n`).
pub(crate) fn dequant_rows(
    codes: &Tensor,
    scales: &Tensor,
    biases: &Tensor,
    bits: usize,
    group_size: usize,
    idx: Option<&Tensor>,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let (n, words) = codes.dims2()?;
    let in_dim = words * 32 / bits;
    let dev = cuda_dev(codes)?;
    let tn = kname(dtype).map_err(candle_core::Error::wrap)?;
    let sn = kname(scales.dtype()).map_err(candle_core::Error::wrap)?;
    let idx = match idx {
        Some(i) => Some(i.to_dtype(DType::U32)?.flatten_all()?.contiguous()?),
        None => None,
    };
    let m = idx.as_ref().map_or(n, |i| i.elem_count());
    let params = QmatParams {
        rows: m as u32,
        out_dim: n as u32,
        in_dim: in_dim as u32,
        group_size: group_size as u32,
    };
    let func = load_kernel(&dev, &format!("dequant_{tn}_{sn}_{bits}"), &QUANTIZE)?;
    let total = m * words;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256).clamp(1, 132 * 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (codes, scales, biases) = (
        codes.contiguous()?,
        scales.contiguous()?,
        biases.contiguous()?,
    );
    macro_rules! go {
        ($t:ty, $s:ty) => {{
            // SAFETY: fully written (one thread per packed word of every output row).
            let mut y = unsafe { dev.alloc::<$t>((m * in_dim).max(1))? };
            if total > 0 {
                let (c_s, c_l) = codes.storage_and_layout();
                let (s_s, s_l) = scales.storage_and_layout();
                let (b_s, b_l) = biases.storage_and_layout();
                let cv = view::<u32>(cuda_storage(&c_s)?, c_l)?;
                let sv = view::<$s>(cuda_storage(&s_s)?, s_l)?;
                let bv = view::<$s>(cuda_storage(&b_s)?, b_l)?;
                let mut b = func.builder();
                b.arg(&params);
                b.arg(&cv);
                b.arg(&sv);
                b.arg(&bv);
                let guard = idx.as_ref().map(|i| i.storage_and_layout());
                let iv = match &guard {
                    Some((st, l)) => Some(view::<u32>(cuda_storage(st)?, l)?),
                    None => None,
                };
                // A null index pointer selects "row i" in the kernel.
                let null = 0u64;
                match &iv {
                    Some(iv) => b.arg(iv),
                    None => b.arg(&null),
                };
                b.arg(&mut y);
                // SAFETY: arguments match the kernel signature; indices are the caller's
                // responsibility and checked against `n` before the call.
                unsafe { b.launch(cfg) }.w()?;
            }
            wrap(y, &dev, &[m, in_dim])
        }};
    }
    macro_rules! by_scale {
        ($t:ty) => {
            match scales.dtype() {
                DType::F32 => go!($t, f32),
                DType::F16 => go!($t, half::f16),
                _ => go!($t, half::bf16),
            }
        };
    }
    Ok(match dtype {
        DType::F32 => by_scale!(f32),
        DType::F16 => by_scale!(half::f16),
        _ => by_scale!(half::bf16),
    })
}

/// Group-wise affine quantization of `x` (`[..., dim]`, f32/f16/bf16, on CUDA) along its last
/// axis, bit-exact with the CPU reference [`crate::kernels::quantize`]: codes `[..., dim * bits /
/// 32]`, scales and biases `[..., dim / group_size]` in `x`'s dtype. The caller checks the group
/// size.
pub(crate) fn quantize(
    x: &Tensor,
    bits: crate::kernels::QuantBits,
    group_size: usize,
) -> candle_core::Result<PackedAffine> {
    let dims = x.dims().to_vec();
    let dim = dims.last().copied().unwrap_or(0);
    let b = bits.bits();
    let dev = cuda_dev(x)?;
    let tn = kname(x.dtype()).map_err(candle_core::Error::wrap)?;
    let x = x.contiguous()?;
    let groups = x.elem_count() / group_size.max(1);
    let params = QmatParams {
        rows: u32::try_from(groups).map_err(candle_core::Error::wrap)?,
        out_dim: 0,
        in_dim: dim as u32,
        group_size: group_size as u32,
    };
    let func = load_kernel(&dev, &format!("quantize_{tn}_{b}"), &QUANTIZE)?;
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let lead = &dims[..dims.len().saturating_sub(1)];
    let shape_with = |last: usize| {
        let mut s = lead.to_vec();
        s.push(last);
        s
    };
    let words = x.elem_count() * b / 32;
    macro_rules! go {
        ($t:ty) => {{
            // SAFETY: every group writes its scale, bias and all its code words.
            let (mut codes, mut scales, mut biases) = unsafe {
                (
                    dev.alloc::<u32>(words.max(1))?,
                    dev.alloc::<$t>(groups.max(1))?,
                    dev.alloc::<$t>(groups.max(1))?,
                )
            };
            if groups > 0 {
                let (x_s, x_l) = x.storage_and_layout();
                let xv = view::<$t>(cuda_storage(&x_s)?, x_l)?;
                let mut bl = func.builder();
                bl.arg(&params);
                bl.arg(&xv);
                bl.arg(&mut codes);
                bl.arg(&mut scales);
                bl.arg(&mut biases);
                // SAFETY: arguments match the kernel's signature; one thread per group.
                unsafe { bl.launch(cfg) }.w()?;
            }
            (
                wrap(codes, &dev, &shape_with(dim * b / 32)),
                wrap(scales, &dev, &shape_with(dim / group_size)),
                wrap(biases, &dev, &shape_with(dim / group_size)),
            )
        }};
    }
    let (codes, scales, biases) = match x.dtype() {
        DType::F32 => go!(f32),
        DType::F16 => go!(half::f16),
        _ => go!(half::bf16),
    };
    Ok(PackedAffine::from_parts(
        codes,
        scales,
        biases,
        crate::kernels::AffineSpec { bits, group_size },
    ))
}
