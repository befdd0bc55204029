//! Batch-1 decode steps replayed from a CUDA graph.
//!
//! The first eligible decode step runs eagerly: it sizes the per-thread scratch buffers and fills
//! candle's cache of uploaded kernel parameters (the shapes and strides of strided operands),
//! which the capture must find there. The second is captured into a graph and launched; later
//! steps replay that graph. A replay does on
//! the host only what a step must: advance each layer's cache by one token and plan each
//! layer's attention over its new view (the same planning the captured launches did), then
//! write the token id, the rotary tables and those plans into fixed device buffers and launch
//! the graph (see `kernels::cuda::graph`). The graph holds no cache address and no key count,
//! so it stays valid as caches grow, wrap or change; it holds the capturing thread's scratch
//! buffers, so only that thread replays it (other threads run eagerly), and only while those
//! buffers live: an eager launch that outgrows one (a long prefill, a batched step) replaces
//! it, and the next step captures again (`scratch::generation`).
//!
//! Eligible steps: one sequence, one new token, on CUDA with the fused kernels, every
//! KV-owning layer's cache dense in the activations' dtype (simple, rotating, or a batch of
//! one of those) or quantized and already packed with scales in that dtype (growing or ring,
//! or a batch of one; a quantized cache still below its `start` runs eagerly until the update
//! that packs it). Quantized layers write K/V to a fresh buffer and quantize it into the
//! slots their parameter block names. `CANDLE_GEMMA_CUDA_GRAPH=0` turns graphs off. A
//! capture that fails (an op that reads back to the host, such as MoE routing on the sorted
//! path, or an upload candle has not cached) turns them off for the model, rolls the caches
//! back and runs the step eagerly; the reason is in [`TextModel::cuda_graph_state`].

use std::sync::{Mutex, TryLockError};
use std::thread::ThreadId;

use candle_core::cuda_backend::cudarc::driver::{CudaGraph, CudaSlice, DevicePtr};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};

use super::model::TextModel;
use super::step::Step;
use crate::config::{KvSource, LayerKind};
use crate::error::{Error, Result};
use crate::kernels::cuda::batched::{address, step_descriptor};
use crate::kernels::cuda::fused::kv_destination;
use crate::kernels::cuda::graph::{self, Slot, StepParams};
use crate::kernels::cuda::launch::kvq_destination;
use crate::kernels::cuda::scratch;
use crate::kernels::QueryPlan;
use crate::kv::{KvView, ModelCache};

/// Bytes of the parameter area: two blocks a layer (a `QsdpaSeq` is 192 bytes), ample for
/// every Gemma 4 depth.
const PARAM_BYTES: usize = 64 * 1024;

/// Eager decode steps before the capture (the first sizes the scratch buffers).
const EAGER_STEPS: usize = 1;

/// A model's decode graph, shared by its clones.
#[derive(Default)]
pub(crate) struct DecodeGraphs {
    state: Mutex<State>,
}

impl std::fmt::Debug for DecodeGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DecodeGraphs({})", self.describe())
    }
}

enum State {
    /// Eligible steps run so far without a graph.
    Cold {
        eager_steps: usize,
    },
    Ready(Box<Captured>),
    /// Why graphs are off for this model.
    Off(String),
}

impl Default for State {
    fn default() -> Self {
        State::Cold { eager_steps: 0 }
    }
}

/// A captured step and the fixed buffers it reads.
struct Captured {
    graph: CudaGraph,
    thread: ThreadId,
    /// What each parameter block feeds, as recorded at capture.
    slots: Vec<Slot>,
    /// The parameter area, `PARAM_BYTES` bytes, and its device address.
    _params: CudaSlice<u8>,
    params_at: u64,
    /// Token id `[1, 1]` u32.
    ids_at: u64,
    /// Rotary tables (sliding, full), `[2, 1, 1, head_dim / 2]` each.
    rope_at: [u64; 2],
    /// The step's logits `[1, vocab]` f32, written by the graph.
    out: Tensor,
    /// Kept alive for the graph.
    _inputs: (Tensor, Tensor, Tensor),
    /// The device the graph runs on (to wait for its last replay before it is destroyed).
    dev: CudaDevice,
    /// The capturing thread's scratch generation (`scratch::generation`) the graph's
    /// addresses belong to.
    scratch_generation: u64,
}

