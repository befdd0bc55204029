//! A loopback Hugging Face hub for the download tests: a thread serving committed fixture
//! folders on `127.0.0.1:0` over plain HTTP/1.1 (one request per connection), counting every
//! request, and told to fail in scripted ways ([`Fault`]).
//!
//! Endpoints, as the hub answers them:
//! - `GET /api/models/{org}/{name}/revision/{rev}`: `{"id", "sha", "siblings": [...]}`;
//! - `HEAD|GET /{org}/{name}/resolve/{rev}/{file}`: for `*.safetensors` (LFS) a 302 to
//!   `/cdn/{sha256}` with `X-Linked-Etag`, `X-Linked-Size`, `X-Repo-Commit`; for other files
//!   a 200 with `ETag`, `X-Repo-Commit` and the bytes;
//! - `GET /cdn/{sha256}`: the bytes, honouring `Range: bytes=N-` with a 206;
//! - a renamed repo ([`HubServer::rename`]): a relative 307 to the new path;
//! - errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`,
//!   `GatedRepo`); a gated repo lists its files to anyone and serves them with its token.
//!
//! The server stops when dropped: the accept loop polls a flag, and each connection thread
//! ends with its request (socket timeouts bound a stuck client).
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use sha2::{Digest, Sha256};

/// A fresh hub cache folder for one test (named by the test's tag and the process), removed on
/// drop.
pub struct TempCache(pub PathBuf);

impl TempCache {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cg-hub-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp cache");
        Self(dir)
    }

    /// The cache folder of `repo` (`models--org--name`).
    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.0.join(format!("models--{}", repo.replace('/', "--")))
    }
}

impl Drop for TempCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One repo the server hosts, at one commit.
#[derive(Clone)]
pub struct HubRepo {
    /// `org/name`.
    pub id: String,
    /// The commit every branch points at.
    pub commit: String,
    /// Branch names resolving to `commit`.
    pub branches: Vec<String>,
    /// File name and bytes.
    pub files: Vec<(String, Vec<u8>)>,
    /// When set, requests must carry `Authorization: Bearer <token>` (a gated repo).
    pub token: Option<String>,
}

impl HubRepo {
    /// The files of a fixture folder (its `golden.json` left out), on branch `main`.
    pub fn from_fixture(id: &str, dir: &Path) -> Self {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).expect("fixture dir") {
            let path = entry.expect("entry").path();
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            if name != "golden.json" && path.is_file() {
                files.push((name, std::fs::read(&path).expect("fixture file")));
            }
        }
        files.sort();
        let commit = sha256_hex(id.as_bytes())[..40].to_string();
        Self {
            id: id.to_string(),
            commit,
            branches: vec!["main".to_string()],
            files,
            token: None,
        }
    }

    pub fn file(&self, name: &str) -> Option<&[u8]> {
        self.files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
    }

    /// Checks that every file of the snapshot folder `dir` holds the served bytes.
    pub fn assert_snapshot_matches(&self, dir: &Path) {
        for (name, bytes) in &self.files {
            let got = std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(got == *bytes, "{name} differs from the served bytes");
        }
    }
}

/// A scripted failure for requests whose file (or `"api"` for model info) is the target.
#[derive(Clone, Debug)]
pub enum Fault {
    /// Answer `status` (with `X-Error-Code: code` when given) to the next `times` requests.
    Status {
        status: u16,
        code: Option<&'static str>,
        times: usize,
    },
    /// Send the headers and `after` body bytes, then close the connection; `times` times.
    Cut { after: usize, times: usize },
    /// Announce this size in `X-Linked-Size` instead of the true one.
    LinkedSize(u64),
    /// Send the bytes with one flipped (the announced hash stays the true one).
    Corrupt,
}

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
}

#[derive(Default)]
struct State {
    repos: Vec<HubRepo>,
    faults: Mutex<Vec<(String, Fault)>>,
    seen: Mutex<Vec<Seen>>,
    /// Body transfers in flight per file, and the most seen at once.
    active: Mutex<HashMap<String, (usize, usize)>>,
    /// Pause after each 64 KiB of body (so concurrent clients overlap).
    chunk_delay: Mutex<Duration>,
    /// Renamed repos: old id, new id.
    renamed: Mutex<Vec<(String, String)>>,
}

