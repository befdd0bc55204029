//! Whole-model speed at real Gemma 4 shapes with random weights (no checkpoint can be
//! downloaded here): prefill tok/s, decode tok/s at several batch sizes and contexts, bytes
//! read per decode step and the fraction of the bandwidth limit, measured against a
//! device-to-device copy in the same process. Prints one JSON object per line.
//!
//! ```text
//! cargo bench --features cuda --bench model_speed -- --config fixtures/real-configs/e4b-config.json
//! cargo bench --bench model_speed -- --cpu --config fixtures/real-configs/e2b-config.json --prefill 0 --batch 1 --context 128
//! ```
//!
//! On a GPU machine without a toolchain, build here with
//! `cargo bench --features cuda --bench model_speed --no-run`, carry the binary it names
//! (`target/release/deps/model_speed-<hash>`) and run it with the same flags. Without `--config`
//! it measures nothing and says so (a plain `cargo bench` runs it that way).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gemma::config::{Config, KvSource};
use candle_gemma::generate::{Sampler, SamplingOptions};
use candle_gemma::kv::{CacheMode, ModelCache, QuantBits, QuantSpec};
use candle_gemma::{CacheConfig, GenOptions, Model};
use clap::Parser;
use serde_json::json;

#[derive(Debug, Parser)]
struct Args {
    /// config.json of the shape to build (repeatable).
    #[arg(long)]
    config: Vec<PathBuf>,
    /// Prompt lengths for prefill (0: none).
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    prefill: Vec<usize>,
    /// Batch sizes for decode (0: none).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batch: Vec<usize>,
    /// Contexts for decode.
    #[arg(long, value_delimiter = ',', default_value = "128,4096")]
    context: Vec<usize>,
    /// Decode steps timed per point.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Rounds of `steps` decode steps per point; the median round is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// KV cache: dense, q8, q4 (repeatable).
    #[arg(long, value_delimiter = ',', default_value = "dense")]
    kv: Vec<String>,
    /// Weights: bf16, q8, q4 (MLX affine, group 64, kept packed) (repeatable).
    #[arg(long, value_delimiter = ',', default_value = "bf16")]
    weights: Vec<String>,
    /// Build and report memory only (no prefill or decode).
    #[arg(long)]
    memory_only: bool,
    /// After timing each point, run one more prefill / decode step inside cuProfilerStart/Stop,
    /// for `ncu --profile-from-start off` (see scripts/profile.sh).
    #[arg(long)]
    profile: bool,
    /// Run on the CPU.
    #[arg(long)]
    cpu: bool,
    /// Tensor parallel over GPUs 0..N of this host (`nccl` feature): one thread per GPU runs
    /// every point; rank 0 prints, with the all-reduces' share of the time.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// MoE models: replace the router's picks with picks spread evenly over the experts
    /// (`LaunchPolicy::bench_spread_routing`). Random weights route most tokens to a few
    /// experts; a trained router spreads them, which this stands in for. Speed only: the
    /// printed ids and logits are not the model's.
    #[arg(long)]
    spread_routing: bool,
    /// Decode: read the greedy ids back only after a round's last step, so the host enqueues
    /// each step while the GPU runs the one before (the bench's input ids do not depend on
    /// the output). Against the default, which reads every step back as greedy generation
    /// does, this shows what the host's turn between two steps costs.
    #[arg(long)]
    pipelined: bool,
    /// Decode at batch 1 also through the crate's `Generator` (greedy, EOS ignored), with
    /// `GenOptions::lookahead` off and on: the tokens a user's generation loop gets, at the
    /// step time it sees. Prints `"op": "generate"` rows with the first tokens, which must be
    /// the same with and without lookahead. With `--sampled`, also with temperature 1 and no
    /// filters (`"sampling": "tempered"`) and with Gemma 4's recommended top-k 64 and top-p
    /// 0.95 (`"sampling": "recommended"`), both drawn on the device on CUDA.
    #[arg(long)]
    generator: bool,
    /// Decode: also time each batch with every row sampled as Gemma 4's generation config
    /// recommends (temperature 1, top-k 64, top-p 0.95), once with the samplers reading whole
    /// rows (`"pick": "whole_rows"`) and once from each row's 64 best logits picked on the
    /// device (`"pick": "device_best"`, CUDA only), and drawn on the device from those
    /// (`"pick": "device_filtered_draw"`, CUDA only, as `Generator` and `BatchSession` do); and
    /// with OpenAI's defaults (temperature 1, no filter), once on whole rows
    /// (`"pick": "whole_rows_plain"`) and once drawn on the device (`"pick": "device_draw"`,
    /// CUDA only); and with top-p 0.9 alone at temperature 0.5 from the device's candidates
    /// and each row's mass (`"pick": "device_nucleus"`, CUDA only; `"nucleus_whole_rows"`
    /// counts the rows whose cut lay past the candidates, read whole).
    #[arg(long)]
    sampled: bool,
    /// Passed by `cargo bench` to every bench; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Copy bandwidth in bytes/s (bytes read + written) of a device-to-device copy of 1 GiB: on
/// CUDA an SM copy kernel with 16-byte accesses (the driver's memcpy runs on the copy engines,
/// which are slower than what kernels reach), elsewhere `Tensor::copy`.
fn copy_bandwidth(dev: &Device) -> Result<f64> {
    let n = 256 * 1024 * 1024; // f32 elements = 1 GiB
    let a = Tensor::ones(n, DType::F32, dev)?;
    let b = Tensor::zeros(n, DType::F32, dev)?;
    let copy = || -> Result<()> {
        #[cfg(feature = "cuda")]
        if dev.is_cuda() {
            candle_gemma::kernels::cuda::diagnostics::device_copy(&a, &b)?;
            return Ok(());
        }
        drop(a.copy()?);
        Ok(())
    };
    copy()?;
    dev.synchronize()?;
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        copy()?;
    }
    dev.synchronize()?;
    drop(b);
    Ok((2 * 4 * n * reps) as f64 / t.elapsed().as_secs_f64())
}

