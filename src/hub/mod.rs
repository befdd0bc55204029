//! Fetching a checkpoint from the Hugging Face hub (feature `hub`).
//!
//! [`resolve`] returns a local folder (a snapshot of the hub cache) holding what the model
//! needs: `config.json`, `tokenizer.json`, the safetensors weights (a single file or every
//! shard named by `model.safetensors.index.json`), and when the repo has them
//! `generation_config.json`, `tokenizer_config.json` and `chat_template.jinja`.
//!
//! The cache (`~/.cache/huggingface/hub`, or `$HF_HOME/hub`, or [`HubOptions::cache_dir`])
//! is consulted first, so a checkpoint downloaded once loads without the network; with
//! [`HubOptions::offline`] the network is never used. The layout is the one `huggingface_hub`
//! and `hf-hub` share (`models--org--name/{blobs,snapshots,refs}`), so either can fill it.
//!
//! Downloads are made to survive the network:
//! - every file comes from the one commit the revision resolves to;
//! - a transfer goes to `blobs/<etag>.incomplete` and resumes from there (HTTP `Range`) after
//!   a broken connection, in this run or the next;
//! - server errors (5xx, 429) and broken connections are retried with exponential backoff:
//!   at most [`ATTEMPTS`] requests for the model info or a file's metadata, and at most
//!   [`ATTEMPTS`] transfers in a row that bring no new byte for a file's contents;
//! - a file enters the cache only once its size matches the announced one and, for LFS files
//!   (the weights), its sha256 matches the hub's `X-Linked-Etag`; otherwise it is discarded
//!   and reported ([`HubError::SizeMismatch`], [`HubError::HashMismatch`]);
//! - one lock file per blob (`.locks/models--org--name/<etag>.lock`) lets threads and
//!   processes share a cache: a file is fetched by one of them while the others wait, then
//!   find it in place. The lock is an advisory OS file lock (`flock`, `LockFileEx`), so a
//!   process that exits or is killed releases it and its lock file never blocks anyone. A
//!   waiter gives up with [`HubError::LockTimeout`] once the holder's download has made no
//!   progress for [`HubOptions::lock_timeout`] ([`DEFAULT_LOCK_TIMEOUT`] by default).
//!
//! The token, when not given, is the one `huggingface-cli login` stored next to the cache.
//! This module reads no environment variable itself; `hf-hub` reads `HF_HOME` when no cache
//! dir is given, and the HTTP client honours `HTTPS_PROXY`/`ALL_PROXY` for non-loopback
//! endpoints.
//!
//! ```no_run
//! use candle_gemma::hub::{resolve, HubOptions};
//! let dir = resolve("google/gemma-4-E2B-it", &HubOptions::default())?;
//! assert!(dir.join("config.json").is_file());
//! # Ok::<(), candle_gemma::Error>(())
//! ```

mod cache;
mod client;
mod fetch;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::error::HubError;
use crate::{Error, Result};
use cache::RepoCache;
use client::Client;
pub use client::ATTEMPTS;

/// The public Hugging Face hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How long a wait for another fetcher's lock on a file may see its download make no
/// progress. Longer than a live fetcher of this crate can go without a new byte before it
/// gives up itself (its retries: [`ATTEMPTS`] transfers of at most 20 s to connect and 60 s
/// per read), and than it spends verifying a resumed file of tens of gigabytes.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(600);

/// Files the model cannot load without.
const REQUIRED: &[&str] = &["config.json", "tokenizer.json"];
/// Files used when the repo has them.
const OPTIONAL: &[&str] = &[
    "generation_config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];
const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// Where and how to fetch a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HubOptions {
    /// Branch, tag or commit; `main` when `None`.
    pub revision: Option<String>,
    /// Access token for gated or private repos; when `None`, the token stored by
    /// `huggingface-cli login` next to the cache, if any.
    pub token: Option<String>,
    /// The hub cache folder (the one holding `models--org--name`); when `None`,
    /// `$HF_HOME/hub` or `~/.cache/huggingface/hub`.
    pub cache_dir: Option<PathBuf>,
    /// The hub's base URL (a mirror, or a test server); [`DEFAULT_ENDPOINT`] when `None`.
    pub endpoint: Option<String>,
    /// Use only the local cache, never the network.
    pub offline: bool,
    /// Show a progress bar per downloaded file (bytes and rate, on stderr).
    pub progress: bool,
    /// How long to wait for a file another thread or process is downloading into the same
    /// cache while that download makes no progress; [`DEFAULT_LOCK_TIMEOUT`] when `None`.
    pub lock_timeout: Option<Duration>,
}

/// Returns a local folder holding the checkpoint `repo` (`"org/name"`), downloading what is
/// missing from the cache unless `opts.offline`.
///
/// When every file is already cached the network is not touched, even if `offline` is off
/// (optional files that were never downloaded are then simply absent).
///
/// # Errors
/// [`Error::Hub`] naming the repo, the file (empty when the whole repo is concerned) and a
/// [`HubError`]: the repo, revision or file does not exist, access is refused, the server or
/// the network kept failing, a download does not match its announced size or hash, the index
/// is malformed, a file is not cached (offline), or the cache cannot be written.
pub fn resolve(repo: &str, opts: &HubOptions) -> Result<PathBuf> {
    let revision = opts.revision.as_deref().unwrap_or("main");
    let cache = RepoCache::new(cache_root(repo, opts)?, repo);
    match (cache.complete(revision)?, opts.offline) {
        (Some(dir), _) => Ok(dir),
        (None, true) => Err(cache.first_missing(revision)?),
        (None, false) => download(&cache, revision, opts),
    }
}

