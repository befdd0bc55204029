//! The HTTP side of the hub: model info, file metadata, ranged downloads, and what each
//! failure means ([`HubError`]), with bounded retries and exponential backoff.
//!
//! Endpoints (as `huggingface_hub` uses them):
//! - `GET {endpoint}/api/models/{repo}/revision/{revision}`: the commit and the file list;
//! - `HEAD {endpoint}/{repo}/resolve/{commit}/{file}`: `X-Repo-Commit`, `ETag` (or, for LFS
//!   files, `X-Linked-Etag`, the sha256, and `X-Linked-Size`), size; relative redirects (a
//!   renamed repo) are followed, an absolute one (the LFS storage) is not needed for metadata;
//! - `GET` of the same URL with `Range: bytes=N-`, following redirects.
//!
//! The hub names the cause of a 4xx in `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`,
//! `EntryNotFound`, `GatedRepo`); without it the status and the endpoint decide.

use std::time::Duration;

use serde::Deserialize;

use super::HubError;

/// Requests made for the model info or a file's metadata, and transfers in a row that bring
/// no new byte of a file, before giving up on server errors and broken connections.
pub const ATTEMPTS: u32 = 5;
/// Wait before the first retry; doubled for each further one.
const BACKOFF: Duration = Duration::from_millis(200);
/// Longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The parts of the model info the download uses.
#[derive(Debug, Deserialize)]
pub(super) struct RepoInfo {
    /// The commit the revision resolves to.
    pub sha: String,
    /// The repo's files.
    pub siblings: Vec<Sibling>,
}

/// One file of the repo.
#[derive(Debug, Deserialize)]
pub(super) struct Sibling {
    /// Its path in the repo.
    pub rfilename: String,
}

/// What the hub says about one file.
#[derive(Debug, Clone)]
pub(super) struct FileMeta {
    /// The blob name: the sha256 for LFS files, the git blob hash otherwise.
    pub etag: String,
    /// Size in bytes.
    pub size: u64,
    /// The sha256 to check the bytes against (LFS files only).
    pub sha256: Option<String>,
    /// The git blob hash (sha1 of `blob {size}\0` + bytes) to check files kept in git against.
    pub git_sha1: Option<String>,
    /// Where to download it from.
    pub url: String,
}

/// The outcome of one failed attempt: worth retrying, or final.
pub(super) enum Failure {
    Retry(HubError),
    Fatal(HubError),
}

/// Which endpoint a status came from, to read a bare 404.
#[derive(Clone, Copy)]
enum Endpoint {
    Info,
    File,
}

/// A hub client for one repo.
pub(super) struct Client {
    agent: ureq::Agent,
    /// Follows no redirect: metadata is read from the first response.
    head_agent: ureq::Agent,
    endpoint: String,
    token: Option<String>,
    repo: String,
}

impl Client {
    pub(super) fn new(endpoint: &str, token: Option<String>, repo: &str) -> Self {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        // No proxy for a loopback endpoint (ureq does not read NO_PROXY).
        let proxy = !["http://127.0.0.1", "http://localhost", "http://[::1]"]
            .iter()
            .any(|p| endpoint.starts_with(p));
        let base = || {
            ureq::AgentBuilder::new()
                .try_proxy_from_env(proxy)
                .timeout_connect(Duration::from_secs(20))
                .timeout_read(Duration::from_secs(60))
                .user_agent(concat!("candle-gemma/", env!("CARGO_PKG_VERSION")))
        };
        Self {
            agent: base()
                .redirects(8)
                .redirect_auth_headers(ureq::RedirectAuthHeaders::SameHost)
                .build(),
            head_agent: base().redirects(0).build(),
            endpoint,
            token,
            repo: repo.to_string(),
        }
    }

    fn request(&self, agent: &ureq::Agent, method: &str, url: &str) -> ureq::Request {
        let req = agent.request(method, url);
        match &self.token {
            Some(t) => req.set("Authorization", &format!("Bearer {t}")),
            None => req,
        }
    }

