//! [`Model`]: a loaded checkpoint (config, weights, tokenizer) and the entry point to
//! generation. Build one with [`Model::builder`].

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tokenizers::Tokenizer;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::gemma4::TextModel;
use crate::generate::constraint::{Constraint, Grammars, TokenConstraint};
use crate::generate::{GenOptions, Generator};
use crate::kernels::policy::LaunchPolicy;
use crate::kv::{CacheConfig, ModelCache};
use crate::parallel::ShardedModel;
use crate::shard::ShardPlan;
use crate::weights::WeightStore;

/// Where the checkpoint comes from.
#[derive(Debug, Clone)]
enum Source {
    Path(PathBuf),
    Repo(String),
}

/// Configures and loads a [`Model`]. Setters cannot fail; [`ModelBuilder::build`] validates.
#[derive(Debug, Clone)]
pub struct ModelBuilder {
    source: Option<Source>,
    revision: Option<String>,
    hub_token: Option<String>,
    hub_cache_dir: Option<PathBuf>,
    hub_endpoint: Option<String>,
    offline: bool,
    progress: bool,
    hub_lock_timeout: Option<std::time::Duration>,
    device: Device,
    dtype: DType,
    launch_policy: Option<LaunchPolicy>,
    /// CUDA ordinals of a tensor-parallel load ([`ModelBuilder::build_sharded`]).
    devices: Vec<usize>,
}

impl Default for ModelBuilder {
    fn default() -> Self {
        Self {
            source: None,
            revision: None,
            hub_token: None,
            hub_cache_dir: None,
            hub_endpoint: None,
            offline: false,
            progress: false,
            hub_lock_timeout: None,
            device: Device::Cpu,
            dtype: DType::F32,
            launch_policy: None,
            devices: Vec::new(),
        }
    }
}

impl ModelBuilder {
    /// Loads from a local checkpoint folder (config.json, safetensors, tokenizer.json).
    pub fn path(mut self, dir: impl Into<PathBuf>) -> Self {
        self.source = Some(Source::Path(dir.into()));
        self
    }

    /// Loads a Hugging Face hub repo (`org/name`), from the local hub cache when the files are
    /// there. Needs the `hub` feature.
    pub fn repo(mut self, repo_id: impl Into<String>) -> Self {
        self.source = Some(Source::Repo(repo_id.into()));
        self
    }

    /// Hub revision (branch, tag or commit); `main` by default.
    pub fn revision(mut self, revision: impl Into<String>) -> Self {
        self.revision = Some(revision.into());
        self
    }

    /// Hub token; by default hf-hub's own lookup (the token file in the hub cache) applies.
    pub fn hub_token(mut self, token: impl Into<String>) -> Self {
        self.hub_token = Some(token.into());
        self
    }