/// The running server; stops when dropped.
pub struct HubServer {
    url: String,
    state: Arc<State>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The git blob hash of `bytes`, the ETag the hub gives files kept in git.
pub fn git_blob_sha1(bytes: &[u8]) -> String {
    use sha1::{Digest as _, Sha1};
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl HubServer {
    pub fn start(repos: Vec<HubRepo>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        listener.set_nonblocking(true).expect("nonblocking");
        let state = Arc::new(State {
            repos,
            ..Default::default()
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp, base) = (state.clone(), stop.clone(), url.clone());
        let thread = std::thread::spawn(move || {
            while !sp.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (st, base) = (st.clone(), base.clone());
                        std::thread::spawn(move || serve(stream, &st, &base));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Self {
            url,
            state,
            stop,
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Adds a fault for `target`: a file name, or `"api"` for model info.
    pub fn fault(&self, target: &str, fault: Fault) {
        lock(&self.state.faults).push((target.to_string(), fault));
    }

    /// Answers requests for repo `old` with a relative 307 to the same path under `new`, as
    /// the hub does for a renamed repo.
    pub fn rename(&self, old: &str, new: &str) {
        lock(&self.state.renamed).push((old.to_string(), new.to_string()));
    }

    pub fn clear_faults(&self) {
        lock(&self.state.faults).clear();
    }

    pub fn set_chunk_delay(&self, d: Duration) {
        *lock(&self.state.chunk_delay) = d;
    }

    pub fn requests(&self) -> Vec<Seen> {
        lock(&self.state.seen).clone()
    }

    pub fn count(&self) -> usize {
        lock(&self.state.seen).len()
    }

    /// The `Range` header of each GET of `file`'s bytes, in order.
    pub fn ranges(&self, file: &str) -> Vec<Option<String>> {
        lock(&self.state.seen)
            .iter()
            .filter(|s| s.method == "GET" && s.path.ends_with(&format!("#{file}")))
            .map(|s| s.range.clone())
            .collect()
    }

    /// Body transfers of `file` started (GETs that sent bytes or a cut), and the most that
    /// ran at once.
    pub fn transfers(&self, file: &str) -> (usize, usize) {
        let fetched = lock(&self.state.seen)
            .iter()
            .filter(|s| s.method == "GET" && s.path.ends_with(&format!("#{file}")))
            .count();
        let most = lock(&self.state.active).get(file).map_or(0, |a| a.1);
        (fetched, most)
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A response before it is written.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The file whose bytes the body is, for counting and faults.
    file: Option<String>,
}

impl Reply {
    fn status(status: u16, code: Option<&str>) -> Self {
        let mut headers = Vec::new();
        if let Some(c) = code {
            headers.push(("X-Error-Code".to_string(), c.to_string()));
        }
        Self {
            status,
            headers,
            body: Vec::new(),
            file: None,
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Self {
        self.headers.push((k.to_string(), v.into()));
        self
    }
}

fn serve(mut stream: TcpStream, state: &State, base: &str) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let Some(req) = read_request(&stream) else {
        return;
    };
    let reply = route(state, base, &req);
    let mut seen = req.clone();
    if let Some(f) = &reply.file {
        seen.path = format!("{}#{f}", seen.path);
    }
    lock(&state.seen).push(seen);
    let _ = write_reply(&mut stream, state, &req, reply);
    let _ = stream.shutdown(Shutdown::Both);
}

fn read_request(stream: &TcpStream) -> Option<Seen> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).ok()? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "range" => range = Some(v.trim().to_string()),
                "authorization" => auth = Some(v.trim().to_string()),
                _ => {}
            }
        }
    }
    Some(Seen {
        method,
        path,
        range,
        auth,
    })
}

/// Takes the first live `Status` fault for `target`, counting it down.
fn status_fault(state: &State, target: &str) -> Option<Reply> {
    let mut faults = lock(&state.faults);
    for (t, f) in faults.iter_mut() {
        if let (
            true,
            Fault::Status {
                status,
                code,
                times,
            },
        ) = (t == target, f)
        {
            if *times > 0 {
                *times -= 1;
                return Some(Reply::status(*status, *code));
            }
        }
    }
    None
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn route(state: &State, base: &str, req: &Seen) -> Reply {
    let segs: Vec<&str> = req.path.trim_start_matches('/').split('/').collect();
    if segs.len() == 2 && segs[0] == "cdn" {
        return cdn(state, segs[1]);
    }
    let (id, rev, file) = match segs.as_slice() {
        ["api", "models", org, name, "revision", rev] => (format!("{org}/{name}"), *rev, None),
        [org, name, "resolve", rev, rest @ ..] if !rest.is_empty() => {
            (format!("{org}/{name}"), *rev, Some(rest.join("/")))
        }
        _ => return Reply::status(404, None),
    };
    let renamed = lock(&state.renamed)
        .iter()
        .find(|(old, _)| *old == id)
        .map(|(old, new)| req.path.replacen(old.as_str(), new, 1));
    if let Some(location) = renamed {
        return Reply::status(307, None).header("Location", location);
    }
    let target = file.clone().unwrap_or_else(|| "api".to_string());
    if let Some(r) = status_fault(state, &target) {
        return r;
    }
    let Some(repo) = state.repos.iter().find(|r| r.id == id) else {
        return Reply::status(404, Some("RepoNotFound"));
    };
    let rev = decode(rev);
    if rev != repo.commit && !repo.branches.contains(&rev) {
        return Reply::status(404, Some("RevisionNotFound"));
    }
    let Some(file) = file else {
        let siblings: Vec<_> = repo
            .files
            .iter()
            .map(|(n, _)| serde_json::json!({ "rfilename": n }))
            .collect();
        let body = serde_json::json!({ "id": repo.id, "sha": repo.commit, "siblings": siblings });
        let mut r = Reply::status(200, None).header("Content-Type", "application/json");
        r.body = body.to_string().into_bytes();
        return r;
    };
    // A gated repo lists its files to anyone; its files need the token.
    if let Some(t) = &repo.token {
        if req.auth.as_deref() != Some(&format!("Bearer {t}")) {
            return Reply::status(401, Some("GatedRepo"));
        }
    }
    let Some(bytes) = repo.file(&file) else {
        return Reply::status(404, Some("EntryNotFound"));
    };
    let sha = sha256_hex(bytes);
    if file.ends_with(".safetensors") {
        let size = linked_size(state, &file).unwrap_or(bytes.len() as u64);
        return Reply::status(302, None)
            .header("Location", format!("{base}/cdn/{sha}"))
            .header("X-Repo-Commit", repo.commit.clone())
            .header("ETag", format!("\"{}\"", &sha[..40]))
            .header("X-Linked-Etag", format!("\"{sha}\""))
            .header("X-Linked-Size", size.to_string());
    }
    body_reply(state, &file, bytes)
        .header("X-Repo-Commit", repo.commit.clone())
        .header("ETag", format!("\"{}\"", git_blob_sha1(bytes)))
}

fn linked_size(state: &State, file: &str) -> Option<u64> {
    lock(&state.faults).iter().find_map(|(t, f)| match f {
        Fault::LinkedSize(n) if t == file => Some(*n),
        _ => None,
    })
}

fn cdn(state: &State, sha: &str) -> Reply {
    for repo in &state.repos {
        for (name, bytes) in &repo.files {
            if sha256_hex(bytes) == sha {
                if let Some(r) = status_fault(state, name) {
                    return r;
                }
                return body_reply(state, name, bytes);
            }
        }
    }
    Reply::status(404, None)
}

/// The whole file with a 200; the range is applied when written.
fn body_reply(state: &State, file: &str, bytes: &[u8]) -> Reply {
    let corrupt = lock(&state.faults)
        .iter()
        .any(|(t, f)| t == file && matches!(f, Fault::Corrupt));
    let mut body = bytes.to_vec();
    if corrupt {
        if let Some(b) = body.last_mut() {
            *b ^= 0xff;
        }
    }
    let mut r = Reply::status(200, None);
    r.body = body;
    r.file = Some(file.to_string());
    r
}

/// The first byte of `bytes=N-`.
fn range_start(range: Option<&str>) -> Option<usize> {
    range?
        .strip_prefix("bytes=")?
        .split('-')
        .next()?
        .parse()
        .ok()
}

fn write_reply(
    stream: &mut TcpStream,
    state: &State,
    req: &Seen,
    reply: Reply,
) -> std::io::Result<()> {
    let mut status = reply.status;
    let mut headers = reply.headers;
    let mut body: &[u8] = &reply.body;
    let total = body.len();
    if let (200, Some(_), Some(start)) = (status, &reply.file, range_start(req.range.as_deref())) {
        let start = start.min(total);
        status = 206;
        headers.push((
            "Content-Range".into(),
            format!("bytes {start}-{}/{total}", total.saturating_sub(1)),
        ));
        body = &body[start..];
    }
    let reason = match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        307 => "Temporary Redirect",
        401 => "Unauthorized",
        404 => "Not Found",
        _ => "Status",
    };
    let mut head = format!("HTTP/1.1 {status} {reason}\r\nConnection: close\r\n");
    for (k, v) in &headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    stream.write_all(head.as_bytes())?;
    if req.method == "HEAD" || (reply.file.is_none() && body.is_empty()) {
        return stream.flush();
    }
    let Some(file) = reply.file.filter(|_| req.method == "GET") else {
        stream.write_all(body)?;
        return stream.flush();
    };
    let cut = {
        let mut faults = lock(&state.faults);
        faults.iter_mut().find_map(|(t, f)| match f {
            Fault::Cut { after, times } if *t == file && *times > 0 => {
                *times -= 1;
                Some(*after)
            }
            _ => None,
        })
    };
    let _active = Active::enter(state, &file);
    let delay = *lock(&state.chunk_delay);
    let send = cut.map_or(body.len(), |c| c.min(body.len()));
    for chunk in body[..send].chunks(1 << 16) {
        stream.write_all(chunk)?;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
    }
    stream.flush()
}

/// Counts a body transfer of one file while it runs.
struct Active<'a> {
    state: &'a State,
    file: String,
}

impl<'a> Active<'a> {
    fn enter(state: &'a State, file: &str) -> Self {
        let mut active = lock(&state.active);
        let a = active.entry(file.to_string()).or_default();
        a.0 += 1;
        a.1 = a.1.max(a.0);
        Self {
            state,
            file: file.to_string(),
        }
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        if let Some(a) = lock(&self.state.active).get_mut(&self.file) {
            a.0 -= 1;
        }
    }
}
