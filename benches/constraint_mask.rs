//! Host time of constrained decoding at Gemma 4's vocabulary size (262,144 tokens), over a
//! synthetic SentencePiece-style tokenizer of that size: the compiler's token trie (built once
//! per model), starting a constraint (once per request; again, for a constraint started
//! before), then each step's mask of allowed
//! tokens and the parser's advance past the chosen one. The tokens are chosen by a fixed pseudo-random walk among the allowed
//! ones, so strings run long, as a free answer's do. Prints one JSON line per constraint.
//!
//! ```text
//! cargo bench --bench constraint_mask
//! cargo bench --bench constraint_mask -- --write-tokenizer tokenizer.json  # the tokenizer only
//! ```

use std::collections::HashSet;
use std::str::FromStr;
use std::time::Instant;

use anyhow::Result;
use candle_gemma::generate::{Constraint, ConstraintCompiler};
use serde_json::json;
use tokenizers::Tokenizer;

/// Gemma 4's vocabulary size.
const VOCAB: usize = 262_144;
/// The special tokens, ids 0 up; `<eos>` (1) ends a complete output.
const SPECIALS: [&str; 6] = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"];
/// Decode steps measured per constraint.
const STEPS: usize = 256;

/// A tokenizer.json of `VOCAB` pieces: the specials, the 256 byte pieces, then unique pieces
/// of 1 to 10 characters (letters, digits, JSON punctuation, some accented and CJK
/// characters), half of them starting a word (`▁`).
fn synthetic_tokenizer() -> Result<Tokenizer> {
    let alphabet: Vec<char> =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]:,\"'.-_ éèüñ中文字日本"
            .chars()
            .collect();
    let mut vocab = serde_json::Map::new();
    let mut seen = HashSet::new();
    let mut added = Vec::new();
    for (id, s) in SPECIALS.iter().enumerate() {
        vocab.insert(s.to_string(), json!(id));
        seen.insert(s.to_string());
        added.push(
            json!({"id": id, "content": s, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    for b in 0..=255u32 {
        let piece = format!("<0x{b:02X}>");
        seen.insert(piece.clone());
        vocab.insert(piece, json!(vocab.len()));
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    while vocab.len() < VOCAB {
        let len = 1 + (next() % 10) as usize;
        let mut piece = String::new();
        if next() % 2 == 0 {
            piece.push('▁');
        }
        for _ in 0..len {
            piece.push(alphabet[(next() % alphabet.len() as u64) as usize]);
        }
        if seen.insert(piece.clone()) {
            vocab.insert(piece, json!(vocab.len()));
        }
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": true, "vocab": vocab, "merges": []}
    });
    Tokenizer::from_str(&tokenizer.to_string()).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))
}

fn main() -> Result<()> {
    let built = Instant::now();
    let tokenizer = synthetic_tokenizer()?;
    let tokenizer_ms = built.elapsed().as_secs_f64() * 1e3;
    // `-- --write-tokenizer PATH` only writes the tokenizer (for `serve --tokenizer` with
    // random weights at the real vocabulary, as `scripts/serve-load.sh` uses it).
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--write-tokenizer") {
        let path = args
            .get(i + 1)
            .ok_or_else(|| anyhow::anyhow!("--write-tokenizer needs a path"))?;
        tokenizer
            .save(path, false)
            .map_err(|e| anyhow::anyhow!("writing {path}: {e}"))?;
        return Ok(());
    }
    let cases = [
        ("json_object", Constraint::JsonObject),
        (
            "json_schema",
            Constraint::JsonSchema(json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "count": {"type": "integer"}
                },
                "required": ["name", "tags", "count"]
            })),
        ),
        ("regex", Constraint::Regex("([a-z]+ )*[0-9]{3}".to_string())),
    ];
    let t = Instant::now();
    let compiler = ConstraintCompiler::new(&tokenizer, &[1], VOCAB)?;
    let trie_ms = t.elapsed().as_secs_f64() * 1e3;
    for (name, constraint) in cases {
        let t = Instant::now();
        let mut c = compiler.start(&constraint)?;
        let start_ms = t.elapsed().as_secs_f64() * 1e3;
        // The same constraint again (another request with the same schema): a copy of the
        // parser the first start kept.
        let t = Instant::now();
        drop(compiler.start(&constraint)?);
        let start_again_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut times = Vec::with_capacity(STEPS);
        let mut allowed_counts = Vec::with_capacity(STEPS);
        for _ in 0..STEPS {
            let t = Instant::now();
            let mask = c.allowed()?;
            let masked = t.elapsed();
            let allowed: Vec<u32> = mask
                .iter()
                .enumerate()
                .filter(|(_, &m)| m == 1)
                .map(|(i, _)| i as u32)
                .collect();
            // A walk that prefers anything over the end, so the output keeps going.
            let open: Vec<u32> = allowed.iter().copied().filter(|&t| t != 1).collect();
            let pool = if open.is_empty() { &allowed } else { &open };
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            let token = pool[(state >> 33) as usize % pool.len()];
            let t = Instant::now();
            c.accept(token)?;
            times.push((masked + t.elapsed()).as_secs_f64() * 1e6);
            allowed_counts.push(allowed.len());
            if token == 1 {
                break;
            }
        }
        let steps = times.len();
        let mean = times.iter().sum::<f64>() / steps as f64;
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "{}",
            json!({
                "bench": "constraint_mask",
                "constraint": name,
                "vocab": VOCAB,
                "tokenizer_ms": tokenizer_ms,
                "trie_ms": trie_ms,
                "start_ms": start_ms,
                "start_again_ms": start_again_ms,
                "steps": steps,
                "step_us_mean": mean,
                "step_us_p50": sorted[steps / 2],
                "step_us_p90": sorted[steps * 9 / 10],
                "step_us_max": sorted[steps - 1],
                "allowed_mean": allowed_counts.iter().sum::<usize>() as f64 / steps as f64,
            })
        );
    }
    Ok(())
}
