//! # chunnel-shm: a shared-memory datapath for peers on one host
//!
//! [`LocalFastPath`] is a Chunnel that, when negotiation picks it, moves a connection's data
//! from the kernel socket it was negotiated over onto two single-producer single-consumer
//! rings in one `/dev/shm` file. Put it in a `select` over a kernel datapath and the same
//! application code runs over shared memory when the peers share memory and over the socket
//! otherwise (the HotNets `local_or_remote` example):
//!
//! ```
//! use chunnel::{select, Chunnel, ConnectionExt, Identity, Side};
//! use chunnel_negotiate::{listen, Client, Config};
//! use chunnel_net::udp;
//! use chunnel_shm::LocalFastPath;
//!
//! # #[tokio::main]
//! # async fn main() -> anyhow::Result<()> {
//! let listener = udp::Listener::bind("127.0.0.1:0".parse()?).await?;
//! let addr = listener.local_addr()?;
//! let mut server = listen(select(LocalFastPath::server(), Identity), listener, Config::default());
//! tokio::spawn(async move {
//!     while let Ok(conn) = server.accept().await {
//!         tokio::spawn(async move {
//!             while let Ok(m) = conn.recv_one().await {
//!                 let _ = conn.send_one(m).await;
//!             }
//!         });
//!     }
//! });
//!
//! let base = udp::Connect::new(addr).connect_wrap(()).await?;
//! let conn = Client::new(Config::default())
//!     .connect(&addr.to_string(), select(LocalFastPath::client(), Identity), base)
//!     .await?;
//! conn.send_one("hi".into()).await?;
//! assert_eq!(conn.recv_one().await?, "hi");
//! // Both ends are on this host and see the same /dev/shm: shared memory was picked.
//! assert_eq!(conn.get_ref().side(), Side::Left);
//! # Ok(()) }
//! ```
//!
//! ## When it is picked
//!
//! Its capability is the exact-match `host-shm` with one label, [`host_identity`]: the
//! kernel's boot id plus the device and inode of the shared-memory directory. Two processes
//! share the label exactly when they run on the same booted kernel *and* see the same
//! `/dev/shm` mount — which holds across network namespaces (containers with their own
//! network) and fails for a process with a private `/dev/shm` (its own mount namespace and
//! tmpfs, as a container without `--ipc=host` has) or on another host. Negotiation requires
//! equal labels at both ends, so otherwise it falls back to the select's other branch.
//! [`LocalFastPath::check_available`](chunnel::Negotiate::check_available) fails when the
//! directory is not writable, so such a host does not even offer it.
//!
//! ## Set-up over the negotiated connection
//!
//! The client creates the region (a new, uniquely named file, mode 0600), takes a lock on it
//! and sends `CHSHM1 | offer | token | name` over the negotiated (inner) connection,
//! re-sending every 100 ms. The server maps the file, checks it (magic, version, the token,
//! sizes against the file's real size), takes its own lock, marks itself attached, unlinks
//! the file and answers `ok` (or `err` with the reason, which fails both ends with
//! [`chunnel::Error::NotAvailable`]). From then on all data goes over the rings; the inner
//! connection stays open, unused. The file is unlinked as soon as both have mapped it (or by
//! the client if set-up fails), so nothing is left in `/dev/shm` unless the client dies during
//! set-up. This layer does not support 0-RTT (`Client::connect_0rtt`): its set-up needs a
//! round trip before any data.
//!
//! ## Waiting, latency and CPU
//!
//! A receiver on an empty ring busy-polls for [`WaitPolicy::spin`] (default 50 µs: request/
//! response traffic then never sleeps), then parks: it sets a flag in the ring, and a waiter
//! thread of the connection blocks on a futex that the sender wakes (one `futex` system call
//! per burst, and only while the receiver sleeps). A wake from the futex costs a cross-core
//! thread wake-up (tens of µs on a VM), so: `spin = Duration::MAX` gives the lowest latency and
//! burns a core per waiting receiver; `spin = 0` never spins (latency close to a kernel
//! socket's, no CPU while idle); the default spins only across short gaps.
//!
//! ## Liveness
//!
//! Each side holds an open-file-description lock on its own byte of the region; the kernel
//! releases it when the process dies. A side whose peer closed (drop sets a state word and
//! wakes it) or died (the lock is gone, checked every [`WaitPolicy::liveness`]) gets the
//! remaining messages, then [`chunnel::Error::PeerClosed`].
//!
//! ## Copies and allocation
//!
//! Data is `bytes::Bytes` on the `ChunnelConnection` path: sending copies each message into the
//! ring; receiving copies it out into a block that hands out `Bytes` slices and is reused in
//! place once the application has dropped them (so steady-state receiving allocates nothing).
//! Copying out, rather than handing the application a view of shared memory, means a peer
//! cannot change a message after it was validated. Every length and position read from shared
//! memory is bounds-checked; a misbehaving peer causes [`chunnel::Error::Malformed`], never a
//! panic. A peer that *truncates* the file could still make accesses fault (`SIGBUS`): the
//! region is trusted not to shrink (a sealed memfd would close this, but needs descriptor
//! passing).
//!
//! ## Lent buffers (zero copies)
//!
//! [`ShmConnection`] also lends the rings themselves:
//! [`LendRecv::recv_lent`](chunnel::LendRecv::recv_lent) gives [`ShmPayload`]s, views of the
//! records in the receive ring, whose space the peer reuses only once they are dropped (from
//! any thread, in any order); [`LendBuffer::lend`](chunnel::LendBuffer::lend) reserves a record
//! in the send ring as a [`ShmBuf`] to fill, and [`Emit::emit`](chunnel::Emit::emit) publishes
//! it. Neither copies nor allocates per message. Held payloads do not stop the ring: a lent
//! record becomes a hole the sender steps over (see `ring.rs`), and past [`RX_HOLES`] held
//! records or half the ring held, `recv_lent` copies instead (counted in
//! [`LendStats`](chunnel::LendStats)), so the sender always has room in total. One limit:
//! the room must be contiguous for a message, so payloads held long and scattered over the
//! ring (up to 56 of them) can leave no gap as large as a big message; its sender then waits
//! until one is dropped (small messages, and the tests' patterns, keep flowing). `lend` returns `None`
//! when the ring has no room or [`LEND_WINDOW`] buffers are out (send the `Bytes` then);
//! messages leave in the order they were lent or sent, so a buffer lent and not yet emitted
//! holds back later ones. A payload keeps the mapping alive: it stays readable after the
//! connection is dropped or the peer died. A lent payload is memory the peer maps too: a peer
//! that writes a record after publishing it (a bug, or a hostile peer) changes what the
//! application reads; use `recv` when the peer is not trusted that far.
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod conn;
mod lend;
mod ring;
mod shared;
mod sys;

