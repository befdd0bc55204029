//! Fetching a checkpoint from the Hugging Face hub (feature `hub`).
//!
//! [`resolve`] returns a local folder (a snapshot of the hub cache) holding what the model
//! needs: `config.json`, `tokenizer.json`, the safetensors weights (a single file or every
//! shard named by `model.safetensors.index.json`), and when the repo has them
//! `generation_config.json`, `tokenizer_config.json` and `chat_template.jinja`.
//!
//! The cache (`~/.cache/huggingface/hub`, or `$HF_HOME/hub`, or [`HubOptions::cache_dir`])
//! is consulted first, so a checkpoint downloaded once loads without the network; with
//! [`HubOptions::offline`] the network is never used. The token, when not given, is the
//! one `huggingface-cli login` stored next to the cache (read by `hf-hub`). This module reads
//! no environment variable itself; `hf-hub` reads `HF_HOME` when no cache dir is given.
//!
//! ```no_run
//! use candle_gemma::hub::{resolve, HubOptions};
//! let dir = resolve("google/gemma-4-E2B-it", &HubOptions::default())?;
//! assert!(dir.join("config.json").is_file());
//! # Ok::<(), candle_gemma::Error>(())
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use crate::{Error, Result};

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
    /// Use only the local cache, never the network.
    pub offline: bool,
    /// Show download progress bars.
    pub progress: bool,
}

/// Returns a local folder holding the checkpoint `repo` (`"org/name"`), downloading what is
/// missing from the cache unless `opts.offline`.
///
/// When every file is already cached the network is not touched, even if `offline` is off
/// (optional files that were never downloaded are then simply absent).
///
/// # Errors
/// [`Error::Hub`] naming the repo and the file: a required file or weight shard that is not
/// cached (offline) or not in the repo, a failed download, a malformed index, or no usable
/// cache folder.
pub fn resolve(repo: &str, opts: &HubOptions) -> Result<PathBuf> {
    let revision = opts.revision.clone().unwrap_or_else(|| "main".to_string());
    let cache = cache(repo, opts)?;
    let local = Local {
        cache: &cache,
        repo,
        revision: &revision,
    };
    match (local.complete()?, opts.offline) {
        (Some(dir), _) => Ok(dir),
        (None, true) => Err(local.first_missing()?),
        (None, false) => download(repo, &revision, cache, opts),
    }
}

fn hub_error(repo: &str, file: &str, reason: impl Into<String>) -> Error {
    Error::Hub {
        repo: repo.to_string(),
        file: file.to_string(),
        reason: reason.into(),
    }
}

fn cache(repo: &str, opts: &HubOptions) -> Result<Cache> {
    if let Some(dir) = &opts.cache_dir {
        return Ok(Cache::new(dir.clone()));
    }
    // hf-hub panics when there is no home directory; turn that into an error.
    std::panic::catch_unwind(Cache::from_env).map_err(|_| {
        hub_error(
            repo,
            "",
            "no home directory for the hub cache; set HubOptions::cache_dir",
        )
    })
}

/// Lookups in the local cache only.
struct Local<'a> {
    cache: &'a Cache,
    repo: &'a str,
    revision: &'a str,
}

