//! Unix-domain sockets: datagrams ([`DatagramConnect`], [`DatagramListener`]) and
//! length-framed streams ([`StreamConnect`], [`StreamListener`]).
//!
//! Addresses are [`UnixAddr`]: a filesystem path or a Linux abstract name. A listener bound to
//! a path removes its socket file when dropped. Datagram clients bind a unique abstract name
//! so the server can answer them.
//!
//! ```
//! use chunnel::{Chunnel, ConnectionExt, Listener as _};
//! use chunnel_net::uds::{self, UnixAddr};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let addr = UnixAddr::Abstract(b"my-service".to_vec());
//! let mut listener = uds::DatagramListener::bind(addr.clone()).await?;
//! let client = uds::DatagramConnect::new(addr).connect_wrap(()).await?;
//! client.send_one("hi".into()).await?;
//! assert_eq!(listener.accept().await?.recv_one().await?, "hi");
//! # Ok(()) }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

use chunnel::{Chunnel, Error, Negotiate};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixDatagram, UnixListener, UnixStream};

use crate::datagram;
pub use crate::sys::UnixAddr;

/// Largest Unix datagram carried by default (64 KiB; the kernel's limit is the socket buffer).
pub const MAX_DATAGRAM: usize = 65_536;

/// Settings of the Unix datagram datapath (the same knobs as UDP).
pub type DatagramConfig = datagram::Config;
/// Settings of the Unix stream datapath.
pub type StreamConfig = crate::framed::Config;

fn default_dgram_config() -> DatagramConfig {
    datagram::Config::with_max_payload(MAX_DATAGRAM)
}

fn to_std(addr: &UnixAddr) -> Result<std::os::unix::net::SocketAddr, Error> {
    addr.check().map_err(|e| Error::Io {
        op: "unix address",
        source: e,
    })?;
    match addr {
        UnixAddr::Path(p) => std::os::unix::net::SocketAddr::from_pathname(p),
        UnixAddr::Abstract(n) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(n)
        }
    }
    .map_err(|e| Error::Io {
        op: "unix address",
        source: e,
    })
}

fn unique_abstract_name() -> UnixAddr {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    UnixAddr::Abstract(
        format!(
            "chunnel-{}-{}-{nanos:x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
        .into_bytes(),
    )
}

fn bind_std_dgram(addr: &UnixAddr) -> Result<std::os::unix::net::UnixDatagram, Error> {
    std::os::unix::net::UnixDatagram::bind_addr(&to_std(addr)?)
        .map_err(|e| Error::from_io("bind", addr, e))
}

fn bind_dgram(addr: &UnixAddr) -> Result<UnixDatagram, Error> {
    register_dgram(bind_std_dgram(addr)?)
}

fn register_dgram(s: std::os::unix::net::UnixDatagram) -> Result<UnixDatagram, Error> {
    s.set_nonblocking(true).map_err(|e| Error::Io {
        op: "set_nonblocking",
        source: e,
    })?;
    UnixDatagram::from_std(s).map_err(|e| Error::Io {
        op: "register",
        source: e,
    })
}

/// A client-side Unix datagram connection.
pub type DatagramConnection = datagram::Connection<UnixDatagram>;
/// A server-side Unix datagram connection.
pub type DatagramServerConnection = datagram::ServerConnection<UnixDatagram>;

/// The base Chunnel of a Unix datagram client.
#[derive(Clone, Debug)]
pub struct DatagramConnect {
    addr: UnixAddr,
    cfg: DatagramConfig,
}

impl DatagramConnect {
    /// Connects to the listener at `addr`.
    pub fn new(addr: impl Into<UnixAddr>) -> Self {
        DatagramConnect {
            addr: addr.into(),
            cfg: default_dgram_config(),
        }
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: DatagramConfig) -> Self {
        self.cfg = cfg;
        self
    }
}

impl Negotiate for DatagramConnect {
    fn id(&self) -> &'static str {
        "chunnel/unix-dgram/1"
    }
}

impl Chunnel<()> for DatagramConnect {
    type Connection = DatagramConnection;