    /// The commit `revision` resolves to and the files of the repo at that commit.
    pub(super) fn info(&self, revision: &str) -> Result<RepoInfo, HubError> {
        let url = format!(
            "{}/api/models/{}/revision/{}",
            self.endpoint,
            self.repo,
            encode(revision)
        );
        let info: RepoInfo = retry(|| {
            let resp = self
                .request(&self.agent, "GET", &url)
                .call()
                .map_err(|e| self.failure(e, Endpoint::Info, revision))?;
            resp.into_json().map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidData => Failure::Fatal(HubError::BadResponse {
                    reason: format!("model info: {e}"),
                }),
                _ => Failure::Retry(HubError::Network {
                    attempts: 1,
                    reason: format!("model info: {e}"),
                }),
            })
        })?;
        if info.sha.is_empty() || !info.sha.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(HubError::BadResponse {
                reason: format!("model info names commit {:?}", info.sha),
            });
        }
        Ok(info)
    }

    /// Size, etag and download URL of `file` at `commit`.
    pub(super) fn meta(&self, commit: &str, file: &str) -> Result<FileMeta, HubError> {
        let url = format!(
            "{}/{}/resolve/{commit}/{}",
            self.endpoint,
            self.repo,
            file.split('/').map(encode).collect::<Vec<_>>().join("/")
        );
        retry(|| self.meta_once(&url, commit))
    }

    fn meta_once(&self, url: &str, commit: &str) -> Result<FileMeta, Failure> {
        let mut at = url.to_string();
        for _ in 0..8 {
            let resp = self
                .request(&self.head_agent, "HEAD", &at)
                .set("Accept-Encoding", "identity")
                .call()
                .map_err(|e| self.failure(e, Endpoint::File, commit))?;
            let location = resp.header("Location").map(str::to_string);
            let redirect = (300..400).contains(&resp.status());
            if let (true, Some(loc)) = (redirect, &location) {
                if loc.starts_with('/') {
                    at = format!("{}{loc}", origin(&at));
                    continue;
                }
            }
            return parse_meta(&resp, url).map_err(Failure::Fatal);
        }
        Err(Failure::Fatal(HubError::BadResponse {
            reason: "too many relative redirects".into(),
        }))
    }

    /// A response streaming `url` from byte `start` (redirects followed).
    pub(super) fn get_from(&self, url: &str, start: u64) -> Result<ureq::Response, Failure> {
        let mut req = self
            .request(&self.agent, "GET", url)
            .set("Accept-Encoding", "identity");
        if start > 0 {
            req = req.set("Range", &format!("bytes={start}-"));
        }
        req.call().map_err(|e| self.failure(e, Endpoint::File, ""))
    }

    /// What a failed request means.
    fn failure(&self, err: ureq::Error, endpoint: Endpoint, revision: &str) -> Failure {
        let resp = match err {
            ureq::Error::Status(_, resp) => resp,
            ureq::Error::Transport(t) => {
                return Failure::Retry(HubError::Network {
                    attempts: 1,
                    reason: t.to_string(),
                })
            }
        };
        let status = resp.status();
        let revision = revision.to_string();
        let token_sent = self.token.is_some();
        Failure::Fatal(match (resp.header("X-Error-Code"), status, endpoint) {
            (Some("GatedRepo"), _, _) => HubError::Unauthorized {
                token_sent,
                gated: true,
            },
            (Some("RepoNotFound"), _, _) => HubError::RepoNotFound,
            (Some("RevisionNotFound"), _, _) => HubError::RevisionNotFound { revision },
            (Some("EntryNotFound"), _, _) => HubError::FileNotFound { revision },
            (_, 401 | 403, _) => HubError::Unauthorized {
                token_sent,
                gated: false,
            },
            (_, 404, Endpoint::Info) => HubError::RepoNotFound,
            (_, 404, Endpoint::File) => HubError::FileNotFound { revision },
            (_, 429 | 500..=599, _) => {
                return Failure::Retry(HubError::Server {
                    status,
                    attempts: 1,
                })
            }
            _ => HubError::Status { status },
        })
    }
}

