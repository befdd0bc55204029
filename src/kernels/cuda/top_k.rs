//! Each row's k best logits for sampling (`top_k.cu`): a sampled decode step then copies k
//! (id, logit) pairs a row to the host instead of the whole vocabulary, or draws from them on
//! the device under the sampler's filters ([`draw_from_best`]); and each row's softmax mass.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Result, Tensor};

use super::device::{bind, cuda_dev, u32_of, wrap};
use super::kernel_cache::{load_kernel, TOP_K};

/// Most candidates a row (`TOPK_MAX` in `top_k.cu`).
pub const TOP_K_MAX: usize = 1024;
/// Threads of a block (`TOPK_THREADS`).
const THREADS: u32 = 1024;
/// Columns of a block of the first launch for rows longer than this: a block a chunk picks
/// the chunk's best, then one a row picks the best of those (one block for a whole row of
/// Gemma 4's vocabulary was bound by one multiprocessor).
const CHUNK: usize = 8192;

/// The `k` best columns of each row of f32 `logits` `[rows, cols]` under the host sampler's
/// order: the key `logit / temps[row]` (IEEE division), largest first, the lowest column first
/// among equal keys, NaN counted as -inf. Returns the raw logits `[rows, k']` (f32) and their
/// columns `[rows, k']` (u32), each row in that order, with `k' = min(k, cols)`.
///
/// # Errors
/// Non-f32 logits, `k` of 0 or above [`TOP_K_MAX`], a temperature count other than the rows,
/// CUDA errors.
pub fn top_k_rows(logits: &Tensor, temps: &[f32], k: usize) -> Result<(Tensor, Tensor)> {
    let (rows, cols) = logits.dims2()?;
    if logits.dtype() != DType::F32 {
        candle_core::bail!(
            "top_k_rows: f32 logits expected, found {:?}",
            logits.dtype()
        );
    }
    if k == 0 || k > TOP_K_MAX || temps.len() != rows {
        candle_core::bail!(
            "top_k_rows: k {k} (1..={TOP_K_MAX}) with {} temperatures for {rows} rows",
            temps.len()
        );
    }
    let dev = cuda_dev(logits)?;
    let logits = logits.contiguous()?;
    let kept = k.min(cols);
    let (cols32, k32, rows32) = (
        u32_of(cols, "columns")?,
        u32_of(kept, "candidates")?,
        u32_of(rows, "rows")?,
    );
    let temps = Tensor::from_slice(temps, rows, logits.device())?;
    // SAFETY: the kernel writes `kept` pairs of every row before any reader on this stream
    // (rows with no columns have none to write, and `kept` is then 0).
    let mut values = unsafe { dev.alloc::<f32>((rows * kept).max(1))? };
    let mut ids = unsafe { dev.alloc::<u32>((rows * kept).max(1))? };
    if rows > 0 && kept > 0 {
        bind!(xv, logits, f32);
        bind!(tv, temps, f32);
        let block = |grid: (u32, u32)| LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        if cols <= CHUNK {
            let func = load_kernel(&dev, "top_k_rows_f32", &TOP_K)?;
            let mut b = func.builder();
            b.arg(&xv);
            b.arg(&cols32);
            b.arg(&tv);
            b.arg(&k32);
            b.arg(&mut values);
            b.arg(&mut ids);
            // SAFETY: arguments match the kernel's signature; each output holds `rows * kept`
            // elements and `kept` is at most TOPK_MAX.
            unsafe { b.launch(block((rows32, 1))) }.w()?;
        } else {
            let chunks = cols.div_ceil(CHUNK);
            let chunks32 = u32_of(chunks, "column chunks")?;
            let chunk32 = u32_of(CHUNK, "chunk")?;
            // SAFETY: every (chunk, row) block writes its `kept` slots before the merge reads
            // them on this stream.
            let mut listed = unsafe { dev.alloc::<u32>(rows * chunks * kept)? };
            let func = load_kernel(&dev, "top_k_chunks_f32", &TOP_K)?;
            let mut b = func.builder();
            b.arg(&xv);
            b.arg(&cols32);
            b.arg(&tv);
            b.arg(&k32);
            b.arg(&chunk32);
            b.arg(&mut listed);
            // SAFETY: arguments match the kernel's signature; `listed` holds `kept` ids for
            // every (row, chunk), and each chunk has at least one column.
            unsafe { b.launch(block((chunks32, rows32))) }.w()?;
            let func = load_kernel(&dev, "top_k_merge_f32", &TOP_K)?;
            let mut b = func.builder();
            b.arg(&xv);
            b.arg(&cols32);
            b.arg(&tv);
            b.arg(&k32);
            b.arg(&chunks32);
            b.arg(&listed);
            b.arg(&mut values);
            b.arg(&mut ids);
            // SAFETY: as above; each output holds `rows * kept` elements.
            unsafe { b.launch(block((rows32, 1))) }.w()?;
        }
    }
    Ok((
        wrap(values, &dev, &[rows, kept]),
        wrap(ids, &dev, &[rows, kept]),
    ))
}