/// Weight bytes one decode step of one token reads (the tied head reads the whole table; MoE
/// reads top_k experts; embedding lookups read one row, ignored).
fn weight_bytes_per_token(cfg: &Config, bytes_per_param: f64) -> usize {
    let h = cfg.hidden_size;
    let nh = cfg.num_attention_heads;
    let mut params = cfg.vocab_size * h;
    let p = cfg.hidden_size_per_layer_input;
    params += cfg.num_layers() * p * h;
    for l in &cfg.layers {
        params += 2 * nh * l.head_dim * h;
        if l.kv == KvSource::Own {
            params += l.kv_heads * l.head_dim * h * if l.has_v_proj { 2 } else { 1 };
        }
        params += 3 * l.intermediate_size * h + 2 * p * h;
        if let Some(m) = &cfg.moe {
            params += m.num_experts * h + m.top_k * 3 * m.intermediate_size * h;
        }
    }
    (params as f64 * bytes_per_param) as usize
}

/// Bytes per matrix parameter of a weight format: bf16, or MLX affine codes plus one bf16
/// scale and bias per group of 64.
fn bytes_per_param(weights: &str) -> Result<(f64, Option<QuantBits>)> {
    Ok(match weights {
        "bf16" => (2.0, None),
        "q8" => (1.0 + 4.0 / 64.0, Some(QuantBits::Eight)),
        "q4" => (0.5 + 4.0 / 64.0, Some(QuantBits::Four)),
        other => anyhow::bail!("unknown --weights {other}"),
    })
}

/// Runs `f` inside cuProfilerStart/Stop when `on` (CUDA builds), so a profiler started with
/// `--profile-from-start off` sees exactly this region.
fn profiled<T>(on: bool, dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    #[cfg(feature = "cuda")]
    if on && dev.is_cuda() {
        dev.synchronize()?;
        let guard = candle_core::cuda_backend::cudarc::driver::Profiler::new()?;
        let out = f();
        dev.synchronize()?;
        drop(guard);
        return out;
    }
    let _ = (on, dev);
    f()
}

/// Greedy ids of each row of `[B, V]` logits, argmax on the device: only B ids cross to the
/// host, as in greedy generation.
fn greedy(logits: &Tensor) -> Result<Vec<u32>> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return Ok(candle_gemma::kernels::cuda::reduce::argmax_rows(logits)?.to_vec1::<u32>()?);
    }
    Ok(logits.argmax(1)?.to_vec1::<u32>()?)
}

