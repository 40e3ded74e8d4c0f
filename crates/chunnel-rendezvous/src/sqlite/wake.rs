//! The SQLite store's wake-ups: within the process through a registry, and across the
//! processes of the host through Unix datagram sockets in a directory next to the file.
//!
//! Every process that watches a group of a file binds one datagram socket,
//! `<file>.wake/<pid>-<random hex>.sock` (the directory is created with the file's permission
//! bits, plus search where they allow reading, and the file's group if the process may set
//! it). A write, once its transaction committed, wakes this process's watches of the group
//! through the registry, and sends one [wake-up datagram](encode) to every socket of another
//! process in the directory, without blocking:
//!
//! * a socket whose owner died (`ECONNREFUSED`) is removed, with its marker;
//! * a full receive queue (`EAGAIN`) drops the datagram: the writer then creates the socket's
//!   *missed* marker, `<pid>-<hex>.missed`, and sends once more. The receiver removes its
//!   marker after it has drained its queue, and, if it was there, wakes every watch of the
//!   file with [`Changes::ALL`]. Either the second send got through (after the marker was
//!   made), or the queue is still full and the receiver will drain it: either way it finds
//!   the marker, so an overflow costs a read of every watched group, never a lost change.
//!
//! A writer lists the directory again when its modification time changed, and on every write
//! while that time is less than [`RACY`] old (a coarse file-system clock may give two changes
//! the same time), reading at most [`MAX_ENTRIES`] entries. So a watch counts as complete
//! ([`Watch::is_complete`]) only while its socket is bound and still in the directory, and
//! the directory holds at most [`MAX_ENTRIES`] entries; the receiving thread checks that every
//! [`CHECK_EVERY`] and binds a new socket if its own went away. A watch is incomplete while
//! the socket cannot be bound (e.g. a path longer than a socket address holds, 107 bytes),
//! and its participant then polls at [`crate::Config::poll`]. Writes by other users that may
//! not send to the socket are not notified either (the socket has the file's mode and group,
//! so a user who may write the file may normally send), nor writes by a process running a
//! version of this crate from before these wake-ups: the polls at
//! [`crate::Config::poll_notified`] cover both.
//!
//! The socket belongs to a thread of its own (one per watched file and process, not a task,
//! so that it outlives any one tokio runtime), which ends once the last watch of the file is
//! dropped, removing the socket.
//!
//! The datagram format is specified in `docs/wire.md` §15.2 ("SQLite wake-up").

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixDatagram as StdDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, SystemTime};

use crate::Error;
use crate::store::{Changes, Notifier, Watch, check_name};

/// The version byte of the datagrams this version sends and reads.
pub const VERSION: u8 = 1;

/// The longest group name (as every store checks).
pub const MAX_GROUP: usize = 128;

/// The longest datagram: version, kinds and the longest group name.
pub const MAX_DATAGRAM: usize = 2 + MAX_GROUP;

/// The most directory entries a writer reads per listing (and so the most sockets it sends
/// to); a watch is complete only while the directory holds no more.
pub const MAX_ENTRIES: usize = 128;

/// How long after the directory's modification time a writer keeps listing it again on every
/// write.
pub const RACY: Duration = Duration::from_secs(2);

/// How often the receiving thread checks that its socket is still in the directory.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The most datagrams the receiving thread reads before it wakes the watches.
const BATCH: usize = 256;

const SOCK: &str = "sock";
const MISSED: &str = "missed";

/// One decoded wake-up datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wakeup<'a> {
    /// What changed (never empty).
    pub changes: Changes,
    /// The group it changed in.
    pub group: &'a str,
}

fn bits(c: Changes) -> u8 {
    [
        (Changes::MEMBERS, 1),
        (Changes::TRANSITION, 2),
        (Changes::BALLOTS, 4),
    ]
    .into_iter()
    .filter(|(k, _)| c.contains(*k))
    .map(|(_, b)| b)
    .sum()
}

fn from_bits(b: u8) -> Changes {
    let mut c = Changes::NONE;
    for (k, bit) in [
        (Changes::MEMBERS, 1),
        (Changes::TRANSITION, 2),
        (Changes::BALLOTS, 4),
    ] {
        if b & bit != 0 {
            c |= k;
        }
    }
    c
}

