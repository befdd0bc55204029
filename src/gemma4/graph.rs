//! Batch-1 decode steps replayed from a captured graph (CUDA graphs, through
//! [`crate::kernels::ops::graph`]; elsewhere every step runs eagerly).
//!
//! The first eligible decode step runs eagerly: it sizes the per-thread scratch buffers and fills
//! candle's cache of uploaded kernel parameters (the shapes and strides of strided operands),
//! which the capture must find there. The second is captured into a graph and launched; later
//! steps replay that graph. A replay does on the host only what a step must: advance each
//! layer's cache by one token and plan each layer's attention over its new view (the same
//! planning the captured launches did), then write the token id, the rotary tables and those
//! plans into fixed device buffers and launch the graph. The graph holds no cache address and no key count,
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
//! slots their parameter block names. [`crate::kernels::policy::LaunchPolicy::cuda_graph`]
//! turns graphs off. A capture that fails (an op that reads back to the host, such as MoE
//! routing on the sorted path, or an upload candle has not cached) turns them off for the
//! model, rolls the caches back and runs the step eagerly; the reason is in
//! [`TextModel::cuda_graph_state`].

use std::sync::{Mutex, TryLockError};
use std::thread::ThreadId;

use candle_core::{DType, Tensor};

use super::model::TextModel;
use super::routing::KvRouting;
use super::step::Step;
use super::KvInput;
use crate::config::{KvSource, LayerKind};
use crate::error::Result;
use crate::kernels::ops::graph::{self, DecodeGraph, StepRecord};
use crate::kernels::QueryPlan;
use crate::kv::ModelCache;

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

/// A captured step and the buffer its logits land in.
struct Captured {
    /// The graph; its inputs are the token id `[1, 1]` u32 and the rotary tables (sliding,
    /// full) `[2, 1, 1, head_dim / 2]`, in that order.
    graph: DecodeGraph,
    thread: ThreadId,
    /// The step's logits `[1, vocab]` f32, written by the graph.
    out: Tensor,
}

// Models are shared across threads.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<DecodeGraphs>();
    shared::<TextModel>();
};

impl DecodeGraphs {
    /// Graphs off for the model, for `why` (a tensor-parallel rank: its all-reduces are not
    /// captured, and a capture failing on one rank alone would leave its peers waiting).
    pub(crate) fn off(why: &str) -> Self {
        Self {
            state: Mutex::new(State::Off(why.to_string())),
        }
    }

    /// One line: whether steps replay a graph, and if not, why.
    pub(crate) fn describe(&self) -> String {
        if let Some(why) = graph::unsupported() {
            return format!("off: {why}");
        }
        match self.state.try_lock() {
            Ok(s) => match &*s {
                State::Cold { eager_steps } => {
                    format!("not captured yet ({eager_steps} eligible steps run)")
                }
                State::Ready(c) => format!("captured ({} parameter blocks)", c.graph.blocks()),
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
        if !graph::available(model.device()) || !eligible(model, cache) {
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
                // A capture must find candle's uploads of shapes and strides in its upload
                // cache, so this step fills the cache.
                let offsets = cache.offsets();
                let logits = graph::with_cached_uploads(model.device(), || {
                    model.run_eager(batch, offsets, cache)
                })?;
                Ok(Some(logits))
            }
            State::Cold { .. } => match capture(model, id, cache)? {
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
            State::Ready(c) => match replay(model, c, id, cache)? {
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
        && crate::kernels::ops::fused(model.device())
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
    cache: &mut ModelCache,
    pos: usize,
    rec: &mut StepRecord,
) -> Result<bool> {
    let config = model.config();
    let (device, dtype) = (model.device(), model.dtype());
    let mut routing = KvRouting::new(&model.producers);
    for (i, plan) in config.layers.iter().enumerate() {
        let view = match routing.input(i, plan.kv, cache)? {
            KvInput::Own(c) => {
                if let Some((kd, vd)) = c.reserve_slots(1, device)? {
                    rec.kv_destination(&kd, &vd)?;
                } else if let Some(parts) = c.reserve_packed_slots(1, device)? {
                    if !rec.packed_kv_destination(&parts, plan.head_dim, dtype)? {
                        return Ok(false);
                    }
                } else {
                    return Ok(false);
                }
                c.commit_slots(1)?
            }
            KvInput::Shared(view) => view.clone(),
        };
        let query = QueryPlan {
            q_offset: pos,
            window: window_of(model, plan.kind),
            scale: 1.0,
        };
        if !rec.attention(
            config.num_attention_heads,
            plan.head_dim,
            dtype,
            &view,
            &query,
        )? {
            return Ok(false);
        }
        routing.produced(i, Some(view));
    }
    Ok(true)
}

/// Captures this step (token `id`) into a graph and launches it. The outer error is a failure
/// of the step itself; the inner one says why no graph could be made (the cache is then as
/// before and the caller runs the step eagerly).
fn capture(
    model: &TextModel,
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
    let step = Step::from_both(vec![pos], 1, &rope_s, &rope_f)?;
    let inputs = vec![ids.clone(), rope_s.clone(), rope_f.clone()];
    let captured = DecodeGraph::capture(device, inputs, || {
        let logits = model.run(&ids, step, cache)?;
        out.slice_set(&logits, 0, 0)?;
        Ok::<(), crate::Error>(())
    })?;
    let graph = match captured {
        Ok(g) => g,
        Err(why) => {
            cache.restore(&marks);
            return Ok(Err(why));
        }
    };
    let logits = out.copy()?;
    let captured = Captured {
        graph,
        thread: std::thread::current().id(),
        out,
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
fn replay(model: &TextModel, c: &Captured, id: u32, cache: &mut ModelCache) -> Result<Replayed> {
    if c.graph.outgrown() {
        return Ok(Replayed::Outgrown);
    }
    let Some(marks) = cache.marks() else {
        return Ok(Replayed::NotThisStep);
    };
    let pos = cache.offsets().first().copied().unwrap_or(0);
    let mut rec = c.graph.record();
    let recorded = record_step(model, cache, pos, &mut rec);
    match recorded {
        Ok(true) if c.graph.fits(&rec) => {}
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
    let rope_s = model.rope_sliding.both_bytes(&[pos], 1, dtype)?;
    let rope_f = model.rope_full.both_bytes(&[pos], 1, dtype)?;
    c.graph
        .replay(&rec, &[&id.to_le_bytes(), &rope_s, &rope_f])?;
    Ok(Replayed::Logits(c.out.copy()?))
}
