//! The hub cache on disk, in the layout `huggingface_hub` and `hf-hub` share:
//!
//! ```text
//! <root>/models--org--name/refs/<revision>             the commit hash the revision names
//! <root>/models--org--name/blobs/<etag>                 file contents, named by their etag
//! <root>/models--org--name/blobs/<etag>.incomplete      a download in progress (resumable)
//! <root>/models--org--name/snapshots/<commit>/<file>    relative symlink to ../../blobs/<etag>
//! <root>/.locks/models--org--name/<etag>.lock           held while <etag> is being fetched
//! ```
//!
//! A snapshot entry is made only for a verified blob, so whatever a snapshot holds is whole.
//!
//! The `.lock` files carry advisory OS locks (`flock` on Unix, `LockFileEx` on Windows), as
//! `huggingface_hub`'s do: the OS releases a lock when its process exits, killed or not, so a
//! lock file left behind blocks no one.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{hub_error, safe_name, shards, snapshot_dir, HubError, INDEX, REQUIRED, SINGLE};
use crate::{Error, Result};

/// One repo's part of a hub cache.
pub(super) struct RepoCache {
    root: PathBuf,
    folder: String,
    repo: String,
}

/// How often a waiter tries a held lock again.
const LOCK_POLL: Duration = Duration::from_millis(50);

/// Makes temporary names unique within the process (the pid makes them unique across).
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

pub(super) fn io_error(path: &Path, source: std::io::Error) -> HubError {
    HubError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl RepoCache {
    pub(super) fn new(root: PathBuf, repo: &str) -> Self {
        Self {
            root,
            folder: format!("models--{}", repo.replace('/', "--")),
            repo: repo.to_string(),
        }
    }

    pub(super) fn repo(&self) -> &str {
        &self.repo
    }

    pub(super) fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self) -> PathBuf {
        self.root.join(&self.folder)
    }

    pub(super) fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir().join("snapshots").join(commit)
    }

    pub(super) fn blob(&self, etag: &str) -> PathBuf {
        self.dir().join("blobs").join(etag)
    }

    pub(super) fn incomplete(&self, etag: &str) -> PathBuf {
        self.dir().join("blobs").join(format!("{etag}.incomplete"))
    }

    fn lock_path(&self, etag: &str) -> PathBuf {
        self.root
            .join(".locks")
            .join(&self.folder)
            .join(format!("{etag}.lock"))
    }

    /// Waits until this thread holds the lock of blob `etag` (released on drop), as long as
    /// the holder's download makes progress: the wait ends with [`HubError::LockTimeout`]
    /// once `blobs/<etag>.incomplete` has not changed size for `timeout`.
    pub(super) fn lock(
        &self,
        etag: &str,
        timeout: Duration,
    ) -> std::result::Result<BlobLock, HubError> {
        use fs2::FileExt;
        let path = self.lock_path(etag);
        create_parent(&path)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| io_error(&path, e))?;
        let part = self.incomplete(etag);
        let size = || std::fs::metadata(&part).map(|m| m.len()).ok();
        let (mut seen, mut since) = (size(), Instant::now());
        loop {
            match file.try_lock_exclusive() {
                Ok(()) => return Ok(BlobLock(file)),
                Err(e) if e.raw_os_error() == fs2::lock_contended_error().raw_os_error() => {}
                Err(e) => return Err(io_error(&path, e)),
            }
            let now = size();
            if now != seen {
                (seen, since) = (now, Instant::now());
            } else if since.elapsed() >= timeout {
                return Err(HubError::LockTimeout {
                    lock: path,
                    idle: since.elapsed(),
                });
            }
            std::thread::sleep(LOCK_POLL.min(timeout));
        }
    }

    /// The cached path of `file` at `revision` (a branch or tag with a ref, or a commit).
    pub(super) fn get(&self, revision: &str, file: &str) -> Option<PathBuf> {
        if !safe_name(revision) || !safe_name(file) {
            return None;
        }
        let commit = std::fs::read_to_string(self.dir().join("refs").join(revision))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| revision.to_string());
        if !safe_name(&commit) {
            return None;
        }
        let p = self.snapshot(&commit).join(file);
        p.is_file().then_some(p)
    }

    /// Links `snapshots/<commit>/<file>` to the verified blob `etag`.
    pub(super) fn link(
        &self,
        commit: &str,
        file: &str,
        etag: &str,
    ) -> std::result::Result<PathBuf, HubError> {
        let pointer = self.snapshot(commit).join(file);
        if pointer.is_file() {
            return Ok(pointer);
        }
        create_parent(&pointer)?;
        let blob = self.blob(etag);
        let tmp = tmp_name(&pointer);
        link_file(&blob, &tmp, file).map_err(|e| io_error(&tmp, e))?;
        if let Err(e) = std::fs::rename(&tmp, &pointer) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_error(&pointer, e));
        }
        Ok(pointer)
    }

    /// Points `refs/<revision>` at `commit` (replacing the file in one step).
    pub(super) fn set_ref(
        &self,
        revision: &str,
        commit: &str,
    ) -> std::result::Result<(), HubError> {
        if !safe_name(revision) {
            return Ok(());
        }
        let path = self.dir().join("refs").join(revision);
        create_parent(&path)?;
        let tmp = tmp_name(&path);
        std::fs::write(&tmp, commit).map_err(|e| io_error(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io_error(&path, e)
        })
    }

    /// The weight files: every shard of the index if it is cached, else the single file.
    /// `Err` only for a malformed index; `Ok(None)` if neither is cached.
    fn weights(&self, revision: &str) -> Result<Option<Vec<String>>> {
        match self.get(revision, INDEX) {
            Some(index) => shards(&self.repo, &index).map(Some),
            None => Ok(self.get(revision, SINGLE).map(|_| vec![SINGLE.to_string()])),
        }
    }

    /// The snapshot folder if every needed file is cached in it.
    pub(super) fn complete(&self, revision: &str) -> Result<Option<PathBuf>> {
        let Some(weights) = self.weights(revision)? else {
            return Ok(None);
        };
        let mut dir: Option<PathBuf> = None;
        for file in REQUIRED
            .iter()
            .copied()
            .chain(weights.iter().map(String::as_str))
        {
            let Some(path) = self.get(revision, file) else {
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
    pub(super) fn first_missing(&self, revision: &str) -> Result<Error> {
        let not_cached = || HubError::NotCached {
            cache: self.root.clone(),
        };
        for file in REQUIRED {
            if self.get(revision, file).is_none() {
                return Ok(hub_error(&self.repo, file, not_cached()));
            }
        }
        match self.weights(revision)? {
            None => Ok(hub_error(&self.repo, SINGLE, not_cached())),
            Some(weights) => Ok(
                match weights.iter().find(|f| self.get(revision, f).is_none()) {
                    Some(file) => hub_error(&self.repo, file, not_cached()),
                    None => hub_error(&self.repo, "", HubError::MixedSnapshots),
                },
            ),
        }
    }
}

/// An exclusive lock on one blob's lock file, released when dropped.
pub(super) struct BlobLock(std::fs::File);

impl Drop for BlobLock {
    fn drop(&mut self) {
        let _ = fs2::FileExt::unlock(&self.0);
    }
}

fn create_parent(path: &Path) -> std::result::Result<(), HubError> {
    match path.parent() {
        Some(dir) => std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e)),
        None => Ok(()),
    }
}

