//! The control endpoint: a Unix stream socket serving the protocol of [`crate::proto`].

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio::time::timeout;

use crate::Error;
use crate::proto::{
    Body, Code, EntryView, Failure, MAX_REQUEST, MAX_WATCH_INTERVAL_MS, MIN_WATCH_INTERVAL_MS, Op,
    Reply, Response, SwitchResult, Target, VERSION, encode_response, parse_request,
};
use crate::registry::{Mode, Registry};

/// The environment variable naming the control socket's path.
pub const ENV: &str = "CHUNNEL_CONTROL";

/// Endpoint settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// The socket's path; its directory must exist and belong to this process's user.
    pub path: PathBuf,
    /// Control clients served at once; more are answered [`Code::Busy`] and closed.
    pub max_clients: usize,
    /// A client that sends nothing for this long is disconnected (not while it watches).
    pub idle_timeout: Duration,
    /// Longest wait for one switch (or each entry's, for all).
    pub switch_timeout: Duration,
    /// Entries one `ls` or `watch` snapshot lists at most.
    pub max_listed: usize,
}

impl Config {
    /// Defaults for a socket at `path`: 16 clients, 5 min idle, 30 s per switch, 10 000
    /// entries per answer.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Config {
            path: path.into(),
            max_clients: 16,
            idle_timeout: Duration::from_secs(300),
            switch_timeout: Duration::from_secs(30),
            max_listed: 10_000,
        }
    }

    /// The socket path from [`ENV`], if it is set (and not empty).
    pub fn from_env() -> Option<Self> {
        std::env::var_os(ENV)
            .filter(|p| !p.is_empty())
            .map(Config::new)
    }

    /// Sets [`Config::max_clients`].
    pub fn with_max_clients(mut self, n: usize) -> Self {
        self.max_clients = n.max(1);
        self
    }

    /// Sets [`Config::idle_timeout`].
    pub fn with_idle_timeout(mut self, t: Duration) -> Self {
        self.idle_timeout = t;
        self
    }
}

/// A running control endpoint. Dropping it stops accepting, ends its clients' sessions and
/// removes the socket file.
#[derive(Debug)]
pub struct Endpoint {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// This process's effective uid.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// Checks the socket's directory and clears a stale socket file.
fn prepare(path: &Path) -> Result<(), Error> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let meta = std::fs::metadata(dir).map_err(io_err(dir, "reading the socket's directory"))?;
    let uid = euid();
    if meta.uid() != uid {
        return Err(Error::Insecure {
            path: dir.to_owned(),
            reason: format!(
                "the directory belongs to uid {}, not to this process's uid {uid}",
                meta.uid()
            ),
        });
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path, "reading the socket path")(e)),
        Ok(m) if !m.file_type().is_socket() => Err(Error::Insecure {
            path: path.to_owned(),
            reason: "a file that is not a socket is in the way".into(),
        }),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(Error::InUse {
                path: path.to_owned(),
            }),
            // Nobody listens: a stale socket of a process that died.
            Err(_) => std::fs::remove_file(path).map_err(io_err(path, "removing a stale socket")),
        },
    }
}

impl Endpoint {
    /// Binds the control socket (mode 0600, in a directory this user owns) and serves
    /// `registry` on it from a task of the current tokio runtime (so it must be called
    /// within one; it panics outside a runtime, as `tokio::spawn` does).
    pub fn bind(cfg: Config, registry: Registry) -> Result<Endpoint, Error> {
        let path = cfg.path.clone();
        prepare(&path)?;
        let listener = UnixListener::bind(&path).map_err(io_err(&path, "binding"))?;
        // The peer check below refuses other users in the window before the chmod.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(io_err(&path, "setting the socket's mode"))?;
        let task = tokio::spawn(serve(listener, cfg, registry));
        Ok(Endpoint { path, task })
    }

