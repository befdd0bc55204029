//! One file into the cache: take the blob's lock, download (resuming a partial transfer),
//! verify size and sha256, move the blob into place, link it into the snapshot.
//!
//! Bytes go to `blobs/<etag>.incomplete` and become `blobs/<etag>` only once verified, so a
//! snapshot never links to a partial or corrupt file. A file that fails verification is
//! deleted and reported; a partial file left by a broken connection stays for the next
//! attempt, which asks for the rest with `Range`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::cache::{io_error, RepoCache};
use super::client::{backoff, with_attempts, Client, Failure, FileMeta, ATTEMPTS};
use super::{safe_name, HubError};

/// Returns the cached path of `file` at `commit`, downloading it first if needed.
pub(super) fn file(
    client: &Client,
    cache: &RepoCache,
    commit: &str,
    file: &str,
    progress: bool,
    lock_timeout: Duration,
) -> Result<PathBuf, HubError> {
    if !safe_name(file) {
        return Err(HubError::BadResponse {
            reason: format!("unsafe file name {file:?}"),
        });
    }
    if let Some(path) = cache.get(commit, file) {
        return Ok(path);
    }
    let meta = client.meta(commit, file)?;
    // Whoever holds the lock fetches the blob; the others then find it in place.
    let _lock = cache.lock(&meta.etag, lock_timeout)?;
    let blob = cache.blob(&meta.etag);
    match std::fs::metadata(&blob) {
        Ok(m) if m.is_file() && m.len() == meta.size => {}
        found => {
            // A blob of the wrong size was written without verification: fetch it again.
            if found.is_ok() {
                std::fs::remove_file(&blob).map_err(|e| io_error(&blob, e))?;
            }
            download(client, cache, &meta, file, progress)?;
        }
    }
    cache.link(commit, file, &meta.etag)
}

/// Fetches the blob of `meta` into `blobs/<etag>`, verified.
fn download(
    client: &Client,
    cache: &RepoCache,
    meta: &FileMeta,
    name: &str,
    progress: bool,
) -> Result<(), HubError> {
    let part = cache.incomplete(&meta.etag);
    if let Some(dir) = part.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    }
    let bar = progress_bar(progress, name, meta.size);
    let resumed = std::fs::metadata(&part).is_ok_and(|m| m.len() > 0);
    let result = match transfer(client, meta, &part, &bar) {
        // The kept prefix may be what was wrong: the failed file is gone, so start over once.
        Err(HubError::HashMismatch { .. }) if resumed => transfer(client, meta, &part, &bar),
        other => other,
    };
    match result {
        Ok(()) => bar.finish(),
        Err(e) => {
            bar.abandon();
            return Err(e);
        }
    }
    let blob = cache.blob(&meta.etag);
    std::fs::rename(&part, &blob).map_err(|e| io_error(&blob, e))
}

/// Where a transfer stands: the partial file, its length and the running hash.
struct Partial<'a> {
    path: &'a Path,
    out: std::fs::File,
    have: u64,
    hasher: Option<Sha256>,
    bar: &'a indicatif::ProgressBar,
}

impl Partial<'_> {
    fn restart(&mut self) -> Result<(), HubError> {
        self.out.set_len(0).map_err(|e| io_error(self.path, e))?;
        self.have = 0;
        if let Some(h) = &mut self.hasher {
            h.reset();
        }
        self.bar.set_position(0);
        Ok(())
    }

    fn discard(&self) {
        let _ = std::fs::remove_file(self.path);
    }
}

