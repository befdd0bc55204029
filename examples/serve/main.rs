//! An OpenAI- and Anthropic-compatible HTTP server for a Gemma 4 checkpoint, over the
//! library's continuous-batching engine.
//!
//! ```text
//! cargo run --release --example serve -- --model fixtures/e2b-hf --port 8080
//! cargo run --release --features cuda --example serve -- \
//!     --random-weights fixtures/real-configs/e4b-config.json --dtype bf16 --device cuda
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
//! ```
//! Routes, request fields, errors and the JSON policy are described in [`server`].

mod server;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_gemma::config::Config;
use candle_gemma::kv::QuantBits;
use candle_gemma::{LaunchPolicy, Model};
use clap::{Parser, ValueEnum};

use server::engine::{EngineSettings, Served};
use server::options::{head_dims, Defaults};
use server::ServerConfig;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    Cpu,
    Cuda,
    Metal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DenseKv {
    /// A ring of W slots on sliding layers.
    Rotating,
    /// Every layer keeps every token.
    Simple,
}

#[derive(Debug, Parser)]
#[command(about = "Serve a Gemma 4 checkpoint over OpenAI- and Anthropic-compatible HTTP")]
struct Args {
    /// Checkpoint folder, or a hub id (org/name) with the `hub` feature.
    #[arg(long, conflicts_with = "random_weights")]
    model: Option<String>,
    /// A config.json: serve a model of its real shapes with random weights (benchmarks; no
    /// tokenizer unless --tokenizer gives one, so token-id prompts on /v1/completions only). A
    /// `generation_config.json`
    /// beside it gives the EOS ids and the recommended sampling.
    #[arg(long)]
    random_weights: Option<PathBuf>,
    /// A tokenizer.json for the --random-weights model (one GPU): text prompts, chat and
    /// structured output then work, for benchmarks of those paths at real shapes.
    #[arg(long, requires = "random_weights")]
    tokenizer: Option<PathBuf>,
    /// The name clients give as `model` (default: the --model argument).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every /v1 route.
    #[arg(long)]
    api_key: Option<String>,
    /// Most sequences decoded together.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// KV memory budget of the running sequences, MiB.
    #[arg(long, default_value_t = 8192)]
    kv_budget_mb: usize,
    /// Most requests waiting for admission; more get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Prompt tokens prefilled per engine step (joining prompts share it). 256 keeps a running
    /// E4B stream's inter-token p99 within about 3x its p50 while a 4,096-token prompt joins on
    /// an H200 (512: about 4.5x); see docs/performance.md, "Serving under load".
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Most running sequences whose decode steps replay a CUDA graph (one graph a batch
    /// size, captured the second time a size is seen). 1 keeps graphs to single streams: no
    /// capture pauses when the batch size changes, at a lower aggregate rate.
    #[arg(long, default_value_t = 64)]
    cuda_graph_max_batch: usize,
    /// Byte budget of the prefix store, MiB (0 turns prefix reuse off).
    #[arg(long, default_value_t = 2048)]
    prefix_cache_mb: usize,
    /// KV bits of requests that do not set `kv_bits` (4 or 8; absent: dense KV).
    #[arg(long)]
    kv_bits: Option<usize>,
    /// Group size of quantized KV for requests that do not set `kv_group_size` (default: 64,
    /// or 32 where 64 does not divide the model's head dimensions).
    #[arg(long)]
    kv_group_size: Option<usize>,
    /// The dense KV layout.
    #[arg(long, value_enum, default_value_t = DenseKv::Rotating)]
    dense_kv: DenseKv,
    /// `max_tokens` of requests that do not set it (clipped to the context).
    #[arg(long, default_value_t = 1024)]
    default_max_tokens: usize,
    /// Ignore the sampling the checkpoint's `generation_config.json` recommends: requests that
    /// omit `temperature`, `top_k`, `top_p`, `min_p` or `repetition_penalty` then get
    /// OpenAI's defaults (temperature 1, no filters) instead of the model's (Gemma 4:
    /// temperature 1, top-k 64, top-p 0.95).
    #[arg(long)]
    ignore_generation_config: bool,
    /// Activation dtype (default: bf16 on a GPU, f32 on the CPU).
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Device (default: the GPU the build has, else the CPU).
    #[arg(long, value_enum)]
    device: Option<DeviceKind>,
    /// Tensor parallel over GPUs 0..N of this host (`nccl` feature), one scheduler per GPU fed
    /// the same steps; with `--device cpu`, N CPU ranks that sum through the host (a reference
    /// for tests, not for speed).
    #[arg(long, default_value_t = 1)]
    tp: usize,
}

fn load(args: &Args) -> Result<(Served, String)> {
    let device = candle_gemma::best_device(args.device == Some(DeviceKind::Cpu))?;
    let dtype = match args.dtype {
        Some(Dtype::F32) => DType::F32,
        Some(Dtype::Bf16) => DType::BF16,
        Some(Dtype::F16) => DType::F16,
        None if device.is_cpu() => DType::F32,
        None => DType::BF16,
    };
    match (args.device, device.is_cpu()) {
        (Some(DeviceKind::Cuda), false) if device.is_cuda() => {}
        (Some(DeviceKind::Metal), false) if device.is_metal() => {}
        (Some(DeviceKind::Cuda | DeviceKind::Metal), _) => {
            bail!("--device {:?}: this build has no such device", args.device)
        }
        _ => {}
    }
    let mut policy = LaunchPolicy::from_env();
    policy.cuda_graph_max_batch = args.cuda_graph_max_batch;
    if !policy.install() {
        bail!("another launch policy is already in force in this process");
    }
    let ordinals: Vec<usize> = (0..args.tp.max(1)).collect();
    if let Some(path) = &args.random_weights {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let generation = path.with_file_name("generation_config.json");
        let generation: Option<serde_json::Value> = match std::fs::read_to_string(&generation) {
            Ok(g) => Some(serde_json::from_str(&g)?),
            Err(_) => None,
        };
        let config = Config::from_json(&serde_json::from_str(&text)?, generation.as_ref())?;
        let name = path
            .file_stem()
            .map_or_else(|| "random".into(), |s| s.to_string_lossy().into_owned());
        if args.tokenizer.is_some() && args.tp > 1 {
            bail!("--tokenizer serves one GPU's random-weight model (leave out --tp)");
        }
        let random = |config: Config| -> Result<Model> {
            let model = Model::random(config, &device, dtype, 1)?;
            Ok(match &args.tokenizer {
                Some(t) => model.with_tokenizer(
                    tokenizers::Tokenizer::from_file(t)
                        .map_err(|e| anyhow::anyhow!("reading {}: {e}", t.display()))?,
                )?,
                None => model,
            })
        };
        let served = match args.tp {
            0 | 1 => Served::Single(Arc::new(random(config)?)),
            _ if device.is_cuda() => Served::Sharded(Arc::new(Model::random_sharded(
                config, &ordinals, dtype, 1, None,
            )?)),
            _ => bail!("--tp with --random-weights needs CUDA devices"),
        };
        return Ok((served, format!("random-{name}")));
    }
    let Some(model) = &args.model else {
        bail!("give --model DIR|ID or --random-weights CONFIG.json");
    };
    let path = PathBuf::from(model);
    let on_cpu = device.is_cpu();
    let builder = Model::builder()
        .device(device)
        .dtype(dtype)
        .launch_policy(policy);
    let builder = if path.exists() {
        builder.path(path)
    } else {
        builder.repo(model)
    };
    let served = match args.tp {
        0 | 1 => Served::Single(Arc::new(builder.build()?)),
        n if on_cpu => Served::Sharded(Arc::new(builder.build_sharded_cpu(n)?)),
        _ => Served::Sharded(Arc::new(builder.devices(&ordinals).build_sharded()?)),
    };
    Ok((served, model.clone()))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (served, name) = load(&args)?;
    let kv_bits = args.kv_bits.map(QuantBits::from_bits).transpose()?;
    let dims = head_dims(served.model());
    let kv_group_size = args
        .kv_group_size
        .unwrap_or(if dims.iter().all(|d| d % 64 == 0) {
            64
        } else {
            32
        });
    let mut model_names = vec![args.served_model_name.clone().unwrap_or(name.clone())];
    model_names.push(name);
    let config = ServerConfig {
        model_names,
        api_key: args.api_key.clone(),
        defaults: Defaults {
            kv_bits,
            kv_group_size,
            rotating: args.dense_kv == DenseKv::Rotating,
            max_tokens: args.default_max_tokens,
            head_dims: dims,
            sampling: if args.ignore_generation_config {
                None
            } else {
                served.model().config().recommended_sampling.clone()
            },
            vocab_size: served.model().config().vocab_size,
        },
        engine: EngineSettings {
            max_batch: args.max_batch,
            kv_budget_bytes: args.kv_budget_mb << 20,
            max_queue: args.max_queue,
            prefill_chunk: args.prefill_chunk,
            prefix_cache_bytes: args.prefix_cache_mb << 20,
        },
    };
    let (tx, mut stop) = tokio::sync::mpsc::unbounded_channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let running = server::start(served, config, listener)?;
        eprintln!(
            "serving `{}` on {} (Ctrl-C stops)",
            running.state.model_id(),
            running.url()
        );
        stop.recv().await;
        eprintln!("stopping");
        drop(running);
        Ok::<(), anyhow::Error>(())
    })
}
