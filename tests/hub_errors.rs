//! Every way the loopback hub (tests/common/hub_server.rs) can fail a download gives an
//! [`Error::Hub`] naming the repo, the file and a typed [`HubError`] cause, and leaves nothing
//! in the cache that a later run would load; server errors are retried with a bounded backoff.
#![cfg(feature = "hub")]

mod common;
#[path = "common/hub_server.rs"]
mod hub_server;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_gemma::hub::{resolve, HubOptions, ATTEMPTS};
use candle_gemma::{Error, HubError};
use common::fixture;
use hub_server::{git_blob_sha1, sha256_hex, Fault, HubRepo, HubServer, TempCache};

const REPO: &str = "test-org/dense-sharded";
const SHARD: &str = "model-00002-of-00003.safetensors";

fn sharded() -> HubRepo {
    HubRepo::from_fixture(REPO, &fixture("dense-sharded"))
}

fn opts(server: &HubServer, cache: &TempCache) -> HubOptions {
    HubOptions {
        endpoint: Some(server.url().to_string()),
        cache_dir: Some(cache.0.clone()),
        ..Default::default()
    }
}

/// Splits a hub error into (repo, file, cause), checking the message names both.
fn hub_error(result: candle_gemma::Result<PathBuf>) -> (String, String, HubError) {
    match result {
        Err(e @ Error::Hub { .. }) => {
            let msg = e.to_string();
            let Error::Hub { repo, file, cause } = e else {
                unreachable!()
            };
            assert!(msg.contains(&repo) && msg.contains(&file), "{msg}");
            eprintln!("{msg}");
            (repo, file, cause)
        }
        other => panic!("expected a hub error, got {other:?}"),
    }
}

