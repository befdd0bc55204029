//! `Model::builder().repo(..)` over HTTP against a loopback hub (tests/common/hub_server.rs):
//! a cold download of the sharded fixture reproduces its goldens, a second build makes no
//! request, a transfer cut mid-file resumes with `Range`, a partial file left by an earlier
//! run is resumed (or fetched again when its bytes are wrong), five clients sharing one cache
//! fetch each file once, and a renamed repo is followed through the hub's redirects.
#![cfg(feature = "hub")]

mod common;
#[path = "common/hub_server.rs"]
mod hub_server;

use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use candle_gemma::{CacheConfig, Model};
use common::*;
use hub_server::{sha256_hex, Fault, HubRepo, HubServer, TempCache};

const REPO: &str = "test-org/dense-sharded";
const SHARD: &str = "model-00002-of-00003.safetensors";

fn sharded() -> HubRepo {
    HubRepo::from_fixture(REPO, &fixture("dense-sharded"))
}

fn build(server: &HubServer, cache: &TempCache) -> candle_gemma::Result<Model> {
    Model::builder()
        .repo(REPO)
        .endpoint(server.url())
        .hub_cache_dir(&cache.0)
        .progress(false)
        .build()
}

fn check_goldens(model: &Model) {
    for (i, case) in golden("dense-sharded").iter().enumerate() {
        let got = greedy_case(model, case);
        assert_matches_reference(&format!("hub dense-sharded case {i}"), &got, case, 0.01);
    }
}

#[test]
fn cold_download_matches_goldens_and_second_build_makes_no_request() {
    let repo = sharded();
    let server = HubServer::start(vec![repo.clone()]);
    let cache = TempCache::new("cold");

    let model = build(&server, &cache).expect("cold download");
    check_goldens(&model);
    repo.assert_snapshot_matches(model.dir());
    // Each file's bytes crossed the wire once.
    for (name, _) in &repo.files {
        assert_eq!(server.transfers(name).0, 1, "{name} fetched once");
    }
    // The layout huggingface_hub uses: refs/main names the commit, weights are blobs named by
    // their sha256, snapshot entries are links to them.
    let root = cache.repo_dir(REPO);
    let main = std::fs::read_to_string(root.join("refs/main")).expect("refs/main");
    assert_eq!(main.trim(), repo.commit);
    assert_eq!(model.dir(), root.join("snapshots").join(&repo.commit));
    let shard = repo.file(SHARD).expect("shard");
    assert!(root.join("blobs").join(sha256_hex(shard)).is_file());
    let blobs = std::fs::read_dir(root.join("blobs")).expect("blobs");
    for b in blobs {
        let name = b.expect("entry").file_name().to_string_lossy().into_owned();
        assert!(
            !name.contains('.'),
            "no partial or temporary blob left: {name}"
        );
    }

    let before = server.count();
    let again = build(&server, &cache).expect("second build");
    assert_eq!(server.count(), before, "the second build made a request");
    assert_eq!(again.dir(), model.dir());
    let offline = Model::builder()
        .repo(REPO)
        .hub_cache_dir(&cache.0)
        .offline(true)
        .build()
        .expect("offline build");
    check_goldens(&offline);
    assert_eq!(server.count(), before);
}

#[test]
fn single_file_checkpoint_downloads_at_a_commit() {
    let repo = HubRepo::from_fixture("test-org/e2b", &fixture("e2b-hf"));
    let server = HubServer::start(vec![repo.clone()]);
    let cache = TempCache::new("single");
    let model = Model::builder()
        .repo("test-org/e2b")
        .revision(repo.commit.clone())
        .endpoint(server.url())
        .hub_cache_dir(&cache.0)
        // One bar per file on stderr (indicatif draws nothing when it is not a terminal).
        .progress(true)
        .build()
        .expect("download by commit");
    repo.assert_snapshot_matches(model.dir());
    let first = golden("e2b-hf");
    let got = greedy(&model, &first[0].prompt, 8, CacheConfig::default(), None);
    assert_matches_reference("hub e2b", &got, &first[0], 0.01);
}