use std::fs::OpenOptions;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use chunnel::{Capability, Chunnel, ChunnelConnection, ConnectionExt, Error, Negotiate};

pub use crate::conn::ShmConnection;
pub use crate::lend::{ShmBuf, ShmPayload};
/// Lent send buffers out at once per connection; past it `lend` returns `None`.
pub const LEND_WINDOW: usize = ring::LEND_WINDOW;
/// Received records lent out at once per connection; past it `recv_lent` copies.
pub const RX_HOLES: usize = ring::RX_HOLES;
use crate::ring::Region;
use crate::sys::Mapping;

/// The Chunnel's stable id.
pub const ID: &str = "chunnel/shm/1";
/// The capability kind that carries the host identity.
pub const CAPABILITY: &str = "host-shm";
const FILE_PREFIX: &str = "chunnel-shm-";
const MSG_MAGIC: &[u8; 6] = b"CHSHM1";
const MSG_OFFER: u8 = 1;
const MSG_OK: u8 = 2;
const MSG_ERR: u8 = 3;
/// Longest file name accepted in an offer.
const MAX_NAME: usize = 128;

/// Which end of the connection a [`LocalFastPath`] builds: the client creates the region,
/// the server attaches to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The connecting side (runs `Client::connect`).
    Client,
    /// The listening side (runs `listen`).
    Server,
}