impl Local<'_> {
    fn get(&self, file: &str) -> Option<PathBuf> {
        let model = Repo::with_revision(self.repo.into(), RepoType::Model, self.revision.into());
        if let Some(p) = self.cache.repo(model).get(file) {
            return Some(p);
        }
        // hf-hub does not trim the ref file and does not look up commit hashes directly.
        let root = self
            .cache
            .path()
            .join(format!("models--{}", self.repo.replace('/', "--")));
        let commit = std::fs::read_to_string(root.join("refs").join(self.revision))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| self.revision.to_string());
        let p = root.join("snapshots").join(commit).join(file);
        p.is_file().then_some(p)
    }

    /// The weight files: every shard of the index if it is cached, else the single file.
    /// `Err` only for a malformed index; `Ok(None)` if neither is cached.
    fn weights(&self) -> Result<Option<Vec<String>>> {
        match self.get(INDEX) {
            Some(index) => shards(self.repo, &index).map(Some),
            None => Ok(self.get(SINGLE).map(|_| vec![SINGLE.to_string()])),
        }
    }

    /// The snapshot folder if every needed file is cached in it.
    fn complete(&self) -> Result<Option<PathBuf>> {
        let Some(weights) = self.weights()? else {
            return Ok(None);
        };
        let mut dir: Option<PathBuf> = None;
        for file in REQUIRED
            .iter()
            .copied()
            .chain(weights.iter().map(String::as_str))
        {
            let Some(path) = self.get(file) else {
                return Ok(None);
            };
            let parent = snapshot_dir(&path, file);
            match &dir {
                None => dir = Some(parent),
                Some(d) if *d == parent => {}
                Some(_) => return Ok(None),
            }
        }
        Ok(dir)
    }

    /// The error for an incomplete offline cache, naming the first missing file.
    fn first_missing(&self) -> Result<Error> {
        let reason = format!(
            "not in the local cache at {} (offline)",
            self.cache.path().display()
        );
        for file in REQUIRED {
            if self.get(file).is_none() {
                return Ok(hub_error(self.repo, file, reason));
            }
        }
        match self.weights()? {
            None => Ok(hub_error(
                self.repo,
                SINGLE,
                format!("{reason}; nor is {INDEX}"),
            )),
            Some(weights) => {
                let missing = weights.iter().find(|f| self.get(f).is_none());
                Ok(hub_error(
                    self.repo,
                    missing.map_or("", String::as_str),
                    match missing {
                        Some(_) => reason,
                        None => "cached files belong to different snapshots (offline)".into(),
                    },
                ))
            }
        }
    }
}

/// The folder that holds `file` (which may contain `/`).
fn snapshot_dir(path: &Path, file: &str) -> PathBuf {
    let mut dir = path.to_path_buf();
    for _ in file.split('/') {
        dir.pop();
    }
    dir
}

/// The distinct shard names of a safetensors index, sorted.
fn shards(repo: &str, index: &Path) -> Result<Vec<String>> {
    let bad = |reason: String| hub_error(repo, INDEX, reason);
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
        if file.is_empty() || file.starts_with('/') || file.split('/').any(|c| c == "..") {
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

fn download(repo: &str, revision: &str, cache: Cache, opts: &HubOptions) -> Result<PathBuf> {
    let mut builder = ApiBuilder::from_cache(cache).with_progress(opts.progress);
    if opts.token.is_some() {
        builder = builder.with_token(opts.token.clone());
    }
    let api = builder
        .build()
        .map_err(|e| hub_error(repo, "", format!("cannot start the hub client: {e}")))?;
    let api = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let info = api
        .info()
        .map_err(|e| hub_error(repo, "", format!("cannot list the repo at {revision}: {e}")))?;
    let listed: BTreeSet<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();

    let mut files: Vec<String> = Vec::new();
    for file in REQUIRED {
        if !listed.contains(file) {
            return Err(hub_error(
                repo,
                file,
                format!("not in the repo at {revision}"),
            ));
        }
        files.push(file.to_string());
    }
    files.extend(
        OPTIONAL
            .iter()
            .filter(|f| listed.contains(*f))
            .map(|f| f.to_string()),
    );
    if listed.contains(INDEX) {
        let index = fetch(&api, repo, INDEX)?;
        files.push(INDEX.to_string());
        for shard in shards(repo, &index)? {
            if !listed.contains(shard.as_str()) {
                return Err(hub_error(
                    repo,
                    &shard,
                    format!("named by {INDEX} but not in the repo"),
                ));
            }
            files.push(shard);
        }
    } else if listed.contains(SINGLE) {
        files.push(SINGLE.to_string());
    } else {
        return Err(hub_error(
            repo,
            SINGLE,
            format!("not in the repo, nor is {INDEX}"),
        ));
    }

    let mut paths = Vec::with_capacity(files.len());
    for file in &files {
        paths.push(fetch(&api, repo, file)?);
    }
    // All files must sit in one snapshot folder; a file cached under an older commit is
    // downloaded again into the current one.
    let dir = snapshot_dir(&paths[0], &files[0]);
    for (file, path) in files.iter().zip(&paths) {
        if snapshot_dir(path, file) != dir {
            let again = api
                .download(file)
                .map_err(|e| hub_error(repo, file, e.to_string()))?;
            if snapshot_dir(&again, file) != dir {
                return Err(hub_error(
                    repo,
                    file,
                    "the repo changed during the download; retry",
                ));
            }
        }
    }
    Ok(dir)
}

fn fetch(api: &ApiRepo, repo: &str, file: &str) -> Result<PathBuf> {
    api.get(file)
        .map_err(|e| hub_error(repo, file, e.to_string()))
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
