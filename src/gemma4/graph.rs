//! Decode steps replayed from captured graphs (CUDA graphs, through
//! [`crate::kernels::ops::graph`]; elsewhere every step runs eagerly), one graph per batch
//! size.
//!
//! The first eligible decode step of a batch size runs eagerly: it sizes the per-thread
//! scratch buffers and fills candle's cache of uploaded kernel parameters (the shapes and
//! strides of strided operands), which the capture must find there. The second is captured
//! into a graph and launched; later steps of that size replay the graph. A replay does on the
//! host only what a step must: advance each layer's cache by one token a sequence and plan
//! each layer's attention over its new views (the same planning the captured launches did),
//! then write the token ids, the rotary tables and those plans into fixed device buffers and
//! launch the graph. The graph holds no cache address and no key count, so it stays valid as
//! caches grow, wrap or change; it holds the capturing thread's scratch buffers, so only that
//! thread replays it (other threads run eagerly), and only while those buffers live: an eager
//! launch that outgrows one (a long prefill, a larger batch) replaces it, and the next step
//! of each size captures again (`scratch::generation`).
//!
//! Eligible steps: 1 to [`crate::kernels::policy::LaunchPolicy::cuda_graph_max_batch`]
//! sequences of one new token each, on CUDA with the fused kernels, every KV-owning layer's cache dense in the activations' dtype (simple,
//! rotating, or a batch of those) or quantized and already packed with scales in that dtype
//! (growing or ring, or a batch of those with one bit width and group size); a quantized cache
//! still below its `start` runs eagerly until the update that packs it. A batch's sequences
//! may differ in length, position and storage: each replay plans each one. Quantized layers
//! write K/V to a fresh buffer and quantize it into the slots their parameter block names.
//! At most [`MAX_GRAPHS`] batch sizes keep a graph; the one replayed least recently goes
//! first. [`crate::kernels::policy::LaunchPolicy::cuda_graph`] turns graphs off. A capture
//! that fails (an op that reads back to the host, such as MoE routing on the sorted path, or
//! an upload candle has not cached) turns graphs off for that batch size, rolls the caches
//! back and runs the step eagerly; the reason is in [`TextModel::cuda_graph_state`].
//!
//! A tensor-parallel rank captures its collectives into its graphs (NCCL calls can be
//! captured). Its ranks must take the same path at every step, or one rank's all-reduce would
//! wait for a peer that never launches its own: each capture and each replay is decided by
//! [`crate::kernels::ops::collective::Collective::agree_max`], so a capture that fails on one
//! rank, or a replay one rank cannot take, sends every rank the eager way (or to a new
//! capture). Graphs replay on the thread that captured them; once that thread has ended (the
//! rank threads of a finished [`crate::ShardedModel::run`] call), the next step captures again.

use std::sync::{Arc, Mutex, TryLockError, Weak};

use candle_core::{DType, Tensor};

use super::model::TextModel;
use super::routing::KvRouting;
use super::step::{Step, StepIds};
use super::KvInput;
use crate::config::{KvSource, LayerKind};
use crate::error::Result;
use crate::kernels::ops::graph::{self, DecodeGraph, GraphInput, SeqRecord, StepRecord};
use crate::kernels::QueryPlan;
use crate::kv::{CacheMark, ModelCache};

/// Eager decode steps of a batch size before its capture (the first sizes the scratch
/// buffers).
const EAGER_STEPS: usize = 1;

/// Batch sizes that keep a graph (or the reason they have none) at once.
pub(crate) const MAX_GRAPHS: usize = 8;

/// A model's decode graphs, shared by its clones.
#[derive(Default)]
pub(crate) struct DecodeGraphs {
    state: Mutex<States>,
}

impl std::fmt::Debug for DecodeGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DecodeGraphs({})", self.describe())
    }
}

/// The graphs of each batch size.
#[derive(Default)]
struct States {
    /// One state per batch size, the one used least recently first.
    sizes: Vec<(usize, State)>,
}