/// The wake-up datagram for `changes` in `group`: the version ([`VERSION`]), one byte of kinds
/// (1 members, 2 transition or committed stack, 4 ballots), and the group name in UTF-8.
/// `None` if there is nothing to send: no kinds, or a name no store accepts.
pub fn encode(changes: Changes, group: &str) -> Option<Vec<u8>> {
    let kinds = bits(changes);
    if kinds == 0 || check_name("group name", group).is_err() {
        return None;
    }
    let mut d = Vec::with_capacity(2 + group.len());
    d.extend_from_slice(&[VERSION, kinds]);
    d.extend_from_slice(group.as_bytes());
    Some(d)
}

/// Reads a wake-up datagram; anything but what [`encode`] makes is [`Error::Corrupt`].
pub fn decode(d: &[u8]) -> Result<Wakeup<'_>, Error> {
    let [version, kinds, name @ ..] = d else {
        return Err(Error::Corrupt("a wake-up datagram shorter than 2 bytes"));
    };
    if *version != VERSION {
        return Err(Error::Corrupt("a wake-up datagram of an unknown version"));
    }
    if *kinds == 0 || *kinds > 7 {
        return Err(Error::Corrupt(
            "a wake-up datagram with no or unknown kinds",
        ));
    }
    let group = std::str::from_utf8(name)
        .map_err(|_| Error::Corrupt("a wake-up datagram's group is not UTF-8"))?;
    check_name("group name", group)
        .map_err(|_| Error::Corrupt("a wake-up datagram's group is not a valid name"))?;
    Ok(Wakeup {
        changes: from_bits(*kinds),
        group,
    })
}

/// What a store handle's wake-ups did, for tests and diagnostics
/// ([`crate::SqliteStore::wake_counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Datagrams this handle sent to other processes' sockets.
    pub sent: u64,
    /// Sends that found a full receive queue (the socket's *missed* marker was made).
    pub overflowed: u64,
    /// Sockets of dead processes this handle removed.
    pub removed: u64,
    /// Sends that failed otherwise (e.g. no permission).
    pub failed: u64,
    /// Datagrams this process's socket for the file received and acted on.
    pub received: u64,
    /// Datagrams it received and ignored as malformed.
    pub malformed: u64,
    /// Times it found its *missed* marker (and woke every watch of the file).
    pub missed: u64,
    /// Whether this process has a socket bound for the file and in its directory now.
    pub bound: bool,
}

/// The watches of one file in this process, and the socket that receives other processes'
/// wake-ups for them.
#[derive(Default)]
struct FileWatches {
    /// Per group, the notifiers of the live watches (closed ones are dropped whenever their
    /// group is notified or watched).
    groups: HashMap<String, Vec<Notifier>>,
    /// The receiving socket's owner, while a watch holds it.
    hub: Weak<Hub>,
}

/// Per file (device, inode).
type Registry = HashMap<(u64, u64), FileWatches>;

fn registry() -> MutexGuard<'static, Registry> {
    static WATCHES: OnceLock<Mutex<Registry>> = OnceLock::new();
    WATCHES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Notifies this process's watches of `group` in `file`, dropping the closed ones.
fn notify_local(reg: &mut Registry, file: (u64, u64), group: &str, changes: Changes) {
    let Some(entry) = reg.get_mut(&file) else {
        return;
    };
    let Some(watchers) = entry.groups.get_mut(group) else {
        return;
    };
    watchers.retain(|n| !n.is_closed());
    for n in watchers.iter() {
        n.notify(changes);
    }
    if watchers.is_empty() {
        entry.groups.remove(group);
        if entry.groups.is_empty() && entry.hub.strong_count() == 0 {
            reg.remove(&file);
        }
    }
}

/// A store handle's side of the wake-ups (shared by its clones).
#[derive(Debug)]
pub(crate) struct Wakes {
    file: (u64, u64),
    db: PathBuf,
    dir: PathBuf,
    listing: Mutex<Listing>,
    sent: AtomicU64,
    overflowed: AtomicU64,
    removed: AtomicU64,
    failed: AtomicU64,
}

