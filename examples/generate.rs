//! Generate text from a Gemma 4 checkpoint.
//!
//! ```text
//! cargo run --release --example generate -- --model fixtures/e2b-hf --prompt "Hello" --max-tokens 16
//! cargo run --release --example generate -- --model fixtures/e2b-hf --prompt-ids 2,17,40 --prompt-ids 2,300 --json
//! ```
//! Several `--prompt`/`--prompt-ids` run as one batch. Without `--json` the text streams to
//! stdout and the speed goes to stderr.
//!
//! `--tp N` (the `nccl` feature) shards the checkpoint over GPUs 0..N of this host, tensor
//! parallel: one thread per GPU runs the same generation, rank 0 prints.
//! ```text
//! cargo run --release --features nccl --example generate -- --model DIR --tp 2 --prompt "Hello"
//! ```

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_gemma::generate::{BatchSession, SamplingOptions};
use candle_gemma::kv::{CacheMode, QuantBits, QuantSpec};
use candle_gemma::{CacheConfig, GenOptions, Model, ModelBuilder};
use clap::{Parser, ValueEnum};
use serde_json::json;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum KvKind {
    Simple,
    Rotating,
    Quantized,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

#[derive(Debug, Parser)]
#[command(about = "Generate text with a Gemma 4 checkpoint")]
struct Args {
    /// Checkpoint folder, or a hub id (org/name) with the `hub` feature.
    #[arg(long)]
    model: String,
    /// Hub revision.
    #[arg(long)]
    revision: Option<String>,
    /// A text prompt (repeatable: several run as one batch). Encoded with `<bos>` first.
    #[arg(long)]
    prompt: Vec<String>,
    /// A prompt as comma-separated token ids (repeatable: several run as one batch).
    #[arg(long = "prompt-ids", value_delimiter = ',', num_args = 1, action = clap::ArgAction::Append)]
    prompt_ids: Vec<String>,
    /// Most tokens to generate per sequence.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k filter.
    #[arg(long)]
    top_k: Option<usize>,
    /// Top-p filter.
    #[arg(long)]
    top_p: Option<f32>,
    /// Min-p filter.
    #[arg(long)]
    min_p: Option<f32>,
    /// Repetition penalty.
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Frequency penalty (OpenAI's, in [-2, 2]).
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// Presence penalty (OpenAI's, in [-2, 2]).
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// A logit bias `ID:BIAS` (OpenAI's, bias in [-100, 100]); repeat for several tokens.
    #[arg(long, value_parser = parse_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Greedy decoding on CUDA: wait for each token on the host before the next step is
    /// enqueued (`GenOptions::lookahead` off; the tokens are the same).
    #[arg(long)]
    no_lookahead: bool,
    /// Activation dtype.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
    /// Run on the CPU even when a GPU feature is built.
    #[arg(long)]
    cpu: bool,
    /// Print one JSON line instead of streaming.
    #[arg(long)]
    json: bool,
    /// KV cache layout.
    #[arg(long, value_enum, default_value_t = KvKind::Rotating)]
    kv_cache: KvKind,
    /// Bits of the quantized KV cache (4 or 8).
    #[arg(long, default_value_t = 8)]
    kv_bits: usize,
    /// Group size of the quantized KV cache (32, 64, 128).
    #[arg(long, default_value_t = 64)]
    kv_group_size: usize,
    /// Tokens kept dense before the quantized cache converts.
    #[arg(long, default_value_t = 0)]
    quantized_kv_start: usize,
    /// Prompt cache file: loaded if present, saved after generation (single prompt only).
    #[arg(long)]
    prompt_cache: Option<PathBuf>,
    /// Prefill chunk size.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Tensor parallel over this many GPUs (0..N) of this host (needs the `nccl` feature).
    #[arg(long, default_value_t = 1)]
    tp: usize,
}

fn builder(args: &Args) -> Result<ModelBuilder> {
    let dtype = match args.dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
    };
    let mut b = Model::builder().dtype(dtype).progress(!args.json);
    let path = PathBuf::from(&args.model);
    b = if path.exists() {
        b.path(path)
    } else {
        b.repo(&args.model)
    };
    if let Some(r) = &args.revision {
        b = b.revision(r);
    }
    Ok(b)
}

fn options(args: &Args) -> Result<GenOptions> {
    let mode = match args.kv_cache {
        KvKind::Simple => CacheMode::Simple,
        KvKind::Rotating => CacheMode::Rotating,
        KvKind::Quantized => CacheMode::Quantized(QuantSpec {
            bits: QuantBits::from_bits(args.kv_bits)?,
            group_size: args.kv_group_size,
            start: args.quantized_kv_start,
        }),
    };
    let options = GenOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingOptions {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            frequency_penalty: args.frequency_penalty,
            presence_penalty: args.presence_penalty,
            logit_bias: args.logit_bias.clone(),
            seed: args.seed,
        },
        stop_strings: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        cache: CacheConfig { mode },
        prefill_chunk: args.prefill_chunk,
        lookahead: !args.no_lookahead,
        ..Default::default()
    };
    // `--top-p 2`, `--temperature NaN`, ... are refused with the option's name.
    options.validate()?;
    Ok(options)
}