impl States {
    /// The state of batch size `seqs`, made the most recently used (a new one, cold, may push
    /// out the least recently used).
    fn of(&mut self, seqs: usize) -> &mut State {
        let state = match self.sizes.iter().position(|(n, _)| *n == seqs) {
            Some(i) => self.sizes.remove(i).1,
            None => {
                if self.sizes.len() >= MAX_GRAPHS {
                    self.sizes.remove(0);
                }
                State::default()
            }
        };
        self.sizes.push((seqs, state));
        let last = self.sizes.len() - 1;
        &mut self.sizes[last].1
    }
}

enum State {
    /// Eligible steps run so far without a graph.
    Cold {
        eager_steps: usize,
    },
    Ready(Box<Captured>),
    /// Why this batch size has no graph.
    Off(String),
}

impl Default for State {
    fn default() -> Self {
        State::Cold { eager_steps: 0 }
    }
}

impl State {
    fn describe(&self) -> String {
        match self {
            State::Cold { eager_steps } => {
                format!("not captured yet ({eager_steps} eligible steps run)")
            }
            State::Ready(c) => format!("captured ({} parameter blocks)", c.graph.blocks()),
            State::Off(why) => format!("off: {why}"),
        }
    }
}

/// A captured step and the buffer its logits land in.
struct Captured {
    /// The graph; its inputs are the token ids `[seqs, 1]` u32 and the rotary tables (sliding,
    /// full) `[2, seqs, 1, head_dim / 2]`, in that order.
    graph: DecodeGraph,
    /// Alive while the capturing thread runs (its scratch buffers, which the graph writes,
    /// are freed when it ends): only that thread replays the graph, and once it has ended the
    /// batch size captures again.
    thread: Weak<()>,
    /// The step's logits `[seqs, vocab]` f32, written by the graph.
    out: Tensor,
    /// The next step, recorded while the GPU ran this one.
    next: Option<Prepared>,
    /// Collectives (all-reduces, the head's gather) the graph holds: a tensor-parallel rank's
    /// count of collectives grows by this much at each replay.
    collectives: usize,
}

/// A step recorded ahead: right after a replay is launched, the host plans the step after it
/// (advancing every cache by one token, recording, then putting the counters back) while the
/// GPU runs the replay. The next replay uses it when the caches are exactly as they were left:
/// the same counters (so the same positions) and storage (an eager step, a trim, another cache
/// or a replaced sequence in between makes it stale, and the step is planned again).
struct Prepared {
    rec: StepRecord,
    /// The counters it was planned from, and the ones the step advances them to.
    before: Vec<Option<CacheMark>>,
    after: Vec<Option<CacheMark>>,
    storage: Vec<Option<candle_core::TensorId>>,
}

// Models are shared across threads.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<DecodeGraphs>();
    shared::<TextModel>();
};

impl DecodeGraphs {
    /// One line: whether steps replay graphs, and if not, why; with several batch sizes seen,
    /// the state of each (`batch N: ...`, least recently used first).
    pub(crate) fn describe(&self) -> String {
        if let Some(why) = graph::unsupported() {
            return format!("off: {why}");
        }
        match self.state.try_lock() {
            Ok(s) => match s.sizes.as_slice() {
                [] => "not captured yet (0 eligible steps run)".to_string(),
                [(1, only)] => only.describe(),
                sizes => sizes
                    .iter()
                    .map(|(n, st)| format!("batch {n}: {}", st.describe()))
                    .collect::<Vec<_>>()
                    .join("; "),
            },
            Err(_) => "in use".to_string(),
        }
    }

