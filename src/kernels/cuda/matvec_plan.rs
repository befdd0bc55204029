//! The kernel choice of a packed-weight matrix-vector product ([`super::matvec`]): SIMT
//! (`qmatvec_*`), tensor-core (`qmv_mma_*`), dequantize-then-mma (`qmv_tc4_*`, and
//! `qmv_tc4x_*` for 9..=32 rows) or the row-contiguous 4-bit kernel (`qmv_row4_*`) and its
//! variant, with the block shape each takes.

use candle_core::cuda_backend::CudaDevice;
use candle_core::DType;

use super::device::sm_count;
use super::kernel_cache::{load_kernel, Module, MATVEC, MATVEC_BATCH};
use crate::kernels::PackedAffine;

/// Output rows per quantized matrix-vector block (`QMV_WARPS`).
pub(crate) const QMATVEC_WARPS: usize = 8;
/// Output rows per tensor-core matrix-vector block (the M of `mma.m16n8k16`).
pub(crate) const QMATVEC_MMA_ROWS: usize = 16;
/// Warps per tensor-core matrix-vector block, splitting the input groups (`QMMA_WARPS`).
pub(crate) const QMATVEC_MMA_WARPS: usize = 8;
/// Warps a block of the row-contiguous 4-bit matvec (`qmv_row4`, one activation row; at most
/// `QROW_MAX_WARPS`): each warp owns whole output rows, so the block size only sets the launch
/// granularity.
pub(crate) const QMATVEC_ROW_WARPS: usize = 4;
/// Most warps a block of `qmv_row4` holds (`QROW_MAX_WARPS`): row-pair warps times the
/// warps splitting each pair's input.
pub(crate) const QROW_MAX_WARPS: usize = 8;
/// Activation rows every matvec kernel takes (the N of `mma.m16n8k16`).
pub(crate) const QMATVEC_ROWS: usize = 8;
/// Activation rows `qmv_tc4x` takes (`8 * QTC_NTILES`), for weights [`takes_row_matvec`] accepts.
pub(crate) const QMATVEC_TC4X_ROWS: usize = 32;

/// A planned matvec launch: the kernel and its module, output rows a block, warps a row pair's
/// input is split over (`blockDim.y`; 1 except for `qmv_row4`) and warps a block along x.
pub(super) struct MatvecKernel {
    pub(super) name: String,
    pub(super) module: &'static Module,
    pub(super) rows_per_block: usize,
    pub(super) warps: usize,
    pub(super) split: usize,
}