    /// Binds at the path in [`ENV`], if set; `Ok(None)` if it is not.
    pub fn from_env(registry: Registry) -> Result<Option<Endpoint>, Error> {
        Config::from_env()
            .map(|cfg| Endpoint::bind(cfg, registry))
            .transpose()
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

struct Shared {
    cfg: Config,
    registry: Registry,
    started: Instant,
    uid: u32,
}

async fn serve(listener: UnixListener, cfg: Config, registry: Registry) {
    let slots = Arc::new(Semaphore::new(cfg.max_clients.max(1)));
    let shared = Arc::new(Shared {
        cfg,
        registry,
        started: Instant::now(),
        uid: euid(),
    });
    let mut sessions = tokio::task::JoinSet::new();
    loop {
        while sessions.try_join_next().is_some() {}
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors and the like: wait, do not spin.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let shared = Arc::clone(&shared);
        let permit = Arc::clone(&slots).try_acquire_owned();
        sessions.spawn(async move {
            let mut stream = stream;
            let refusal = match (&permit, stream.peer_cred()) {
                (_, Err(e)) => Some((Code::PermissionDenied, format!("peer credentials: {e}"))),
                (_, Ok(c)) if c.uid() != shared.uid && c.uid() != 0 => Some((
                    Code::PermissionDenied,
                    format!(
                        "uid {} may not use this control endpoint (it belongs to uid {})",
                        c.uid(),
                        shared.uid
                    ),
                )),
                (Err(_), _) => Some((
                    Code::Busy,
                    format!(
                        "the endpoint serves its maximum of {} control clients",
                        shared.cfg.max_clients
                    ),
                )),
                _ => None,
            };
            if let Some((code, message)) = refusal {
                let _ = write(&mut stream, &error(code, message)).await;
                return;
            }
            session(stream, &shared).await;
            drop(permit);
        });
    }
}

fn ok(reply: Reply) -> Response {
    Response {
        v: VERSION,
        body: Body::Ok(reply),
        more: false,
    }
}

fn error(code: Code, message: impl Into<String>) -> Response {
    Response {
        v: VERSION,
        body: Body::Error(Failure {
            code,
            message: message.into(),
        }),
        more: false,
    }
}

async fn write<W: AsyncWriteExt + Unpin>(w: &mut W, r: &Response) -> io::Result<()> {
    let line = encode_response(r);
    match timeout(Duration::from_secs(10), w.write_all(&line)).await {
        Ok(r) => r,
        Err(_) => Err(io::ErrorKind::TimedOut.into()),
    }
}

/// Reads one line of at most [`MAX_REQUEST`] bytes: `Ok(None)` at the end of the stream,
/// `Err(true)` if it was too long, `Err(false)` on an I/O error.
async fn read_line<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Option<()>, bool> {
    buf.clear();
    let mut limited = r.take(MAX_REQUEST as u64);
    let n = limited.read_until(b'\n', buf).await.map_err(|_| false)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        // Either the stream ended mid-line (answer what came) or the line is too long.
        return if n >= MAX_REQUEST {
            Err(true)
        } else {
            Ok(Some(()))
        };
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some(()))
}

async fn session(stream: UnixStream, shared: &Shared) {
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut buf = Vec::with_capacity(256);
    loop {
        let line = match timeout(shared.cfg.idle_timeout, read_line(&mut rd, &mut buf)).await {
            Err(_) | Ok(Ok(None)) | Ok(Err(false)) => return,
            Ok(Err(true)) => {
                let msg = format!("request longer than {MAX_REQUEST} bytes");
                let _ = write(&mut wr, &error(Code::TooLong, msg)).await;
                return;
            }
            Ok(Ok(Some(()))) => &buf,
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let op = match parse_request(line) {
            Ok(op) => op,
            Err(e) => {
                if write(&mut wr, &error(e.code, e.message)).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let done = match op {
            Op::Watch {
                id,
                interval_ms,
                count,
            } => watch(&mut wr, shared, id, interval_ms, count).await,
            op => write(&mut wr, &handle(shared, op).await).await,
        };
        if done.is_err() {
            return;
        }
    }
}

fn listed(shared: &Shared, only: Option<u64>) -> (Vec<EntryView>, usize) {
    let mut entries = shared.registry.views(only);
    let left_off = entries.len().saturating_sub(shared.cfg.max_listed);
    entries.truncate(shared.cfg.max_listed);
    (entries, left_off)
}

async fn watch<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    shared: &Shared,
    id: Option<u64>,
    interval_ms: u64,
    count: Option<u64>,
) -> io::Result<()> {
    let every =
        Duration::from_millis(interval_ms.clamp(MIN_WATCH_INTERVAL_MS, MAX_WATCH_INTERVAL_MS));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        tick.tick().await;
        let (entries, _) = listed(shared, id);
        if let Some(id) = id
            && entries.is_empty()
        {
            return write(
                w,
                &error(Code::NoSuchEntry, format!("no entry {id} (gone?)")),
            )
            .await;
        }
        let last = count.is_some_and(|c| seq + 1 >= c);
        let mut r = ok(Reply::Watch {
            seq,
            at_ms: u64::try_from(shared.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            entries,
        });
        r.more = !last;
        write(w, &r).await?;
        if last {
            return Ok(());
        }
        seq += 1;
    }
}

async fn handle(shared: &Shared, op: Op) -> Response {
    let registry = &shared.registry;
    match op {
        Op::Hello => ok(Reply::Hello {
            version: VERSION,
            pid: std::process::id(),
            name: registry.name().to_owned(),
        }),
        Op::Ls => {
            let (entries, left_off) = listed(shared, None);
            ok(Reply::Ls { entries, left_off })
        }
        Op::Show { id } => match registry.views(Some(id)).pop() {
            Some(entry) => ok(Reply::Show {
                entry: Box::new(entry),
            }),
            None => error(Code::NoSuchEntry, format!("no entry {id}")),
        },
        Op::Policy { name, value } => match (name, value) {
            (Some(name), Some(value)) => match registry.set_policy(&name, &value) {
                Ok(previous) => {
                    let mut views = registry.policy_views(Some(&name)).unwrap_or_default();
                    for v in &mut views {
                        v.previous = Some(previous.clone());
                    }
                    ok(Reply::Policy { policies: views })
                }
                Err(Error::NoSuchPolicy { name }) => {
                    error(Code::NoSuchPolicy, format!("no policy {name:?}"))
                }
                Err(e) => error(Code::InvalidValue, e.to_string()),
            },
            (name, _) => match registry.policy_views(name.as_deref()) {
                Some(policies) => ok(Reply::Policy { policies }),
                None => error(
                    Code::NoSuchPolicy,
                    format!("no policy {:?}", name.unwrap_or_default()),
                ),
            },
        },
        Op::Switch {
            target,
            branch,
            commit,
        } => switch(shared, target, &branch, commit).await,
        Op::Autopilot { id, since } => ok(match registry.autopilot() {
            Some(a) => a.reply(id, since),
            None => Reply::Autopilot {
                running: false,
                enabled: false,
                rules: Vec::new(),
                decisions: Vec::new(),
                dropped: 0,
            },
        }),
        // Streams; handled by the session.
        Op::Watch { .. } => error(Code::Malformed, "watch is a stream"),
    }
}

async fn switch(shared: &Shared, target: Target, branch: &str, commit: bool) -> Response {
    let only = match target {
        Target::All => None,
        Target::Id(id) => Some(id),
    };
    let handles = shared.registry.switches(only);
    if let Some(id) = only {
        match handles.first() {
            None => return error(Code::NoSuchEntry, format!("no entry {id}")),
            Some((_, None)) => {
                return error(
                    Code::NotSwitchable,
                    format!("entry {id} has no switch handle (not a reconfigurable select)"),
                );
            }
            Some(_) => {}
        }
    }
    let mode = if commit {
        Mode::Commit
    } else {
        Mode::Unilateral
    };
    let mut results = Vec::new();
    for (id, sw) in handles {
        let Some(sw) = sw else { continue };
        let names = sw.branches();
        let Some(to) = names
            .iter()
            .position(|n| n == branch)
            .or_else(|| branch.parse().ok().filter(|&i: &usize| i < names.len()))
        else {
            if only.is_some() {
                return error(
                    Code::NoSuchBranch,
                    format!(
                        "entry {id} has no branch {branch:?} (its branches: {})",
                        names.join(", ")
                    ),
                );
            }
            results.push(SwitchResult {
                id,
                ok: false,
                from: names.get(sw.current()).cloned().unwrap_or_default(),
                to: branch.to_owned(),
                changed: false,
                epoch: sw.epoch(),
                message: format!("no branch {branch:?} (its branches: {})", names.join(", ")),
            });
            continue;
        };
        let from = names.get(sw.current()).cloned().unwrap_or_default();
        let out = timeout(shared.cfg.switch_timeout, sw.switch(to, mode)).await;
        let (ok_, changed, message) = match out {
            Ok(Ok(s)) => (true, s.changed, s.detail),
            Ok(Err(why)) => (false, false, why),
            Err(_) => (
                false,
                false,
                format!("no outcome within {:?}", shared.cfg.switch_timeout),
            ),
        };
        results.push(SwitchResult {
            id,
            ok: ok_,
            from,
            to: names[to].clone(),
            changed,
            epoch: sw.epoch(),
            message,
        });
    }
    if let (Some(_), Some(r)) = (only, results.first())
        && !r.ok
    {
        return error(Code::SwitchFailed, format!("entry {}: {}", r.id, r.message));
    }
    ok(Reply::Switch { results })
}