fn prompts(args: &Args, model: &Model) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for p in &args.prompt {
        out.push(model.encode(p, true)?);
    }
    // clap splits each --prompt-ids on commas; an empty string separates prompts.
    let mut ids_groups: Vec<Vec<u32>> = Vec::new();
    for raw in std::env::args().collect::<Vec<_>>().windows(2) {
        if raw[0] == "--prompt-ids" {
            let ids = raw[1]
                .split(',')
                .map(|s| {
                    s.trim()
                        .parse::<u32>()
                        .with_context(|| format!("bad token id `{s}`"))
                })
                .collect::<Result<Vec<_>>>()?;
            ids_groups.push(ids);
        }
    }
    if ids_groups.is_empty() && !args.prompt_ids.is_empty() {
        bail!("use --prompt-ids 2,17,40 (one comma-separated list per flag)");
    }
    out.extend(ids_groups);
    if out.is_empty() {
        bail!("give at least one --prompt or --prompt-ids");
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args = Args::parse();
    // Options are checked before the model loads (a bad flag fails fast).
    let opts = options(&args)?;
    if args.tp > 1 {
        // One thread per GPU runs the same generation; only rank 0 prints.
        let sharded = builder(&args)?
            .devices(&(0..args.tp).collect::<Vec<_>>())
            .build_sharded()?;
        let prompts = prompts(&args, sharded.first())?;
        sharded.run(|model| -> Result<()> {
            let opts = opts.clone();
            if prompts.len() == 1 {
                run_single(&args, model, opts, &prompts[0])
            } else {
                run_batch(&args, model, opts, &prompts)
            }
        })?;
        return Ok(());
    }
    let model = builder(&args)?
        .device(candle_gemma::best_device(args.cpu)?)
        .build()?;
    let prompts = prompts(&args, &model)?;
    if prompts.len() == 1 {
        run_single(&args, &model, opts, &prompts[0])
    } else {
        run_batch(&args, &model, opts, &prompts)
    }
}