/// How a receiver waits on an empty ring (see the crate docs for the trade-off).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Busy-poll this long before parking. `Duration::MAX`: never park (lowest latency, one
    /// core per waiting receiver); zero: park at once.
    pub spin: Duration,
    /// How often a waiting side checks that the peer process is still alive (a system call).
    pub liveness: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy {
            spin: Duration::from_micros(50),
            liveness: Duration::from_millis(100),
        }
    }
}

impl WaitPolicy {
    /// Always busy-poll (benchmarks; a dedicated core per receiver).
    pub fn busy_poll() -> Self {
        WaitPolicy {
            spin: Duration::MAX,
            ..WaitPolicy::default()
        }
    }
}

/// Settings of a [`LocalFastPath`].
#[derive(Clone, Debug)]
pub struct Config {
    /// Bytes of each ring (a power of two, 4 KiB to 1 GiB). The client's setting sizes both
    /// rings; the server's is ignored. Default 256 KiB. The memory is allocated and mapped
    /// in full at set-up (no page faults on the data path): 4 KiB + 2 rings per connection.
    pub ring_bytes: usize,
    /// Largest message (at most a quarter of the ring); larger sends fail with
    /// `Error::MessageTooLarge`. The client's setting applies to both directions. Default
    /// 64 KiB.
    pub max_message: usize,
    /// How receivers wait.
    pub wait: WaitPolicy,
    /// How long set-up may take (the client waiting for the server to attach; the server
    /// waiting for the offer).
    pub setup_timeout: Duration,
    /// The shared-memory directory (a tmpfs). Default `/dev/shm`.
    pub dir: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ring_bytes: 256 << 10,
            max_message: 64 * 1024,
            wait: WaitPolicy::default(),
            setup_timeout: Duration::from_secs(5),
            dir: PathBuf::from("/dev/shm"),
        }
    }
}

/// "This host and this shared-memory directory": `<boot id>:<st_dev>:<st_ino>` of `dir`.
/// Equal across network namespaces of one host; different for a process that mounted its own
/// tmpfs on `dir` or runs on another host.
pub fn host_identity(dir: &Path) -> std::io::Result<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let meta = std::fs::metadata(dir)?;
    Ok(format!("{}:{:x}:{:x}", boot.trim(), meta.dev(), meta.ino()))
}

/// A shared-memory fast path for co-located peers; see the crate docs.
///
/// As a `Chunnel<C>` over any byte connection `C` (the negotiated kernel connection), it
/// builds a [`ShmConnection`] whose data bypasses `C`.
#[derive(Clone, Debug)]
pub struct LocalFastPath {
    role: Role,
    cfg: Config,
    identity: Result<Arc<str>, Arc<str>>,
}

impl LocalFastPath {
    /// The end `role` with `cfg`.
    pub fn new(role: Role, cfg: Config) -> Self {
        let identity = match host_identity(&cfg.dir) {
            Ok(id) if sys::writable(&cfg.dir) => Ok(Arc::from(id)),
            Ok(_) => Err(Arc::from(format!("{} is not writable", cfg.dir.display()))),
            Err(e) => Err(Arc::from(format!(
                "no host identity for {}: {e}",
                cfg.dir.display()
            ))),
        };
        LocalFastPath {
            role,
            cfg,
            identity,
        }
    }

    /// The client end with the default configuration.
    pub fn client() -> Self {
        Self::new(Role::Client, Config::default())
    }

    /// The server end with the default configuration.
    pub fn server() -> Self {
        Self::new(Role::Server, Config::default())
    }