/// How a decode point picks each step's tokens.
#[derive(Clone, Copy, PartialEq)]
enum Pick {
    /// The argmax on the device, one id a row read back.
    Greedy,
    /// Host samplers (`--sampled`) over whole rows read back.
    WholeRows,
    /// Host samplers over each row's best logits picked on the device.
    DeviceBest,
    /// Temperature-only samplers over whole rows read back.
    WholeRowsPlain,
    /// Temperature-only samplers drawn on the device, one id a row read back.
    DeviceDraw,
    /// The recommended samplers (top-k 64, top-p 0.95) drawn on the device from each row's
    /// best logits, one id a row read back.
    DeviceFiltered,
    /// Top-p samplers without a top-k (temperature 0.5, top-p 0.9) from the device's 1,024
    /// candidates and each row's softmax mass; a row whose cut lies past them is read whole
    /// ([`NUCLEUS_WHOLE_ROWS`] counts them).
    DeviceNucleus,
}

/// Rows that [`Pick::DeviceNucleus`] read whole.
static NUCLEUS_WHOLE_ROWS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Pick {
    fn name(self) -> &'static str {
        match self {
            Pick::Greedy => "greedy",
            Pick::WholeRows => "whole_rows",
            Pick::DeviceBest => "device_best",
            Pick::WholeRowsPlain => "whole_rows_plain",
            Pick::DeviceDraw => "device_draw",
            Pick::DeviceFiltered => "device_filtered_draw",
            Pick::DeviceNucleus => "device_nucleus",
        }
    }

    /// Row `i`'s sampler: the recommended sampling, or OpenAI's defaults for the plain picks.
    fn sampler(self, i: u64) -> Sampler {
        if self == Pick::DeviceNucleus {
            return Sampler::new(SamplingOptions {
                temperature: 0.5,
                top_p: Some(0.9),
                seed: i,
                ..Default::default()
            });
        }
        let plain = matches!(self, Pick::WholeRowsPlain | Pick::DeviceDraw);
        Sampler::new(SamplingOptions {
            temperature: 1.0,
            top_k: (!plain).then_some(64),
            top_p: (!plain).then_some(0.95),
            seed: i,
            ..Default::default()
        })
    }
}