/// One tempered draw of each row from its best logits ([`top_k_rows`]' output: `values` f32
/// and `ids` u32, `[rows, k]`, each row in the sampler's order) under the row's
/// [`super::reduce::DRAW_WORDS`] parameters, as u32 ids `[rows]`: the pool is the row's first
/// `min(k, top-k)` pairs whose logit is neither NaN nor -inf, keyed `logit / t`; the top-p and
/// min-p filters cut it as the host sampler does, and the Gumbel-max draw picks among the
/// pairs kept (id 0 for an empty pool). The host sampler's operations on those pairs, in its
/// order; only `exp` and `logf` may differ from the host's by an ulp.
///
/// # Errors
/// Other dtypes or shapes, `k` above [`TOP_K_MAX`], a parameter count other than the rows,
/// CUDA errors.
pub fn draw_from_best(
    values: &Tensor,
    ids: &Tensor,
    params: &[[u32; super::reduce::DRAW_WORDS]],
) -> Result<Tensor> {
    let (rows, k) = values.dims2()?;
    if values.dtype() != DType::F32 || ids.dtype() != DType::U32 || ids.dims2()? != (rows, k) {
        candle_core::bail!(
            "draw_from_best: f32 values and u32 ids of one shape expected, found {:?} {:?} and {:?} {:?}",
            values.dtype(),
            values.dims(),
            ids.dtype(),
            ids.dims()
        );
    }
    if k > TOP_K_MAX || params.len() != rows {
        candle_core::bail!(
            "draw_from_best: {k} candidates (at most {TOP_K_MAX}) and {} draws for {rows} rows",
            params.len()
        );
    }
    let dev = cuda_dev(values)?;
    // SAFETY: one block a row writes its id before any reader on this stream.
    let mut out = unsafe { dev.alloc::<u32>(rows.max(1))? };
    if rows > 0 {
        let (values, ids) = (values.contiguous()?, ids.contiguous()?);
        let words: Vec<u32> = params.iter().flatten().copied().collect();
        let words = Tensor::from_vec(
            words,
            params.len() * super::reduce::DRAW_WORDS,
            values.device(),
        )?;
        bind!(vv, values, f32);
        bind!(iv, ids, u32);
        bind!(wv, words, u32);
        let k32 = u32_of(k, "candidates")?;
        let func = load_kernel(&dev, "draw_best_f32", &TOP_K)?;
        let mut b = func.builder();
        b.arg(&vv);
        b.arg(&iv);
        b.arg(&k32);
        b.arg(&wv);
        b.arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(rows, "rows")?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; a thread a candidate (k is at most
        // the block's threads) and DRAW_WORDS words a row.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(wrap(out, &dev, &[rows]))
}

/// Columns of a block of the mass launches (`MASS_CHUNK` in `top_k.cu`).
const MASS_CHUNK: usize = 4096;
/// Threads of a block of the mass launches (`MASS_THREADS`).
const MASS_THREADS: u32 = 256;

/// Each row's softmax mass under the sampler's key, in chunks: f64 `[rows, chunks]` whose
/// row sums are `sum(exp((logit / temps[row] - M) as f64))` over the row's logits (NaN and -inf
/// left out), `M` the row's largest key, the f32 difference then the f64 exponential, as the
/// host sampler computes its softmax. Every temperature must be above 0.
///
/// # Errors
/// Non-f32 logits, a temperature count other than the rows, a temperature not above 0, CUDA
/// errors.
pub fn key_mass_chunks(logits: &Tensor, temps: &[f32]) -> Result<Tensor> {
    let (rows, cols) = logits.dims2()?;
    if logits.dtype() != DType::F32 {
        candle_core::bail!(
            "key_mass_chunks: f32 logits expected, found {:?}",
            logits.dtype()
        );
    }
    if temps.len() != rows
        || temps
            .iter()
            .any(|t| t.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater))
    {
        candle_core::bail!(
            "key_mass_chunks: {} temperatures (each above 0) for {rows} rows",
            temps.len()
        );
    }
    let dev = cuda_dev(logits)?;
    let logits = logits.contiguous()?;
    let chunks = cols.div_ceil(MASS_CHUNK).max(1);
    let (cols32, rows32, chunks32) = (
        u32_of(cols, "columns")?,
        u32_of(rows, "rows")?,
        u32_of(chunks, "column chunks")?,
    );
    // SAFETY: every (chunk, row) block writes its slot of each buffer before any reader.
    let mut maxima = unsafe { dev.alloc::<f32>((rows * chunks).max(1))? };
    let mut sums = unsafe { dev.alloc::<f64>((rows * chunks).max(1))? };
    if rows > 0 {
        let temps = Tensor::from_slice(temps, rows, logits.device())?;
        bind!(xv, logits, f32);
        bind!(tv, temps, f32);
        let cfg = LaunchConfig {
            grid_dim: (chunks32, rows32, 1),
            block_dim: (MASS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let func = load_kernel(&dev, "key_max_chunks_f32", &TOP_K)?;
        let mut b = func.builder();
        b.arg(&xv);
        b.arg(&cols32);
        b.arg(&tv);
        b.arg(&mut maxima);
        // SAFETY: arguments match the kernel's signature; `maxima` holds rows * chunks floats.
        unsafe { b.launch(cfg) }.w()?;
        let func = load_kernel(&dev, "key_mass_chunks_f32", &TOP_K)?;
        let mut b = func.builder();
        b.arg(&xv);
        b.arg(&cols32);
        b.arg(&tv);
        b.arg(&maxima);
        b.arg(&mut sums);
        // SAFETY: as above; `sums` holds rows * chunks doubles.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(wrap(sums, &dev, &[rows, chunks]))
}