    /// The label this end offers (or why it offers nothing).
    pub fn identity(&self) -> Result<&str, Error> {
        self.identity.as_deref().map_err(|e| Error::NotAvailable {
            chunnel: ID,
            reason: e.to_string(),
        })
    }
}

impl Negotiate for LocalFastPath {
    fn id(&self) -> &'static str {
        ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        match &self.identity {
            Ok(id) => vec![Capability::exact(CAPABILITY, [id.to_string()])],
            Err(_) => Vec::new(),
        }
    }

    fn check_available(&self) -> Result<(), Error> {
        self.identity().map(|_| ())
    }
}

impl<C> Chunnel<C> for LocalFastPath
where
    C: ChunnelConnection<Data = Bytes> + Send + Sync + 'static,
{
    type Connection = ShmConnection<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<ShmConnection<C>, Error> {
        self.identity()?;
        let region = match self.role {
            Role::Client => client_setup(&self.cfg, &inner).await?,
            Role::Server => server_setup(&self.cfg, &inner).await?,
        };
        Ok(ShmConnection::new(region, self.role, self.cfg.wait, inner))
    }
}

fn not_available(reason: impl Into<String>) -> Error {
    Error::NotAvailable {
        chunnel: ID,
        reason: reason.into(),
    }
}

fn io_err(op: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { op, source }
}

fn random_u64() -> u64 {
    chunnel::util::random_u64()
}

fn message(kind: u8, token: u64, body: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(MSG_MAGIC.len() + 9 + body.len());
    b.put_slice(MSG_MAGIC);
    b.put_u8(kind);
    b.put_u64(token);
    b.put_slice(body);
    b.freeze()
}

/// Parses a set-up message: `(kind, token, body)`, `None` for anything else.
fn parse(m: &[u8]) -> Option<(u8, u64, &[u8])> {
    let rest = m.strip_prefix(MSG_MAGIC)?;
    let (&kind, rest) = rest.split_first()?;
    let token = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    Some((kind, token, rest.get(8..)?))
}

fn valid_name(name: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(name).ok()?;
    let ok = s.len() <= MAX_NAME
        && s.starts_with(FILE_PREFIX)
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_');
    ok.then_some(s)
}

/// Removes the region's file unless disarmed (the server unlinks it once attached).
struct Unlink(Option<PathBuf>);

