//! The per-file download lock of a shared hub cache, against a loopback hub
//! (tests/common/hub_server.rs): a waiter waits while the lock's holder makes progress and then
//! resumes what the holder left; a holder that makes no progress ends the wait with a typed
//! `HubError::LockTimeout` naming the lock, leaving no half-file; a lock file left by a killed
//! process blocks no one.
#![cfg(feature = "hub")]

mod common;
#[path = "common/hub_server.rs"]
mod hub_server;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_gemma::hub::{resolve, HubOptions};
use candle_gemma::{Error, HubError, Model};
use common::fixture;
use fs2::FileExt;
use hub_server::{sha256_hex, HubRepo, HubServer, TempCache};

const REPO: &str = "test-org/dense-sharded";
const SHARD: &str = "model-00002-of-00003.safetensors";
/// The helper test a child process runs to hold a lock until it is killed.
const CHILD: &str = "child_process_holding_a_lock";
/// Set in the child's environment: the lock file it takes.
const CHILD_LOCK: &str = "CANDLE_GEMMA_TEST_HOLD_LOCK";

fn sharded() -> HubRepo {
    HubRepo::from_fixture(REPO, &fixture("dense-sharded"))
}

/// The shard's bytes and its blob name (the sha256, as for every LFS file).
fn shard(repo: &HubRepo) -> (Vec<u8>, String) {
    let bytes = repo.file(SHARD).expect("shard").to_vec();
    let sha = sha256_hex(&bytes);
    (bytes, sha)
}

/// What each lock test starts from: the sharded repo served, an empty cache named `name`, and
/// the shard's bytes, hash and lock path.
struct Setup {
    repo: HubRepo,
    bytes: Vec<u8>,
    sha: String,
    server: HubServer,
    cache: TempCache,
    lock: PathBuf,
}

fn setup(name: &str) -> Setup {
    let repo = sharded();
    let (bytes, sha) = shard(&repo);
    let server = HubServer::start(vec![repo.clone()]);
    let cache = TempCache::new(name);
    let lock = lock_path(&cache, &sha);
    Setup {
        repo,
        bytes,
        sha,
        server,
        cache,
        lock,
    }
}

/// `.locks/models--org--name/<etag>.lock`, with its folder made.
fn lock_path(cache: &TempCache, etag: &str) -> PathBuf {
    let path = cache
        .0
        .join(".locks")
        .join(format!("models--{}", REPO.replace('/', "--")))
        .join(format!("{etag}.lock"));
    std::fs::create_dir_all(path.parent().expect("lock folder")).expect("mkdir");
    path
}

fn open_lock(path: &Path) -> File {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .expect("open lock")
}

fn build(server: &HubServer, cache: &TempCache, timeout: Duration) -> candle_gemma::Result<Model> {
    Model::builder()
        .repo(REPO)
        .endpoint(server.url())
        .hub_cache_dir(&cache.0)
        .hub_lock_timeout(timeout)
        .build()
}

#[test]
fn waiter_waits_while_the_holder_progresses_then_resumes_its_part() {
    let Setup {
        repo,
        bytes,
        sha,
        server,
        cache,
        lock,
    } = setup("lock-progress");
    let blobs = cache.repo_dir(REPO).join("blobs");
    std::fs::create_dir_all(&blobs).expect("blobs");
    let part = blobs.join(format!("{sha}.incomplete"));

    // Another fetcher holds the shard's lock and writes a correct prefix in 8 steps 250 ms
    // apart (2 s in all, twice the waiter's bound), then stops without finishing.
    let held = open_lock(&lock);
    held.lock_exclusive().expect("lock");
    const STEP: usize = 4096;
    const STEPS: usize = 8;
    assert!(bytes.len() > STEP * STEPS);
    let prefix = bytes[..STEP * STEPS].to_vec();
    let holder = std::thread::spawn(move || {
        let mut out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&part)
            .expect("part");
        for chunk in prefix.chunks(STEP) {
            out.write_all(chunk).expect("write");
            out.flush().expect("flush");
            std::thread::sleep(Duration::from_millis(250));
        }
        drop(held);
    });
    let start = Instant::now();
    let model = build(&server, &cache, Duration::from_secs(1)).expect("waits, then resumes");
    holder.join().expect("holder");
    assert!(
        start.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        start.elapsed()
    );
    repo.assert_snapshot_matches(model.dir());
    assert_eq!(
        server.ranges(SHARD),
        vec![Some(format!("bytes={}-", STEP * STEPS))],
        "the waiter asks only for what the holder did not write"
    );
}