    async fn connect_wrap(&mut self, (): ()) -> Result<DatagramConnection, Error> {
        let peer = to_std(&self.addr)?;
        let sock = bind_std_dgram(&unique_abstract_name())?;
        // std connects to abstract names too (tokio's `connect` takes only paths).
        sock.connect_addr(&peer)
            .map_err(|e| Error::from_io("connect", &self.addr, e))?;
        let sock = register_dgram(sock)?;
        Ok(datagram::Connection::new(
            sock,
            self.addr.clone(),
            self.cfg.clone(),
        ))
    }
}

/// The bind config of a Unix datagram server: [`Listen::listen`](chunnel::Listen::listen)
/// binds `addr` ([`DatagramListener::bind_with`]). The server-side counterpart of
/// [`DatagramConnect`], with the same id.
#[derive(Clone, Debug)]
pub struct DatagramBind {
    addr: UnixAddr,
    cfg: DatagramConfig,
}

impl DatagramBind {
    /// Binds `addr` with the default configuration.
    pub fn new(addr: impl Into<UnixAddr>) -> Self {
        DatagramBind {
            addr: addr.into(),
            cfg: default_dgram_config(),
        }
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: DatagramConfig) -> Self {
        self.cfg = cfg;
        self
    }
}

impl Negotiate for DatagramBind {
    fn id(&self) -> &'static str {
        "chunnel/unix-dgram/1"
    }
}

impl chunnel::Listen for DatagramBind {
    type Listener = DatagramListener;

    fn listen(&self) -> impl Future<Output = Result<DatagramListener, Error>> + Send {
        DatagramListener::bind_with(self.addr.clone(), self.cfg.clone())
    }
}

/// A Unix datagram server socket, one connection per client address.
#[derive(Debug)]
pub struct DatagramListener {
    inner: datagram::Listener<UnixDatagram>,
    _file: Option<SocketFile>,
}

impl DatagramListener {
    /// Binds `addr` with the default configuration.
    pub async fn bind(addr: impl Into<UnixAddr>) -> Result<Self, Error> {
        Self::bind_with(addr, default_dgram_config()).await
    }

    /// Binds `addr` with `cfg`.
    pub async fn bind_with(addr: impl Into<UnixAddr>, cfg: DatagramConfig) -> Result<Self, Error> {
        let addr = addr.into();
        let sock = bind_dgram(&addr)?;
        Ok(DatagramListener {
            inner: datagram::Listener::new(sock, cfg),
            _file: SocketFile::of(&addr),
        })
    }

    /// The demultiplexing listener underneath (peer counts, drop counters).
    pub fn get_ref(&self) -> &datagram::Listener<UnixDatagram> {
        &self.inner
    }
}

impl chunnel::Listener for DatagramListener {
    type Connection = DatagramServerConnection;

    fn accept(
        &mut self,
    ) -> impl std::future::Future<Output = Result<DatagramServerConnection, Error>> + Send {
        self.inner.accept()
    }

    fn accepting_in_loop(&mut self) {
        chunnel::Listener::accepting_in_loop(&mut self.inner);
    }

    fn recognise_sessions(&mut self, session_of: fn(&[u8]) -> Option<u64>) {
        chunnel::Listener::recognise_sessions(&mut self.inner, session_of);
    }
}

/// Removes a listener's socket file when the listener goes away.
#[derive(Debug)]
struct SocketFile(std::path::PathBuf);

impl SocketFile {
    fn of(addr: &UnixAddr) -> Option<Self> {
        match addr {
            UnixAddr::Path(p) => Some(SocketFile(p.clone())),
            UnixAddr::Abstract(_) => None,
        }
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A Unix stream connection carrying length-framed messages.
pub type StreamConnection = crate::framed::Connection<OwnedReadHalf, OwnedWriteHalf>;

/// The base Chunnel of a Unix stream client.
#[derive(Clone, Debug)]
pub struct StreamConnect {
    addr: UnixAddr,
    cfg: StreamConfig,
}

impl StreamConnect {
    /// Connects to the listener at `addr`.
    pub fn new(addr: impl Into<UnixAddr>) -> Self {
        StreamConnect {
            addr: addr.into(),
            cfg: StreamConfig::default(),
        }
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: StreamConfig) -> Self {
        self.cfg = cfg;
        self
    }
}

impl Negotiate for StreamConnect {
    fn id(&self) -> &'static str {
        "chunnel/unix-stream/1"
    }
}

impl Chunnel<()> for StreamConnect {
    type Connection = StreamConnection;