/// Chooses the kernel of `rows` activation rows of dtype `x_dtype` through `[out_dim, in_dim]`
/// codes of `bits` bits in groups of `group_size`, scales and biases of `scale_dtype` /
/// `bias_dtype`; `tn`/`sn` are the activation and scale dtypes' name suffixes. `settled`: the
/// weight is [`PackedAffine::settled`](crate::kernels::PackedAffine::settled).
///
/// # Errors
/// The driver's occupancy query fails to load a kernel.
#[allow(clippy::too_many_arguments)]
pub(super) fn choose(
    dev: &CudaDevice,
    x_dtype: DType,
    scale_dtype: DType,
    bias_dtype: DType,
    rows: usize,
    out_dim: usize,
    in_dim: usize,
    bits: usize,
    group_size: usize,
    settled: bool,
    (tn, sn): (&'static str, &'static str),
) -> candle_core::Result<MatvecKernel> {
    let r = match rows {
        1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    };
    let kernel = |name, rows_per_block, warps| MatvecKernel {
        name,
        module: &MATVEC,
        rows_per_block,
        warps,
        split: 1,
    };
    // Tensor-core kernels: 16 output rows a block; SIMT kernel: one warp per output row;
    // `qmv_row4`: two output rows a warp index, times `split` warps over the input.
    if dequantizes_before_mma(x_dtype, scale_dtype, bias_dtype, bits, group_size, in_dim) {
        if rows > QMATVEC_ROWS {
            let tiles = batch_tiles_per_warp(out_dim, sm_count(dev));
            let suffix = if tiles == 1 {
                String::new()
            } else {
                tiles.to_string()
            };
            return Ok(MatvecKernel {
                name: format!("qmv_tc4x{suffix}_{tn}"),
                module: &MATVEC_BATCH,
                rows_per_block: QMATVEC_MMA_ROWS * tiles,
                warps: QMATVEC_MMA_WARPS,
                split: 1,
            });
        }
        if rows != 1 {
            let name = format!("qmv_tc4_{tn}_b4");
            return Ok(kernel(name, QMATVEC_MMA_ROWS, QMATVEC_MMA_WARPS));
        }
        let split = row_matvec_split_for(out_dim, in_dim, sm_count(dev));
        let late_warps = QROW_MAX_WARPS / split;
        let late_fits =
            settled && long_rows(split, in_dim) && late_variant_fits(dev, tn, out_dim, late_warps)?;
        let variant = row_matvec_variant(split, in_dim, settled, late_fits);
        let warps = if variant == "_u2le" {
            late_warps
        } else {
            QMATVEC_ROW_WARPS.min(QROW_MAX_WARPS / split)
        };
        return Ok(MatvecKernel {
            name: format!("qmv_row4_{tn}{variant}"),
            module: &MATVEC,
            rows_per_block: warps * 2,
            warps,
            split,
        });
    }
    if uses_tensor_core_matvec(x_dtype, rows, bits, group_size, in_dim) {
        let name = format!("qmv_mma_{tn}_{sn}_{bits}_{group_size}");
        return Ok(kernel(name, QMATVEC_MMA_ROWS, QMATVEC_MMA_WARPS));
    }
    let mut name = format!("qmatvec_{tn}_{sn}_{bits}_{r}");
    if bits == 8 && r == 1 {
        let one_wave = format!("{name}w");
        if fits_one_wave_only_of(dev, &name, &one_wave, out_dim, QMATVEC_WARPS)? {
            name = one_wave;
        }
    }
    Ok(kernel(name, QMATVEC_WARPS, QMATVEC_WARPS))
}

/// Whether the tensor-core kernel `qmv_mma` serves: f16/bf16 activations, MLX group sizes, and
/// not a single row of 8-bit or group-32 codes (the SIMT kernel streams those faster). f32
/// activations keep the SIMT kernel, whose products stay in f32.
fn uses_tensor_core_matvec(
    x_dtype: DType,
    rows: usize,
    bits: usize,
    group_size: usize,
    in_dim: usize,
) -> bool {
    matches!(x_dtype, DType::BF16 | DType::F16)
        && matches!(group_size, 32 | 64 | 128)
        && in_dim.is_multiple_of(group_size)
        && (rows > 1 || (bits == 4 && group_size > 32))
}

/// Whether `qmv_tc4` (several rows) or `qmv_row4` (one row) serves, which dequantize 4-bit
/// codes to the activation type in registers (one rounding per weight, as dequantizing W first
/// would): f16/bf16 activations with scales and biases of the same type, groups of a multiple
/// of 32. `qmv_tc4` accumulates whole rows on the tensor cores; `qmv_row4` reads rows
/// contiguously.
pub(super) fn dequantizes_before_mma(
    x_dtype: DType,
    scale_dtype: DType,
    bias_dtype: DType,
    bits: usize,
    group_size: usize,
    in_dim: usize,
) -> bool {
    matches!(x_dtype, DType::BF16 | DType::F16)
        && scale_dtype == x_dtype
        && bias_dtype == x_dtype
        && bits == 4
        && group_size >= 32
        && group_size.is_multiple_of(32)
        && in_dim.is_multiple_of(group_size)
}

/// Most activation rows [`super::matvec::qmatvec`] takes for `x_dtype` through `w`: 32 where
/// the 4-bit kernels that dequantize in registers serve (`qmv_tc4x` above 8 rows), else 8.
pub(crate) fn qmatvec_max_rows(x_dtype: DType, w: &PackedAffine) -> usize {
    if takes_row_matvec(x_dtype, w) {
        QMATVEC_TC4X_ROWS
    } else {
        QMATVEC_ROWS
    }
}

