//! Row reductions on CUDA (`reduce.cu`): the masked softmax of attention scores with the mask
//! built from key positions inside the kernel, the argmax of each row for greedy decoding, and
//! each row's tempered draw over the whole row.

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaView, DeviceRepr, LaunchConfig, PinnedHostSlice,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::device::{bind, by_dtype, check_dtype, cuda_dev, tn, u32_of, wrap};
use super::kernel_cache::{load_kernel, REDUCE};
use super::layer_ops::NORM_THREADS;
use crate::generate::sampling::DeviceDraw;
use crate::kernels::plan::{PositionCode, QsdpaParams};

/// `struct SoftmaxParams` in `reduce.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SoftmaxParams {
    rows: u32,
    keys: u32,
    q_len: u32,
    q_offset: u32,
    window: u32,
    pos_mode: u32,
    pos_base: u32,
    pos_split: u32,
    pos_base2: u32,
    scale: f32,
}

// SAFETY: `#[repr(C)]` plain integers and a float, read by the kernel with the same layout.
unsafe impl DeviceRepr for SoftmaxParams {}

/// Softmax over the last axis of attention scores `[.., rows, keys]` (row `r` is query
/// `r % q_len` of its head, at position `q_offset + r % q_len`) with the causal / sliding mask
/// built from `positions[j]` inside the kernel: no mask tensor, one pass in, one out, in the
/// scores' dtype. `scale` multiplies the scores first.
///
/// # Errors
/// Positions beyond `u32`, CUDA errors.
pub fn masked_softmax(
    scores: &Tensor,
    positions: &[usize],
    q_offset: usize,
    q_len: usize,
    window: Option<usize>,
    scale: f64,
) -> Result<Tensor> {
    let dtype = scores.dtype();
    check_dtype(&[scores], dtype)?;
    let keys = positions.len();
    let dims = scores.dims().to_vec();
    if dims.last() != Some(&keys) || q_len == 0 {
        candle_core::bail!("masked_softmax: scores {dims:?} for {keys} keys");
    }
    let rows = scores.elem_count() / keys.max(1);
    let code = PositionCode::encode(positions)
        .ok_or_else(|| candle_core::Error::Msg("key position beyond u32".into()))?;
    let mut qp = QsdpaParams::default();
    let table = code.apply(&mut qp).map(<[u32]>::to_vec);
    let params = SoftmaxParams {
        rows: u32_of(rows, "rows")?,
        keys: u32_of(keys, "keys")?,
        q_len: u32_of(q_len, "q_len")?,
        q_offset: u32_of(q_offset, "q_offset")?,
        window: u32_of(window.unwrap_or(0), "window")?,
        pos_mode: qp.pos_mode,
        pos_base: qp.pos_base,
        pos_split: qp.pos_split,
        pos_base2: qp.pos_base2,
        scale: scale as f32,
    };
    let dev = cuda_dev(scores)?;
    let scores = scores.contiguous()?;
    let table = match table {
        Some(t) => Some(dev.clone_htod(&t)?),
        None => None,
    };
    // Rows of up to 16 or 32 keys a thread stay in registers (one read of the scores).
    let variant = match keys.div_ceil(NORM_THREADS as usize) {
        0..=16 => "_r16",
        17..=32 => "_r32",
        _ => "",
    };
    let func = load_kernel(
        &dev,
        &format!("masked_softmax{variant}_{}", tn(dtype)?),
        &REDUCE,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (params.rows.max(1), 1, 1),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    by_dtype!(dtype, E, {
        // SAFETY: one block per row writes every key of its row.
        let mut out = unsafe { dev.alloc::<E>((rows * keys).max(1))? };
        if rows * keys > 0 {
            bind!(sv, scores, E);
            let mut b = func.builder();
            b.arg(&params);
            b.arg(&sv);
            match &table {
                Some(t) => b.arg(t),
                None => b.arg(&sv),
            };
            b.arg(&mut out);
            // SAFETY: arguments match the kernel's signature; the table, when read, has `keys`
            // entries.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(wrap(out, &dev, &dims))
    })
}

/// Columns of one block of the first argmax launch (`ARGMAX_CHUNK` in `reduce.cu`).
const ARGMAX_CHUNK: usize = 4096;
/// Threads of a block of the first argmax launch (`ARGMAX_THREADS` in `reduce.cu`).
const ARGMAX_THREADS: u32 = 256;

/// Index of the largest value of each row of f32 `[rows, cols]` (ties: lowest index), as u32
/// `[rows]`: greedy decoding without copying the logits to the host.
///
/// # Errors
/// Non-f32 input, CUDA errors.
pub fn argmax_rows(x: &Tensor) -> Result<Tensor> {
    RowPicks::new(x, "argmax_rows")?.run("argmax_chunks_f32", None)
}

/// Words of one row's draw parameters (`DRAW_WORDS` in `draw.cuh`): the temperature's bits,
/// the noise key's two words, the draw index's low and high words, then the filters of a draw
/// from the row's best logits ([`super::top_k::draw_from_best`]): the top-k (0 without
/// filters), the top-p's and the min-p's bits (NaN where that filter is off).
pub const DRAW_WORDS: usize = 8;

/// The [`DRAW_WORDS`] parameters of `draw`.
pub fn draw_words(draw: &DeviceDraw) -> [u32; DRAW_WORDS] {
    let (top_k, top_p, min_p) = match &draw.filter {
        Some(f) => (f.top_k as u32, f.top_p, f.min_p),
        None => (0, None, None),
    };
    [
        draw.temperature.to_bits(),
        draw.key[0],
        draw.key[1],
        draw.draw as u32,
        (draw.draw >> 32) as u32,
        top_k,
        top_p.unwrap_or(f32::NAN).to_bits(),
        min_p.unwrap_or(f32::NAN).to_bits(),
    ]
}

/// One tempered draw of each row of f32 logits `[rows, cols]`, as u32 ids `[rows]`: the
/// column with the largest `logit / t + gumbel(key, draw, column)` under its row's
/// [`DRAW_WORDS`] parameters (`crate::generate::noise`; the filter words are not read), the
/// lowest column among equal sums, NaN and -inf logits left out (id 0 where every one is). The
/// same float operations as the host's draw; only `logf` may differ from the host's by an ulp.
///
/// # Errors
/// Non-f32 input, a parameter count other than the rows, CUDA errors.
pub fn draw_rows(x: &Tensor, params: &[[u32; DRAW_WORDS]]) -> Result<Tensor> {
    let picks = RowPicks::new(x, "draw_rows")?;
    if params.len() != picks.rows as usize {
        candle_core::bail!("draw_rows: {} draws for {} rows", params.len(), picks.rows);
    }
    let words: Vec<u32> = params.iter().flatten().copied().collect();
    let words = Tensor::from_vec(words, params.len() * DRAW_WORDS, x.device())?;
    bind!(wv, words, u32);
    picks.run("draw_chunks_f32", Some(&wv))
}

/// `logits` (f32 `[rows, vocab]`) with each token whose bit is clear in its row of `bits` (u32
/// `[rows, words]`, bit `t % 32` of word `t / 32`) at -inf: a constrained step's mask, uploaded
/// as bits (a 32nd of a byte mask's bytes).
///
/// # Errors
/// Shapes or dtypes other than these, CUDA errors.
pub fn mask_by_bits(logits: &Tensor, bits: &Tensor) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let (bit_rows, words) = bits.dims2()?;
    if logits.dtype() != DType::F32
        || bits.dtype() != DType::U32
        || bit_rows != rows
        || words != vocab.div_ceil(32)
    {
        candle_core::bail!(
            "mask_by_bits: logits {:?} {:?}, bits {:?} {:?}",
            logits.dims(),
            logits.dtype(),
            bits.dims(),
            bits.dtype()
        );
    }
    let dev = cuda_dev(logits)?;
    let (logits, bits) = (logits.contiguous()?, bits.contiguous()?);
    let n = rows * vocab;
    // SAFETY: the grid-stride loop writes every element before any reader on this stream.
    let mut out = unsafe { dev.alloc::<f32>(n.max(1))? };
    bind!(lv, logits, f32);
    bind!(bv, bits, u32);
    let func = load_kernel(&dev, "mask_bits_f32", &REDUCE)?;
    let mut b = func.builder();
    b.arg(&lv);
    b.arg(&bv);
    let (r, v, w) = (
        u32_of(rows, "rows")?,
        u32_of(vocab, "vocab")?,
        u32_of(words, "words")?,
    );
    b.arg(&r);
    b.arg(&v);
    b.arg(&w);
    b.arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (u32_of(n.div_ceil(256).clamp(1, 4096), "blocks")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments match the kernel's signature; `bits` holds rows * words words.
    unsafe { b.launch(cfg) }.w()?;
    Ok(wrap(out, &dev, &[rows, vocab]))
}

/// What a pick of one column a row needs: the contiguous input, its sizes, each chunk's best
/// (value, column) scratch and the first launch's shape.
struct RowPicks {
    dev: candle_core::CudaDevice,
    x: Tensor,
    rows: u32,
    cols: u32,
    chunks: u32,
    best_v: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    best_i: candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    out: candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    first_launch: LaunchConfig,
}

impl RowPicks {
    fn new(x: &Tensor, what: &str) -> Result<Self> {
        let (rows, cols) = x.dims2()?;
        if x.dtype() != DType::F32 {
            candle_core::bail!("{what}: f32 expected, found {:?}", x.dtype());
        }
        let dev = cuda_dev(x)?;
        let chunks = cols.div_ceil(ARGMAX_CHUNK).max(1);
        // SAFETY: every (row, chunk) block of the first launch writes its pair before the
        // merge reads it; the empty output is only wrapped, never read.
        let best_v = unsafe { dev.alloc::<f32>((rows * chunks).max(1))? };
        let best_i = unsafe { dev.alloc::<u32>((rows * chunks).max(1))? };
        let out = unsafe { dev.alloc::<u32>(1)? };
        let (rows, chunks) = (u32_of(rows, "rows")?, u32_of(chunks, "column chunks")?);
        Ok(Self {
            x: x.contiguous()?,
            rows,
            cols: u32_of(cols, "columns")?,
            chunks,
            best_v,
            best_i,
            out,
            first_launch: LaunchConfig {
                grid_dim: (chunks, rows, 1),
                block_dim: (ARGMAX_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
            dev,
        })
    }
}

impl RowPicks {
    /// Runs the first launch `kernel` (arguments: the logits, the column count, then `params`
    /// where given, then the chunks' best values and columns), then the merge: each row's
    /// column as u32 `[rows]`.
    fn run(self, kernel: &str, params: Option<&CudaView<'_, u32>>) -> Result<Tensor> {
        if self.rows == 0 {
            return Ok(wrap(self.out, &self.dev, &[0]));
        }
        bind!(xv, self.x, f32);
        let func = load_kernel(&self.dev, kernel, &REDUCE)?;
        let mut b = func.builder();
        b.arg(&xv);
        b.arg(&self.cols);
        if let Some(p) = params {
            b.arg(p);
        }
        let (mut best_v, mut best_i) = (self.best_v, self.best_i);
        b.arg(&mut best_v);
        b.arg(&mut best_i);
        // SAFETY: arguments match the kernel's signature (the draw kernel's parameters hold
        // DRAW_WORDS words a row); the scratch holds rows * chunks pairs.
        unsafe { b.launch(self.first_launch) }.w()?;
        merge_picks(&self.dev, &best_v, &best_i, self.chunks, self.rows)
    }
}

/// Each row's best of its chunks' (value, column) pairs, as u32 `[rows]`.
fn merge_picks(
    dev: &candle_core::CudaDevice,
    best_v: &candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    best_i: &candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    chunks: u32,
    rows: u32,
) -> Result<Tensor> {
    // SAFETY: one warp a row writes its index before any reader on this stream.
    let mut out = unsafe { dev.alloc::<u32>(rows as usize)? };
    let func = load_kernel(dev, "argmax_merge_f32", &REDUCE)?;
    let mut b = func.builder();
    b.arg(best_v);
    b.arg(best_i);
    b.arg(&chunks);
    b.arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments match the kernel's signature; the scratch holds rows * chunks pairs.
    unsafe { b.launch(cfg) }.w()?;
    Ok(wrap(out, dev, &[rows as usize]))
}

/// Page-locked host slots that u32 ids are copied into on the device's stream, so the host
/// waits for the copy alone and not for the work queued after it.
#[derive(Debug, Default)]
pub(crate) struct IdSlots {
    /// Each slot, the event recorded right after its last copy (the slot's own event is
    /// recorded only where cudarc manages stream synchronization, which candle turns off), and
    /// whether a copy into it is pending.
    slots: Vec<(PinnedHostSlice<u32>, CudaEvent, bool)>,
}

impl Drop for IdSlots {
    fn drop(&mut self) {
        // A copy still in flight must land before its host memory is freed (no one to report
        // a failed wait to).
        for (_, copied, _) in &self.slots {
            let _ = copied.synchronize();
        }
    }
}

/// One copy in flight ([`IdSlots::start`]): its slot and the ids it carries.
#[derive(Debug)]
pub(crate) struct IdCopy {
    slot: usize,
    len: usize,
}

impl IdSlots {
    /// Starts copying `ids` (u32 on a CUDA device) to the host.
    ///
    /// # Errors
    /// Another dtype or device, CUDA errors.
    pub(crate) fn start(&mut self, ids: &Tensor) -> Result<IdCopy> {
        let dev = cuda_dev(ids)?;
        let ids = ids.contiguous()?;
        let len = ids.elem_count();
        let stream = dev.cuda_stream();
        // A copy fills its whole slot, so a slot holds exactly `len` ids: an idle slot of
        // another length (a batch that changed size) is replaced.
        let size = len.max(1);
        let free = self
            .slots
            .iter()
            .position(|(s, _, busy)| !busy && s.len() == size);
        let slot = match free {
            Some(i) => i,
            None => {
                let ctx = stream.context();
                // Plain page-locked memory (not write-combined): the host reads it.
                // SAFETY: the slot is read only after a copy filled its `len` ids.
                let host = unsafe { ctx.alloc_pinned_with_flags::<u32>(size, 0) }.w()?;
                // The host sleeps until the copy is done (it has a whole step to wait).
                let event = ctx
                    .new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
                    .w()?;
                match self.slots.iter().position(|(_, _, busy)| !busy) {
                    Some(i) => {
                        self.slots[i] = (host, event, false);
                        i
                    }
                    None => {
                        self.slots.push((host, event, false));
                        self.slots.len() - 1
                    }
                }
            }
        };
        let Some((host, copied, busy)) = self.slots.get_mut(slot) else {
            candle_core::bail!("no id slot {slot}");
        };
        if len > 0 {
            bind!(v, ids, u32);
            stream.memcpy_dtoh(&v, host).w()?;
        }
        copied.record(&stream).w()?;
        *busy = true;
        Ok(IdCopy { slot, len })
    }

    /// Waits for `copy` alone and returns its ids; its slot is kept for the next copy.
    ///
    /// # Errors
    /// CUDA errors; a copy these slots did not start.
    pub(crate) fn finish(&mut self, copy: IdCopy) -> Result<Vec<u32>> {
        let Some((host, copied, busy)) = self.slots.get_mut(copy.slot) else {
            candle_core::bail!("no id copy in slot {}", copy.slot);
        };
        copied.synchronize().w()?;
        *busy = false;
        match host.as_slice().w()?.get(..copy.len) {
            Some(ids) => Ok(ids.to_vec()),
            None => candle_core::bail!("slot {} holds fewer than {} ids", copy.slot, copy.len),
        }
    }
}