    /// Hub cache folder instead of hf-hub's default.
    pub fn hub_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.hub_cache_dir = Some(dir.into());
        self
    }

    /// Hub base URL (a mirror or a local test hub) instead of `https://huggingface.co`.
    pub fn endpoint(mut self, url: impl Into<String>) -> Self {
        self.hub_endpoint = Some(url.into());
        self
    }

    /// Never touch the network: use only files already in the hub cache.
    pub fn offline(mut self, offline: bool) -> Self {
        self.offline = offline;
        self
    }

    /// Show a progress bar per downloaded file (bytes and rate, on stderr); off by default.
    pub fn progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }

    /// How long to wait for a file that another thread or process is downloading into the
    /// same hub cache while that download makes no progress, before failing with
    /// `HubError::LockTimeout`; 10 minutes by default (`hub::DEFAULT_LOCK_TIMEOUT`).
    pub fn hub_lock_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.hub_lock_timeout = Some(timeout);
        self
    }

    /// The kernels' tuning switches. Without it, [`LaunchPolicy::from_env`]: the defaults with
    /// the documented environment overrides applied. The policy is per process: kernels cache
    /// launch decisions, so every model of a process runs under the first policy built with.
    pub fn launch_policy(mut self, policy: LaunchPolicy) -> Self {
        self.launch_policy = Some(policy);
        self
    }

    /// The device to run on (CPU by default).
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// The activation and weight dtype (f32 by default; bf16 or f16 halve the memory).
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// The GPUs (CUDA ordinals) of a tensor-parallel load: [`ModelBuilder::build_sharded`]
    /// puts rank `i` on `ordinals[i]`. Needs the `nccl` feature for more than one.
    pub fn devices(mut self, ordinals: &[usize]) -> Self {
        self.devices = ordinals.to_vec();
        self
    }

    /// Resolves the source to a local folder.
    fn resolve(&self) -> Result<PathBuf> {
        match &self.source {
            None => Err(Error::Input(
                "no checkpoint given: call .path(dir) or .repo(id) on the builder".to_string(),
            )),
            Some(Source::Path(p)) => Ok(p.clone()),
            #[cfg(feature = "hub")]
            Some(Source::Repo(repo)) => crate::hub::resolve(
                repo,
                &crate::hub::HubOptions {
                    revision: self.revision.clone(),
                    token: self.hub_token.clone(),
                    cache_dir: self.hub_cache_dir.clone(),
                    endpoint: self.hub_endpoint.clone(),
                    offline: self.offline,
                    progress: self.progress,
                    lock_timeout: self.hub_lock_timeout,
                },
            ),
            #[cfg(not(feature = "hub"))]
            Some(Source::Repo(repo)) => Err(Error::Hub {
                repo: repo.clone(),
                file: "config.json".to_string(),
                cause: crate::error::HubError::Disabled,
            }),
        }
    }

    /// Loads config, weights and (when present) `tokenizer.json`.
    ///
    /// # Errors
    /// Anything [`Config::from_dir`], the safetensors loader or the layer constructors report,
    /// [`Error::Tokenizer`] for an unreadable `tokenizer.json`, and [`Error::Config`] (field
    /// `launch_policy`) when another model of this process was built under another policy.
    pub fn build(self) -> Result<Model> {
        self.install_policy()?;
        let dir = self.resolve()?;
        let config = Config::from_dir(&dir)?;
        let store = WeightStore::open(&dir, &self.device, self.dtype)?;
        let fingerprint = fingerprint(&dir, self.dtype)?;
        let text = TextModel::new(config, &store)?;
        Ok(Model {
            text,
            tokenizer: load_tokenizer(&dir)?,
            grammars: Grammars::default(),
            fingerprint,
            dir,
            checkpoint_bytes: store.file_bytes(),
        })
    }

    /// Loads the checkpoint tensor-parallel over the GPUs given to
    /// [`ModelBuilder::devices`]: rank `i` on `ordinals[i]` holds its part of every sharded
    /// weight ([`crate::shard`]), loaded by a thread of its own; the ranks then form one NCCL
    /// group. Drive it with [`ShardedModel::run`] (one thread per GPU in this process).
    ///
    /// # Errors
    /// As [`ModelBuilder::build`]; [`Error::Config`] when the heads do not split over the
    /// devices; [`Error::Rank`] naming the first rank that failed to load (no rank is left
    /// waiting) or a group NCCL could not set up (a build without the `nccl` feature).
    pub fn build_sharded(self) -> Result<ShardedModel> {
        let ordinals = if self.devices.is_empty() {
            vec![0]
        } else {
            self.devices.clone()
        };
        self.build_sharded_on(ordinals.len(), |rank| Ok(Device::new_cuda(ordinals[rank])?))
    }

    /// [`ModelBuilder::build_sharded`] over `world` CPU ranks, which sum through the host
    /// instead of NCCL: the reference the sharded forward is tested against, and a way to run
    /// sharded serving without GPUs in tests. Not for speed.
    ///
    /// # Errors
    /// As [`ModelBuilder::build_sharded`].
    #[doc(hidden)]
    pub fn build_sharded_cpu(self, world: usize) -> Result<ShardedModel> {
        self.build_sharded_on(world.max(1), |_| Ok(Device::Cpu))
    }

    /// [`ModelBuilder::build_sharded`] over `world` ranks, rank `r` on `device(r)` (CPU ranks
    /// sum through the host: the tests' reference for the sharded forward).
    pub(crate) fn build_sharded_on(
        self,
        world: usize,
        device: impl Fn(usize) -> Result<Device> + Sync,
    ) -> Result<ShardedModel> {
        self.install_policy()?;
        let dir = self.resolve()?;
        let config = Config::from_dir(&dir)?;
        let fingerprint = fingerprint(&dir, self.dtype)?;
        let tokenizer = load_tokenizer(&dir)?;
        let unit = crate::shard::cut_unit(config.quantization_group);
        // Checked once here, so a config that does not split fails before any thread starts.
        ShardPlan::with_cut_unit(&config, 0, world, unit)?;
        ShardedModel::load(world, |rank| {
            let device = device(rank)?;
            let plan = ShardPlan::with_cut_unit(&config, rank, world, unit)?;
            let local = plan.local_config(&config);
            let store = WeightStore::open(&dir, &device, self.dtype)?.with_shard(plan);
            Ok(Model {
                text: TextModel::new(local, &store)?,
                tokenizer: tokenizer.clone(),
                grammars: Grammars::default(),
                fingerprint: format!("{fingerprint}-tp{rank}of{world}"),
                dir: dir.clone(),
                checkpoint_bytes: store.file_bytes(),
            })
        })
    }

    /// Checks the dtype and installs the launch policy.
    fn install_policy(&self) -> Result<()> {
        if !matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::Input(format!(
                "dtype {:?} is not supported: use f32, bf16 or f16",
                self.dtype
            )));
        }
        let policy = self.launch_policy.unwrap_or_else(LaunchPolicy::from_env);
        if !crate::kernels::policy::install(policy) {
            return Err(Error::Config {
                field: "launch_policy".to_string(),
                reason: format!(
                    "this process already runs under another launch policy ({:?})",
                    crate::kernels::policy::current()
                ),
            });
        }
        Ok(())
    }
}