/// Whether one activation row of `x_dtype` through `w` takes `qmv_row4` (so `qmv_row4_norm`
/// can fold the residual add + norm into it).
pub(super) fn takes_row_matvec(x_dtype: DType, w: &PackedAffine) -> bool {
    dequantizes_before_mma(
        x_dtype,
        w.scales.dtype(),
        w.biases.dtype(),
        w.bits.bits(),
        w.group_size,
        w.in_dim(),
    )
}

/// Warps a `qmv_row4` row pair takes for `[out_dim, in_dim]` on `sms` multiprocessors: 1
/// unless the row pairs leave the device under-filled (fewer than 12 warps a multiprocessor;
/// 24 fit) and each warp would still walk at least four 1024-code steps. Projections that give
/// a multiprocessor 20 or more row-pair warps do not split.
pub(crate) fn row_matvec_split_for(out_dim: usize, in_dim: usize, sms: usize) -> usize {
    let pairs = out_dim.div_ceil(2);
    let steps = in_dim.div_ceil(1024);
    let mut split = 1;
    while split < 4 && pairs * split < 12 * sms && steps / (2 * split) >= 4 {
        split *= 2;
    }
    split
}

/// Output tiles of 16 rows each warp of `qmv_tc4x` owns (matvec_batch.cu): the most of 4, 2
/// and 1 that still gives at least 0.6 blocks a multiprocessor. Every block reads all of x, so
/// fewer, wider blocks read less of it; below that count too many multiprocessors idle. (On an
/// H100, E4B and 31B at batch 32 with 4-bit weights, a threshold of 0.6 ran 1.09x and 1.10x
/// the steps of a threshold of 1, and 1.15x and 1.00x those of 4 tiles everywhere.)
pub(crate) fn batch_tiles_per_warp(out_dim: usize, sms: usize) -> usize {
    let enough = |tiles: usize| out_dim.div_ceil(QMATVEC_MMA_ROWS * tiles) * 5 >= sms * 3;
    [4, 2].into_iter().find(|&t| enough(t)).unwrap_or(1)
}

/// Whether weights marked settled may take the early forms: the mark, unless the launch policy
/// turns early loads off ([`LaunchPolicy::early_loads`](crate::kernels::policy::LaunchPolicy::early_loads)).
pub(super) fn loads_early(settled: bool) -> bool {
    settled && crate::kernels::policy::current().early_loads
}

/// Kernel-name suffix of the `qmv_row4` variant for a launch over rows of `in_dim` codes with
/// `split` warps a row pair: `_u1` issues one step's loads before its math, `_u2` two; an `e`
/// after it issues the first weight loads before the PDL wait, for weights marked
/// [`PackedAffine::settled`](crate::kernels::PackedAffine::settled) (`settled`).
///
/// Unsplit rows of at least 5120 codes take `_u2`, the rest `_u1` (two steps in flight pay
/// off only on long rows). Settled weights take the same choice with `e`, and `_u2le` (x read
/// in the math: 64 registers, 32 warps a multiprocessor rather than `_u2`'s 24, and its
/// dependents launch before its wait) where `late_fits`: the launch's row pairs need more than
/// one wave of `_u2e` warps and fit in one of `_u2le`'s ([`late_variant_fits`]).
pub(super) fn row_matvec_variant(
    split: usize,
    in_dim: usize,
    settled: bool,
    late_fits: bool,
) -> &'static str {
    match (settled, long_rows(split, in_dim)) {
        (false, true) => "_u2",
        (false, false) => "_u1",
        (true, true) if late_fits => "_u2le",
        (true, true) => "_u2e",
        (true, false) => "_u1e",
    }
}

/// Whether a `qmv_row4` launch takes a two-step variant: unsplit rows of 5120+ codes.
fn long_rows(split: usize, in_dim: usize) -> bool {
    split == 1 && in_dim >= 5 * 1024
}

/// Whether `out_dim` rows (row pairs of `warps`-warp blocks) take more than one wave of
/// `qmv_row4_{tn}_u2e` on `dev` but fit in one wave of `_u2le` (see [`row_matvec_variant`]).
fn late_variant_fits(
    dev: &CudaDevice,
    tn: &'static str,
    out_dim: usize,
    warps: usize,
) -> candle_core::Result<bool> {
    fits_one_wave_only_of(
        dev,
        &format!("qmv_row4_{tn}_u2e"),
        &format!("qmv_row4_{tn}_u2le"),
        out_dim.div_ceil(2),
        warps,
    )
}