/// Nothing a later run could load: no partial blob, and every snapshot entry is a whole,
/// verified blob (its sha256 is its name, for LFS blobs); an offline resolve does not find a
/// complete checkpoint.
fn assert_no_half_file(cache: &TempCache, repo: &HubRepo) {
    let root = cache
        .0
        .join(format!("models--{}", repo.id.replace('/', "--")));
    if let Ok(blobs) = std::fs::read_dir(root.join("blobs")) {
        for b in blobs {
            let name = b.expect("entry").file_name().to_string_lossy().into_owned();
            assert!(!name.ends_with(".incomplete"), "half-file {name} left");
        }
    }
    let snapshot = root.join("snapshots").join(&repo.commit);
    for (name, bytes) in &repo.files {
        let p = snapshot.join(name);
        if p.exists() {
            assert!(
                std::fs::read(&p).expect("read") == *bytes,
                "{name} is not whole"
            );
            let blob = std::fs::canonicalize(&p).expect("link");
            let blob_name = blob
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            if blob_name.len() == 64 {
                assert_eq!(blob_name, sha256_hex(bytes));
            }
        }
    }
    let offline = HubOptions {
        cache_dir: Some(cache.0.clone()),
        offline: true,
        ..Default::default()
    };
    let (_, _, cause) = hub_error(resolve(&repo.id, &offline));
    assert!(matches!(cause, HubError::NotCached { .. }), "{cause:?}");
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

#[test]
fn gated_repo_without_token_with_a_wrong_one_and_with_the_right_one() {
    let mut repo = sharded();
    repo.token = Some("hf_right".into());
    let server = HubServer::start(vec![repo.clone()]);
    let cache = TempCache::new("gated");

    let (r, file, cause) = hub_error(resolve(REPO, &opts(&server, &cache)));
    assert_eq!((r.as_str(), file.as_str()), (REPO, "config.json"));
    assert!(matches!(
        cause,
        HubError::Unauthorized {
            token_sent: false,
            gated: true
        }
    ));
    assert!(cause.to_string().contains("token"), "{cause}");

    let wrong = HubOptions {
        token: Some("hf_wrong".into()),
        ..opts(&server, &cache)
    };
    let (_, file, cause) = hub_error(resolve(REPO, &wrong));
    assert_eq!(file, "config.json");
    assert!(matches!(
        cause,
        HubError::Unauthorized {
            token_sent: true,
            ..
        }
    ));
    assert!(server
        .requests()
        .iter()
        .any(|s| s.auth.as_deref() == Some("Bearer hf_wrong")));
    assert_no_half_file(&cache, &repo);

    let right = HubOptions {
        token: Some("hf_right".into()),
        ..opts(&server, &cache)
    };
    resolve(REPO, &right).expect("the right token downloads");
    // The hub saw the token.
    let seen = server.requests();
    assert!(seen
        .iter()
        .filter(|s| !s.path.starts_with("/cdn/"))
        .any(|s| s.auth.as_deref() == Some("Bearer hf_right")));
}

#[test]
fn token_stored_next_to_the_cache_is_used() {
    let mut repo = sharded();
    repo.token = Some("hf_stored".into());
    let server = HubServer::start(vec![repo]);
    let home = TempCache::new("stored-token");
    std::fs::write(home.0.join("token"), "hf_stored\n").expect("token file");
    let cache_dir = home.0.join("hub");
    let o = HubOptions {
        endpoint: Some(server.url().to_string()),
        cache_dir: Some(cache_dir),
        ..Default::default()
    };
    resolve(REPO, &o).expect("the stored token downloads");
}

#[test]
fn missing_repo_revision_and_file_are_named() {
    let repo = sharded();
    let mut no_tokenizer = HubRepo::from_fixture("test-org/no-tokenizer", &fixture("e2b-hf"));
    no_tokenizer.files.retain(|(n, _)| n != "tokenizer.json");
    let server = HubServer::start(vec![repo.clone(), no_tokenizer]);
    let cache = TempCache::new("notfound");

    let (r, file, cause) = hub_error(resolve("test-org/absent", &opts(&server, &cache)));
    assert_eq!((r.as_str(), file.as_str()), ("test-org/absent", ""));
    assert!(matches!(cause, HubError::RepoNotFound), "{cause:?}");

    let v9 = HubOptions {
        revision: Some("v9".into()),
        ..opts(&server, &cache)
    };
    let (_, _, cause) = hub_error(resolve(REPO, &v9));
    assert!(
        matches!(&cause, HubError::RevisionNotFound { revision } if revision == "v9"),
        "{cause:?}"
    );

    // Not in the repo's file list.
    let (_, file, cause) = hub_error(resolve("test-org/no-tokenizer", &opts(&server, &cache)));
    assert_eq!(file, "tokenizer.json");
    assert!(matches!(cause, HubError::FileNotFound { .. }), "{cause:?}");

    // Listed, but the hub answers 404 for it.
    server.fault(
        SHARD,
        Fault::Status {
            status: 404,
            code: Some("EntryNotFound"),
            times: usize::MAX,
        },
    );
    let (_, file, cause) = hub_error(resolve(REPO, &opts(&server, &cache)));
    assert_eq!(file, SHARD);
    assert!(matches!(cause, HubError::FileNotFound { .. }), "{cause:?}");
    assert_no_half_file(&cache, &repo);
}

#[test]
fn server_errors_are_retried_with_bounded_backoff() {
    let repo = sharded();
    let server = HubServer::start(vec![repo.clone()]);
    let cache = TempCache::new("retry");

    // Two 500s on model info and on a shard, then success.
    for target in ["api", SHARD] {
        server.fault(
            target,
            Fault::Status {
                status: 500,
                code: None,
                times: 2,
            },
        );
    }
    let start = Instant::now();
    resolve(REPO, &opts(&server, &cache)).expect("succeeds after retries");
    let waited = start.elapsed();
    // Two waits of 200 ms then 400 ms, for each of the two.
    assert!(waited >= Duration::from_millis(1200), "{waited:?}");
    let info_calls = server
        .requests()
        .iter()
        .filter(|s| s.path.starts_with("/api/"))
        .count();
    assert_eq!(info_calls, 3);

    // A server that keeps failing: the error says so after ATTEMPTS requests, in bounded time.
    let cache = TempCache::new("retry-fail");
    server.clear_faults();
    server.fault(
        "config.json",
        Fault::Status {
            status: 503,
            code: None,
            times: usize::MAX,
        },
    );
    let start = Instant::now();
    let (_, file, cause) = hub_error(resolve(REPO, &opts(&server, &cache)));
    assert!(start.elapsed() < Duration::from_secs(10), "bounded");
    assert_eq!(file, "config.json");
    assert!(
        matches!(cause, HubError::Server { status: 503, attempts } if attempts == ATTEMPTS),
        "{cause:?}"
    );
    assert_no_half_file(&cache, &repo);
}

#[test]
fn wrong_linked_size_is_reported_and_nothing_is_kept() {
    let repo = sharded();
    let true_size = repo.file(SHARD).expect("shard").len() as u64;
    for (tag, announced) in [("short", true_size + 1000), ("long", true_size - 1000)] {
        let server = HubServer::start(vec![repo.clone()]);
        server.fault(SHARD, Fault::LinkedSize(announced));
        let cache = TempCache::new(tag);
        let (r, file, cause) = hub_error(resolve(REPO, &opts(&server, &cache)));
        assert_eq!((r.as_str(), file.as_str()), (REPO, SHARD));
        assert!(
            matches!(cause, HubError::SizeMismatch { expected, .. } if expected == announced),
            "{cause:?}"
        );
        assert_no_half_file(&cache, &repo);
        // With the truth told, the next run completes.
        server.clear_faults();
        let dir = resolve(REPO, &opts(&server, &cache)).expect("next run");
        assert!(files_in(&dir) >= repo.files.len());
    }
}

#[test]
fn bytes_that_differ_from_the_hash_are_reported_and_discarded() {
    let repo = sharded();
    let server = HubServer::start(vec![repo.clone()]);
    server.fault(SHARD, Fault::Corrupt);
    let cache = TempCache::new("corrupt");
    let (r, file, cause) = hub_error(resolve(REPO, &opts(&server, &cache)));
    assert_eq!((r.as_str(), file.as_str()), (REPO, SHARD));
    match &cause {
        HubError::HashMismatch { expected, found } => {
            assert_eq!(*expected, sha256_hex(repo.file(SHARD).expect("shard")));
            assert_ne!(expected, found);
        }
        other => panic!("expected a hash mismatch, got {other:?}"),
    }
    assert_no_half_file(&cache, &repo);
    server.clear_faults();
    resolve(REPO, &opts(&server, &cache)).expect("next run");
}

#[test]
fn git_file_whose_bytes_differ_from_its_blob_hash_is_reported_and_discarded() {
    let repo = sharded();
    let server = HubServer::start(vec![repo.clone()]);
    server.fault("config.json", Fault::Corrupt);
    let cache = TempCache::new("corrupt-git");
    let (r, file, cause) = hub_error(resolve(REPO, &opts(&server, &cache)));
    assert_eq!((r.as_str(), file.as_str()), (REPO, "config.json"));
    match &cause {
        HubError::HashMismatch { expected, found } => {
            assert_eq!(
                *expected,
                git_blob_sha1(repo.file("config.json").expect("config"))
            );
            assert_ne!(expected, found);
        }
        other => panic!("expected a hash mismatch, got {other:?}"),
    }
    assert_no_half_file(&cache, &repo);
    server.clear_faults();
    resolve(REPO, &opts(&server, &cache)).expect("next run");
}

#[test]
fn connection_that_keeps_breaking_gives_a_network_error() {
    let repo = sharded();
    let server = HubServer::start(vec![repo.clone()]);
    // Every transfer breaks before its first byte: no progress, so the retries run out.
    server.fault(
        SHARD,
        Fault::Cut {
            after: 0,
            times: usize::MAX,
        },
    );
    let cache = TempCache::new("broken");
    let (_, file, cause) = hub_error(resolve(REPO, &opts(&server, &cache)));
    assert_eq!(file, SHARD);
    assert!(
        matches!(cause, HubError::Network { attempts, .. } if attempts == ATTEMPTS),
        "{cause:?}"
    );
    assert_eq!(server.transfers(SHARD).0, ATTEMPTS as usize);
    // A refused connection is a network error too.
    let closed = HubOptions {
        endpoint: Some("http://127.0.0.1:9".into()),
        cache_dir: Some(cache.0.clone()),
        ..Default::default()
    };
    let (_, _, cause) = hub_error(resolve(REPO, &closed));
    assert!(matches!(cause, HubError::Network { .. }), "{cause:?}");
    server.clear_faults();
    resolve(REPO, &opts(&server, &cache)).expect("next run");
}