/// `tokenizer.json` of a checkpoint folder, when present.
fn load_tokenizer(dir: &Path) -> Result<Option<Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    Tokenizer::from_file(&path)
        .map(Some)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
}

/// A loaded Gemma 4 checkpoint.
///
/// ```no_run
/// # fn main() -> candle_gemma::Result<()> {
/// use candle_gemma::{GenOptions, Model};
/// let model = Model::builder().path("fixtures/e2b-hf").build()?;
/// let mut generator = model.generator(GenOptions { max_tokens: 8, ..Default::default() });
/// let out = generator.generate(&[2, 200, 300])?;
/// println!("{:?}", out.tokens);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Model {
    text: TextModel,
    tokenizer: Option<Tokenizer>,
    /// The grammar compiler of constrained generations, built on first use.
    grammars: Grammars,
    fingerprint: String,
    dir: PathBuf,
    checkpoint_bytes: usize,
}

impl Model {
    /// A model with random weights (N(0, 0.02²) matrices, unit norms) at the shapes of
    /// `config`, built directly on `device`: for benchmarks at real shapes. No tokenizer.
    ///
    /// # Errors
    /// Allocation failure.
    pub fn random(config: Config, device: &Device, dtype: DType, seed: u64) -> Result<Self> {
        Self::from_random_store(config, WeightStore::random(device, dtype, seed), seed)
    }

    /// Like [`Model::random`], with the 2-D matrices (projections and the embedding table, so
    /// the tied head too) MLX-packed at `bits` and `group_size` and kept packed, as a quantized
    /// checkpoint loads. [`Model::checkpoint_bytes`] then gives the packed size it stands for.
    ///
    /// # Errors
    /// Allocation failure; a group size other than 32, 64 or 128.
    pub fn random_packed(
        config: Config,
        device: &Device,
        dtype: DType,
        seed: u64,
        bits: crate::kv::QuantBits,
        group_size: usize,
    ) -> Result<Self> {
        if !crate::kernels::GROUP_SIZES.contains(&group_size) {
            return Err(Error::Quantized {
                tensor: "random weights".to_string(),
                reason: format!(
                    "group size {group_size} is not one of {:?}",
                    crate::kernels::GROUP_SIZES
                ),
            });
        }
        let store = WeightStore::random_packed(device, dtype, seed, bits, group_size);
        Self::from_random_store(config, store, seed)
    }

    /// Like [`Model::random`] (or [`Model::random_packed`] with `packing` as `(bits,
    /// group_size)`), tensor-parallel over the GPUs `ordinals`: each rank generates only its
    /// part of the sharded weights ([`crate::shard`]).
    ///
    /// # Errors
    /// As [`ModelBuilder::build_sharded`].
    pub fn random_sharded(
        config: Config,
        ordinals: &[usize],
        dtype: DType,
        seed: u64,
        packing: Option<(crate::kv::QuantBits, usize)>,
    ) -> Result<ShardedModel> {
        let world = ordinals.len().max(1);
        let unit = crate::shard::cut_unit(packing.map(|(_, group)| group));
        ShardPlan::with_cut_unit(&config, 0, world, unit)?;
        ShardedModel::load(world, |rank| {
            let device = Device::new_cuda(ordinals.get(rank).copied().unwrap_or(0))?;
            let plan = ShardPlan::with_cut_unit(&config, rank, world, unit)?;
            let local = plan.local_config(&config);
            let store = match packing {
                Some((bits, group)) => {
                    WeightStore::random_packed(&device, dtype, seed, bits, group)
                }
                None => WeightStore::random(&device, dtype, seed),
            };
            Self::from_random_store(local, store.with_shard(plan), seed)
        })
    }