/// Whether `units` (one a warp, `warps` warps a block) take more than one wave of kernel
/// `wide` on `dev` but fit in one wave of kernel `narrow` (which holds more of them at once).
///
/// The 8-bit one-row `qmatvec` takes its 32-register `_1w` build where this holds: a launch
/// that needs a little more than one wave of the 39-register build (6 blocks a multiprocessor)
/// fits in one wave at 8. Launches that fit one wave either way keep the uncapped build, which
/// streams faster.
fn fits_one_wave_only_of(
    dev: &CudaDevice,
    wide: &str,
    narrow: &str,
    units: usize,
    warps: usize,
) -> candle_core::Result<bool> {
    let wave = |name: &str| -> candle_core::Result<usize> {
        Ok(resident_units(dev, name, warps)? * sm_count(dev))
    };
    Ok(units > wave(wide)? && units <= wave(narrow)?)
}

/// Warps of kernel `name` in `warps`-warp blocks one multiprocessor of `dev` holds at once,
/// asked of the driver once per kernel and block size.
/// Launches ask this on the host's hot path: a known answer costs a lock and a lookup, no
/// allocation.
fn resident_units(dev: &CudaDevice, name: &str, warps: usize) -> candle_core::Result<usize> {
    type Known = std::collections::HashMap<usize, std::collections::HashMap<String, usize>>;
    static KNOWN: std::sync::OnceLock<std::sync::Mutex<Known>> = std::sync::OnceLock::new();
    let known = KNOWN.get_or_init(Default::default);
    let cached = known
        .lock()
        .ok()
        .and_then(|m| m.get(&warps).and_then(|by_name| by_name.get(name)).copied());
    if let Some(n) = cached {
        return Ok(n);
    }
    let blocks = load_kernel(dev, name, &MATVEC)?
        .resident_blocks((warps * 32) as u32)
        .unwrap_or(0);
    let n = blocks * warps;
    if let Ok(mut m) = known.lock() {
        m.entry(warps).or_default().insert(name.to_string(), n);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_tiles_shrink_with_the_output_width() {
        // H100 (132 SMs): E4B's 2560-wide products keep 2 tiles (80 blocks), its gate/up and
        // head take 4; the 31B's 5376-wide ones take 4 (84 blocks); narrow outputs keep 1.
        assert_eq!(batch_tiles_per_warp(2560, 132), 2);
        assert_eq!(batch_tiles_per_warp(20480, 132), 4);
        assert_eq!(batch_tiles_per_warp(5376, 132), 4);
        assert_eq!(batch_tiles_per_warp(1024, 132), 1);
        assert_eq!(batch_tiles_per_warp(384, 132), 1);
    }

    #[test]
    fn row_matvec_splits_only_when_row_pairs_leave_the_device_short() {
        // On an H100 the 31B projections do not split; E4B's down_proj (2560 rows of 10240)
        // takes two warps a row pair.
        assert_eq!(row_matvec_split_for(5376, 21504, 132), 1);
        assert_eq!(row_matvec_split_for(8192, 5376, 132), 1);
        assert_eq!(row_matvec_split_for(21504, 5376, 132), 1);
        assert_eq!(row_matvec_split_for(2560, 10240, 132), 2);
        // Short rows never split, however few: a warp keeps at least four steps.
        assert_eq!(row_matvec_split_for(64, 4096, 132), 1);
        assert_eq!(row_matvec_split_for(64, 1 << 16, 132), 4);
        for (out, inp) in [(1, 32), (5376, 21504), (64, 1 << 20), (262144, 5376)] {
            let s = row_matvec_split_for(out, inp, 132);
            assert!(
                matches!(s, 1 | 2 | 4) && QROW_MAX_WARPS.is_multiple_of(s),
                "{out}x{inp}: {s}"
            );
        }
    }
}
