//! CUDA graphs for decode steps (one sequence or a batch): the host side.
//!
//! A decode step of a small model is a few hundred short kernels, and enqueueing them costs more
//! host time than the GPU spends running them. A captured graph enqueues them all with one call.
//! A graph replays its launches with the arguments they had at capture, so the arguments that
//! change from step to step (where K and V are written, how many keys attention reads, where the
//! query sits) are not kernel arguments on this path: the launches read them from a parameter
//! area in device memory, which the host rewrites before each replay. Everything else a step
//! reads (token id, rotary tables) sits in fixed buffers that are rewritten the same way.
//!
//! While a thread records, [`record`] appends one parameter block and returns the device address
//! the kernel will read it from. The capture and each replay record the same blocks in the same
//! order; [`StepParams::slots`] lets the caller check that.

use std::cell::RefCell;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaGraph};
use candle_core::cuda_backend::{CudaDevice, WrapErr};

/// What a parameter block feeds, recorded with it so a replay can be checked against the
/// capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Where each of `seqs` sequences' new K and V go (`QkvDst` each): written by the fused
    /// projection for one sequence, by the scatter for a batch.
    KvDestination { seqs: u32 },
    /// Where each of `seqs` sequences' new K and V are quantized to (`KvqDst` each), with the
    /// bits and group size the captured launch quantizes to.
    KvQuantDestination {
        bits: u32,
        group_size: u32,
        seqs: u32,
    },
    /// One attention launch's sequence descriptors (`QsdpaSeq`, one per sequence), with their
    /// key splits (at capture, the most the launch covers; at a replay, the most any sequence
    /// needs), the bits of the K/V its kernel reads (4/8 packed, 16/32 dense) and the kernel
    /// it launches ([`kernel_code`]).
    Attention {
        seqs: u32,
        splits: u32,
        bits: u32,
        kernel: u32,
    },
}

/// A number naming an attention kernel choice (query rows a block, tensor cores, shared-memory
/// stages, value folding), so a replay whose planning would pick another kernel than the
/// captured launch is caught.
pub(crate) fn kernel_code(nq: usize, tensor_cores: bool, stages: usize, fold: bool) -> u32 {
    (nq as u32) << 8 | (stages as u32) << 2 | u32::from(tensor_cores) << 1 | u32::from(fold)
}

impl Slot {
    /// Whether a replay's block fits the captured launch that reads it.
    pub(crate) fn fits(self, captured: Slot) -> bool {
        match (self, captured) {
            (Slot::KvDestination { .. }, Slot::KvDestination { .. })
            | (Slot::KvQuantDestination { .. }, Slot::KvQuantDestination { .. }) => {
                self == captured
            }
            (
                Slot::Attention {
                    seqs,
                    splits,
                    bits,
                    kernel,
                },
                Slot::Attention {
                    seqs: captured_seqs,
                    splits: most,
                    bits: captured_bits,
                    kernel: captured_kernel,
                },
            ) => {
                seqs == captured_seqs
                    && splits <= most
                    && bits == captured_bits
                    && kernel == captured_kernel
            }
            _ => false,
        }
    }
}

/// Key splits a captured attention launch covers when the step it captures needs `n_split`:
/// twice that (at least 8), at most `bound` (what the shape can ever take). Each split block
/// past a step's own returns at once but still costs a launch slot, so the graph covers a
/// margin rather than every split, and is captured again when a step outgrows it (keys
/// double between captures).
pub(crate) fn covered_splits(n_split: usize, bound: usize) -> usize {
    (2 * n_split).max(8).min(bound).max(n_split)
}

/// Alignment of each block (the widest field of the kernels' structs is 8 bytes).
const BLOCK_ALIGN: usize = 16;

/// The parameter blocks of one step, in launch order, laid out as they go to the device.
#[derive(Debug)]
pub(crate) struct StepParams {
    bytes: Vec<u8>,
    slots: Vec<Slot>,
    /// Device address of the parameter area.
    base: u64,
    /// Bytes the area holds.
    capacity: usize,
}

impl StepParams {
    /// An empty record for an area of `capacity` bytes at device address `base`.
    pub(crate) fn new(base: u64, capacity: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(capacity.min(1 << 16)),
            slots: Vec::new(),
            base,
            capacity,
        }
    }

    /// What each block feeds, in order.
    pub(crate) fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Appends `value`'s bytes and returns the device address it will be read from.
    ///
    /// # Errors
    /// The area is full.
    pub(crate) fn push<T: Copy>(&mut self, slot: Slot, value: &T) -> candle_core::Result<u64> {
        self.push_slice(slot, std::slice::from_ref(value))
    }

    /// Appends the bytes of `values`, one block read as an array, and returns the device
    /// address of its first element.
    ///
    /// # Errors
    /// The area is full.
    pub(crate) fn push_slice<T: Copy>(
        &mut self,
        slot: Slot,
        values: &[T],
    ) -> candle_core::Result<u64> {
        let at = self.bytes.len().div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN;
        let size = std::mem::size_of_val(values);
        if at + size > self.capacity {
            candle_core::bail!(
                "CUDA graph parameter area full: {} bytes, a block of {size} more needed",
                self.capacity
            );
        }
        self.bytes.resize(at, 0);
        // SAFETY: `T` is a `#[repr(C)]` struct of integers and floats (the kernels' parameter
        // blocks); its bytes are read as they are.
        let raw = unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size) };
        self.bytes.extend_from_slice(raw);
        self.slots.push(slot);
        Ok(self.base + at as u64)
    }

    /// Copies the blocks into the device area (ordered on `dev`'s stream).
    ///
    /// # Errors
    /// CUDA errors.
    pub(crate) fn upload(&self, dev: &CudaDevice) -> candle_core::Result<()> {
        upload_bytes(dev, self.base, &self.bytes)
    }
}