/// A sibling name for `path` no other writer uses.
pub(super) fn tmp_name(path: &Path) -> PathBuf {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}-{n}", std::process::id()));
    path.with_file_name(name)
}

/// Makes `link` (in `snapshots/<commit>/`, `file` deep) point at `blob` by a relative path.
#[cfg(unix)]
fn link_file(blob: &Path, link: &Path, file: &str) -> std::io::Result<()> {
    let mut target = PathBuf::new();
    // From snapshots/<commit>/<file's folders>/ back up to the repo folder.
    for _ in 0..file.split('/').count() + 1 {
        target.push("..");
    }
    target.push("blobs");
    target.push(blob.file_name().unwrap_or_default());
    std::os::unix::fs::symlink(target, link)
}

/// Without symlinks, a hard link (same volume) or a copy stands in for the link.
#[cfg(not(unix))]
fn link_file(blob: &Path, link: &Path, _file: &str) -> std::io::Result<()> {
    std::fs::hard_link(blob, link).or_else(|_| std::fs::copy(blob, link).map(|_| ()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_relative_and_resolve() {
        let root = std::env::temp_dir().join(format!("cg-hub-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let cache = RepoCache::new(root.clone(), "org/name");
        let blob = cache.blob("e1");
        std::fs::create_dir_all(blob.parent().expect("blobs")).expect("mkdir");
        std::fs::write(&blob, "x").expect("blob");
        for file in ["a.json", "sub/b.json"] {
            let p = cache.link("c0", file, "e1").expect("link");
            assert_eq!(std::fs::read_to_string(&p).expect("read"), "x");
            assert_eq!(cache.get("c0", file), Some(p));
        }
        cache.set_ref("main", "c0").expect("ref");
        assert!(cache.get("main", "sub/b.json").is_some());
        assert!(cache.get("../x", "a.json").is_none());
        let _ = std::fs::remove_dir_all(&root);
    }
}