    /// This model's rank in its tensor-parallel group (0 on a single device).
    pub fn rank(&self) -> usize {
        self.text.collective().rank()
    }

    /// Ranks in this model's tensor-parallel group (1 on a single device).
    pub fn world(&self) -> usize {
        self.text.collective().world()
    }

    /// Collectives this rank has run so far: two all-reduces per layer per forward (26B-A4B
    /// joins its two feed-forward branches into one) and the head's all-gather; 0 on a single
    /// device.
    pub fn all_reduces(&self) -> usize {
        self.text.collective().calls()
    }

    /// Seconds one all-reduce of `rows` activation rows takes on this group (mean of `reps`);
    /// every rank must call it at once ([`ShardedModel::run`]). 0 on a single device.
    ///
    /// # Errors
    /// Allocation and NCCL errors.
    pub fn time_all_reduce(&self, rows: usize, reps: usize) -> Result<f64> {
        let like = Tensor::zeros(
            (rows.max(1), self.config().hidden_size),
            self.dtype(),
            self.device(),
        )?;
        Ok(self.text.collective().time_sum(&like, reps)?)
    }

    /// Makes this model a rank of a tensor-parallel group.
    ///
    /// # Errors
    /// As [`TextModel::set_collective`].
    pub(crate) fn set_collective(
        &mut self,
        c: crate::kernels::ops::collective::Collective,
    ) -> Result<()> {
        self.text.set_collective(c)
    }

    fn from_random_store(config: Config, store: WeightStore, seed: u64) -> Result<Self> {
        let device = store.device().clone();
        // The CPU generator cannot be seeded; GPU runs are reproducible per seed.
        if !device.is_cpu() {
            device.set_seed(seed)?;
        }
        let text = TextModel::new(config, &store)?;
        Ok(Model {
            text,
            tokenizer: None,
            grammars: Grammars::default(),
            fingerprint: format!("random-{seed}-{:?}", store.dtype()),
            dir: PathBuf::new(),
            checkpoint_bytes: store.generated_bytes(),
        })
    }

    /// Bytes of the checkpoint the model was loaded from: its safetensors files, or for a
    /// random model the stored size of every generated tensor (packed ones packed). Compare
    /// with the bytes the loaded weights hold on the device.
    pub fn checkpoint_bytes(&self) -> usize {
        self.checkpoint_bytes
    }

    /// Starts configuring a model.
    pub fn builder() -> ModelBuilder {
        ModelBuilder::default()
    }

    /// The validated config.
    pub fn config(&self) -> &Config {
        self.text.config()
    }

    /// Longest run of new tokens one [`Model::forward`] pass takes at once:
    /// [`crate::LaunchPolicy::prefill_chunk`] where set, else [`crate::PREFILL_CHUNK_FLASH`]
    /// (4096) on CUDA in f16/bf16 with the flash prefill kernel on, else
    /// [`crate::PREFILL_CHUNK`] (1024).
    pub fn prefill_chunk(&self) -> usize {
        self.text.prefill_chunk()
    }

    /// The decoder stack.
    pub fn text_model(&self) -> &TextModel {
        &self.text
    }

    /// The running form of `constraint` for one generation over this model's tokenizer, for a
    /// decoding loop of the caller's own ([`GenOptions::constraint`] does this for
    /// [`Generator`] and `BatchSession`). The token trie is built on the first call and kept.
    ///
    /// # Errors
    /// [`Error::Constraint`]: no tokenizer, a tokenizer that cannot spell constrained output,
    /// or a schema, pattern or grammar that does not compile.
    pub fn constraint(&self, constraint: &Constraint) -> Result<TokenConstraint> {
        let config = self.config();
        self.grammars.start(
            constraint,
            self.tokenizer.as_ref(),
            &config.eos_token_ids,
            config.vocab_size,
        )
    }