#[test]
fn connection_cut_mid_file_is_resumed_with_range() {
    let repo = sharded();
    let server = HubServer::start(vec![repo.clone()]);
    server.fault(
        SHARD,
        Fault::Cut {
            after: 100_000,
            times: 2,
        },
    );
    server.fault(
        "tokenizer.json",
        Fault::Cut {
            after: 10_000,
            times: 1,
        },
    );
    let cache = TempCache::new("cut");

    let model = build(&server, &cache).expect("resumed download");
    repo.assert_snapshot_matches(model.dir());
    let ranges = server.ranges(SHARD);
    assert_eq!(
        ranges,
        vec![
            None,
            Some("bytes=100000-".to_string()),
            Some("bytes=200000-".to_string())
        ],
        "the shard is fetched from where each transfer broke"
    );
    let tok = server.ranges("tokenizer.json");
    assert_eq!(tok, vec![None, Some("bytes=10000-".to_string())]);
}

#[test]
fn partial_file_of_an_earlier_run_is_resumed_or_refetched() {
    let repo = sharded();
    let shard = repo.file(SHARD).expect("shard").to_vec();
    let sha = sha256_hex(&shard);
    let server = HubServer::start(vec![repo.clone()]);

    // A good prefix: only the rest is asked for.
    let cache = TempCache::new("partial");
    let blobs = cache.repo_dir(REPO).join("blobs");
    std::fs::create_dir_all(&blobs).expect("blobs");
    std::fs::write(blobs.join(format!("{sha}.incomplete")), &shard[..4096]).expect("part");
    let model = build(&server, &cache).expect("resumed");
    repo.assert_snapshot_matches(model.dir());
    let ranges = server.ranges(SHARD);
    assert_eq!(ranges, vec![Some("bytes=4096-".to_string())]);

    // A corrupt prefix: the hash check fails, the file is fetched again from the start.
    let server = HubServer::start(vec![repo.clone()]);
    let cache = TempCache::new("badpartial");
    let blobs = cache.repo_dir(REPO).join("blobs");
    std::fs::create_dir_all(&blobs).expect("blobs");
    std::fs::write(blobs.join(format!("{sha}.incomplete")), vec![7u8; 4096]).expect("part");
    let model = build(&server, &cache).expect("fetched again");
    repo.assert_snapshot_matches(model.dir());
    let ranges = server.ranges(SHARD);
    assert_eq!(ranges, vec![Some("bytes=4096-".to_string()), None]);
}

#[test]
fn five_clients_share_one_cache_and_fetch_each_file_once() {
    let repo = sharded();
    let server = HubServer::start(vec![repo.clone()]);
    // Slow transfers, so the clients overlap.
    server.set_chunk_delay(std::time::Duration::from_millis(15));
    let cache = Arc::new(TempCache::new("five"));
    let url = server.url().to_string();
    let barrier = Arc::new(Barrier::new(5));
    let clients: Vec<_> = (0..5)
        .map(|_| {
            let (cache, url, barrier) = (cache.clone(), url.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                Model::builder()
                    .repo(REPO)
                    .endpoint(url)
                    .hub_cache_dir(&cache.0)
                    .build()
                    .map(|m| m.dir().to_path_buf())
            })
        })
        .collect();
    let dirs: Vec<PathBuf> = clients
        .into_iter()
        .map(|c| c.join().expect("client thread").expect("client builds"))
        .collect();
    assert!(dirs.windows(2).all(|w| w[0] == w[1]), "one snapshot");
    repo.assert_snapshot_matches(&dirs[0]);
    for (name, _) in &repo.files {
        let (fetched, most) = server.transfers(name);
        assert_eq!((fetched, most), (1, 1), "{name}: transfers, most at once");
    }
    check_goldens(&Model::builder().path(&dirs[0]).build().expect("loads"));
}

#[test]
fn renamed_repo_is_followed_through_relative_redirects() {
    let repo = HubRepo::from_fixture("test-org/e2b", &fixture("e2b-hf"));
    let server = HubServer::start(vec![repo.clone()]);
    server.rename("test-org/e2b-old", "test-org/e2b");
    let cache = TempCache::new("renamed");
    let model = Model::builder()
        .repo("test-org/e2b-old")
        .endpoint(server.url())
        .hub_cache_dir(&cache.0)
        .build()
        .expect("download through the redirect");
    repo.assert_snapshot_matches(model.dir());
    assert!(model.dir().starts_with(cache.repo_dir("test-org/e2b-old")));
    let seen = server.requests();
    assert!(seen.iter().any(|s| s.path.contains("/test-org/e2b-old/")));
    assert!(seen.iter().any(|s| s.path.contains("/test-org/e2b/")));
}
