//! The Gemma 4 text stack: embedding (scaled), per-layer embeddings, the decoder layers with KV
//! sharing, the final norm, the tied head and the logit soft-cap.

use candle_core::{DType, Device, Tensor};

use super::layer::DecoderLayer;
use super::norm::RmsNorm;
use super::ple::{self, scale_in_dtype, PerLayerEmbeddings};
use super::rope::Rope;
use super::routing::KvRouting;
use super::step::{Step, StepIds};
use super::{Embedding, Linear};
use crate::config::{Config, KvSource, LayerKind};
use crate::error::{Error, Result};
use crate::kernels::ops::collective::Collective;
use crate::kv::{LayerCacheSpec, ModelCache};
use crate::weights::WeightStore;

/// Longest run of new tokens one forward pass takes at once where prefill attention builds
/// score matrices (CPU, Metal, f32, or the flash kernel switched off); longer prompts are split.
pub const PREFILL_CHUNK: usize = 1024;

/// Longest run of new tokens one forward pass takes at once where prefill attention takes the
/// CUDA flash kernel (f16/bf16), which builds no score matrix. Each chunk reads every weight
/// once, and an MoE layer's chunk of 1024 tokens reads nearly every expert: four times fewer
/// chunks read them four times less.
pub const PREFILL_CHUNK_FLASH: usize = 4096;

/// The decoder stack of a Gemma 4 checkpoint.
#[derive(Debug, Clone)]
pub struct TextModel {
    config: Config,
    /// `[V, H]`, also the (tied) head.
    embed_tokens: Embedding,
    ple: Option<PerLayerEmbeddings>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `[V, H]` when the head is not tied.
    lm_head: Option<Linear>,
    pub(super) rope_sliding: Rope,
    pub(super) rope_full: Rope,
    /// `producers[i]`: some later layer reads layer i's K/V.
    pub(super) producers: Vec<bool>,
    dtype: DType,
    device: Device,
    /// Captured batch-1 decode steps (shared by clones of the model).
    graphs: std::sync::Arc<super::graph::DecodeGraphs>,
    /// The tensor-parallel group this model is a rank of.
    collective: Collective,
    /// A rank's part of a vocabulary-parallel tied head (its rows of the table); the logits of
    /// every rank's part are gathered.
    head_part: Option<Embedding>,
}