    /// Compiles `constraint` against this model's tokenizer as a generation would, without
    /// generating: a server checks a request's constraint this way before queueing it.
    ///
    /// # Errors
    /// As [`Model::constraint`].
    pub fn check_constraint(&self, constraint: &Constraint) -> Result<()> {
        self.constraint(constraint).map(drop)
    }

    /// This model with `tokenizer` in place of its own (a random-weight model has none): text
    /// prompts, chat and constrained generation then work on it, as for benchmarks of those
    /// paths at real shapes.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] for a tokenizer with more tokens than the model's vocabulary.
    pub fn with_tokenizer(mut self, tokenizer: Tokenizer) -> Result<Self> {
        let (tokens, vocab) = (
            tokenizer.get_vocab_size(true),
            self.text.config().vocab_size,
        );
        if tokens > vocab {
            return Err(Error::Tokenizer(format!(
                "a tokenizer of {tokens} tokens for a vocabulary of {vocab}"
            )));
        }
        self.tokenizer = Some(tokenizer);
        self.grammars = Grammars::default();
        Ok(self)
    }

    /// The tokenizer, when the checkpoint has a `tokenizer.json`.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        self.text.device()
    }

    /// The activation dtype.
    pub fn dtype(&self) -> DType {
        self.text.dtype()
    }

    /// A string that identifies this checkpoint and dtype (prompt caches record it).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Encodes text with the checkpoint's tokenizer; `add_bos` prepends `<bos>` if the
    /// tokenizer does not.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when there is no tokenizer or encoding fails.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let tok = self.require_tokenizer()?;
        let enc = tok
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        let bos = self.config().bos_token_id;
        if add_bos && ids.first() != Some(&bos) {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Decodes ids to text.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when there is no tokenizer or decoding fails.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.require_tokenizer()?
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    fn require_tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| Error::Tokenizer(format!("no tokenizer.json in {}", self.dir.display())))
    }

    /// A fresh cache for one sequence, laid out by `config`.
    ///
    /// # Errors
    /// Invalid cache options (bits, group size).
    pub fn new_cache(&self, config: &CacheConfig) -> Result<ModelCache> {
        Ok(ModelCache::new(
            config,
            &self.text.cache_specs(),
            self.dtype(),
            self.device(),
        )?)
    }

    /// Runs new tokens (one row per sequence, equal lengths) through the model, appending to
    /// `cache`; returns the f32 logits of each sequence's last position, `[B, vocab]`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`], [`Error::ContextTooLong`], [`Error::Input`], cache errors.
    ///
    /// Prompts longer than [`Model::prefill_chunk`] tokens run as consecutive chunks of that
    /// size; the whole batch is validated before the first chunk runs.
    pub fn forward(&self, batch: &[Vec<u32>], cache: &mut ModelCache) -> Result<Tensor> {
        self.text.forward(batch, cache)
    }

    /// A generator with these options.
    pub fn generator(&self, options: GenOptions) -> Generator<'_> {
        Generator::new(self, options)
    }
}

/// The first GPU the build supports (CUDA, then Metal), or the CPU when `cpu` is set or no GPU
/// feature is built.
///
/// # Errors
/// The GPU could not be opened.
pub fn best_device(cpu: bool) -> Result<Device> {
    if cpu {
        return Ok(Device::Cpu);
    }
    Ok(crate::kernels::ops::memory::best_gpu()?)
}

/// FNV-1a over config.json, the weight file names and sizes, and the dtype.
fn fingerprint(dir: &Path, dtype: DType) -> Result<String> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    let config_path = dir.join("config.json");
    let config = std::fs::read(&config_path).map_err(|source| Error::Io {
        path: config_path,
        source,
    })?;
    feed(&config);
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut files: Vec<(String, u64)> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
            .map(|e| {
                let len = e.metadata().map(|m| m.len()).unwrap_or(0);
                (e.file_name().to_string_lossy().into_owned(), len)
            })
            .collect();
        files.sort();
        for (name, len) in files {
            feed(name.as_bytes());
            feed(&len.to_le_bytes());
        }
    }
    feed(format!("{dtype:?}").as_bytes());
    Ok(format!("{h:016x}"))
}

/// Bytes of device memory in use on `device` by every process (total minus free, after the
/// memory pool returned its unused blocks), or `None`
/// where the backend does not report it (the CPU, Metal). Sampled before and after loading a
/// model, the difference is the model's resident size as the driver sees it.
pub fn device_memory_in_use(device: &Device) -> Option<usize> {
    crate::kernels::ops::memory::device_memory_in_use(device)
}