#[test]
fn held_lock_without_progress_ends_the_wait_with_a_typed_error() {
    let Setup {
        repo,
        sha,
        server,
        cache,
        lock,
        ..
    } = setup("lock-stalled");
    let held = open_lock(&lock);
    held.lock_exclusive().expect("lock");

    let opts = HubOptions {
        endpoint: Some(server.url().to_string()),
        cache_dir: Some(cache.0.clone()),
        lock_timeout: Some(Duration::from_millis(500)),
        ..Default::default()
    };
    let start = Instant::now();
    match resolve(REPO, &opts) {
        Err(
            e @ Error::Hub {
                cause: HubError::LockTimeout { .. },
                ..
            },
        ) => {
            let msg = e.to_string();
            let Error::Hub { repo, file, cause } = e else {
                unreachable!()
            };
            let HubError::LockTimeout { lock: named, idle } = cause else {
                unreachable!()
            };
            assert_eq!((repo.as_str(), file.as_str()), (REPO, SHARD));
            assert_eq!(named, lock);
            assert!(idle >= Duration::from_millis(500), "{idle:?}");
            assert!(msg.contains(REPO) && msg.contains(SHARD), "{msg}");
            assert!(msg.contains(&lock.display().to_string()), "{msg}");
        }
        other => panic!("expected HubError::LockTimeout, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(30), "bounded wait");
    // Nothing of the shard is in the cache, and an offline load finds no checkpoint.
    let blobs = cache.repo_dir(REPO).join("blobs");
    for b in std::fs::read_dir(&blobs).expect("blobs") {
        let name = b.expect("entry").file_name().to_string_lossy().into_owned();
        assert!(!name.starts_with(&sha), "{name} left in the cache");
    }
    let offline = HubOptions {
        cache_dir: Some(cache.0.clone()),
        offline: true,
        ..Default::default()
    };
    assert!(matches!(
        resolve(REPO, &offline),
        Err(Error::Hub {
            cause: HubError::NotCached { .. },
            ..
        })
    ));

    // Once the holder lets go, the same call completes the checkpoint.
    drop(held);
    let dir = resolve(REPO, &opts).expect("download after the lock is free");
    repo.assert_snapshot_matches(&dir);
}

#[test]
fn lock_left_by_a_killed_process_blocks_no_one() {
    let Setup {
        repo,
        server,
        cache,
        lock,
        ..
    } = setup("lock-killed");

    // A child process (this test binary, running the helper test below) takes the lock.
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["--exact", CHILD, "--test-threads", "1"])
        .env(CHILD_LOCK, &lock)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the child");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // A free lock is released again at once (the file is closed), for the child to take.
        if open_lock(&lock).try_lock_exclusive().is_err() {
            break;
        }
        assert!(Instant::now() < deadline, "the child never took the lock");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("kill the child");
    child.wait().expect("reap the child");
    assert!(lock.is_file(), "the killed process leaves its lock file");

    let start = Instant::now();
    let model = build(&server, &cache, Duration::from_secs(30)).expect("the lock is free");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    repo.assert_snapshot_matches(model.dir());
}

/// Run by [`lock_left_by_a_killed_process_blocks_no_one`] in a child process: takes the lock
/// named by `CANDLE_GEMMA_TEST_HOLD_LOCK` and holds it until killed. Passes at once in a
/// normal run (the variable unset).
#[test]
fn child_process_holding_a_lock() {
    let Some(path) = std::env::var_os(CHILD_LOCK) else {
        return;
    };
    let file = open_lock(Path::new(&path));
    file.lock_exclusive().expect("lock");
    std::thread::sleep(Duration::from_secs(300));
}