impl Drop for Unlink {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

async fn client_setup<C>(cfg: &Config, inner: &C) -> Result<Region, Error>
where
    C: ChunnelConnection<Data = Bytes>,
{
    let ring = cfg.ring_bytes;
    if !(ring::MIN_RING..=ring::MAX_RING).contains(&ring) || !ring.is_power_of_two() {
        return Err(not_available(format!(
            "ring size {ring} is not a power of two in 4 KiB..=1 GiB"
        )));
    }
    if cfg.max_message == 0 || cfg.max_message > ring / 4 {
        return Err(not_available(format!(
            "max message {} exceeds a quarter of the ring ({ring})",
            cfg.max_message
        )));
    }
    let token = random_u64();
    let name = format!("{FILE_PREFIX}{}-{:016x}", std::process::id(), random_u64());
    let path = cfg.dir.join(&name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(io_err("create the shared-memory file"))?;
    let mut unlink = Unlink(Some(path));
    let len = ring::file_len(ring);
    file.set_len(len as u64)
        .map_err(io_err("size the shared-memory file"))?;
    let map = Mapping::new(file, len).map_err(io_err("map the shared-memory file"))?;
    sys::lock_byte(map.file(), 0).map_err(io_err("lock the shared-memory file"))?;
    let region = Region::init(map, ring, cfg.max_message, token);
    conn::mark_attached(&region, Role::Client);

    let offer = message(MSG_OFFER, token, name.as_bytes());
    let deadline = tokio::time::Instant::now() + cfg.setup_timeout;
    let resend = Duration::from_millis(100);
    loop {
        if conn::peer_attached(&region) {
            break;
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(not_available(format!(
                "the server did not attach to the shared memory within {:?}",
                cfg.setup_timeout
            )));
        }
        inner.send_one(offer.clone()).await?;
        let wait = resend.min(deadline - now);
        match tokio::time::timeout(wait, inner.recv_one()).await {
            Ok(Ok(m)) => match parse(&m) {
                Some((MSG_OK, t, _)) if t == token => {}
                Some((MSG_ERR, t, why)) if t == token => {
                    return Err(not_available(format!(
                        "the server could not attach: {}",
                        String::from_utf8_lossy(why)
                    )));
                }
                // Not ours (a stale or foreign message): ignore.
                _ => continue,
            },
            Ok(Err(e)) => return Err(e),
            Err(_) => {}
        }
    }
    // The server unlinked it already; this only covers a server that died right after.
    drop(unlink.0.take().map(std::fs::remove_file));
    Ok(region)
}

async fn server_setup<C>(cfg: &Config, inner: &C) -> Result<Region, Error>
where
    C: ChunnelConnection<Data = Bytes>,
{
    let deadline = tokio::time::Instant::now() + cfg.setup_timeout;
    loop {
        let m = tokio::time::timeout_at(deadline, inner.recv_one())
            .await
            .map_err(|_| {
                not_available(format!(
                    "no shared-memory offer from the client within {:?}",
                    cfg.setup_timeout
                ))
            })??;
        let Some((MSG_OFFER, token, name)) = parse(&m) else {
            continue;
        };
        match attach(cfg, token, name) {
            Ok(region) => {
                inner.send_one(message(MSG_OK, token, &[])).await?;
                return Ok(region);
            }
            Err(why) => {
                let _ = inner
                    .send_one(message(MSG_ERR, token, why.as_bytes()))
                    .await;
                return Err(not_available(format!(
                    "cannot attach to the client's shared memory: {why}"
                )));
            }
        }
    }
}

fn attach(cfg: &Config, token: u64, name: &[u8]) -> Result<Region, String> {
    let name = valid_name(name).ok_or("invalid file name")?;
    let path = cfg.dir.join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    let meta = file.metadata().map_err(|e| format!("stat: {e}"))?;
    if !meta.file_type().is_file() {
        return Err("not a regular file".into());
    }
    let len = usize::try_from(meta.len()).map_err(|_| "file too large")?;
    if len < ring::HEADER || len > ring::file_len(ring::MAX_RING) {
        return Err(format!("file size {len} out of range"));
    }
    let map = Mapping::new(file, len).map_err(|e| format!("mmap: {e}"))?;
    sys::lock_byte(map.file(), 1).map_err(|e| format!("lock: {e}"))?;
    let region = Region::attach(map, token)?;
    conn::mark_attached(&region, Role::Server);
    // Both ends have it mapped: nothing needs the name any more.
    let _ = std::fs::remove_file(&path);
    Ok(region)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_never_panics_and_round_trips() {
        let m = message(MSG_OFFER, 42, b"chunnel-shm-1-abc");
        assert_eq!(parse(&m), Some((MSG_OFFER, 42, &b"chunnel-shm-1-abc"[..])));
        for cut in 0..m.len() {
            let _ = parse(&m[..cut]);
        }
        assert!(parse(b"garbage").is_none());
    }

    #[test]
    fn names_are_checked() {
        assert!(valid_name(b"chunnel-shm-12-00ff").is_some());
        assert!(valid_name(b"chunnel-shm-../../etc/passwd").is_none());
        assert!(valid_name(b"other").is_none());
        assert!(valid_name(&[b'c'; 300]).is_none());
    }

    #[test]
    fn identity_is_stable() {
        let a = host_identity(Path::new("/dev/shm"));
        let b = host_identity(Path::new("/dev/shm"));
        if let (Ok(a), Ok(b)) = (a, b) {
            assert_eq!(a, b);
        }
    }
}