/// Each row's next token as `pick` chooses it (`samplers`: one a row).
fn pick_tokens(pick: Pick, logits: &Tensor, samplers: &mut [Sampler]) -> Result<Vec<u32>> {
    match pick {
        Pick::Greedy => greedy(logits),
        Pick::WholeRows | Pick::WholeRowsPlain => Ok(logits
            .to_vec2::<f32>()?
            .iter()
            .zip(samplers.iter_mut())
            .map(|(row, s)| s.sample(row, &[]))
            .collect()),
        Pick::DeviceBest => {
            #[cfg(feature = "cuda")]
            {
                let needed: Vec<(usize, f32)> = samplers
                    .iter()
                    .map(|s| {
                        s.best_needed(&[])
                            .ok_or_else(|| anyhow::anyhow!("a whole-row sampler"))
                    })
                    .collect::<Result<_>>()?;
                let k = needed.iter().map(|n| n.0).max().unwrap_or(1);
                let temps: Vec<f32> = needed.iter().map(|n| n.1).collect();
                let (values, ids) =
                    candle_gemma::kernels::cuda::top_k::top_k_rows(logits, &temps, k)?;
                let (values, ids) = (values.to_vec2::<f32>()?, ids.to_vec2::<u32>()?);
                Ok(samplers
                    .iter_mut()
                    .zip(ids.into_iter().zip(values))
                    .map(|(s, (i, v))| {
                        let best: Vec<(u32, f32)> = i.into_iter().zip(v).collect();
                        s.sample_from_best(&best, &[])
                    })
                    .collect())
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (logits, samplers);
                anyhow::bail!("device-picked candidates need the cuda feature")
            }
        }
        Pick::DeviceNucleus => {
            #[cfg(feature = "cuda")]
            {
                use candle_gemma::kernels::cuda::top_k::{key_mass_chunks, top_k_rows, TOP_K_MAX};
                let temps: Vec<f32> = samplers
                    .iter()
                    .map(|s| {
                        s.nucleus_needed(&[])
                            .ok_or_else(|| anyhow::anyhow!("not a nucleus sampler"))
                    })
                    .collect::<Result<_>>()?;
                let (values, ids) = top_k_rows(logits, &temps, TOP_K_MAX)?;
                let masses = key_mass_chunks(logits, &temps)?.to_vec2::<f64>()?;
                let (values, ids) = (values.to_vec2::<f32>()?, ids.to_vec2::<u32>()?);
                let cols = logits.dim(1)?;
                let mut out = Vec::with_capacity(samplers.len());
                for (r, s) in samplers.iter_mut().enumerate() {
                    let best: Vec<(u32, f32)> = ids[r]
                        .iter()
                        .copied()
                        .zip(values[r].iter().copied())
                        .collect();
                    let mass: f64 = masses[r].iter().sum();
                    out.push(match s.sample_from_nucleus(&best, mass, cols) {
                        Some(id) => id,
                        None => {
                            NUCLEUS_WHOLE_ROWS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            s.sample(&logits.get(r)?.to_vec1::<f32>()?, &[])
                        }
                    });
                }
                Ok(out)
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (logits, samplers);
                anyhow::bail!("device candidates need the cuda feature")
            }
        }
        Pick::DeviceDraw | Pick::DeviceFiltered => {
            #[cfg(feature = "cuda")]
            {
                use candle_gemma::kernels::cuda::{reduce, top_k};
                let draws = samplers
                    .iter()
                    .map(|s| {
                        s.device_draw(&[])
                            .ok_or_else(|| anyhow::anyhow!("a sampler the device cannot draw for"))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let params: Vec<[u32; reduce::DRAW_WORDS]> =
                    draws.iter().map(reduce::draw_words).collect();
                let ids: Vec<u32> =
                    match draws.iter().filter_map(|d| d.filter).map(|f| f.top_k).max() {
                        None => reduce::draw_rows(logits, &params)?.to_vec1()?,
                        Some(k) => {
                            let temps: Vec<f32> = draws.iter().map(|d| d.temperature).collect();
                            let (values, best) = top_k::top_k_rows(logits, &temps, k)?;
                            top_k::draw_from_best(&values, &best, &params)?.to_vec1()?
                        }
                    };
                for (s, &id) in samplers.iter_mut().zip(&ids) {
                    s.accept_device_draw(id);
                }
                Ok(ids)
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (logits, samplers);
                anyhow::bail!("device draws need the cuda feature")
            }
        }
    }
}

/// The `n` largest logits of the first row of `[B, V]` logits, as `(id, logit)` from the
/// largest: builds that must compute alike print the same ids, with logits that differ by
/// rounding only (random weights leave near-ties that rounding may reorder).
fn top_logits(logits: &Tensor, n: usize) -> Result<Vec<(u32, f32)>> {
    let row = logits.get(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    Ok(ids
        .into_iter()
        .take(n)
        .map(|i| (i, row[i as usize]))
        .collect())
}

fn cache_config(kv: &str) -> Result<CacheConfig> {
    let mode = match kv {
        "dense" => CacheMode::Rotating,
        "q8" => CacheMode::Quantized(QuantSpec {
            bits: QuantBits::Eight,
            group_size: 64,
            start: 0,
        }),
        "q4" => CacheMode::Quantized(QuantSpec {
            bits: QuantBits::Four,
            group_size: 64,
            start: 0,
        }),
        other => anyhow::bail!("unknown --kv {other}"),
    };
    Ok(CacheConfig { mode })
}

/// One prefill of `len` tokens from a fresh cache.
struct Prefill {
    cache: ModelCache,
    /// Seconds until the greedy id is on the host.
    secs: f64,
    /// Seconds until `forward` returned (the host's share; near `secs` when the host is the
    /// limit or the forward waits on the device).
    host_secs: f64,
    /// The last position's logits.
    logits: Tensor,
}

fn prefill(model: &Model, cc: &CacheConfig, len: usize, seed: u32) -> Result<Prefill> {
    let mut cache = model.new_cache(cc)?;
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..len as u32).map(|i| (i * 7919 + seed) % vocab).collect();
    let t = Instant::now();
    let logits = model.forward(&[prompt], &mut cache)?;
    let host_secs = t.elapsed().as_secs_f64();
    let _ = greedy(&logits)?;
    Ok(Prefill {
        cache,
        secs: t.elapsed().as_secs_f64(),
        host_secs,
        logits,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.config.is_empty() {
        eprintln!("model_speed: no --config given, nothing to measure (see --help)");
        return Ok(());
    }
    if args.spread_routing {
        let mut policy = candle_gemma::kernels::policy::LaunchPolicy::from_env();
        policy.bench_spread_routing = true;
        if !policy.install() {
            anyhow::bail!("model_speed: another launch policy was installed first");
        }
    }
    let dev = candle_gemma::best_device(args.cpu)?;
    let bw = copy_bandwidth(&dev)?;
    println!(
        "{}",
        json!({"device": format!("{dev:?}"), "copy_bandwidth_gb_s": bw / 1e9, "tp": args.tp})
    );
    for path in &args.config {
        let text = std::fs::read_to_string(path)?;
        let cfg = Config::from_json(&serde_json::from_str(&text)?, None)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        for weights in &args.weights {
            let (bpp, bits) = bytes_per_param(weights)?;
            let point = Point {
                name: &name,
                weights,
                wbytes: weight_bytes_per_token(&cfg, bpp),
                bw,
            };
            let before = candle_gemma::device_memory_in_use(&dev);
            let t = Instant::now();
            if args.tp > 1 {
                let ordinals: Vec<usize> = (0..args.tp).collect();
                let packing = bits.map(|b| (b, 64));
                let sharded =
                    Model::random_sharded(cfg.clone(), &ordinals, DType::BF16, 1, packing)?;
                let build_s = t.elapsed().as_secs_f64();
                sharded.run(|m| -> Result<()> {
                    if m.rank() == 0 {
                        report_memory(m, &point, build_s, None);
                    }
                    measure(m, &args, &point)
                })?;
                continue;
            }
            let model = match bits {
                None => Model::random(cfg.clone(), &dev, DType::BF16, 1)?,
                Some(b) => Model::random_packed(cfg.clone(), &dev, DType::BF16, 1, b, 64)?,
            };
            dev.synchronize()?;
            let after = candle_gemma::device_memory_in_use(&dev);
            let device_delta = before.zip(after).map(|(b, a)| a.saturating_sub(b));
            let build_s = t.elapsed().as_secs_f64();
            report_memory(&model, &point, build_s, device_delta);
            measure(&model, &args, &point)?;
        }
    }
    Ok(())
}

/// What every line of one model and weight format names.
struct Point<'a> {
    name: &'a str,
    weights: &'a str,
    wbytes: usize,
    bw: f64,
}

fn report_memory(model: &Model, p: &Point<'_>, build_s: f64, device: Option<usize>) {
    let checkpoint = model.checkpoint_bytes();
    println!(
        "{}",
        json!({
            "model": p.name, "weights": p.weights, "op": "memory", "tp": model.world(),
            "build_s": build_s,
            "checkpoint_bytes": checkpoint, "resident_bytes": model.text_model().resident_bytes(),
            "device_bytes": device,
            "device_over_checkpoint": device.map(|d| d as f64 / checkpoint as f64),
            "weight_bytes_read_per_token": p.wbytes,
        })
    );
}

/// The all-reduces a run of `calls` took, as `(per run, ms of one alone, share of secs)`; on
/// every rank at once (the timing is an all-reduce itself).
fn all_reduce_share(model: &Model, calls: f64, rows: usize, secs: f64) -> Result<(f64, f64, f64)> {
    if model.world() == 1 {
        return Ok((0.0, 0.0, 0.0));
    }
    let one = model.time_all_reduce(rows, 20)?;
    Ok((calls, one * 1e3, calls * one / secs))
}

/// Every prefill and decode point of `args` on `model` (on every rank of a sharded one, in
/// step; rank 0 prints).
fn measure(model: &Model, args: &Args, p: &Point<'_>) -> Result<()> {
    if args.memory_only {
        return Ok(());
    }
    let dev = model.device().clone();
    let print = model.rank() == 0;
    let fused = std::env::var("CANDLE_GEMMA_UNFUSED").map_or(true, |v| v.is_empty() || v == "0");
    let (name, weights, wbytes, bw) = (p.name, p.weights, p.wbytes, p.bw);
    let tp = model.world();
    for kv in &args.kv {
        let cc = cache_config(kv)?;
        for &len in args.prefill.iter().filter(|&&l| l > 0) {
            // Warm-up at the timed length (first uses of kernels and cuBLAS plans
            // for these shapes), then the median of three.
            let top = top_logits(&prefill(model, &cc, len, 0)?.logits, 5)?;
            let calls0 = model.all_reduces();
            let mut times = (1..=3)
                .map(|seed| prefill(model, &cc, len, seed).map(|r| (r.secs, r.host_secs)))
                .collect::<Result<Vec<(f64, f64)>>>()?;
            let calls = (model.all_reduces() - calls0) as f64 / 3.0;
            times.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (secs, host_secs) = times[1];
            profiled(args.profile, &dev, || prefill(model, &cc, len, 2))?;
            let rows = len.min(model.prefill_chunk());
            let (ar_calls, ar_ms, ar_share) = all_reduce_share(model, calls, rows, secs)?;
            if print {
                println!(
                    "{}",
                    json!({"model": name, "weights": weights, "kv": kv, "fused": fused, "tp": tp,
                        "spread_routing": args.spread_routing,
                        "op": "prefill", "tokens": len, "tok_s": len as f64 / secs, "top": top,
                        "ms": secs * 1e3, "host_ms": host_secs * 1e3,
                        "all_reduces": ar_calls, "all_reduce_ms": ar_ms, "all_reduce_share": ar_share})
                );
            }
        }
        for &ctx in &args.context {
            if args.generator {
                for lookahead in [false, true] {
                    generate_point(model, args, p, kv, &cc, ctx, (lookahead, "greedy"))?;
                    if args.sampled {
                        for sampling in ["tempered", "recommended"] {
                            generate_point(model, args, p, kv, &cc, ctx, (lookahead, sampling))?;
                        }
                    }
                }
            }
            let mut picks = vec![Pick::Greedy];
            if args.sampled {
                picks.extend([Pick::WholeRows, Pick::WholeRowsPlain]);
                if dev.is_cuda() {
                    picks.extend([
                        Pick::DeviceBest,
                        Pick::DeviceFiltered,
                        Pick::DeviceDraw,
                        Pick::DeviceNucleus,
                    ]);
                }
            }
            for (&b, &pick) in args
                .batch
                .iter()
                .filter(|&&b| b > 0)
                .flat_map(|b| picks.iter().map(move |p| (b, p)))
            {
                let mut samplers: Vec<Sampler> = (0..b as u64).map(|i| pick.sampler(i)).collect();
                let seqs = (0..b)
                    .map(|i| prefill(model, &cc, ctx, i as u32).map(|c| c.cache))
                    .collect::<Result<Vec<_>>>()?;
                let mut cache = ModelCache::batch(seqs)?;
                let kv_bytes = cache.memory_bytes();
                let tokens: Vec<Vec<u32>> = (0..b).map(|i| vec![100 + i as u32]).collect();
                // Warm-up.
                let _ = greedy(&model.forward(&tokens, &mut cache)?)?;
                // `host_ms`: the time until `forward` returns, i.e. the host's cost of
                // enqueueing the step; near `step_ms` means the host is the limit.
                // Several rounds, reporting the median round: the host's speed drifts
                // between rounds on a shared machine.
                let mut rounds = Vec::new();
                // The first sequence's greedy id at each step of the first round: runs
                // that must compute alike (CUDA graphs on and off) print the same list.
                let mut step_ids = Vec::new();
                let calls0 = model.all_reduces();
                for round in 0..args.rounds.max(1) {
                    let mut enqueue = 0.0;
                    let t = Instant::now();
                    for step in 0..args.steps {
                        let e = Instant::now();
                        let logits = model.forward(&tokens, &mut cache)?;
                        enqueue += e.elapsed().as_secs_f64();
                        if args.pipelined && step + 1 < args.steps {
                            continue;
                        }
                        let ids = pick_tokens(pick, &logits, &mut samplers)?;
                        if round == 0 {
                            step_ids.push(ids[0]);
                        }
                    }
                    let n = args.steps as f64;
                    rounds.push((t.elapsed().as_secs_f64() / n, enqueue / n * 1e3));
                }
                let steps = (args.steps * args.rounds.max(1)) as f64;
                let calls = (model.all_reduces() - calls0) as f64 / steps;
                rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
                let (secs, host_ms) = rounds[rounds.len() / 2];
                profiled(args.profile, &dev, || {
                    greedy(&model.forward(&tokens, &mut cache)?)
                })?;
                let (ar_calls, ar_ms, ar_share) = all_reduce_share(model, calls, b, secs)?;
                let bytes = wbytes + kv_bytes;
                // Whether batch-1 steps replayed a CUDA graph (and if not, why).
                #[cfg(feature = "cuda")]
                let graph = model.text_model().cuda_graph_state();
                #[cfg(not(feature = "cuda"))]
                let graph = "cuda feature off";
                if print {
                    println!(
                        "{}",
                        json!({
                            "model": name, "weights": weights, "kv": kv, "fused": fused, "tp": tp,
                            "spread_routing": args.spread_routing,
                            "op": "decode", "batch": b, "context": ctx, "cuda_graph": graph,
                            "pick": pick.name(),
                            "nucleus_whole_rows": NUCLEUS_WHOLE_ROWS.swap(0, std::sync::atomic::Ordering::Relaxed),
                            "pipelined": args.pipelined,
                            "tok_s": b as f64 / secs, "step_ms": secs * 1e3, "host_ms": host_ms,
                            "bytes_per_step": bytes, "bandwidth_fraction": (bytes as f64 / secs) / bw,
                            "all_reduces_per_step": ar_calls, "all_reduce_ms": ar_ms,
                            "all_reduce_share": ar_share,
                            "step_ids": step_ids,
                        })
                    );
                }
            }
        }
    }
    Ok(())
}

/// Batch-1 decode through `Generator::stream` from a prompt of `ctx` tokens: the median over
/// `args.rounds` generations (after one to warm up) of the time from the first token to the
/// last over the steps between them. Each generation reuses the cached prompt (one token is
/// prefilled again).
fn generate_point(
    model: &Model,
    args: &Args,
    p: &Point<'_>,
    kv: &str,
    cc: &CacheConfig,
    ctx: usize,
    (lookahead, sampling): (bool, &str),
) -> Result<()> {
    let (tempered, filtered) = (sampling != "greedy", sampling == "recommended");
    let steps = args.steps.max(1);
    let options = GenOptions {
        max_tokens: steps + 1,
        ignore_eos: true,
        cache: *cc,
        lookahead,
        sampling: SamplingOptions {
            temperature: if tempered { 1.0 } else { 0.0 },
            top_k: filtered.then_some(64),
            top_p: filtered.then_some(0.95),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut generator = model.generator(options);
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..ctx.max(1) as u32)
        .map(|i| (i * 7919 + 3) % vocab)
        .collect();
    let mut rounds = Vec::new();
    let mut tokens = Vec::new();
    for round in 0..=args.rounds.max(1) {
        let mut first = None;
        let mut ids = Vec::new();
        for step in generator.stream(&prompt)? {
            ids.push(step?.token);
            first.get_or_insert_with(Instant::now);
        }
        let secs = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
        if round > 0 {
            rounds.push(secs / steps as f64);
        }
        tokens = ids;
    }
    rounds.sort_by(f64::total_cmp);
    let secs = rounds[rounds.len() / 2];
    if model.rank() == 0 {
        tokens.truncate(16);
        println!(
            "{}",
            json!({"model": p.name, "weights": p.weights, "kv": kv, "tp": model.world(),
                "op": "generate", "batch": 1, "context": ctx, "lookahead": lookahead,
                "sampling": sampling,
                "tok_s": 1.0 / secs, "step_ms": secs * 1e3, "tokens": tokens})
        );
    }
    Ok(())
}