/// Completes `part` to `meta.size` bytes (resuming what it holds) and verifies it. Deletes
/// it when it cannot be right; keeps it after a network failure, for a later resume.
fn transfer(
    client: &Client,
    meta: &FileMeta,
    part: &Path,
    bar: &indicatif::ProgressBar,
) -> Result<(), HubError> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .map_err(|e| io_error(part, e))?;
    let have = out.metadata().map_err(|e| io_error(part, e))?.len();
    let mut p = Partial {
        path: part,
        out,
        have,
        hasher: meta.sha256.as_ref().map(|_| Sha256::new()),
        bar,
    };
    if p.have > meta.size {
        p.restart()?;
    }
    if let Some(h) = &mut p.hasher {
        hash_prefix(part, p.have, h)?;
    }
    bar.set_position(p.have);

    // Bounded: at most ATTEMPTS attempts in a row that bring no new byte.
    let mut failures = 0;
    while p.have < meta.size {
        let before = p.have;
        match stream(client, meta, &mut p) {
            Ok(()) => break,
            Err(Failure::Fatal(e)) => {
                if matches!(e, HubError::SizeMismatch { .. }) {
                    p.discard();
                }
                return Err(e);
            }
            Err(Failure::Retry(e)) => {
                failures = if p.have > before { 1 } else { failures + 1 };
                if failures >= ATTEMPTS {
                    return Err(with_attempts(e, failures));
                }
                std::thread::sleep(backoff(failures));
            }
        }
    }
    if p.have != meta.size {
        p.discard();
        return Err(HubError::SizeMismatch {
            expected: meta.size,
            found: p.have,
        });
    }
    if let (Some(h), Some(expected)) = (p.hasher.take(), &meta.sha256) {
        let found = hex(&h.finalize());
        if found != *expected {
            p.discard();
            return Err(HubError::HashMismatch {
                expected: expected.clone(),
                found,
            });
        }
    }
    p.out.sync_all().map_err(|e| io_error(part, e))?;
    if let Some(expected) = &meta.git_sha1 {
        let bytes = std::fs::read(part).map_err(|e| io_error(part, e))?;
        let found = git_blob_sha1(&bytes);
        if found != *expected {
            p.discard();
            return Err(HubError::HashMismatch {
                expected: expected.clone(),
                found,
            });
        }
    }
    Ok(())
}

/// The hash git names a blob by: sha1 of `blob {len}\0` followed by the bytes.
pub(super) fn git_blob_sha1(bytes: &[u8]) -> String {
    use sha1::{Digest as _, Sha1};
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex(&h.finalize())
}

/// One request for the rest of the file; `Ok` when the body ended cleanly.
fn stream(client: &Client, meta: &FileMeta, p: &mut Partial<'_>) -> Result<(), Failure> {
    let resp = client.get_from(&meta.url, p.have)?;
    let fatal = Failure::Fatal;
    match resp.status() {
        206 if range_start(&resp) == Some(p.have) => {}
        206 => {
            // The range is not the one asked for: drop the prefix, ask for the whole file.
            p.restart().map_err(fatal)?;
            return Err(Failure::Retry(HubError::BadResponse {
                reason: "the server answered another range".into(),
            }));
        }
        200 => {
            if p.have > 0 {
                p.restart().map_err(fatal)?;
            }
        }
        status => return Err(fatal(HubError::Status { status })),
    }
    let mut reader = resp.into_reader();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Failure::Retry(HubError::Network {
                    attempts: 1,
                    reason: e.to_string(),
                }))
            }
        };
        if p.have + n as u64 > meta.size {
            return Err(fatal(HubError::SizeMismatch {
                expected: meta.size,
                found: p.have + n as u64,
            }));
        }
        p.out
            .write_all(&buf[..n])
            .map_err(|e| fatal(io_error(p.path, e)))?;
        if let Some(h) = &mut p.hasher {
            h.update(&buf[..n]);
        }
        p.have += n as u64;
        p.bar.inc(n as u64);
    }
}

/// The first byte of a `Content-Range: bytes S-E/T` answer.
fn range_start(resp: &ureq::Response) -> Option<u64> {
    let v = resp.header("Content-Range")?.trim();
    let range = v.strip_prefix("bytes")?.trim_start();
    range.split('-').next()?.trim().parse().ok()
}

/// Feeds the first `len` bytes of `path` to `h`.
fn hash_prefix(path: &Path, len: u64, h: &mut Sha256) -> Result<(), HubError> {
    let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    let mut reader = file.take(len);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => h.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(path, e)),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One bar per file (name, bytes, rate, time left) on stderr; hidden when `show` is off.
fn progress_bar(show: bool, name: &str, size: u64) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(size);
    let style = indicatif::ProgressStyle::with_template(
        "{msg:30} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    let short = match name.char_indices().rev().nth(29) {
        Some((i, _)) => format!("..{}", &name[i..]),
        None => name.to_string(),
    };
    bar.set_message(short);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_bar_per_file_is_hidden_when_off() {
        assert!(progress_bar(false, "model.safetensors", 10).is_hidden());
        let bar = progress_bar(true, "model-00001-of-00042.safetensors.extra-long-name", 10);
        assert_eq!(bar.length(), Some(10));
        assert!(bar.message().starts_with("..") && bar.message().chars().count() == 32);
    }

    #[test]
    fn git_blob_sha1_matches_git_hash_object() {
        // `git hash-object` of an empty file and of "hello\n".
        assert_eq!(
            git_blob_sha1(b""),
            "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
        );
        assert_eq!(
            git_blob_sha1(b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
    }

    #[test]
    fn sha256_hex_of_abc() {
        assert_eq!(
            hex(&Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