thread_local! {
    static RECORDING: RefCell<Option<StepParams>> = const { RefCell::new(None) };
}

/// Whether this thread is recording a step's parameter blocks (a capture is under way).
pub(crate) fn recording() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

/// While recording: appends `value` as the next block and returns its device address; `None`
/// when this thread is not recording.
///
/// # Errors
/// The area is full.
pub(crate) fn record<T: Copy>(slot: Slot, value: &T) -> candle_core::Result<Option<u64>> {
    RECORDING.with(|r| match r.borrow_mut().as_mut() {
        Some(p) => p.push(slot, value).map(Some),
        None => Ok(None),
    })
}

/// While recording: appends `values` as the next block (an array) and returns the device
/// address of its first element; `None` when this thread is not recording.
///
/// # Errors
/// The area is full.
pub(crate) fn record_slice<T: Copy>(slot: Slot, values: &[T]) -> candle_core::Result<Option<u64>> {
    RECORDING.with(|r| match r.borrow_mut().as_mut() {
        Some(p) => p.push_slice(slot, values).map(Some),
        None => Ok(None),
    })
}

/// Runs `f` with this thread recording into `params`; returns `f`'s result and the record.
pub(crate) fn with_recording<R>(params: StepParams, f: impl FnOnce() -> R) -> (R, StepParams) {
    let previous = RECORDING.with(|r| r.borrow_mut().replace(params));
    let out = f();
    let params = RECORDING.with(|r| std::mem::replace(&mut *r.borrow_mut(), previous));
    // `f` cannot remove the record (only this function installs and takes it).
    (out, params.unwrap_or_else(|| StepParams::new(0, 0)))
}

/// Copies `bytes` to device address `dst` on `dev`'s stream.
///
/// # Errors
/// CUDA errors.
pub(crate) fn upload_bytes(dev: &CudaDevice, dst: u64, bytes: &[u8]) -> candle_core::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    // SAFETY: `dst` is the address of a live device buffer of at least `bytes.len()` bytes (the
    // caller's buffers); the host bytes are staged by the driver before the call returns.
    unsafe { result::memcpy_htod_async(dst, bytes, stream.cu_stream()) }.w()
}

/// Copies `bytes` bytes from device address `src` to `dst` on `dev`'s stream.
///
/// # Errors
/// CUDA errors.
pub(crate) fn copy_device(
    dev: &CudaDevice,
    dst: u64,
    src: u64,
    bytes: usize,
) -> candle_core::Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    // SAFETY: `dst` and `src` are addresses of live device buffers of at least `bytes` bytes
    // (the caller's), ordered on this stream after their writers.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }.w()
}

/// Starts capturing `dev`'s stream into a graph (relaxed mode: other threads are unaffected).
///
/// # Errors
/// CUDA errors (the stream is already capturing, ...).
pub(crate) fn begin_capture(dev: &CudaDevice) -> candle_core::Result<()> {
    dev.cuda_stream()
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .w()
}

/// Ends the capture begun by [`begin_capture`] and instantiates the graph; `None` when nothing
/// was captured.
///
/// # Errors
/// CUDA errors, including a capture invalidated by an operation graphs cannot hold.
pub(crate) fn end_capture(dev: &CudaDevice) -> candle_core::Result<Option<CudaGraph>> {
    dev.cuda_stream()
        .end_capture(sys::CUgraphInstantiate_flags_enum(0))
        .w()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_of_one_is_laid_out_as_the_value_and_slots_fit_only_their_capture() {
        #[derive(Clone, Copy)]
        #[repr(C)]
        struct Block {
            a: u64,
            b: u32,
            c: u32,
        }
        let block = Block { a: 7, b: 8, c: 9 };
        let mut one = StepParams::new(1 << 20, 64);
        let mut slice = StepParams::new(1 << 20, 64);
        let kv = Slot::KvDestination { seqs: 1 };
        assert_eq!(one.push(kv, &block).unwrap(), 1 << 20);
        assert_eq!(slice.push_slice(kv, &[block]).unwrap(), 1 << 20);
        assert_eq!(one.bytes, slice.bytes);
        // Blocks start 16-byte aligned; the area's end is enforced.
        assert_eq!(one.push(kv, &1u32).unwrap(), (1 << 20) + 16);
        assert!(one.push_slice(kv, &[block; 3]).is_err());

        let quant = |bits, seqs| Slot::KvQuantDestination {
            bits,
            group_size: 32,
            seqs,
        };
        assert!(quant(4, 8).fits(quant(4, 8)));
        assert!(!quant(4, 8).fits(quant(8, 8)));
        assert!(!quant(4, 7).fits(quant(4, 8)));
        assert!(!Slot::KvDestination { seqs: 2 }.fits(Slot::KvDestination { seqs: 3 }));
        assert!(!Slot::KvDestination { seqs: 1 }.fits(quant(4, 1)));
        let attention = |splits, kernel| Slot::Attention {
            seqs: 4,
            splits,
            bits: 16,
            kernel,
        };
        // A capture for 3 splits covers at least 8 (twice the need, at least 8).
        let covered = covered_splits(3, 64) as u32;
        assert_eq!(covered, 8);
        let captured = attention(covered, 1);
        assert!(attention(3, 1).fits(captured));
        assert!(attention(8, 1).fits(captured));
        assert!(!attention(9, 1).fits(captured));
        assert!(!attention(3, 2).fits(captured));
    }
}