impl Drop for Captured {
    fn drop(&mut self) {
        // The graph and its memory go only once its last replay has finished (a failed wait
        // has no one to report to).
        let _ = self.dev.cuda_stream().synchronize();
    }
}

// SAFETY: the graph's handles may be used from any thread once the context is bound (every
// launch binds it); the state is only touched under the mutex.
unsafe impl Send for Captured {}

// Models are shared across threads.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<DecodeGraphs>();
    shared::<TextModel>();
};

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CANDLE_GEMMA_CUDA_GRAPH").map_or(true, |v| v != "0"))
}

fn cuda_device(device: &Device) -> Option<&CudaDevice> {
    match device {
        Device::Cuda(d) => Some(d),
        _ => None,
    }
}

impl DecodeGraphs {
    /// One line: whether steps replay a graph, and if not, why.
    pub(crate) fn describe(&self) -> String {
        match self.state.try_lock() {
            Ok(s) => match &*s {
                State::Cold { eager_steps } => {
                    format!("not captured yet ({eager_steps} eligible steps run)")
                }
                State::Ready(c) => format!("captured ({} parameter blocks)", c.slots.len()),
                State::Off(why) => format!("off: {why}"),
            },
            Err(_) => "in use".to_string(),
        }
    }

    /// Runs a decode step through the graph when it is eligible (see the module docs) and
    /// returns its logits; `None` when the caller must run it eagerly.
    ///
    /// # Errors
    /// CUDA and cache errors of a replay (the cache is then rolled back to before the step).
    pub(crate) fn decode(
        &self,
        model: &TextModel,
        batch: &[Vec<u32>],
        cache: &mut ModelCache,
    ) -> Result<Option<Tensor>> {
        let id = match batch {
            [seq] if seq.len() == 1 => seq[0],
            _ => return Ok(None),
        };
        let Some(dev) = cuda_device(model.device()) else {
            return Ok(None);
        };
        if !enabled() || !eligible(model, cache) {
            return Ok(None);
        }
        let mut state = match self.state.try_lock() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        match &mut *state {
            State::Off(_) => Ok(None),
            State::Cold { eager_steps } if *eager_steps < EAGER_STEPS => {
                *eager_steps += 1;
                // candle uploads the shapes and strides of strided operands for its kernels;
                // a capture must find each of them in candle's upload cache (a captured upload
                // would read freed host memory at replay), so this step fills the cache.
                let _uploads = dev.enable_cuda_graph_htod_cache();
                Ok(Some(model.run_eager(batch, cache.offsets(), cache)?))
            }
            State::Cold { .. } => match capture(model, dev, id, cache)? {
                Ok((captured, logits)) => {
                    *state = State::Ready(Box::new(captured));
                    Ok(Some(logits))
                }
                Err(why) => {
                    *state = State::Off(why);
                    Ok(None)
                }
            },
            State::Ready(c) if c.thread != std::thread::current().id() => Ok(None),
            State::Ready(c) => match replay(model, dev, c, id, cache)? {
                Replayed::Logits(logits) => Ok(Some(logits)),
                Replayed::NotThisStep => Ok(None),
                Replayed::Outgrown => {
                    // Capture again at the next step (this one runs eagerly).
                    *state = State::Cold {
                        eager_steps: EAGER_STEPS,
                    };
                    Ok(None)
                }
            },
        }
    }
}

/// Whether `cache` suits a captured step of `model` (the host-side conditions; the capture
/// checks the rest).
fn eligible(model: &TextModel, cache: &ModelCache) -> bool {
    let dtype = model.dtype();
    matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
        && crate::kernels::fused_enabled(model.device())
        && cache.layers.len() == model.config().layers.len()
        && model
            .config()
            .layers
            .iter()
            .zip(&cache.layers)
            .all(|(plan, c)| match (&plan.kv, c) {
                (KvSource::Own, Some(c)) => {
                    c.dense_dtype() == Some(dtype) || c.packed_dtype() == Some(dtype)
                }
                (KvSource::Shared { .. }, None) => true,
                _ => false,
            })
}

