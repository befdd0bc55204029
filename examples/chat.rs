//! Interactive multi-turn chat in the terminal.
//!
//! ```text
//! cargo run --release --example chat -- --model fixtures/e2b-hf
//! ```
//! Each turn prefills only its new tokens (the cache is kept across turns). Answers are
//! sampled as the checkpoint's `generation_config.json` recommends (`--greedy` for greedy
//! decoding, `--temperature` to change the temperature). Thinking is shown dimmed. Ctrl-C stops the current answer, not the program; Ctrl-D (end of input) quits.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use candle_gemma::chat::{ChatSession, OutputEvent};
use candle_gemma::generate::SamplingOptions;
use candle_gemma::{GenOptions, Model};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Chat with a Gemma 4 checkpoint")]
struct Args {
    /// Checkpoint folder, or a hub id with the `hub` feature.
    #[arg(long)]
    model: String,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    /// Let the model think before answering.
    #[arg(long)]
    think: bool,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy); the other sampling settings stay the model's
    /// recommendation.
    #[arg(long)]
    temperature: Option<f32>,
    /// Greedy decoding instead of the model's recommended sampling (`generation_config.json`;
    /// Gemma 4: temperature 1, top-k 64, top-p 0.95).
    #[arg(long)]
    greedy: bool,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run on the CPU even when a GPU feature is built.
    #[arg(long)]
    cpu: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let path = PathBuf::from(&args.model);
    let builder = Model::builder()
        .device(candle_gemma::best_device(args.cpu)?)
        .progress(true);
    let model = if path.exists() {
        builder.path(path)
    } else {
        builder.repo(&args.model)
    }
    .build()?;
    let mut sampling = match args.greedy {
        true => SamplingOptions::default(),
        false => SamplingOptions::recommended(model.config(), args.seed),
    };
    if let Some(t) = args.temperature {
        sampling.temperature = t;
    }
    let options = GenOptions {
        max_tokens: args.max_tokens,
        sampling,
        ..Default::default()
    };
    options.validate()?;

    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))?;

    let mut chat = ChatSession::new(&model, options)?.with_thinking(args.think);
    if let Some(s) = &args.system {
        chat = chat.with_system(s.clone());
    }

    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    loop {
        write!(stdout, "\n> ")?;
        stdout.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        interrupted.store(false, Ordering::SeqCst);
        let reply = chat.send(line, |event| {
            let mut out = std::io::stdout();
            let _ = match event {
                OutputEvent::Thinking(t) => write!(out, "\x1b[2m{t}\x1b[0m"),
                OutputEvent::Text(t) => write!(out, "{t}"),
                OutputEvent::ToolCall { name, arguments } => {
                    write!(out, "\n[tool call] {name}({arguments})\n")
                }
            };
            let _ = out.flush();
            !interrupted.load(Ordering::SeqCst)
        })?;
        let s = &reply.stats;
        eprintln!(
            "\n[{} prompt tokens, {} new; {} generated at {:.1} tok/s{}]",
            s.prompt_tokens,
            s.prefilled_tokens,
            s.generated_tokens,
            s.decode_tok_s(),
            if reply.finish.is_none() {
                "; stopped"
            } else {
                ""
            }
        );
    }
    Ok(())
}