fn run_single(args: &Args, model: &Model, opts: GenOptions, prompt: &[u32]) -> Result<()> {
    // Tensor parallel: every rank generates the same tokens; rank 0 prints.
    let quiet = model.rank() != 0;
    // Each rank caches its own part of the K/V: one file per rank.
    let prompt_cache = args.prompt_cache.as_ref().map(|p| match model.world() {
        1 => p.clone(),
        _ => p.with_extension(format!("rank{}", model.rank())),
    });
    let mut gen = model.generator(opts);
    if let Some(path) = &prompt_cache {
        if path.exists() {
            gen.load_prompt_cache(path)?;
        }
    }
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut stream = gen.stream(prompt)?;
    let stdout = std::io::stdout();
    for step in stream.by_ref() {
        let step = step?;
        ids.push(step.token);
        text.push_str(&step.text);
        if !args.json && !quiet {
            let mut out = stdout.lock();
            write!(out, "{}", step.text)?;
            out.flush()?;
        }
    }
    let stats = stream.stats();
    drop(stream);
    if let Some(path) = &prompt_cache {
        gen.save_prompt_cache(path)?;
    }
    if quiet {
        return Ok(());
    }
    if args.json {
        println!(
            "{}",
            json!({
                "sequences": [{"ids": ids, "text": text}],
                "stats": {
                    "prompt_tokens": stats.prompt_tokens,
                    "prefilled_tokens": stats.prefilled_tokens,
                    "generated_tokens": stats.generated_tokens,
                    "prefill_tok_s": stats.prefill_tok_s(),
                    "decode_tok_s": stats.decode_tok_s(),
                    "kv_bytes": stats.kv_bytes,
                    "cuda_graph": graph_state(model),
                    "tp": model.world(),
                }
            })
        );
    } else {
        println!();
        eprintln!(
            "prompt {} tokens ({} prefilled) at {:.1} tok/s, generated {} tokens at {:.1} tok/s, KV {} bytes",
            stats.prompt_tokens,
            stats.prefilled_tokens,
            stats.prefill_tok_s(),
            stats.generated_tokens,
            stats.decode_tok_s(),
            stats.kv_bytes
        );
    }
    Ok(())
}

/// Whether decode steps replayed a CUDA graph (per batch size once several were seen), and if
/// not, why.
fn graph_state(model: &Model) -> String {
    #[cfg(feature = "cuda")]
    {
        model.text_model().cuda_graph_state()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = model;
        "cuda feature off".to_string()
    }
}

fn run_batch(args: &Args, model: &Model, opts: GenOptions, prompts: &[Vec<u32>]) -> Result<()> {
    if args.prompt_cache.is_some() {
        bail!("--prompt-cache works with a single prompt");
    }
    let quiet = model.rank() != 0;
    let mut session = BatchSession::new(model, opts);
    for p in prompts {
        session.add(p)?;
    }
    let mut kv_peak = session.kv_bytes();
    let mut results: Vec<(Vec<u32>, String)> = vec![(Vec::new(), String::new()); prompts.len()];
    while !session.is_empty() {
        for (id, step) in session.step()? {
            results[id.0].0.push(step.token);
            results[id.0].1.push_str(&step.text);
            if !args.json && !quiet && !step.text.is_empty() {
                println!("[{}] {}", id.0, step.text);
            }
        }
        kv_peak = kv_peak.max(session.kv_bytes());
    }
    if quiet {
        return Ok(());
    }
    let generated: usize = results.iter().map(|r| r.0.len()).sum();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let prefill_tok_s = if session.prefill_secs > 0.0 {
        prompt_tokens as f64 / session.prefill_secs
    } else {
        0.0
    };
    let decode_tok_s = if session.decode_secs > 0.0 {
        generated.saturating_sub(prompts.len()) as f64 / session.decode_secs
    } else {
        0.0
    };
    if args.json {
        let seqs: Vec<_> = results
            .iter()
            .map(|(ids, text)| json!({"ids": ids, "text": text}))
            .collect();
        println!(
            "{}",
            json!({
                "sequences": seqs,
                "stats": {
                    "prompt_tokens": prompt_tokens,
                    "generated_tokens": generated,
                    "prefill_tok_s": prefill_tok_s,
                    "decode_tok_s": decode_tok_s,
                    "kv_bytes": kv_peak,
                    "tp": model.world(),
                    "cuda_graph": graph_state(model),
                }
            })
        );
    } else {
        eprintln!("batch of {}: prefill {prefill_tok_s:.1} tok/s, decode {decode_tok_s:.1} tok/s (aggregate), KV peak {kv_peak} bytes", prompts.len());
    }
    Ok(())
}

/// `ID:BIAS` as a `(token id, bias)` pair.
fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once(':')
        .ok_or_else(|| format!("expected ID:BIAS, got {s:?}"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|e| format!("token id {id:?}: {e}"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|e| format!("bias {bias:?}: {e}"))?;
    Ok((id, bias))
}
