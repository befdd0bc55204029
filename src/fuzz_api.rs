//! Entry points for the fuzz targets in `fuzz/` and their regression tests in
//! `tests/fuzz_regressions.rs`. Each takes raw bytes, runs one input-facing part of the crate on
//! them the way loading a checkpoint or a prompt cache does, and returns a typed error for bad
//! input. Not part of the supported API: names and signatures follow the crate's internals.
//!
//! Files are written to a fresh scratch folder under [`std::env::temp_dir`] (set `TMPDIR` to a
//! RAM disk such as `/dev/shm` for speed) and removed afterwards, so the loaders run exactly as
//! they do on a user's files, memory mapping included.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv::{
    CacheConfig, CacheError, CacheMode, KvCache, LayerCacheSpec, ModelCache, PromptCache,
    QuantBits, QuantSpec,
};
use crate::weights::WeightStore;

/// Tensors of one fuzzed checkpoint that [`open_checkpoint`] loads at most; bounds the work
/// per input.
const MAX_TENSORS: usize = 64;
/// Largest `kv_heads * head_dim` that [`exercise_prompt_cache`] feeds a decode step into;
/// bounds the memory per input.
const MAX_STEP_WIDTH: usize = 1 << 14;
/// Largest window or layer count whose caches [`parse_config`] builds.
const MAX_CACHE_LAYERS: usize = 1 << 10;

/// A scratch folder, removed with everything in it when dropped.
struct Scratch(PathBuf);