impl TextModel {
    /// Loads every text-stack tensor from `vb` (tower tensors are never read).
    ///
    /// # Errors
    /// Missing or misshapen tensors, named with their layer.
    pub fn new(config: Config, vb: &WeightStore) -> Result<Self> {
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed_tokens = Embedding::from_loaded(vb.matrix("embed_tokens", None, &[v, h])?);
        let layers = (0..config.num_layers())
            .map(|l| DecoderLayer::new(&config, l, vb))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(Linear::from_loaded(vb.matrix("lm_head", None, &[v, h])?))
        };
        let mut producers = vec![false; config.num_layers()];
        for plan in &config.layers {
            if let KvSource::Shared { producer } = plan.kv {
                producers[producer] = true;
            }
        }
        let head_dim = |kind: LayerKind| {
            config
                .layers
                .iter()
                .find(|l| l.kind == kind)
                .map_or(2, |l| l.head_dim)
        };
        let ple = PerLayerEmbeddings::new(&config, vb)?;
        let norm = RmsNorm::new(vb.tensor("norm.weight", None, &[h])?, config.rms_norm_eps);
        // Every weight is written before the first forward pass: the packed ones are marked
        // settled (`PackedAffine::settled`), which lets their products start reading them early.
        vb.device().synchronize()?;
        Ok(Self {
            rope_sliding: Rope::new(&config.rope_sliding, head_dim(LayerKind::Sliding)),
            rope_full: Rope::new(&config.rope_full, head_dim(LayerKind::Full)),
            ple,
            norm,
            embed_tokens,
            layers,
            lm_head,
            producers,
            dtype: vb.dtype(),
            device: vb.device().clone(),
            config,
            graphs: Default::default(),
            collective: Collective::default(),
            head_part: None,
        })
    }

    /// Makes this model one rank of a tensor-parallel group (its weights loaded with that
    /// rank's [`crate::shard::ShardPlan`]): every layer sums its row-parallel products over
    /// `collective`'s group. Decode steps replay CUDA graphs as on one device, the collectives
    /// captured inside them; the ranks decide each capture and replay together
    /// ([`super::graph`]).
    ///
    /// With a tied head and a vocabulary the group divides, the head is vocabulary-parallel:
    /// each rank computes the logits of its rows of the (replicated) table and the ranks'
    /// logits are gathered, so no rank reads the whole table per step.
    ///
    /// # Errors
    /// Allocation of the head's part.
    pub(crate) fn set_collective(&mut self, collective: Collective) -> Result<()> {
        let (rank, world, v) = (
            collective.rank(),
            collective.world(),
            self.config.vocab_size,
        );
        self.head_part = if world > 1 && self.lm_head.is_none() && v % world == 0 {
            let part = self.embed_tokens.rows(rank * v / world, v / world)?;
            // The copy keeps the table's settled mark: it must be complete before any product
            // may load it ahead of its dependent-launch wait.
            self.device.synchronize()?;
            Some(part)
        } else {
            None
        };
        for layer in &mut self.layers {
            layer.set_collective(collective.clone());
        }
        self.collective = collective;
        Ok(())
    }

    /// This rank's handle on its tensor-parallel group (a group of one on a single device).
    pub(crate) fn collective(&self) -> &Collective {
        &self.collective
    }

    /// Bytes of every weight the model holds (packed ones at their packed size).
    pub fn resident_bytes(&self) -> usize {
        self.embed_tokens.resident_bytes()
            + self
                .ple
                .as_ref()
                .map_or(0, PerLayerEmbeddings::resident_bytes)
            + self
                .layers
                .iter()
                .map(DecoderLayer::resident_bytes)
                .sum::<usize>()
            + self.norm.resident_bytes()
            + self.lm_head.as_ref().map_or(0, Linear::resident_bytes)
            + self.head_part.as_ref().map_or(0, Embedding::resident_bytes)
    }

    /// Whether batch-1 decode steps run as a CUDA graph, and if not, why (one line).
    pub fn cuda_graph_state(&self) -> String {
        self.graphs.describe()
    }

    /// The validated config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The activation dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// What each layer's cache must hold; `None` for KV-shared layers, which own no cache.
    pub fn cache_specs(&self) -> Vec<Option<LayerCacheSpec>> {
        crate::kv::layer_cache_specs(&self.config)
    }

    /// Checks ids against the vocabulary and positions against the context length.
    fn validate(&self, batch: &[Vec<u32>], offsets: &[usize]) -> Result<usize> {
        let seq_len = batch.first().map_or(0, Vec::len);
        if seq_len == 0 {
            return Err(Error::Input(
                "empty input: at least one token per sequence".to_string(),
            ));
        }
        if batch.iter().any(|s| s.len() != seq_len) {
            return Err(Error::Input(
                "every sequence of a batched forward must have the same number of new tokens"
                    .to_string(),
            ));
        }
        if offsets.len() != batch.len() {
            return Err(Error::Input(format!(
                "{} sequences given, the cache holds {}",
                batch.len(),
                offsets.len()
            )));
        }
        // Ids index the embedding and, with PLE, the per-layer table: both are checked here, so
        // the lookups on the device need not read the ids back.
        let vocab_size = match &self.ple {
            Some(_) => self
                .config
                .vocab_size
                .min(self.config.vocab_size_per_layer_input),
            None => self.config.vocab_size,
        };
        for seq in batch {
            if let Some((position, &id)) = seq
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= vocab_size)
            {
                return Err(Error::TokenOutOfVocab {
                    id,
                    position,
                    vocab_size,
                });
            }
        }
        let max = self.config.max_position_embeddings;
        if let Some(&o) = offsets.iter().max() {
            if o + seq_len > max {
                return Err(Error::ContextTooLong {
                    length: o + seq_len,
                    max,
                });
            }
        }
        Ok(seq_len)
    }

    /// Runs `batch` (one row of new tokens per sequence, equal lengths) through the model,
    /// appending to `cache`, and returns the f32 logits of each sequence's last position,
    /// `[B, V]`. Positions come from the cache, read before any layer appends.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`], [`Error::ContextTooLong`], [`Error::Input`], cache errors.
    ///
    /// Prompts longer than [`TextModel::prefill_chunk`] tokens run as consecutive chunks of that
    /// size: sliding layers then score each query against at most `window + chunk` keys instead
    /// of the whole prompt, and score matrices stay bounded. Every chunk but the last only fills
    /// the cache: it stops before the KV-shared layers (which write none) and computes no
    /// logits, which nothing would read. The whole batch is validated before the first chunk
    /// runs.
    pub fn forward(&self, batch: &[Vec<u32>], cache: &mut ModelCache) -> Result<Tensor> {
        let seq_len = self.validate(batch, &cache.offsets())?;
        let chunk = self.prefill_chunk();
        if seq_len <= chunk {
            return self.forward_chunk(batch, cache);
        }
        let piece = |start: usize| -> Vec<Vec<u32>> {
            let end = (start + chunk).min(seq_len);
            batch.iter().map(|s| s[start..end].to_vec()).collect()
        };
        let last = (seq_len - 1) / chunk * chunk;
        for start in (0..last).step_by(chunk) {
            let (ids, step) = self.upload(&piece(start), cache.offsets())?;
            self.run_layers(&ids, step, cache, self.config.first_kv_shared_layer)?;
        }
        self.forward_chunk(&piece(last), cache)
    }

    /// Longest run of new tokens one [`TextModel::forward`] pass takes at once:
    /// [`crate::kernels::policy::LaunchPolicy::prefill_chunk`] where set, else
    /// [`PREFILL_CHUNK_FLASH`] on CUDA in f16/bf16 with the flash prefill kernel on, else
    /// [`PREFILL_CHUNK`].
    pub fn prefill_chunk(&self) -> usize {
        let policy = crate::kernels::policy::current();
        if policy.prefill_chunk > 0 {
            return policy.prefill_chunk;
        }
        let half = matches!(self.dtype, DType::BF16 | DType::F16);
        if self.device.is_cuda() && half && policy.flash_prefill {
            PREFILL_CHUNK_FLASH
        } else {
            PREFILL_CHUNK
        }
    }

    /// One chunk of [`TextModel::forward`].
    fn forward_chunk(&self, batch: &[Vec<u32>], cache: &mut ModelCache) -> Result<Tensor> {
        let offsets = cache.offsets();
        self.validate(batch, &offsets)?;
        let ids = StepIds::Host(batch);
        if let Some(logits) = self.graphs.decode(self, ids, cache)? {
            return Ok(logits);
        }
        self.run_eager(ids, offsets, cache)
    }

    /// Whether every id below the vocabulary size (every column of the logits) indexes the
    /// embedding and, with PLE, the per-layer table: then a step may take ids picked on the
    /// device without the host checking them ([`TextModel::forward_device_ids`]).
    pub(crate) fn takes_device_ids(&self) -> bool {
        self.ple.is_none() || self.config.vocab_size_per_layer_input >= self.config.vocab_size
    }

    /// One decode step whose ids, `[seqs, 1]` u32, are already on this model's device: the
    /// previous step's greedy picks, not read back yet. Otherwise as [`TextModel::forward`]
    /// with one token a sequence. The ids are not checked against the vocabulary (the host has
    /// not seen them): a caller passes only ids below the vocabulary size, and only where
    /// [`TextModel::takes_device_ids`] holds.
    ///
    /// # Errors
    /// [`Error::Input`] for ids of another shape, dtype or device, or where device ids are not
    /// taken; [`Error::ContextTooLong`]; cache errors.
    pub(crate) fn forward_device_ids(
        &self,
        ids: &Tensor,
        cache: &mut ModelCache,
    ) -> Result<Tensor> {
        let offsets = cache.offsets();
        let seqs = offsets.len();
        if ids.dims() != [seqs, 1]
            || ids.dtype() != DType::U32
            || !ids.device().same_device(&self.device)
        {
            return Err(Error::Input(format!(
                "device ids must be [{seqs}, 1] u32 on the model's device, found {:?} {:?}",
                ids.dims(),
                ids.dtype()
            )));
        }
        if !self.takes_device_ids() {
            return Err(Error::Input(
                "this checkpoint's per-layer table is smaller than its vocabulary: ids must be checked on the host"
                    .to_string(),
            ));
        }
        let max = self.config.max_position_embeddings;
        if let Some(&o) = offsets.iter().max() {
            if o + 1 > max {
                return Err(Error::ContextTooLong { length: o + 1, max });
            }
        }
        let ids = ids.contiguous()?;
        let ids = StepIds::Device(&ids);
        if let Some(logits) = self.graphs.decode(self, ids, cache)? {
            return Ok(logits);
        }
        self.run_eager(ids, offsets, cache)
    }

    /// Runs `ids` at the positions `offsets` (with their rotary tables) through the stack.
    pub(super) fn run_eager(
        &self,
        ids: StepIds<'_>,
        offsets: Vec<usize>,
        cache: &mut ModelCache,
    ) -> Result<Tensor> {
        let (ids, step) = match ids {
            StepIds::Host(batch) => self.upload(batch, offsets)?,
            StepIds::Device(t) => (t.clone(), self.step_at(offsets, 1)?),
        };
        self.run(&ids, step, cache)
    }

    /// `batch`'s ids `[batch, seq_len]` on the device, and the step of its positions
    /// (`offsets`: each sequence's first).
    fn upload(&self, batch: &[Vec<u32>], offsets: Vec<usize>) -> Result<(Tensor, Step)> {
        let seq_len = batch.first().map_or(0, Vec::len);
        let ids = StepIds::Host(batch).to_owned_tensor(&self.device)?;
        Ok((ids, self.step_at(offsets, seq_len)?))
    }

    /// The step of `seq_len` new tokens a sequence at `offsets`.
    fn step_at(&self, offsets: Vec<usize>, seq_len: usize) -> Result<Step> {
        Ok(Step::new(
            offsets,
            seq_len,
            &self.rope_sliding,
            &self.rope_full,
            self.dtype,
            &self.device,
        )?)
    }

    /// Runs token ids `[batch, seq_len]` at `step`'s positions through the stack, appending to
    /// `cache`; returns the f32 logits of each sequence's last position.
    pub(super) fn run(&self, ids: &Tensor, step: Step, cache: &mut ModelCache) -> Result<Tensor> {
        let x = self.run_layers(ids, step, cache, self.layers.len())?;
        self.logits(&x)
    }

    /// Runs token ids `[batch, seq_len]` through the layers before `end`, appending to `cache`;
    /// returns the residual stream after them (only the last position from the first KV-shared
    /// layer on).
    fn run_layers(
        &self,
        ids: &Tensor,
        mut step: Step,
        cache: &mut ModelCache,
        end: usize,
    ) -> Result<Tensor> {
        let (b, seq_len) = ids.dims2()?;
        // Ids were checked against the vocabulary by `validate`.
        let emb = self
            .embed_tokens
            .lookup_checked_ids(&ids.flatten_all()?, self.dtype)?;
        let emb = emb.reshape((b, seq_len, self.config.hidden_size))?;
        // The references multiply by sqrt(H) rounded to the activation dtype (39.25 in bf16).
        let mut x = scale_in_dtype(&emb, (self.config.hidden_size as f64).sqrt())?;
        let mut ple_all = match &self.ple {
            // Ids were checked against the PLE table by `validate`.
            Some(p) => Some(p.forward_checked_ids(ids, &x)?),
            None => None,
        };

        let mut routing = KvRouting::new(&self.producers);
        // The next layer's input norm, computed by the previous layer's last residual add.
        let mut normed: Option<Tensor> = None;
        if cache.layers.len() != self.layers.len() {
            return Err(Error::Input(format!(
                "cache has {} layers, model has {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        for (i, layer) in self.layers.iter().enumerate().take(end) {
            if i == self.config.first_kv_shared_layer && step.seq_len > 1 {
                // KV-shared layers write no cache, so only the last position matters from here.
                let last = step.seq_len - 1;
                x = x.narrow(1, last, 1)?;
                normed = normed.map(|n| n.narrow(1, last, 1)).transpose()?;
                ple_all = ple_all.map(|p| p.narrow(1, last, 1)).transpose()?;
                step = step.last_only()?;
            }
            let kv = routing.input(i, layer.plan.kv, cache)?;
            let ple_l = ple_all
                .as_ref()
                .map(|p| ple::layer_slice(p, i))
                .transpose()?;
            let next_norm = self
                .layers
                .get(i + 1)
                .filter(|_| i + 1 < end)
                .map(DecoderLayer::input_norm);
            let out =
                layer.forward_chained(&x, normed.as_ref(), &step, ple_l.as_ref(), kv, next_norm)?;
            routing.produced(i, out.view);
            x = out.x;
            normed = out.next_normed;
        }
        Ok(x)
    }

    /// The f32 logits of each sequence's last position of the residual stream `x`.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let last = x.dim(1)? - 1;
        let x = self.norm.forward(&x.narrow(1, last, 1)?.squeeze(1)?)?;
        let logits = match (&self.lm_head, &self.head_part) {
            (Some(head), _) => head.forward(&x)?,
            (None, Some(part)) => self.collective.gather_last(&part.as_head(&x)?)?,
            (None, None) => self.embed_tokens.as_head(&x)?,
        }
        .to_dtype(DType::F32)?;
        Ok(match self.config.final_logit_softcapping {
            Some(c) => ((logits / c)?.tanh()? * c)?,
            None => logits,
        })
    }
}
