//! `hub::resolve` against a fake hub cache laid out as hf-hub writes it
//! (`models--org--name/{refs/main, snapshots/<sha>/…, blobs/…}`), offline: no network.
#![cfg(feature = "hub")]

use std::path::{Path, PathBuf};

use candle_gemma::hub::{resolve, HubOptions};
use candle_gemma::{Error, HubError};

const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

/// A fresh temporary cache folder, removed on drop.
struct TempCache(PathBuf);

impl TempCache {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cg-hub-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp cache");
        Self(dir)
    }

    fn repo_dir(&self, repo: &str) -> PathBuf {
        self.0.join(format!("models--{}", repo.replace('/', "--")))
    }

    /// Writes `refs/<rev>` (with a trailing newline, as some tools leave it).
    fn set_ref(&self, repo: &str, rev: &str, sha: &str) {
        let refs = self.repo_dir(repo).join("refs");
        std::fs::create_dir_all(&refs).expect("refs");
        std::fs::write(refs.join(rev), format!("{sha}\n")).expect("ref");
    }

    /// Stores `content` as a blob and links `snapshots/<sha>/<file>` to it.
    fn add(&self, repo: &str, sha: &str, file: &str, content: &str) {
        let root = self.repo_dir(repo);
        let blobs = root.join("blobs");
        std::fs::create_dir_all(&blobs).expect("blobs");
        let blob = blobs.join(format!("blob-{}", file.replace('/', "_")));
        std::fs::write(&blob, content).expect("blob");
        let link = root.join("snapshots").join(sha).join(file);
        std::fs::create_dir_all(link.parent().expect("parent")).expect("snapshot dir");
        link_or_copy(&blob, &link);
    }

    fn opts(&self) -> HubOptions {
        HubOptions {
            cache_dir: Some(self.0.clone()),
            offline: true,
            ..Default::default()
        }
    }
}

impl Drop for TempCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(unix)]
fn link_or_copy(blob: &Path, link: &Path) {
    std::os::unix::fs::symlink(blob, link).expect("symlink");
}

#[cfg(not(unix))]
fn link_or_copy(blob: &Path, link: &Path) {
    std::fs::copy(blob, link).expect("copy");
}

fn basic_files(cache: &TempCache, repo: &str) {
    cache.set_ref(repo, "main", SHA);
    cache.add(repo, SHA, "config.json", "{}");
    cache.add(repo, SHA, "tokenizer.json", "{}");
}

/// Checks the error names `repo` and `file`, and returns its cause.
fn expect_hub_error(result: Result<PathBuf, Error>, repo: &str, file: &str) -> HubError {
    match result {
        Err(e @ Error::Hub { .. }) => {
            let msg = e.to_string();
            let Error::Hub {
                repo: r,
                file: f,
                cause,
            } = e
            else {
                unreachable!()
            };
            assert_eq!((r.as_str(), f.as_str()), (repo, file), "cause: {cause}");
            assert!(msg.contains(repo) && msg.contains(file), "{msg}");
            cause
        }
        other => panic!("expected a hub error for {file}, got {other:?}"),
    }
}

#[test]
fn single_file_checkpoint_resolves_offline() {
    let cache = TempCache::new("single");
    let repo = "google/gemma-4-E2B-it";
    basic_files(&cache, repo);
    cache.add(repo, SHA, "model.safetensors", "weights");
    cache.add(repo, SHA, "chat_template.jinja", "{{ bos_token }}");
    let dir = resolve(repo, &cache.opts()).expect("resolves");
    assert_eq!(dir, cache.repo_dir(repo).join("snapshots").join(SHA));
    for f in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "chat_template.jinja",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("model.safetensors")).expect("read"),
        "weights"
    );
}

#[test]
fn sharded_checkpoint_needs_every_shard() {
    let cache = TempCache::new("sharded");
    let repo = "org/sharded";
    basic_files(&cache, repo);
    let index = r#"{"metadata":{},"weight_map":{
        "a":"model-00001-of-00002.safetensors",
        "b":"model-00002-of-00002.safetensors",
        "c":"model-00001-of-00002.safetensors"}}"#;
    cache.add(repo, SHA, "model.safetensors.index.json", index);
    cache.add(repo, SHA, "model-00001-of-00002.safetensors", "1");
    expect_hub_error(
        resolve(repo, &cache.opts()),
        repo,
        "model-00002-of-00002.safetensors",
    );
    cache.add(repo, SHA, "model-00002-of-00002.safetensors", "2");
    let dir = resolve(repo, &cache.opts()).expect("resolves");
    assert!(dir.join("model-00002-of-00002.safetensors").is_file());
}

#[test]
fn missing_required_files_are_named() {
    let cache = TempCache::new("missing");
    let repo = "org/partial";
    cache.set_ref(repo, "main", SHA);
    cache.add(repo, SHA, "tokenizer.json", "{}");
    cache.add(repo, SHA, "model.safetensors", "w");
    let cause = expect_hub_error(resolve(repo, &cache.opts()), repo, "config.json");
    assert!(matches!(cause, HubError::NotCached { .. }), "{cause:?}");

    let repo2 = "org/no-weights";
    basic_files(&cache, repo2);
    expect_hub_error(resolve(repo2, &cache.opts()), repo2, "model.safetensors");

    expect_hub_error(
        resolve("org/absent", &cache.opts()),
        "org/absent",
        "config.json",
    );
}

#[test]
fn revision_by_branch_or_commit() {
    let cache = TempCache::new("revision");
    let repo = "org/revs";
    let other = "fedcba9876543210fedcba9876543210fedcba98";
    basic_files(&cache, repo);
    cache.add(repo, SHA, "model.safetensors", "main");
    cache.set_ref(repo, "dev", other);
    cache.add(repo, other, "config.json", "{}");
    cache.add(repo, other, "tokenizer.json", "{}");
    cache.add(repo, other, "model.safetensors", "dev");

    let at = |rev: &str| {
        let opts = HubOptions {
            revision: Some(rev.to_string()),
            ..cache.opts()
        };
        resolve(repo, &opts).expect("resolves")
    };
    let snapshots = cache.repo_dir(repo).join("snapshots");
    assert_eq!(at("dev"), snapshots.join(other));
    assert_eq!(at(other), snapshots.join(other));
    assert_eq!(at(SHA), snapshots.join(SHA));
    let missing = HubOptions {
        revision: Some("v9".into()),
        ..cache.opts()
    };
    expect_hub_error(resolve(repo, &missing), repo, "config.json");
}

#[test]
fn malformed_index_is_an_error_naming_it() {
    let cache = TempCache::new("badindex");
    let repo = "org/badindex";
    basic_files(&cache, repo);
    cache.add(
        repo,
        SHA,
        "model.safetensors.index.json",
        "{\"weight_map\": 3}",
    );
    let cause = expect_hub_error(
        resolve(repo, &cache.opts()),
        repo,
        "model.safetensors.index.json",
    );
    assert!(matches!(cause, HubError::BadIndex { .. }), "{cause:?}");
}