impl Scratch {
    /// A new empty folder, unique within this process.
    fn new() -> std::io::Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("candle-gemma-fuzz-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }

    /// Writes `bytes` to `name` inside the folder and returns its path.
    fn write(&self, name: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
        let path = self.0.join(name);
        std::fs::write(&path, bytes)?;
        Ok(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Parses `bytes` as a `config.json` (either the multimodal shape with `text_config` or the
/// bare text shape, also read as its own `generation_config.json`), validates it, and builds the
/// layer caches it implies in every cache mode, as loading a model does.
///
/// # Errors
/// [`Error::Json`] for bytes that are not JSON, [`Error::Config`] naming the invalid field,
/// [`Error::Cache`] when the geometry cannot hold a cache.
pub fn parse_config(bytes: &[u8]) -> Result<Config> {
    let path = Path::new("config.json");
    let json = |reason: String| Error::Json {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| json(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| json(e.to_string()))?;
    let config = Config::from_json(&value, Some(&value))?;
    let specs = cache_specs(&config);
    if specs.len() <= MAX_CACHE_LAYERS {
        let quantized = QuantSpec {
            bits: QuantBits::Four,
            group_size: 32,
            start: 0,
        };
        for mode in [
            CacheMode::Simple,
            CacheMode::Rotating,
            CacheMode::Quantized(quantized),
        ] {
            ModelCache::new(&CacheConfig { mode }, &specs, DType::F32, &Device::Cpu)?;
        }
    }
    Ok(config)
}

fn cache_specs(config: &Config) -> Vec<Option<LayerCacheSpec>> {
    crate::kv::layer_cache_specs(config)
}

/// Opens `bytes` as the only safetensors file of a checkpoint folder, with the crate's weight
/// loader, then loads every tensor of the detected key layout (at most 64) as the model does:
/// float tensors at their own shape, and MLX-quantized matrices (`.weight` codes with `.scales`
/// and `.biases`) at the dense shapes 4 and 8 bits imply, alone, stacked row-wise with
/// themselves, and (for 3-D expert stacks) joined in pairs. Returns how many loads succeeded.
///
/// # Errors
/// [`Error::Io`] when the scratch file cannot be written; [`Error::Safetensors`] for a malformed
/// header or byte range; [`Error::MissingTensor`] when no key layout is recognised. Errors of
/// single tensors are counted as failed loads, not returned.
pub fn open_checkpoint(bytes: &[u8]) -> Result<usize> {
    let scratch = Scratch::new().map_err(|e| io_error(&std::env::temp_dir(), e))?;
    let path = scratch
        .write("model.safetensors", bytes)
        .map_err(|e| io_error(&scratch.0, e))?;
    let store = WeightStore::open(&scratch.0, &Device::Cpu, DType::F32)?;
    // The header parsed, so reading it again only lists the names and shapes to ask for.
    let (_, header) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| Error::Safetensors {
            path,
            reason: e.to_string(),
        })?;
    let prefix = store.layout().prefix();
    let mut names: Vec<(String, Vec<usize>)> = header
        .tensors()
        .into_iter()
        .filter(|(name, _)| name.starts_with(prefix))
        .map(|(name, info)| (name, info.shape.clone()))
        .collect();
    names.sort();
    let mut loaded = 0;
    for (name, shape) in names.into_iter().take(MAX_TENSORS) {
        let logical = &name[prefix.len()..];
        if let Some(module) = logical.strip_suffix(".weight") {
            if store.contains(&format!("{module}.scales")) {
                loaded += load_packed(&store, module, &shape);
                continue;
            }
        }
        loaded += usize::from(store.tensor(logical, None, &shape).is_ok());
        if let Some(module) = logical.strip_suffix(".weight") {
            loaded += usize::from(store.matrix(module, None, &shape).is_ok());
        }
    }
    Ok(loaded)
}

/// Loads the MLX-quantized matrix `module` (codes of `codes_shape`) at the dense shapes of 4 and
/// 8 bits; returns how many loads succeeded.
fn load_packed(store: &WeightStore, module: &str, codes_shape: &[usize]) -> usize {
    let Some((&words, lead)) = codes_shape.split_last() else {
        return 0;
    };
    let mut loaded = 0;
    for bits in [4, 8] {
        let Some(inp) = words.checked_mul(32).map(|b| b / bits) else {
            continue;
        };
        let mut shape = lead.to_vec();
        shape.push(inp);
        loaded += usize::from(store.matrix(module, None, &shape).is_ok());
        if let [out] = *lead {
            let parts = [(module.to_string(), out), (module.to_string(), out)];
            loaded += usize::from(matches!(store.matrix_rows(&parts, None, inp), Ok(Some(_))));
        }
        if let [n, out] = *lead {
            loaded += usize::from(
                store
                    .matrix_pair(module, module, None, [n, out, inp])
                    .is_ok(),
            );
        }
    }
    loaded
}

/// Loads `bytes` as a prompt-cache file with [`PromptCache::load`].
///
/// # Errors
/// [`CacheError::Io`] when the scratch file cannot be written or read; [`CacheError::Format`]
/// for anything that is not a prompt cache of this version.
pub fn load_prompt_cache(bytes: &[u8]) -> std::result::Result<PromptCache, CacheError> {
    let io = |path: &Path, e: std::io::Error| CacheError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let scratch = Scratch::new().map_err(|e| io(&std::env::temp_dir(), e))?;
    let path = scratch
        .write("prompt.safetensors", bytes)
        .map_err(|e| io(&scratch.0, e))?;
    PromptCache::load(&path, &Device::Cpu)
}

/// Loads `bytes` as a prompt cache, then uses it as a caller would: saves and reloads a deep
/// copy (which must hold the same tokens), feeds one decode step of zeros to every layer of the
/// copy, and reuses the original for a prompt that shares its first `shared` tokens and then
/// differs (rolling it back to that prefix). Returns the number of cached tokens reuse keeps.
///
/// # Errors
/// Any [`CacheError`] of those steps. A reloaded copy whose tokens differ from the saved ones
/// is [`CacheError::Format`].
pub fn exercise_prompt_cache(
    bytes: &[u8],
    shared: usize,
) -> std::result::Result<usize, CacheError> {
    let cache = load_prompt_cache(bytes)?;
    let scratch = Scratch::new().map_err(|e| CacheError::Io {
        path: std::env::temp_dir(),
        reason: e.to_string(),
    })?;
    let path = scratch.0.join("copy.safetensors");
    let mut copy = cache.deep_clone()?;
    copy.save(&path)?;
    let reloaded = PromptCache::load(&path, &Device::Cpu)?;
    if reloaded.tokens != cache.tokens || reloaded.meta != cache.meta {
        return Err(CacheError::Format {
            path,
            reason: "the reloaded copy differs from the saved cache".to_string(),
        });
    }
    let dtype = match cache.meta.dtype.as_str() {
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        _ => DType::F32,
    };
    for layer in copy.cache.layers.iter_mut().flatten() {
        let (kv_heads, head_dim) = layer.geometry();
        if kv_heads.saturating_mul(head_dim) > MAX_STEP_WIDTH {
            continue;
        }
        let kv = Tensor::zeros((1, kv_heads, 1, head_dim), dtype, &Device::Cpu)?;
        layer.update(&kv, &kv)?;
    }
    let mut prompt: Vec<u32> = cache.tokens.iter().copied().take(shared).collect();
    prompt.push(
        cache
            .tokens
            .get(prompt.len())
            .map_or(0, |t| t.wrapping_add(1)),
    );
    let meta = cache.meta.clone();
    let (_, kept) = cache.reuse(&meta, &prompt)?;
    Ok(kept)
}

/// Every special-token string the streaming output parser recognises, for inputs that build
/// on them.
pub fn special_token_strings() -> Vec<&'static str> {
    crate::chat::parser::special_token_strings().collect()
}

/// The first special-token string that shows in `events`: in the text or in the thinking,
/// each joined as a client joins its deltas (the text around a dropped token could spell one).
/// Returns the string and where (`"text"` or `"thinking"`) with the joined stream; `None` when
/// none shows.
pub fn leaked_special_token(
    events: &[crate::chat::OutputEvent],
) -> Option<(&'static str, &'static str, String)> {
    use crate::chat::OutputEvent;
    let (mut text, mut thinking) = (String::new(), String::new());
    for e in events {
        match e {
            OutputEvent::Text(t) => text.push_str(t),
            OutputEvent::Thinking(t) => thinking.push_str(t),
            OutputEvent::ToolCall { .. } => {}
        }
    }
    [("text", text), ("thinking", thinking)]
        .into_iter()
        .find_map(|(kind, joined)| {
            crate::chat::parser::special_token_strings()
                .find(|s| joined.contains(s))
                .map(|s| (s, kind, joined))
        })
}

/// The `output_parser` target's input: a leading byte (bit 0: the output starts inside a
/// thought), then text whose `0xFF` bytes (never part of UTF-8) mark chunk boundaries. Returns
/// the events of the chunks pushed one by one and of the whole text pushed at once, adjacent
/// text (and thinking) events joined; `None` for an empty input.
pub fn parse_output_chunks(
    input: &[u8],
) -> Option<(Vec<crate::chat::OutputEvent>, Vec<crate::chat::OutputEvent>)> {
    let (&mode, text) = input.split_first()?;
    let chunks: Vec<String> = text
        .split(|&b| b == 0xFF)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    let parts: Vec<&str> = chunks.iter().map(String::as_str).collect();
    let whole = chunks.concat();
    let in_thinking = mode & 1 == 1;
    Some((
        parse_joined(in_thinking, &parts),
        parse_joined(in_thinking, &[whole.as_str()]),
    ))
}

/// The events of `chunks` pushed one by one, adjacent text and thinking joined (the parser
/// joins them only within one push).
fn parse_joined(in_thinking: bool, chunks: &[&str]) -> Vec<crate::chat::OutputEvent> {
    use crate::chat::{OutputEvent, OutputParser};
    let mut p = if in_thinking {
        OutputParser::in_thinking()
    } else {
        OutputParser::new()
    };
    let events: Vec<OutputEvent> = chunks.iter().flat_map(|c| p.push(c)).collect();
    let mut out: Vec<OutputEvent> = Vec::new();
    for e in events.into_iter().chain(p.finish()) {
        match (out.last_mut(), e) {
            (Some(OutputEvent::Text(a)), OutputEvent::Text(b))
            | (Some(OutputEvent::Thinking(a)), OutputEvent::Thinking(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}