    async fn connect_wrap(&mut self, (): ()) -> Result<StreamConnection, Error> {
        let addr = to_std(&self.addr)?;
        let s = std::os::unix::net::UnixStream::connect_addr(&addr)
            .map_err(|e| Error::from_io("connect", &self.addr, e))?;
        s.set_nonblocking(true).map_err(|e| Error::Io {
            op: "set_nonblocking",
            source: e,
        })?;
        let s = UnixStream::from_std(s).map_err(|e| Error::Io {
            op: "register",
            source: e,
        })?;
        let (r, w) = s.into_split();
        Ok(StreamConnection::new(
            r,
            w,
            &self.cfg,
            self.addr.to_string(),
        ))
    }
}

/// The bind config of a Unix stream server: [`Listen::listen`](chunnel::Listen::listen)
/// binds `addr` ([`StreamListener::bind_with`]). The server-side counterpart of
/// [`StreamConnect`], with the same id.
#[derive(Clone, Debug)]
pub struct StreamBind {
    addr: UnixAddr,
    cfg: StreamConfig,
}

impl StreamBind {
    /// Binds `addr` with the default configuration.
    pub fn new(addr: impl Into<UnixAddr>) -> Self {
        StreamBind {
            addr: addr.into(),
            cfg: StreamConfig::default(),
        }
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: StreamConfig) -> Self {
        self.cfg = cfg;
        self
    }
}

impl Negotiate for StreamBind {
    fn id(&self) -> &'static str {
        "chunnel/unix-stream/1"
    }
}

impl chunnel::Listen for StreamBind {
    type Listener = StreamListener;

    fn listen(&self) -> impl Future<Output = Result<StreamListener, Error>> + Send {
        StreamListener::bind_with(self.addr.clone(), self.cfg.clone())
    }
}

/// A Unix stream server socket.
#[derive(Debug)]
pub struct StreamListener {
    inner: UnixListener,
    cfg: StreamConfig,
    addr: UnixAddr,
    _file: Option<SocketFile>,
}

impl StreamListener {
    /// Binds `addr` with the default configuration.
    pub async fn bind(addr: impl Into<UnixAddr>) -> Result<Self, Error> {
        Self::bind_with(addr, StreamConfig::default()).await
    }

    /// Binds `addr` with `cfg`.
    pub async fn bind_with(addr: impl Into<UnixAddr>, cfg: StreamConfig) -> Result<Self, Error> {
        let addr = addr.into();
        let std_addr = to_std(&addr)?;
        let l = std::os::unix::net::UnixListener::bind_addr(&std_addr)
            .map_err(|e| Error::from_io("bind", &addr, e))?;
        l.set_nonblocking(true).map_err(|e| Error::Io {
            op: "set_nonblocking",
            source: e,
        })?;
        let inner = UnixListener::from_std(l).map_err(|e| Error::Io {
            op: "register",
            source: e,
        })?;
        Ok(StreamListener {
            inner,
            cfg,
            _file: SocketFile::of(&addr),
            addr,
        })
    }
}

impl chunnel::Listener for StreamListener {
    type Connection = StreamConnection;

    async fn accept(&mut self) -> Result<StreamConnection, Error> {
        let (s, _) = self.inner.accept().await.map_err(|e| Error::Io {
            op: "accept",
            source: e,
        })?;
        let (r, w) = s.into_split();
        Ok(StreamConnection::new(
            r,
            w,
            &self.cfg,
            format!("client of {}", self.addr),
        ))
    }
}