/// Runs `step` until it succeeds, fails for good, or has been tried [`ATTEMPTS`] times,
/// sleeping `BACKOFF * 2^k` (at most `MAX_BACKOFF`) before retry `k + 1`.
pub(super) fn retry<T>(mut step: impl FnMut() -> Result<T, Failure>) -> Result<T, HubError> {
    let mut attempt = 1;
    loop {
        match step() {
            Ok(v) => return Ok(v),
            Err(Failure::Fatal(e)) => return Err(e),
            Err(Failure::Retry(e)) if attempt >= ATTEMPTS => return Err(with_attempts(e, attempt)),
            Err(Failure::Retry(_)) => {
                std::thread::sleep(backoff(attempt));
                attempt += 1;
            }
        }
    }
}

/// The wait after failed attempt `attempt` (1-based).
pub(super) fn backoff(attempt: u32) -> Duration {
    BACKOFF
        .saturating_mul(1 << attempt.saturating_sub(1).min(16))
        .min(MAX_BACKOFF)
}

/// `e` with its attempt count set to `n` (server and network errors).
pub(super) fn with_attempts(e: HubError, n: u32) -> HubError {
    match e {
        HubError::Server { status, .. } => HubError::Server {
            status,
            attempts: n,
        },
        HubError::Network { reason, .. } => HubError::Network {
            attempts: n,
            reason,
        },
        other => other,
    }
}

/// Reads the metadata headers of a `resolve` response.
fn parse_meta(resp: &ureq::Response, url: &str) -> Result<FileMeta, HubError> {
    let header = |name: &str| resp.header(name).map(|v| v.trim().to_string());
    let missing = |name: &str| HubError::BadResponse {
        reason: format!("no `{name}` header"),
    };
    let linked = header("X-Linked-Etag");
    let etag = linked
        .clone()
        .or_else(|| header("ETag"))
        .ok_or_else(|| missing("ETag"))?;
    let etag = etag.trim_start_matches("W/").trim_matches('"').to_string();
    if etag.is_empty() || !etag.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(HubError::BadResponse {
            reason: format!("unusable etag {etag:?}"),
        });
    }
    let size = header("X-Linked-Size")
        .or_else(|| header("Content-Length"))
        .ok_or_else(|| missing("Content-Length"))?;
    let size = size.parse::<u64>().map_err(|_| HubError::BadResponse {
        reason: format!("size {size:?} is not a number"),
    })?;
    let sha256 = linked
        .is_some()
        .then(|| etag.to_ascii_lowercase())
        .filter(|e| e.len() == 64 && e.chars().all(|c| c.is_ascii_hexdigit()));
    let git_sha1 = linked
        .is_none()
        .then(|| etag.to_ascii_lowercase())
        .filter(|e| e.len() == 40 && e.chars().all(|c| c.is_ascii_hexdigit()));
    Ok(FileMeta {
        etag,
        size,
        sha256,
        git_sha1,
        url: url.to_string(),
    })
}

/// `scheme://host[:port]` of an absolute URL.
fn origin(url: &str) -> &str {
    let after = url.find("://").map_or(0, |i| i + 3);
    match url[after..].find('/') {
        Some(i) => &url[..after + i],
        None => url,
    }
}

/// Percent-encodes one path segment (revisions such as `refs/pr/1` keep no `/`).
fn encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        assert_eq!(backoff(1), BACKOFF);
        assert_eq!(backoff(2), BACKOFF * 2);
        assert_eq!(backoff(40), MAX_BACKOFF);
    }

    #[test]
    fn urls_are_split_and_encoded() {
        assert_eq!(origin("http://127.0.0.1:8/a/b"), "http://127.0.0.1:8");
        assert_eq!(encode("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode("model-1.safetensors"), "model-1.safetensors");
    }
}
