//! What every table of CUDA checks shares: the device (taken in turn, or skipped when absent),
//! random inputs, key-position layouts, the per-dtype tolerance and exact comparisons of packed
//! tensors and cache views.

use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::config::Config;
use candle_gemma::kv::{KeyPositions, KvData, KvView, PackedAffine};

use crate::common::close::max_abs_diff;

/// The config of `fixtures/{fixture}` (without its generation config), for random weights at
/// the fixture's shapes.
pub fn fixture_config(fixture: &str) -> Result<Config> {
    let path = format!(
        "{}/fixtures/{fixture}/config.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let json = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    Ok(Config::from_json(&json, None)?)
}

/// The CUDA device, held by one test at a time.
pub struct Gpu {
    /// CUDA device 0.
    pub dev: Device,
    _turn: MutexGuard<'static, ()>,
}

/// CUDA device 0 for this test, once the tests before it have released it. `None` (after a
/// note) when there is none, unless `CUDA_KERNELS_REQUIRE_GPU=1`, which makes that a panic.
pub fn gpu(test: &str) -> Option<Gpu> {
    static TURN: Mutex<()> = Mutex::new(());
    static DEVICE: OnceLock<Option<Device>> = OnceLock::new();
    let turn = TURN.lock().unwrap_or_else(PoisonError::into_inner);
    let required = std::env::var("CUDA_KERNELS_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let dev = DEVICE.get_or_init(|| match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(e) if required => panic!("CUDA_KERNELS_REQUIRE_GPU=1 but no CUDA device: {e}"),
        Err(e) => {
            eprintln!("no CUDA device ({e}): the CUDA kernel tests are skipped");
            None
        }
    });
    match dev {
        Some(dev) => Some(Gpu {
            dev: dev.clone(),
            _turn: turn,
        }),
        None => {
            assert!(!required, "CUDA_KERNELS_REQUIRE_GPU=1 but no CUDA device");
            eprintln!("{test}: skipped (no CUDA device)");
            None
        }
    }
}

/// Largest error a kernel output in `dtype` may show against the CPU reference, for values of
/// order 1.
pub fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-4,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

/// Random normal `[shape]` in `dtype` on the CPU.
pub fn rnd(shape: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)?)
}

/// `t` on the CPU.
pub fn cpu(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&Device::Cpu)?)
}

/// A packed tensor moved to `dev`.
pub fn to_dev(p: &PackedAffine, dev: &Device) -> Result<PackedAffine> {
    Ok(PackedAffine::from_parts(
        p.codes.to_device(dev)?,
        p.scales.to_device(dev)?,
        p.biases.to_device(dev)?,
        candle_gemma::kernels::AffineSpec {
            bits: p.bits,
            group_size: p.group_size,
        },
    ))
}

/// How the keys' positions are laid out in storage.
#[derive(Clone, Copy, Debug)]
pub enum Pos {
    /// Slot j holds position j.
    Linear,
    /// A wrapped ring: the newest keys first in storage after the wrap point.
    Ring,
    /// A random permutation.
    Shuffled,
}

/// Positions of `keys` slots laid out as `pos` (`seed` picks the permutation of `Shuffled`).
pub fn positions(keys: usize, pos: Pos, seed: u64) -> KeyPositions {
    let list: Vec<usize> = match pos {
        Pos::Linear => (0..keys).collect(),
        Pos::Ring => {
            let split = keys / 3;
            (0..keys)
                .map(|j| {
                    if j < split {
                        keys - split + j
                    } else {
                        j - split
                    }
                })
                .collect()
        }
        Pos::Shuffled => {
            let mut p: Vec<usize> = (0..keys).collect();
            let mut s = seed | 1;
            for i in (1..keys).rev() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                p.swap(i, (s % (i as u64 + 1)) as usize);
            }
            p
        }
    };
    list.into()
}

/// Whether two packed tensors (on any devices) hold the same shapes, the same code words and
/// bit-identical scales and biases (f16/bf16 values are exact in f32).
pub fn packed_identical(a: &PackedAffine, b: &PackedAffine) -> Result<bool> {
    let words = |t: &Tensor| -> Result<Vec<u32>> { Ok(cpu(t)?.flatten_all()?.to_vec1::<u32>()?) };
    let f32s = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(cpu(t)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    Ok(a.codes.dims() == b.codes.dims()
        && a.scales.dims() == b.scales.dims()
        && a.biases.dims() == b.biases.dims()
        && words(&a.codes)? == words(&b.codes)?
        && f32s(&a.scales)? == f32s(&b.scales)?
        && f32s(&a.biases)? == f32s(&b.biases)?)
}

/// Whether two cache views hold the same keys: the same positions and, per sequence, packed
/// codes, scales and biases bit for bit or dense K/V equal (a batch: every sequence alike).
pub fn views_identical(a: &KvView, b: &KvView) -> Result<bool> {
    Ok(match (a, b) {
        (KvView::Batch(a), KvView::Batch(b)) => {
            let mut all = a.len() == b.len();
            for (a, b) in a.iter().zip(b) {
                all &= views_identical(a, b)?;
            }
            all
        }
        (
            KvView::Single {
                data: da,
                positions: pa,
            },
            KvView::Single {
                data: db,
                positions: pb,
            },
        ) => {
            pa.to_vec() == pb.to_vec()
                && match (da, db) {
                    (KvData::Packed { k: ka, v: va }, KvData::Packed { k: kb, v: vb }) => {
                        packed_identical(ka, kb)? && packed_identical(va, vb)?
                    }
                    (KvData::Dense { k: ka, v: va }, KvData::Dense { k: kb, v: vb }) => {
                        max_abs_diff(ka, kb) == 0.0 && max_abs_diff(va, vb) == 0.0
                    }
                    _ => false,
                }
        }
        _ => false,
    })
}