/// The sliding window of a layer kind, as attention applies it.
fn window_of(model: &TextModel, kind: LayerKind) -> Option<usize> {
    match kind {
        LayerKind::Sliding => Some(model.config().sliding_window),
        LayerKind::Full => None,
    }
}

/// Advances every KV-owning layer's cache by one token and records, in launch order, the
/// parameter blocks the captured launches read: where each such layer writes its K and V, and
/// each layer's attention over its view. `Ok(false)`: a cache cannot take this step in place
/// (the caller rolls back and runs it eagerly).
fn record_step(
    model: &TextModel,
    dev: &CudaDevice,
    cache: &mut ModelCache,
    pos: usize,
    rec: &mut StepParams,
) -> Result<bool> {
    let config = model.config();
    let mut views: Vec<Option<KvView>> = vec![None; config.layers.len()];
    for (i, plan) in config.layers.iter().enumerate() {
        let view = match plan.kv {
            KvSource::Own => {
                let c = cache.layers[i].as_mut().ok_or_else(|| {
                    Error::Input(format!(
                        "layer {i} owns K/V but the cache has no entry for it"
                    ))
                })?;
                if let Some((kd, vd)) = c.reserve_slots(1, model.device())? {
                    rec.push(Slot::KvDestination, &kv_destination(&kd, &vd)?)?;
                } else if let Some(parts) = c.reserve_packed_slots(1, model.device())? {
                    let Some((dst, slot)) = kvq_destination(&parts, plan.head_dim, model.dtype())?
                    else {
                        return Ok(false);
                    };
                    rec.push(slot, &dst)?;
                } else {
                    return Ok(false);
                }
                c.commit_slots(1)?
            }
            KvSource::Shared { producer } => views[producer].clone().ok_or_else(|| {
                Error::Input(format!(
                    "layer {i} reads layer {producer}'s K/V, which was not produced"
                ))
            })?,
        };
        let query = QueryPlan {
            q_offset: pos,
            window: window_of(model, plan.kind),
            scale: 1.0,
        };
        let Ok((desc, bits)) = step_descriptor(
            config.num_attention_heads,
            plan.head_dim,
            model.dtype(),
            &view,
            &query,
            dev,
        ) else {
            return Ok(false);
        };
        rec.push(
            Slot::Attention {
                splits: desc.p.n_split,
                bits: bits as u32,
            },
            &desc,
        )?;
        if model.producers[i] {
            views[i] = Some(view);
        }
    }
    Ok(true)
}

