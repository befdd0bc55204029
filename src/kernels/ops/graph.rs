//! Decode-step capture and replay: the device side of the decode-graph driver
//! (`gemma4::graph`).
//!
//! On CUDA a captured step is a CUDA graph (see `kernels::cuda::graph`): the launches read the
//! arguments that change from step to step from a parameter area in device memory, which the
//! host rewrites before each replay ([`StepRecord`]), and read the token id and rotary tables
//! from fixed input buffers, rewritten the same way. Off CUDA nothing can be captured:
//! [`available`] is `false` and [`DecodeGraph::capture`] says why.

use candle_core::Device;

pub(crate) use imp::{with_cached_uploads, DecodeGraph, SeqRecord, StepRecord};

/// What rewrites one capture input before a replay.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum GraphInput<'a> {
    /// These bytes, from the host.
    Bytes(&'a [u8]),
    /// A copy of this device tensor (contiguous, the input's size): the previous step's token
    /// ids, for a step the host enqueues before it has read them.
    Device(&'a candle_core::Tensor),
}

/// Whether decode steps on `device` may be captured: the `cuda` feature is built, `device` is a
/// CUDA device and [`crate::kernels::policy::LaunchPolicy::cuda_graph`] is on.
pub(crate) fn available(device: &Device) -> bool {
    cfg!(feature = "cuda") && device.is_cuda() && crate::kernels::policy::current().cuda_graph
}

/// Why this build captures nothing (`None` where it can capture).
pub(crate) fn unsupported() -> Option<&'static str> {
    (!cfg!(feature = "cuda")).then_some("the cuda feature is not built")
}

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::cuda_backend::cudarc::driver::{CudaGraph, CudaSlice, DevicePtr};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Device, Tensor};

    use super::GraphInput;
    use crate::kernels::cuda::batched::{
        address, step_attention, step_attention_slot, StepAttention,
    };
    use crate::kernels::cuda::graph::{self, Slot, StepParams};
    use crate::kernels::cuda::kv_write::{kv_destination, kvq_destination, KvqDst, QkvDst};
    use crate::kernels::cuda::scratch;
    use crate::kernels::ops::Result;
    use crate::kernels::KvView;
    use crate::kernels::QueryPlan;

    /// Bytes of the parameter area for each sequence of a step: two blocks a layer (a
    /// `QsdpaSeq` is 192 bytes), ample for every Gemma 4 depth.
    const PARAM_BYTES_PER_SEQ: usize = 64 * 1024;

    fn cuda_device(device: &Device) -> Option<&CudaDevice> {
        match device {
            Device::Cuda(d) => Some(d),
            _ => None,
        }
    }

    /// Runs `f` with candle's uploads of the shapes and strides of strided operands going
    /// through its upload cache: an eager step fills it, and a capture must find each upload
    /// there (a captured upload would read freed host memory at replay). Off CUDA devices `f`
    /// just runs.
    pub(crate) fn with_cached_uploads<R>(device: &Device, f: impl FnOnce() -> R) -> R {
        let _uploads = cuda_device(device).map(CudaDevice::enable_cuda_graph_htod_cache);
        f()
    }

    /// Where one layer of one sequence writes its new K and V in a replayed step.
    #[derive(Debug, Clone, Copy)]
    enum KvBlock {
        /// Dense slots (`QkvDst`).
        Dense(QkvDst),
        /// Packed slots (`KvqDst`) and the bits and group size they take.
        Packed(KvqDst, (u32, u32)),
    }

    /// One layer of one sequence in a replayed step.
    #[derive(Debug, Clone, Copy)]
    struct LayerBlocks {
        kv: Option<KvBlock>,
        attention: StepAttention,
    }

    /// The parameter blocks of one sequence of a replayed step, layer by layer: where each
    /// KV-owning layer writes its new K and V, and each layer's attention over its view.
    /// Sequences are recorded independently (on several threads for large batches) and then
    /// merged into the step's [`StepRecord`].
    pub(crate) struct SeqRecord {
        layers: Vec<LayerBlocks>,
        pending: Option<KvBlock>,
        dev: CudaDevice,
    }

    impl SeqRecord {
        /// An empty record for a sequence on `device`; `None` off CUDA.
        pub(crate) fn new(device: &Device) -> Option<Self> {
            Some(Self {
                layers: Vec::new(),
                pending: None,
                dev: cuda_device(device)?.clone(),
            })
        }

        /// Records where the next layer's new K and V go: dense slots `kd`, `vd`
        /// (`[1, kv_heads, 1, head_dim]` views). `false`: the slots are not laid out as the
        /// kernels write them (the step cannot replay).
        pub(crate) fn kv_destination(&mut self, kd: &Tensor, vd: &Tensor) -> bool {
            match kv_destination(kd, vd) {
                Ok(block) => {
                    self.pending = Some(KvBlock::Dense(block));
                    true
                }
                Err(_) => false,
            }
        }

        /// Records where the next layer's new K and V are quantized to: packed slots `parts`
        /// (codes, scales, biases of K, then of V). `false`: the slots are not laid out as the
        /// kernel writes them (the step cannot replay).
        ///
        /// # Errors
        /// Slots not on the device.
        pub(crate) fn packed_kv_destination(
            &mut self,
            parts: &[Tensor],
            head_dim: usize,
            dtype: DType,
        ) -> Result<bool> {
            let Some((block, quant)) = kvq_destination(parts, head_dim, dtype)? else {
                return Ok(false);
            };
            self.pending = Some(KvBlock::Packed(block, quant));
            Ok(true)
        }

        /// Records the layer's attention of `n_heads` queries over `view` at `plan`, which
        /// completes the layer. `false`: the view does not suit a captured launch (the step
        /// cannot replay).
        pub(crate) fn attention(
            &mut self,
            n_heads: usize,
            head_dim: usize,
            dtype: DType,
            view: &KvView,
            plan: &QueryPlan,
        ) -> bool {
            match step_attention(n_heads, head_dim, dtype, view, plan, &self.dev) {
                Ok(attention) => {
                    let kv = self.pending.take();
                    self.layers.push(LayerBlocks { kv, attention });
                    true
                }
                Err(_) => false,
            }
        }
    }

    /// The parameter blocks of one replayed step, in launch order: for each layer, where each
    /// sequence of a KV-owning layer writes its new K and V (one block), then the layer's
    /// attention over every sequence's view (one block).
    pub(crate) struct StepRecord {
        params: StepParams,
    }

    impl StepRecord {
        /// Appends every layer of `seqs` (one record a sequence, in batch order) in the order
        /// the captured launches read them. `false`: the sequences' layers do not line up
        /// (another number of layers, K/V written differently, or attention needing different
        /// kernels), so the step cannot replay.
        ///
        /// # Errors
        /// The area is full.
        pub(crate) fn merge(&mut self, seqs: &[SeqRecord]) -> Result<bool> {
            let Some(first) = seqs.first() else {
                return Ok(false);
            };
            let n = seqs.len();
            if seqs.iter().any(|s| s.layers.len() != first.layers.len()) {
                return Ok(false);
            }
            for l in 0..first.layers.len() {
                let layer: Vec<&LayerBlocks> = seqs.iter().map(|s| &s.layers[l]).collect();
                if !self.push_kv(&layer, n)? {
                    return Ok(false);
                }
                let atts: Vec<StepAttention> = layer.iter().map(|b| b.attention).collect();
                let Some(slot) = step_attention_slot(&atts, None) else {
                    return Ok(false);
                };
                let descs: Vec<_> = atts.iter().map(|a| a.desc).collect();
                self.params.push_slice(slot, &descs)?;
            }
            Ok(true)
        }

        /// Appends one layer's K/V blocks of `n` sequences as one block (none for a layer
        /// that writes no K/V). `false` when the sequences write differently.
        fn push_kv(&mut self, layer: &[&LayerBlocks], n: usize) -> Result<bool> {
            let seqs = n as u32;
            match layer.first().and_then(|b| b.kv) {
                None => Ok(layer.iter().all(|b| b.kv.is_none())),
                Some(KvBlock::Dense(_)) => {
                    let mut blocks = Vec::with_capacity(n);
                    for b in layer {
                        match b.kv {
                            Some(KvBlock::Dense(d)) => blocks.push(d),
                            _ => return Ok(false),
                        }
                    }
                    self.params
                        .push_slice(Slot::KvDestination { seqs }, &blocks)?;
                    Ok(true)
                }
                Some(KvBlock::Packed(_, quant)) => {
                    let mut blocks = Vec::with_capacity(n);
                    for b in layer {
                        match b.kv {
                            Some(KvBlock::Packed(d, q)) if q == quant => blocks.push(d),
                            _ => return Ok(false),
                        }
                    }
                    let (bits, group_size) = quant;
                    let slot = Slot::KvQuantDestination {
                        bits,
                        group_size,
                        seqs,
                    };
                    self.params.push_slice(slot, &blocks)?;
                    Ok(true)
                }
            }
        }
    }

    /// A captured decode step: the graph, its parameter area and its fixed input buffers.
    pub(crate) struct DecodeGraph {
        graph: CudaGraph,
        /// What each parameter block feeds, as recorded at capture.
        slots: Vec<Slot>,
        /// The parameter area, `param_bytes` bytes, and its device address.
        _params: CudaSlice<u8>,
        params_at: u64,
        param_bytes: usize,
        /// The inputs rewritten before each replay, kept alive for the graph, and their
        /// device addresses.
        inputs: Vec<(Tensor, u64)>,
        /// The device the graph runs on (to wait for its last replay before it is destroyed).
        dev: CudaDevice,
        /// The capturing thread's scratch generation (`scratch::generation`) the graph's
        /// addresses belong to.
        scratch_generation: u64,
    }

    impl Drop for DecodeGraph {
        fn drop(&mut self) {
            // The graph and its memory go only once its last replay has finished (a failed
            // wait has no one to report to).
            let _ = self.dev.cuda_stream().synchronize();
        }
    }

    // SAFETY: the graph's handles may be used from any thread once the context is bound (every
    // launch binds it); its owner touches it only under a mutex.
    unsafe impl Send for DecodeGraph {}

    impl DecodeGraph {
        /// Captures what `run` launches on `device` for a step of `seqs` sequences into a graph
        /// and launches it once. `inputs` are the buffers `run` reads that
        /// [`DecodeGraph::replay`] rewrites, in that order. `agree` is told whether this
        /// capture made a graph and answers whether to launch it: a tensor-parallel rank
        /// launches only when every rank's capture succeeded (a group of one answers its
        /// input). The outer error is a failure of the step itself; the inner one says why no
        /// graph could be made (the caller then undoes what `run` changed and runs the step
        /// eagerly).
        ///
        /// # Errors
        /// Device errors of the allocation, the upload or the launch; `agree`'s errors.
        pub(crate) fn capture<E: std::fmt::Display>(
            device: &Device,
            seqs: usize,
            inputs: Vec<Tensor>,
            run: impl FnOnce() -> std::result::Result<(), E>,
            agree: impl FnOnce(bool) -> Result<bool>,
        ) -> Result<std::result::Result<Self, String>> {
            let Some(dev) = cuda_device(device) else {
                return Ok(Err("not a CUDA device".to_string()));
            };
            let param_bytes = PARAM_BYTES_PER_SEQ * seqs.max(1);
            let params = dev.alloc_zeros::<u8>(param_bytes)?;
            let params_at = params.device_ptr(&dev.cuda_stream()).0;
            // Candle's uploads come from the cache the eager step filled (a miss fails the
            // capture). The fixed buffers were made before, so none of them is a shared cache
            // entry.
            let uploads = dev.enable_cuda_graph_htod_cache();
            graph::begin_capture(dev)?;
            let (ran, rec) = graph::with_recording(StepParams::new(params_at, param_bytes), run);
            let ended = graph::end_capture(dev);
            drop(uploads);
            let graph = match (ran, ended) {
                (Ok(()), Ok(Some(g))) => Ok(g),
                (Err(e), _) => Err(format!("capture failed: {e}")),
                (_, Err(e)) => Err(format!("capture failed: {e}")),
                _ => Err("nothing was captured".to_string()),
            };
            let graph = match (agree(graph.is_ok())?, graph) {
                (true, Ok(g)) => g,
                (false, Ok(_)) => return Ok(Err("a peer rank's capture failed".to_string())),
                (_, Err(why)) => return Ok(Err(why)),
            };
            rec.upload(dev)?;
            graph.launch().map_err(candle_core::Error::wrap)?;
            let inputs = inputs
                .into_iter()
                .map(|t| {
                    let at = address(&t, dev)?;
                    Ok((t, at))
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Ok(Self {
                graph,
                slots: rec.slots().to_vec(),
                _params: params,
                params_at,
                param_bytes,
                inputs,
                dev: dev.clone(),
                scratch_generation: scratch::generation(),
            }))
        }

        /// Parameter blocks a step records.
        pub(crate) fn blocks(&self) -> usize {
            self.slots.len()
        }

        /// Whether an eager launch since the capture (a longer prefill, a batch) replaced a
        /// scratch buffer the graph writes: its old address is freed, so the graph must not
        /// replay.
        pub(crate) fn outgrown(&self) -> bool {
            scratch::generation() != self.scratch_generation
        }

        /// An empty record of the next step's parameter blocks.
        pub(crate) fn record(&self) -> StepRecord {
            StepRecord {
                params: StepParams::new(self.params_at, self.param_bytes),
            }
        }

        /// Whether `rec` feeds the captured launches: the same blocks in the same order, each
        /// within what its launch covers (attention splits, quantization).
        pub(crate) fn fits(&self, rec: &StepRecord) -> bool {
            let slots = rec.params.slots();
            slots.len() == self.slots.len()
                && slots
                    .iter()
                    .zip(&self.slots)
                    .all(|(a, b)| std::mem::discriminant(a) == std::mem::discriminant(b))
                && slots.iter().zip(&self.slots).all(|(a, b)| a.fits(*b))
        }

        /// Writes `inputs` (each capture input, in order) and `rec` to the device and launches
        /// the graph.
        ///
        /// # Errors
        /// Device errors; a device input of another size or dtype than the capture's, or not
        /// contiguous.
        pub(crate) fn replay(&self, rec: &StepRecord, inputs: &[GraphInput<'_>]) -> Result<()> {
            for ((fixed, at), input) in self.inputs.iter().zip(inputs) {
                match input {
                    GraphInput::Bytes(bytes) => graph::upload_bytes(&self.dev, *at, bytes)?,
                    GraphInput::Device(t) => {
                        if t.dtype() != fixed.dtype()
                            || t.elem_count() != fixed.elem_count()
                            || !t.is_contiguous()
                        {
                            return Err(candle_core::Error::Msg(format!(
                                "a replay input of {:?} {:?} where the graph reads {:?} {:?}",
                                t.dtype(),
                                t.shape(),
                                fixed.dtype(),
                                fixed.shape()
                            ))
                            .into());
                        }
                        let bytes = t.elem_count() * t.dtype().size_in_bytes();
                        graph::copy_device(&self.dev, *at, address(t, &self.dev)?, bytes)?;
                    }
                }
            }
            rec.params.upload(&self.dev)?;
            self.graph.launch().map_err(candle_core::Error::wrap)?;
            Ok(())
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use candle_core::{DType, Device, Tensor};

    use crate::kernels::ops::Result;
    use crate::kernels::KvView;
    use crate::kernels::QueryPlan;

    /// No value: nothing is captured without the `cuda` feature.
    enum Never {}

    /// Runs `f` (candle's upload cache exists on CUDA only).
    pub(crate) fn with_cached_uploads<R>(_device: &Device, f: impl FnOnce() -> R) -> R {
        f()
    }

    /// One sequence's parameter blocks of a replayed step (none exist without CUDA).
    pub(crate) struct SeqRecord {
        never: Never,
    }

    impl SeqRecord {
        /// `None`: nothing is recorded without CUDA.
        pub(crate) fn new(_device: &Device) -> Option<Self> {
            None
        }

        /// See the CUDA build.
        pub(crate) fn kv_destination(&mut self, _kd: &Tensor, _vd: &Tensor) -> bool {
            match self.never {}
        }

        /// See the CUDA build.
        pub(crate) fn packed_kv_destination(
            &mut self,
            _parts: &[Tensor],
            _head_dim: usize,
            _dtype: DType,
        ) -> Result<bool> {
            match self.never {}
        }

        /// See the CUDA build.
        pub(crate) fn attention(
            &mut self,
            _n_heads: usize,
            _head_dim: usize,
            _dtype: DType,
            _view: &KvView,
            _plan: &QueryPlan,
        ) -> bool {
            match self.never {}
        }
    }

    /// The parameter blocks of one replayed step (none exist without CUDA).
    pub(crate) struct StepRecord {
        never: Never,
    }

    impl StepRecord {
        /// See the CUDA build.
        pub(crate) fn merge(&mut self, _seqs: &[SeqRecord]) -> Result<bool> {
            match self.never {}
        }
    }

    /// A captured decode step (none exist without CUDA).
    pub(crate) struct DecodeGraph {
        never: Never,
    }

    impl DecodeGraph {
        /// Nothing can be captured without the `cuda` feature.
        ///
        /// # Errors
        /// None.
        pub(crate) fn capture<E: std::fmt::Display>(
            _device: &Device,
            _seqs: usize,
            _inputs: Vec<Tensor>,
            _run: impl FnOnce() -> std::result::Result<(), E>,
            _agree: impl FnOnce(bool) -> Result<bool>,
        ) -> Result<std::result::Result<Self, String>> {
            Ok(Err("the cuda feature is off".to_string()))
        }

        /// See the CUDA build.
        pub(crate) fn blocks(&self) -> usize {
            match self.never {}
        }

        /// See the CUDA build.
        pub(crate) fn outgrown(&self) -> bool {
            match self.never {}
        }

        /// See the CUDA build.
        pub(crate) fn record(&self) -> StepRecord {
            match self.never {}
        }

        /// See the CUDA build.
        pub(crate) fn fits(&self, _rec: &StepRecord) -> bool {
            match self.never {}
        }

        /// See the CUDA build.
        pub(crate) fn replay(
            &self,
            _rec: &StepRecord,
            _inputs: &[super::GraphInput<'_>],
        ) -> Result<()> {
            match self.never {}
        }
    }
}