fn hub_error(repo: &str, file: &str, cause: HubError) -> Error {
    Error::Hub {
        repo: repo.to_string(),
        file: file.to_string(),
        cause,
    }
}

fn cache_root(repo: &str, opts: &HubOptions) -> Result<PathBuf> {
    if let Some(dir) = &opts.cache_dir {
        return Ok(dir.clone());
    }
    // hf-hub panics when there is no home directory; turn that into an error.
    std::panic::catch_unwind(hf_hub::Cache::from_env)
        .map(|c| c.path().clone())
        .map_err(|_| hub_error(repo, "", HubError::NoCacheDir))
}

/// The token to send: the given one, else the one stored next to the cache.
fn token(root: &Path, opts: &HubOptions) -> Option<String> {
    opts.token
        .clone()
        .or_else(|| hf_hub::Cache::new(root.to_path_buf()).token())
}

/// Resolves the revision to a commit, fetches every needed file of that commit into the
/// cache, then points `refs/<revision>` at the commit.
fn download(cache: &RepoCache, revision: &str, opts: &HubOptions) -> Result<PathBuf> {
    let repo = cache.repo();
    let endpoint = opts.endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT);
    let client = Client::new(endpoint, token(cache.root(), opts), repo);
    let info = client
        .info(revision)
        .map_err(|cause| hub_error(repo, "", cause))?;
    let commit = info.sha.as_str();
    let listed: BTreeSet<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let get = |file: &str| {
        let lock_timeout = opts.lock_timeout.unwrap_or(DEFAULT_LOCK_TIMEOUT);
        fetch::file(&client, cache, commit, file, opts.progress, lock_timeout)
            .map_err(|cause| hub_error(repo, file, cause))
    };

    let not_listed = |file: &str| {
        let cause = HubError::FileNotFound {
            revision: revision.to_string(),
        };
        hub_error(repo, file, cause)
    };

    // Config and tokenizer first, so that a gated repo's refusal names `config.json`.
    for file in REQUIRED {
        if !listed.contains(file) {
            return Err(not_listed(file));
        }
        get(file)?;
    }
    for file in OPTIONAL.iter().filter(|f| listed.contains(*f)) {
        get(file)?;
    }
    let weights = if listed.contains(INDEX) {
        shards(repo, &get(INDEX)?)?
    } else if listed.contains(SINGLE) {
        vec![SINGLE.to_string()]
    } else {
        return Err(not_listed(SINGLE));
    };
    if let Some(file) = weights.iter().find(|f| !listed.contains(f.as_str())) {
        return Err(not_listed(file));
    }
    for file in &weights {
        get(file)?;
    }
    if revision != commit {
        cache
            .set_ref(revision, commit)
            .map_err(|cause| hub_error(repo, "", cause))?;
    }
    Ok(cache.snapshot(commit))
}

/// The folder that holds `file` (which may contain `/`).
fn snapshot_dir(path: &Path, file: &str) -> PathBuf {
    let mut dir = path.to_path_buf();
    for _ in file.split('/') {
        dir.pop();
    }
    dir
}

/// Whether `file` is a relative path that stays inside the snapshot folder.
fn safe_name(file: &str) -> bool {
    !file.is_empty()
        && !file.starts_with('/')
        && !file.contains('\\')
        && file
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// The distinct shard names of a safetensors index, sorted.
fn shards(repo: &str, index: &Path) -> Result<Vec<String>> {
    let bad = |reason: String| hub_error(repo, INDEX, HubError::BadIndex { reason });
    let text = std::fs::read_to_string(index).map_err(|e| bad(e.to_string()))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("`weight_map.{tensor}` is not a string")))?;
        if !safe_name(file) {
            return Err(bad(format!(
                "`weight_map.{tensor}` names an unsafe path {file:?}"
            )));
        }
        names.insert(file.to_string());
    }
    if names.is_empty() {
        return Err(bad("`weight_map` is empty".into()));
    }
    Ok(names.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_dir_strips_nested_names() {
        let p = Path::new("/c/snapshots/abc/sub/x.safetensors");
        assert_eq!(
            snapshot_dir(p, "sub/x.safetensors"),
            Path::new("/c/snapshots/abc")
        );
        assert_eq!(
            snapshot_dir(Path::new("/c/s/abc/config.json"), "config.json"),
            Path::new("/c/s/abc")
        );
    }

    #[test]
    fn index_rejects_unsafe_or_empty_maps() {
        let dir = std::env::temp_dir().join(format!("cg-hub-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let index = dir.join(INDEX);
        for (body, ok) in [
            (
                r#"{"weight_map":{"a":"x-1.safetensors","b":"x-2.safetensors","c":"x-1.safetensors"}}"#,
                true,
            ),
            (r#"{"weight_map":{"a":"../evil"}}"#, false),
            (r#"{"weight_map":{"a":"sub//x"}}"#, false),
            (r#"{"weight_map":{}}"#, false),
            (r#"{"metadata":{}}"#, false),
            ("not json", false),
        ] {
            std::fs::write(&index, body).expect("write");
            let got = shards("o/r", &index);
            assert_eq!(got.is_ok(), ok, "{body}");
            if ok {
                assert_eq!(
                    got.ok(),
                    Some(vec!["x-1.safetensors".into(), "x-2.safetensors".into()])
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