    /// Runs a decode step through a graph when it is eligible (see the module docs) and
    /// returns its logits; `None` when the caller must run it eagerly.
    ///
    /// # Errors
    /// CUDA and cache errors of a replay (the cache is then rolled back to before the step).
    pub(crate) fn decode(
        &self,
        model: &TextModel,
        ids: StepIds<'_>,
        cache: &mut ModelCache,
    ) -> Result<Option<Tensor>> {
        let seqs = ids.seqs();
        let most = crate::kernels::policy::current().cuda_graph_max_batch;
        if seqs == 0 || seqs > most || !ids.one_each() {
            return Ok(None);
        }
        if !graph::available(model.device()) || !eligible(model, cache, seqs) {
            return Ok(None);
        }
        let mut states = match self.state.try_lock() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            // A tensor-parallel rank must take the path its peers take, so it waits out
            // another thread's brief look (`describe`) instead of running eagerly alone.
            Err(TryLockError::WouldBlock) if model.collective().world() > 1 => {
                self.state.lock().unwrap_or_else(|p| p.into_inner())
            }
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        let state = states.of(seqs);
        if matches!(state, State::Ready(c) if c.thread.strong_count() == 0) {
            *state = State::Cold { eager_steps: 0 };
        }
        match state {
            State::Off(_) => Ok(None),
            State::Cold { eager_steps } if *eager_steps < EAGER_STEPS => {
                *eager_steps += 1;
                // A capture must find candle's uploads of shapes and strides in its upload
                // cache, so this step fills the cache.
                let offsets = cache.offsets();
                let logits = graph::with_cached_uploads(model.device(), || {
                    model.run_eager(ids, offsets, cache)
                })?;
                Ok(Some(logits))
            }
            State::Cold { .. } => match capture(model, ids, cache)? {
                Ok((captured, logits)) => {
                    *state = State::Ready(Box::new(captured));
                    Ok(Some(logits))
                }
                Err(why) => {
                    *state = State::Off(why);
                    Ok(None)
                }
            },
            State::Ready(c) if !c.thread.ptr_eq(&this_thread()) => Ok(None),
            State::Ready(c) => match replay(model, c, ids, cache)? {
                Replayed::Logits(logits) => Ok(Some(logits)),
                Replayed::NotThisStep => Ok(None),
                Replayed::Outgrown => {
                    // Capture again at the next step of this size (this one runs eagerly).
                    *state = State::Cold {
                        eager_steps: EAGER_STEPS,
                    };
                    Ok(None)
                }
            },
        }
    }
}

thread_local! {
    /// Lives as long as its thread ([`Captured::thread`]).
    static THREAD: Arc<()> = Arc::new(());
}

/// A token of the calling thread that dies with it.
fn this_thread() -> Weak<()> {
    THREAD.with(Arc::downgrade)
}