/// Captures this step (token `id`) into a graph and launches it. The outer error is a failure
/// of the step itself; the inner one says why no graph could be made (the cache is then as
/// before and the caller runs the step eagerly).
fn capture(
    model: &TextModel,
    dev: &CudaDevice,
    id: u32,
    cache: &mut ModelCache,
) -> Result<std::result::Result<(Captured, Tensor), String>> {
    let device = model.device();
    let dtype = model.dtype();
    // Storage for this token in every layer now: memory allocated during the capture belongs
    // to the graph and must not outlive it inside a cache.
    for (l, c) in cache.layers.iter_mut().enumerate() {
        if let Some(c) = c {
            if c.reserve_slots(1, device)?.is_none() && c.reserve_packed_slots(1, device)?.is_none()
            {
                return Ok(Err(format!(
                    "layer {l}'s cache cannot write a token in place"
                )));
            }
        }
    }
    let Some(marks) = cache.marks() else {
        return Ok(Err("a cache kind without marks".to_string()));
    };
    let pos = cache.offsets().first().copied().unwrap_or(0);
    let ids = Tensor::from_vec(vec![id], (1, 1), device)?;
    let rope_s = model.rope_sliding.both(&[pos], 1, dtype, device)?;
    let rope_f = model.rope_full.both(&[pos], 1, dtype, device)?;
    let out = Tensor::zeros((1, model.config().vocab_size), DType::F32, device)?;
    let params = dev.alloc_zeros::<u8>(PARAM_BYTES)?;
    let params_at = params.device_ptr(&dev.cuda_stream()).0;
    let step = Step::from_both(vec![pos], 1, &rope_s, &rope_f)?;

    // Candle's uploads come from the cache the eager step filled (a miss fails the capture).
    // The fixed buffers above were made before, so none of them is a shared cache entry.
    let uploads = dev.enable_cuda_graph_htod_cache();
    graph::begin_capture(dev)?;
    let (ran, rec) = graph::with_recording(StepParams::new(params_at, PARAM_BYTES), || {
        let logits = model.run(&ids, step, cache)?;
        out.slice_set(&logits, 0, 0)?;
        Ok::<(), Error>(())
    });
    let ended = graph::end_capture(dev);
    drop(uploads);
    let graph = match (ran, ended) {
        (Ok(()), Ok(Some(g))) => g,
        (ran, ended) => {
            cache.restore(&marks);
            let why = match (ran, ended) {
                (Err(e), _) => format!("capture failed: {e}"),
                (_, Err(e)) => format!("capture failed: {e}"),
                _ => "nothing was captured".to_string(),
            };
            return Ok(Err(why));
        }
    };
    rec.upload(dev)?;
    graph.launch().map_err(candle_core::Error::wrap)?;
    let logits = out.copy()?;
    let captured = Captured {
        graph,
        thread: std::thread::current().id(),
        slots: rec.slots().to_vec(),
        _params: params,
        params_at,
        ids_at: address(&ids, dev)?,
        rope_at: [address(&rope_s, dev)?, address(&rope_f, dev)?],
        out,
        _inputs: (ids, rope_s, rope_f),
        dev: dev.clone(),
        scratch_generation: scratch::generation(),
    };
    Ok(Ok((captured, logits)))
}

/// What a replay did.
enum Replayed {
    Logits(Tensor),
    /// This step cannot take the graph (cache untouched): run it eagerly.
    NotThisStep,
    /// Some attention needs more key splits than the graph covers, the step's launches differ
    /// from the captured ones, or a scratch buffer the graph uses was replaced since the
    /// capture (cache untouched): capture again.
    Outgrown,
}

/// Replays the captured step for token `id`.
fn replay(
    model: &TextModel,
    dev: &CudaDevice,
    c: &Captured,
    id: u32,
    cache: &mut ModelCache,
) -> Result<Replayed> {
    // An eager launch since the capture (a longer prefill, a batch) replaced a scratch buffer
    // the graph writes: its old address is freed, so capture again.
    if scratch::generation() != c.scratch_generation {
        return Ok(Replayed::Outgrown);
    }
    let Some(marks) = cache.marks() else {
        return Ok(Replayed::NotThisStep);
    };
    let pos = cache.offsets().first().copied().unwrap_or(0);
    let mut rec = StepParams::new(c.params_at, PARAM_BYTES);
    let recorded = record_step(model, dev, cache, pos, &mut rec);
    let same_launches = rec.slots().len() == c.slots.len()
        && rec
            .slots()
            .iter()
            .zip(&c.slots)
            .all(|(a, b)| std::mem::discriminant(a) == std::mem::discriminant(b));
    let fits = same_launches && rec.slots().iter().zip(&c.slots).all(|(a, b)| a.fits(*b));
    match recorded {
        Ok(true) if fits => {}
        // More key splits than captured, or other launches (the model now decodes with a
        // cache of another kind or bits): capture again.
        Ok(true) => {
            cache.restore(&marks);
            return Ok(Replayed::Outgrown);
        }
        Ok(_) => {
            cache.restore(&marks);
            return Ok(Replayed::NotThisStep);
        }
        Err(e) => {
            cache.restore(&marks);
            return Err(e);
        }
    }
    let dtype = model.dtype();
    graph::upload_bytes(dev, c.ids_at, &id.to_le_bytes())?;
    for (rope, at) in [&model.rope_sliding, &model.rope_full]
        .into_iter()
        .zip(c.rope_at)
    {
        graph::upload_bytes(dev, at, &rope.both_bytes(&[pos], 1, dtype)?)?;
    }
    rec.upload(dev)?;
    c.graph.launch().map_err(candle_core::Error::wrap)?;
    Ok(Replayed::Logits(c.out.copy()?))
}