/// The sockets of other processes, as the directory was last listed.
#[derive(Debug, Default)]
struct Listing {
    names: Vec<OsString>,
    mtime: Option<SystemTime>,
    /// Listed less than [`RACY`] after the directory changed: list again on the next write.
    racy: bool,
}

impl Wakes {
    /// The wake-ups of the database file `db`, known as `file` (device, inode).
    pub(crate) fn new(db: &Path, file: (u64, u64)) -> Wakes {
        let db = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
        let mut dir = db.clone().into_os_string();
        dir.push(".wake");
        Wakes {
            file,
            db,
            dir: PathBuf::from(dir),
            listing: Mutex::default(),
            sent: AtomicU64::new(0),
            overflowed: AtomicU64::new(0),
            removed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// Tells every watch of `group` on this host that it changed (called after the write
    /// committed): this process's through the registry, other processes' by datagram.
    pub(crate) fn notify(&self, group: &str, changes: Changes) {
        notify_local(&mut registry(), self.file, group, changes);
        self.send(group, changes);
    }

    fn send(&self, group: &str, changes: Changes) {
        let Some(d) = encode(changes, group) else {
            return;
        };
        let mut listing = lock(&self.listing);
        if !listing.refresh(&self.dir) || listing.names.is_empty() {
            return;
        }
        // A socket of its own per write: datagrams still queued at slow receivers are charged
        // to the socket that sent them, and must not fill one shared send buffer.
        let sock = match StdDatagram::unbound().and_then(|s| s.set_nonblocking(true).map(|()| s)) {
            Ok(s) => s,
            Err(e) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "no socket to send SQLite wake-ups");
                return;
            }
        };
        let mut gone = Vec::new();
        for name in &listing.names {
            let path = self.dir.join(name);
            match sock.send_to(&d, &path) {
                Ok(_) => {
                    self.sent.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.overflowed.fetch_add(1, Ordering::Relaxed);
                    let marker = path.with_extension(MISSED);
                    if let Err(e) = std::fs::OpenOptions::new()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(&marker)
                    {
                        tracing::debug!(path = %marker.display(), error = %e,
                            "cannot mark a missed wake-up");
                    }
                    // After the marker: if this gets through, the receiver drains it and then
                    // finds the marker; if not, its queue is full and it will.
                    if sock.send_to(&d, &path).is_ok() {
                        self.sent.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    // Nobody is bound to it: its process died without removing it.
                    let _ = std::fs::remove_file(path.with_extension(MISSED));
                    if std::fs::remove_file(&path).is_ok() {
                        self.removed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(path = %path.display(),
                            "removed a dead process's wake-up socket");
                    }
                    gone.push(name.clone());
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => gone.push(name.clone()),
                Err(e) => {
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(path = %path.display(), error = %e, "cannot send a wake-up");
                }
            }
        }
        listing.names.retain(|n| !gone.contains(n));
    }

    /// A watch of `group` (see the module docs): notified by this process's writes, and by
    /// other processes' while this process's socket for the file is healthy (then complete).
    pub(crate) fn watch(&self, group: &str) -> Watch {
        let (watch, notifier) = Watch::new();
        let mut reg = registry();
        reg.retain(|_, e| !e.groups.is_empty() || e.hub.strong_count() > 0);
        let entry = reg.entry(self.file).or_default();
        let hub = match entry.hub.upgrade() {
            Some(h) if h.is_running() => h,
            _ => {
                let h = Arc::new(Hub::start(self.file, self.db.clone(), self.dir.clone()));
                entry.hub = Arc::downgrade(&h);
                h
            }
        };
        if hub.shared.healthy.load(Ordering::Acquire) {
            notifier.set_complete(true);
        }
        let watchers = entry.groups.entry(group.to_owned()).or_default();
        watchers.retain(|n| !n.is_closed());
        watchers.push(notifier);
        drop(reg);
        // The watch holds the socket: the last watch of the file gone, it is closed.
        watch.with_task(tokio::spawn(async move {
            let _hub = hub;
            std::future::pending::<()>().await;
        }))
    }

    /// This handle's counters, and this process's receiving socket's for the file.
    pub(crate) fn counters(&self) -> Counters {
        let mut c = Counters {
            sent: self.sent.load(Ordering::Relaxed),
            overflowed: self.overflowed.load(Ordering::Relaxed),
            removed: self.removed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            ..Counters::default()
        };
        let hub = registry().get(&self.file).and_then(|e| e.hub.upgrade());
        if let Some(h) = hub {
            c.received = h.shared.received.load(Ordering::Relaxed);
            c.malformed = h.shared.malformed.load(Ordering::Relaxed);
            c.missed = h.shared.missed.load(Ordering::Relaxed);
            c.bound = h.shared.healthy.load(Ordering::Acquire);
        }
        c
    }
}

impl Listing {
    /// Lists `dir` again if it changed (or may have); false if it does not exist.
    fn refresh(&mut self, dir: &Path) -> bool {
        let Ok(meta) = std::fs::metadata(dir) else {
            *self = Listing::default();
            return false;
        };
        let mtime = meta.modified().ok();
        if mtime.is_some() && mtime == self.mtime && !self.racy {
            return true;
        }
        let ours = format!("{}-", std::process::id());
        self.names = match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .take(MAX_ENTRIES)
                .filter_map(|e| e.ok().map(|e| e.file_name()))
                .filter(|n| {
                    let s = n.to_string_lossy();
                    s.ends_with(".sock") && !s.starts_with(&ours)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        self.mtime = mtime;
        let now = SystemTime::now();
        self.racy = mtime.is_none_or(|m| now.duration_since(m).is_ok_and(|age| age < RACY));
        true
    }
}

/// This process's receiving socket for one file: the thread that owns it, while a watch
/// holds it (dropping the last one stops the thread, which closes and removes the socket).
/// A thread of its own rather than a task, so that it outlives any one tokio runtime.
struct Hub {
    shared: Arc<HubShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct HubShared {
    file: (u64, u64),
    db: PathBuf,
    dir: PathBuf,
    /// Bound, in the directory, and the directory within bounds.
    healthy: AtomicBool,
    /// Set when the last watch of the file is gone: the thread ends.
    stop: AtomicBool,
    /// The socket's path while bound, and a handle to shut it down with.
    bound: Mutex<Option<(PathBuf, StdDatagram)>>,
    received: AtomicU64,
    malformed: AtomicU64,
    missed: AtomicU64,
}

impl Hub {
    fn start(file: (u64, u64), db: PathBuf, dir: PathBuf) -> Hub {
        let shared = Arc::new(HubShared {
            file,
            db,
            dir,
            healthy: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            bound: Mutex::new(None),
            received: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            missed: AtomicU64::new(0),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("chunnel-sqlite-wake".into())
                .spawn(move || serve(&shared))
        };
        let thread = thread
            .inspect_err(|e| tracing::warn!(error = %e, "no thread for SQLite wake-ups"))
            .ok();
        Hub { shared, thread }
    }

    /// Whether the receiving thread still runs.
    fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some((_, sock)) = &*lock(&self.shared.bound) {
            // Wakes the thread from its receive.
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }
}

fn remove_socket(path: &Path) {
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_file(path.with_extension(MISSED));
}

impl HubShared {
    /// Whether this is the file's current receiving socket.
    fn is_current(self: &Arc<Self>, reg: &Registry) -> bool {
        reg.get(&self.file)
            .and_then(|e| e.hub.upgrade())
            .is_some_and(|h| Arc::ptr_eq(&h.shared, self))
    }

    /// Marks every watch of the file complete or not.
    fn set_healthy(self: &Arc<Self>, healthy: bool) {
        let reg = registry();
        self.healthy.store(healthy, Ordering::Release);
        if !self.is_current(&reg) {
            return;
        }
        if let Some(e) = reg.get(&self.file) {
            for n in e.groups.values().flatten() {
                n.set_complete(healthy);
            }
        }
    }

    /// Wakes every watch of the file as if everything changed.
    fn wake_all(&self) {
        self.missed.fetch_add(1, Ordering::Relaxed);
        if let Some(e) = registry().get(&self.file) {
            for n in e.groups.values().flatten() {
                n.notify(Changes::ALL);
            }
        }
    }

    /// Binds a fresh socket in the directory (made if missing), with the file's mode and group.
    fn bind(&self) -> io::Result<(StdDatagram, PathBuf, u64)> {
        let meta = std::fs::metadata(&self.db)?;
        let mode = meta.mode() & 0o666;
        match std::fs::create_dir(&self.dir) {
            Ok(()) => {
                // Search wherever reading is allowed.
                let dmode = mode | ((mode & 0o444) >> 2);
                std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(dmode))?;
                let _ = std::os::unix::fs::chown(&self.dir, None, Some(meta.gid()));
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let name = format!(
            "{}-{:012x}.{SOCK}",
            std::process::id(),
            chunnel::util::random_u64() & 0xffff_ffff_ffff
        );
        let path = self.dir.join(name);
        let sock = StdDatagram::bind(&path)?;
        let set_up = (|| {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
            let _ = std::os::unix::fs::chown(&path, None, Some(meta.gid()));
            sock.set_read_timeout(Some(CHECK_EVERY))?;
            Ok(std::fs::symlink_metadata(&path)?.ino())
        })();
        match set_up {
            Ok(ino) => Ok((sock, path, ino)),
            Err(e) => {
                remove_socket(&path);
                Err(e)
            }
        }
    }

    /// Whether the socket at `path` (inode `ino`) is still there, and the directory within
    /// what a writer reads.
    fn in_place(&self, path: &Path, ino: u64) -> bool {
        let there = std::fs::symlink_metadata(path).is_ok_and(|m| m.ino() == ino);
        let entries =
            std::fs::read_dir(&self.dir).map_or(usize::MAX, |d| d.take(MAX_ENTRIES + 1).count());
        there && entries <= MAX_ENTRIES
    }
}

/// Marks the file's watches incomplete when the receiving thread ends.
struct Down(Arc<HubShared>);

impl Drop for Down {
    fn drop(&mut self) {
        self.0.set_healthy(false);
    }
}

/// The receiving thread: binds, serves the socket while it stays healthy, binds again, until
/// the hub is dropped.
fn serve(shared: &Arc<HubShared>) {
    let _down = Down(shared.clone());
    let mut warned = false;
    while !shared.stop.load(Ordering::Acquire) {
        match shared.bind() {
            Ok((sock, path, ino)) => {
                match sock.try_clone() {
                    Ok(handle) => *lock(&shared.bound) = Some((path.clone(), handle)),
                    Err(_) => {
                        remove_socket(&path);
                        continue;
                    }
                }
                // The hub may have been dropped before the handle was there to shut down.
                if !shared.stop.load(Ordering::Acquire) && shared.in_place(&path, ino) {
                    shared.set_healthy(true);
                    receive(shared, &sock, &path, ino);
                    shared.set_healthy(false);
                }
                *lock(&shared.bound) = None;
                drop(sock);
                remove_socket(&path);
            }
            Err(e) => {
                if !warned {
                    warned = true;
                    tracing::warn!(dir = %shared.dir.display(), error = %e,
                        "cannot bind an SQLite wake-up socket: \
                         other processes' writes are seen by polling");
                }
            }
        }
        if !shared.stop.load(Ordering::Acquire) {
            std::thread::park_timeout(CHECK_EVERY);
        }
    }
}

/// Serves the bound socket until it is no longer healthy or the hub is dropped.
fn receive(shared: &Arc<HubShared>, sock: &StdDatagram, path: &Path, ino: u64) {
    let marker = path.with_extension(MISSED);
    let mut checked = std::time::Instant::now();
    let mut buf = [0u8; MAX_DATAGRAM + 1];
    let mut woken: HashMap<String, Changes> = HashMap::new();
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        // Blocks for the first datagram (at most `CHECK_EVERY`), then drains the queue.
        let mut got = 0;
        while got < BATCH {
            match sock.recv(&mut buf) {
                Ok(n) => {
                    if shared.stop.load(Ordering::Acquire) {
                        // Shut down by the hub's drop (a receive then returns 0 bytes).
                        return;
                    }
                    got += 1;
                    if got == 1 && sock.set_nonblocking(true).is_err() {
                        return;
                    }
                    match decode(&buf[..n]).ok().filter(|_| n <= MAX_DATAGRAM) {
                        Some(w) => {
                            shared.received.fetch_add(1, Ordering::Relaxed);
                            *woken.entry(w.group.to_owned()).or_default() |= w.changes;
                        }
                        None => {
                            let seen = shared.malformed.fetch_add(1, Ordering::Relaxed);
                            if seen == 0 {
                                tracing::warn!(path = %path.display(), len = n,
                                    "ignored a malformed SQLite wake-up datagram \
                                     (only the first is logged)");
                            }
                        }
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        if got > 0 {
            if sock.set_nonblocking(false).is_err() {
                return;
            }
            // After draining: a writer that found the queue full left the marker first.
            if std::fs::remove_file(&marker).is_ok() {
                shared.wake_all();
            }
            let mut reg = registry();
            for (group, changes) in woken.drain() {
                notify_local(&mut reg, shared.file, &group, changes);
            }
        }
        if checked.elapsed() >= CHECK_EVERY {
            checked = std::time::Instant::now();
            if !shared.in_place(path, ino) {
                tracing::debug!(path = %path.display(),
                    "the SQLite wake-up socket left its directory; binding another");
                return;
            }
            if std::fs::remove_file(&marker).is_ok() {
                shared.wake_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn changes() -> impl Strategy<Value = Changes> {
        (1u8..8).prop_map(from_bits)
    }

    fn name() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9 ._:é-]{1,40}"
            .prop_filter("a valid name", |s| check_name("group name", s).is_ok())
    }

    proptest! {
        /// What is encoded decodes to the same kinds and group.
        #[test]
        fn round_trip(c in changes(), g in name()) {
            let d = encode(c, &g).expect("a valid wake-up");
            prop_assert!(d.len() <= MAX_DATAGRAM);
            let w = decode(&d).unwrap();
            prop_assert_eq!(w.changes, c);
            prop_assert_eq!(w.group, g.as_str());
        }

        /// Any bytes: no panic, and whatever decodes re-encodes to exactly those bytes.
        #[test]
        fn decode_any(d in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(w) = decode(&d) {
                prop_assert_eq!(encode(w.changes, w.group), Some(d));
            }
        }

        /// Valid datagrams with one byte changed: still no panic, canonical if accepted.
        #[test]
        fn decode_mutated(
            c in changes(),
            g in name(),
            at in any::<prop::sample::Index>(),
            b in any::<u8>(),
        ) {
            let mut d = encode(c, &g).unwrap();
            let i = at.index(d.len());
            d[i] = b;
            if let Ok(w) = decode(&d) {
                prop_assert_eq!(encode(w.changes, w.group), Some(d.clone()));
            }
        }
    }

    #[test]
    fn rejects() {
        assert!(decode(&[]).is_err());
        assert!(decode(&[VERSION, 1]).is_err(), "no group");
        assert!(decode(&[2, 1, b'g']).is_err(), "another version");
        assert!(decode(&[VERSION, 0, b'g']).is_err(), "no kinds");
        assert!(decode(&[VERSION, 8, b'g']).is_err(), "unknown kinds");
        assert!(decode(&[VERSION, 1, 0xff]).is_err(), "not UTF-8");
        assert!(
            decode(&[VERSION, 1, b'a', b'/', b'b']).is_err(),
            "not a name"
        );
        let long = [b'g'; MAX_GROUP + 1];
        assert!(
            decode(&[&[VERSION, 1][..], &long].concat()).is_err(),
            "too long"
        );
        assert_eq!(encode(Changes::NONE, "g"), None);
        assert_eq!(encode(Changes::MEMBERS, ""), None);
        assert_eq!(
            decode(&[VERSION, 5, b'g']).unwrap(),
            Wakeup {
                changes: Changes::MEMBERS | Changes::BALLOTS,
                group: "g"
            }
        );
    }
}