/// Whether `cache` suits a captured step of `seqs` sequences of `model` (the host-side
/// conditions; the capture checks the rest).
fn eligible(model: &TextModel, cache: &ModelCache, seqs: usize) -> bool {
    let dtype = model.dtype();
    matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
        && crate::kernels::ops::fused(model.device())
        && cache.layers.len() == model.config().layers.len()
        && cache.offsets().len() == seqs
        && model
            .config()
            .layers
            .iter()
            .zip(&cache.layers)
            .all(|(plan, c)| match (&plan.kv, c) {
                (KvSource::Own, Some(c)) => c.storage_layout().map(|(dt, _)| dt) == Some(dtype),
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

/// Reserves storage for one more token in every layer of every sequence of `cache`; the
/// first layer that cannot write one in place, if any.
fn reserve_step(cache: &mut ModelCache, device: &candle_core::Device) -> Result<Option<usize>> {
    let reserve = |seq: &mut ModelCache| -> Result<Option<usize>> {
        for (l, c) in seq.layers.iter_mut().enumerate() {
            if let Some(c) = c {
                if c.reserve_slots(1, device)?.is_none()
                    && c.reserve_packed_slots(1, device)?.is_none()
                {
                    return Ok(Some(l));
                }
            }
        }
        Ok(None)
    };
    let Some(mut seqs) = cache.split_sequences() else {
        return reserve(cache);
    };
    let refused = seqs.iter_mut().try_fold(None, |found, seq| match found {
        Some(l) => Ok(Some(l)),
        None => reserve(seq),
    });
    cache.join_sequences(seqs);
    refused
}

/// Sequences a thread records at least when a replayed step is recorded on several threads.
const SEQS_PER_THREAD: usize = 4;

/// Most threads recording one replayed step.
const RECORD_THREADS: usize = 8;

/// Advances every KV-owning layer's cache by one token a sequence and records, in launch
/// order, the parameter blocks the captured launches read: for each layer, where each
/// sequence writes its K and V, then the attention over every sequence's view. Each sequence
/// is recorded on its own (large batches on several threads) and the records are merged.
/// `Ok(false)`: a cache cannot take this step in place (the caller rolls back and runs it
/// eagerly).
fn record_step(
    model: &TextModel,
    cache: &mut ModelCache,
    positions: &[usize],
    rec: &mut StepRecord,
) -> Result<bool> {
    let records = match cache.split_sequences() {
        Some(mut seqs) => {
            let recorded = record_sequences(model, &mut seqs, positions);
            cache.join_sequences(seqs);
            recorded?
        }
        None => match positions {
            [pos] => vec![record_sequence(model, cache, *pos)?],
            _ => return Ok(false),
        },
    };
    match records.into_iter().collect::<Option<Vec<SeqRecord>>>() {
        Some(records) => Ok(rec.merge(&records)?),
        None => Ok(false),
    }
}

/// [`record_sequence`] for each of `seqs` at `positions`, on up to [`RECORD_THREADS`] threads
/// of at least [`SEQS_PER_THREAD`] sequences each (one thread below that: a thread costs more
/// than a few sequences).
fn record_sequences(
    model: &TextModel,
    seqs: &mut [ModelCache],
    positions: &[usize],
) -> Result<Vec<Option<SeqRecord>>> {
    if seqs.len() != positions.len() {
        return Ok(vec![None]);
    }
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let threads = (seqs.len() / SEQS_PER_THREAD).clamp(1, RECORD_THREADS.min(cores).max(1));
    if threads == 1 {
        return seqs
            .iter_mut()
            .zip(positions)
            .map(|(c, &pos)| record_sequence(model, c, pos))
            .collect();
    }
    let chunk = seqs.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = seqs
            .chunks_mut(chunk)
            .zip(positions.chunks(chunk))
            .map(|(cs, ps)| {
                scope.spawn(move || {
                    cs.iter_mut()
                        .zip(ps)
                        .map(|(c, &pos)| record_sequence(model, c, pos))
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(positions.len());
        for h in handles {
            let part = h.join().map_err(|_| {
                crate::Error::Candle(candle_core::Error::Msg(
                    "a thread recording a decode step panicked".to_string(),
                ))
            })??;
            out.extend(part);
        }
        Ok(out)
    })
}

/// Advances one sequence's caches (`cache`, not batched) by one token at `pos` and records its
/// blocks, layer by layer; `None` when a cache cannot take the step in place or a view does
/// not suit a captured launch.
fn record_sequence(
    model: &TextModel,
    cache: &mut ModelCache,
    pos: usize,
) -> Result<Option<SeqRecord>> {
    let (device, dtype) = (model.device(), model.dtype());
    let Some(mut rec) = SeqRecord::new(device) else {
        return Ok(None);
    };
    let config = model.config();
    let mut routing = KvRouting::new(&model.producers);
    for (i, plan) in config.layers.iter().enumerate() {
        let view = match routing.input(i, plan.kv, cache)? {
            KvInput::Own(c) => {
                if let Some((kd, vd)) = c.reserve_slots(1, device)? {
                    if !rec.kv_destination(&kd, &vd) {
                        return Ok(None);
                    }
                } else if let Some(parts) = c.reserve_packed_slots(1, device)? {
                    if !rec.packed_kv_destination(&parts, plan.head_dim, dtype)? {
                        return Ok(None);
                    }
                } else {
                    return Ok(None);
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
        ) {
            return Ok(None);
        }
        routing.produced(i, Some(view));
    }
    Ok(Some(rec))
}

/// Captures this step (one new token a sequence) into a graph and launches it. The outer error
/// is a failure of the step itself; the inner one says why no graph could be made (the cache is
/// then as before and the caller runs the step eagerly).
fn capture(
    model: &TextModel,
    ids: StepIds<'_>,
    cache: &mut ModelCache,
) -> Result<std::result::Result<(Captured, Tensor), String>> {
    let device = model.device();
    let dtype = model.dtype();
    let seqs = ids.seqs();
    // Storage for this token in every layer now: memory allocated during the capture belongs
    // to the graph and must not outlive it inside a cache.
    if let Some(l) = reserve_step(cache, device)? {
        return Ok(Err(format!(
            "layer {l}'s cache cannot write a token in place"
        )));
    }
    let Some(marks) = cache.marks() else {
        return Ok(Err("a cache kind without marks".to_string()));
    };
    let positions = cache.offsets();
    let ids = ids.to_owned_tensor(device)?;
    let rope_s = model.rope_sliding.both(&positions, 1, dtype, device)?;
    let rope_f = model.rope_full.both(&positions, 1, dtype, device)?;
    let out = Tensor::zeros((seqs, model.config().vocab_size), DType::F32, device)?;
    let step = Step::from_both(positions, 1, &rope_s, &rope_f)?;
    let inputs = vec![ids.clone(), rope_s.clone(), rope_f.clone()];
    let collective = model.collective();
    let calls = collective.calls();
    let captured = DecodeGraph::capture(
        device,
        seqs,
        inputs,
        || {
            let logits = model.run(&ids, step, cache)?;
            out.slice_set(&logits, 0, 0)?;
            Ok::<(), crate::Error>(())
        },
        |made| Ok(collective.agree_max(u8::from(!made))? == 0),
    )?;
    let collectives = collective.calls() - calls;
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
        thread: this_thread(),
        out,
        next: None,
        collectives,
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

/// Replays the captured step for tokens `ids` (one a sequence), then records the step after
/// it ([`Prepared`]) while the GPU runs this one. The ranks of a tensor-parallel model replay
/// only together: each votes its [`Replayed`] verdict and all take the worst one.
fn replay(
    model: &TextModel,
    c: &mut Captured,
    ids: StepIds<'_>,
    cache: &mut ModelCache,
) -> Result<Replayed> {
    let planned = plan_replay(model, c, ids.seqs(), cache)?;
    let vote = match &planned {
        Planned::Ready { .. } => 0,
        Planned::Not(Replayed::Outgrown) => 2,
        Planned::Not(_) => 1,
    };
    let verdict = model.collective().agree_max(vote)?;
    let (rec, marks, positions) = match planned {
        Planned::Ready {
            rec,
            marks,
            positions,
        } if verdict == 0 => (rec, marks, positions),
        Planned::Ready { marks, .. } => {
            cache.restore(&marks);
            return Ok(if verdict == 2 {
                Replayed::Outgrown
            } else {
                Replayed::NotThisStep
            });
        }
        Planned::Not(_) if verdict == 2 => return Ok(Replayed::Outgrown),
        Planned::Not(own) => return Ok(own),
    };
    let launched = (|| -> Result<Tensor> {
        let dtype = model.dtype();
        let rope_s = model.rope_sliding.both_bytes(&positions, 1, dtype)?;
        let rope_f = model.rope_full.both_bytes(&positions, 1, dtype)?;
        let id_bytes: Vec<u8>;
        let ids = match ids {
            StepIds::Host(b) => {
                id_bytes = b.iter().flatten().flat_map(|id| id.to_le_bytes()).collect();
                GraphInput::Bytes(&id_bytes)
            }
            StepIds::Device(t) => GraphInput::Device(t),
        };
        let inputs = [ids, GraphInput::Bytes(&rope_s), GraphInput::Bytes(&rope_f)];
        c.graph.replay(&rec, &inputs)?;
        model.collective().count_replayed(c.collectives);
        Ok(c.out.copy()?)
    })();
    let logits = match launched {
        Ok(l) => l,
        Err(e) => {
            cache.restore(&marks);
            return Err(e);
        }
    };
    c.next = prepare(model, c, cache);
    Ok(Replayed::Logits(logits))
}

/// A replay's plan: the step recorded (the caches advanced past it) or why it cannot replay.
enum Planned {
    Ready {
        rec: StepRecord,
        /// The caches' counters before the step.
        marks: Vec<Option<CacheMark>>,
        positions: Vec<usize>,
    },
    Not(Replayed),
}

/// Records the step a replay of `c` would launch for `seqs` sequences (or takes the one
/// prepared during the last replay), advancing the caches past it.
fn plan_replay(
    model: &TextModel,
    c: &mut Captured,
    seqs: usize,
    cache: &mut ModelCache,
) -> Result<Planned> {
    let prepared = c.next.take();
    if c.graph.outgrown() {
        return Ok(Planned::Not(Replayed::Outgrown));
    }
    let Some(marks) = cache.marks() else {
        return Ok(Planned::Not(Replayed::NotThisStep));
    };
    let positions = cache.offsets();
    if positions.len() != seqs {
        return Ok(Planned::Not(Replayed::NotThisStep));
    }
    let rec = match prepared {
        Some(p) if p.before == marks && p.storage == cache.storage_ids() => {
            cache.restore(&p.after);
            p.rec
        }
        _ => {
            let mut rec = c.graph.record();
            match record_step(model, cache, &positions, &mut rec) {
                Ok(true) if c.graph.fits(&rec) => rec,
                // More key splits than captured, or other launches (the model now decodes with
                // a cache of another kind or bits): capture again.
                Ok(true) => {
                    cache.restore(&marks);
                    return Ok(Planned::Not(Replayed::Outgrown));
                }
                Ok(false) => {
                    cache.restore(&marks);
                    return Ok(Planned::Not(Replayed::NotThisStep));
                }
                Err(e) => {
                    cache.restore(&marks);
                    return Err(e);
                }
            }
        }
    };
    Ok(Planned::Ready {
        rec,
        marks,
        positions,
    })
}

/// Records the step after the one just launched (see [`Prepared`]); the caches' counters are
/// put back before it returns (storage it grew stays grown). `None` when the step cannot be
/// recorded now; the next replay then records it itself.
fn prepare(model: &TextModel, c: &Captured, cache: &mut ModelCache) -> Option<Prepared> {
    let before = cache.marks()?;
    let positions = cache.offsets();
    let mut rec = c.graph.record();
    let recorded = record_step(model, cache, &positions, &mut rec);
    let after = cache.marks();
    cache.restore(&before);
    match (recorded, after) {
        (Ok(true), Some(after)) if c.graph.fits(&rec) => Some(Prepared {
            rec,
            before,
            after,
            storage: cache.storage_ids(),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(s: &States) -> Vec<usize> {
        s.sizes.iter().map(|(n, _)| *n).collect()
    }

    #[test]
    fn batch_sizes_are_kept_most_recent_last_and_the_least_recent_goes_first() {
        let mut s = States::default();
        for n in 1..=MAX_GRAPHS {
            s.of(n);
        }
        assert_eq!(sizes(&s), (1..=MAX_GRAPHS).collect::<Vec<_>>());
        // Using size 1 again makes it the most recent; a new size then pushes out size 2.
        *s.of(1) = State::Off("marked".to_string());
        s.of(MAX_GRAPHS + 1);
        let mut want: Vec<usize> = (3..=MAX_GRAPHS).collect();
        want.extend([1, MAX_GRAPHS + 1]);
        assert_eq!(sizes(&s), want);
        // A kept size keeps its state.
        assert!(matches!(s.of(1), State::Off(why) if why == "marked"));
        assert!(matches!(s.of(2), State::Cold { eager_steps: 0 }));
    }
}
