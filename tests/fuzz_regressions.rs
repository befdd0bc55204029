//! Regression tests of the fuzz targets in `fuzz/`: every seed of `fuzz/seeds/` and every input
//! that once crashed a target goes through the same entry point as the target, and must give a
//! value or a typed error, never a panic.
//!
//! `cargo test --test fuzz_regressions -- --ignored write_prompt_cache_seeds` rewrites the
//! prompt-cache seeds from caches built here.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_gemma::chat::OutputEvent;
use candle_gemma::fuzz_api;
use candle_gemma::kv::{
    CacheConfig, CacheError, CacheMeta, CacheMode, KvCache, LayerCacheSpec, ModelCache,
    PromptCache, QuantBits, QuantSpec,
};
use candle_gemma::Error;

fn seeds(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    paths.sort();
    assert!(!paths.is_empty(), "no seeds in {}", dir.display());
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

/// The `output_parser` target: events of `text` split at `0xFF` bytes, and of the whole text.
fn parse_chunked(in_thinking: bool, text: &[u8]) -> (Vec<OutputEvent>, Vec<OutputEvent>) {
    let input = [&[u8::from(in_thinking)], text].concat();
    fuzz_api::parse_output_chunks(&input).expect("a non-empty input")
}

#[test]
fn config_seeds_validate() {
    for (path, bytes) in seeds("config") {
        let got = fuzz_api::parse_config(&bytes);
        if path.ends_with("real-generation_config.json") {
            assert!(matches!(got, Err(Error::Config { .. })), "{got:?}");
        } else {
            let config = got.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(config.num_layers() > 0);
        }
    }
}

#[test]
fn safetensors_seeds_load() {
    for (path, bytes) in seeds("safetensors_header") {
        let loaded =
            fuzz_api::open_checkpoint(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(loaded > 0, "{}: nothing loaded", path.display());
        // A truncated copy is a typed error naming the file.
        let cut = fuzz_api::open_checkpoint(&bytes[..bytes.len() - 1]);
        assert!(matches!(cut, Err(Error::Safetensors { .. })), "{cut:?}");
    }
}

#[test]
fn prompt_cache_seeds_load_and_reuse() {
    for (path, bytes) in seeds("prompt_cache") {
        let (&shared, file) = bytes.split_first().expect("a seed has a leading byte");
        let kept = fuzz_api::exercise_prompt_cache(file, usize::from(shared))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(kept <= usize::from(shared), "{}", path.display());
        let cut = fuzz_api::load_prompt_cache(&file[..file.len() / 2]);
        assert!(matches!(cut, Err(CacheError::Format { .. })), "{cut:?}");
    }
}

#[test]
fn output_parser_seeds_split_anywhere() {
    for (path, bytes) in seeds("output_parser") {
        let (&mode, text) = bytes.split_first().expect("a seed has a leading byte");
        let (chunked, whole) = parse_chunked(mode & 1 == 1, text);
        assert_eq!(chunked, whole, "{}", path.display());
        assert!(!chunked.is_empty(), "{}", path.display());
        assert_no_special_token_string(&chunked, &whole_text(text));
    }
}

/// Inputs the `output_parser` target stopped on when it also required that no special-token
/// string appear inside `Text` or `Thinking`: the text around a dropped special token or role
/// header can spell one (`B<e` `<tool|>` `os>` reads `B<eos>`, `A<turn|` `<|turn>m` `>` reads
/// `A<turn|>`). The parser drops such a string as the token it spells: neither the events nor
/// all the text (or thinking) joined hold one, split at the fuzzer's points, at any two points,
/// or whole.
#[test]
fn output_parser_text_around_dropped_tokens() {
    let inputs: [&[u8]; 2] = [
        b"\x00A<turn|\xff\xff<|tu\xffrn>m<channel|>>",
        b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\
          \xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\
          \xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\
          \xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xffu*n|\
          \xc2\x0a<|tu\xffrn>m2\x00\x00\x00odel\x0aB<e<tool|>os>",
    ];
    let expected = [
        vec![OutputEvent::Text("A".into())],
        vec![OutputEvent::Text("u*n|\u{FFFD}\nm2\0\0\0odel\nB".into())],
    ];
    for (bytes, expected) in inputs.iter().zip(expected) {
        let (&mode, text) = bytes.split_first().expect("non-empty");
        let in_thinking = mode & 1 == 1;
        let (chunked, whole) = parse_chunked(in_thinking, text);
        assert_eq!(chunked, whole);
        assert_eq!(chunked, expected);
        let joined = whole_text(text);
        let b: Vec<usize> = (0..=joined.len())
            .filter(|&i| joined.is_char_boundary(i))
            .collect();
        for (n, &i) in b.iter().enumerate() {
            for &j in &b[n..] {
                let split = [&joined[..i], &joined[i..j], &joined[j..]]
                    .map(str::as_bytes)
                    .join(&0xFF);
                let (events, _) = parse_chunked(in_thinking, &split);
                assert_no_special_token_string(&events, &joined);
                assert_eq!(events, expected, "split at {i}, {j}");
            }
        }
    }
}

/// The text of a fuzz input (its chunk markers removed), as the parser reads it.
fn whole_text(text: &[u8]) -> String {
    text.split(|&b| b == 0xFF)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect()
}

/// No special-token string inside `Text` or `Thinking`, nor in all the text (or thinking)
/// joined.
fn assert_no_special_token_string(events: &[OutputEvent], input: &str) {
    if let Some((s, kind, joined)) = fuzz_api::leaked_special_token(events) {
        panic!("{s} in the {kind} {joined:?} from {input:?}");
    }
}

/// The prompt caches of the `prompt_cache` seeds: one sliding layer (window 4), one full layer
/// and one KV-shared layer, 1 head of 32, after 6 tokens.
fn seed_cache(mode: CacheMode, tokens: usize) -> candle_core::Result<PromptCache> {
    let specs = [
        Some(LayerCacheSpec {
            kv_heads: 1,
            head_dim: 32,
            window: Some(4),
        }),
        Some(LayerCacheSpec {
            kv_heads: 1,
            head_dim: 32,
            window: None,
        }),
        None,
    ];
    let mut cache = ModelCache::new(&CacheConfig { mode }, &specs, DType::F32, &Device::Cpu)
        .map_err(candle_core::Error::wrap)?;
    if tokens > 0 {
        let k = Tensor::arange(0f32, (tokens * 32) as f32, &Device::Cpu)?
            .affine(0.01, -0.5)?
            .reshape((1, 1, tokens, 32))?;
        let v = k.neg()?;
        for layer in cache.layers.iter_mut().flatten() {
            layer.update(&k, &v).map_err(candle_core::Error::wrap)?;
        }
    }
    let meta = CacheMeta::of(&cache, DType::F32, "fuzz-seed");
    Ok(PromptCache::new((0..tokens as u32).collect(), cache, meta))
}

#[test]
#[ignore = "writes fuzz/seeds/prompt_cache"]
fn write_prompt_cache_seeds() -> candle_core::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/prompt_cache");
    std::fs::create_dir_all(&dir)?;
    let quant = |bits, start| {
        CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 32,
            start,
        })
    };
    let caches = [
        ("simple", CacheMode::Simple, 6),
        ("rotating", CacheMode::Rotating, 6),
        ("rotating-empty", CacheMode::Rotating, 0),
        ("q4", quant(QuantBits::Four, 0), 6),
        ("q8-start4", quant(QuantBits::Eight, 4), 6),
    ];
    for (name, mode, tokens) in caches {
        let path = dir.join(format!("{name}.safetensors"));
        seed_cache(mode, tokens)?
            .save(&path)
            .map_err(candle_core::Error::wrap)?;
        // The target's input: how many tokens the next prompt shares, then the file.
        let mut bytes = vec![5u8];
        bytes.extend(std::fs::read(&path)?);
        std::fs::write(&path, bytes)?;
    }
    Ok(())
}
