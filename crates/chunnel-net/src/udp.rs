//! Kernel UDP: addressed datagrams, batched with `sendmmsg`/`recvmmsg`.
//!
//! * Client: [`Connect`] is a `Chunnel<()>`; its connection is a socket connected to the
//!   server.
//! * Server: [`Bind`] is a [`chunnel::Listen`]; [`Listener::bind`] gives the
//!   [`chunnel::Listener`] handing out one [`ServerConnection`] per peer address.
//!
//! ```
//! use chunnel::{Chunnel, ConnectionExt, Listener as _};
//! use chunnel_net::udp;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let mut listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let addr = listener.local_addr()?;
//! let client = udp::Connect::new(addr).connect_wrap(()).await?;
//! client.send_one("hello".into()).await?;
//! let server = listener.accept().await?;
//! assert_eq!(server.recv_one().await?, "hello");
//! # Ok(()) }
//! ```

use std::net::SocketAddr;

use chunnel::{Chunnel, Error, Negotiate};
use tokio::net::UdpSocket;

use crate::datagram;
pub use crate::datagram::Config;

/// Largest UDP payload over IPv4 (65,535 − 8 UDP − 20 IP header bytes).
pub const MAX_PAYLOAD: usize = 65_507;

impl Default for Config {
    fn default() -> Self {
        Config::with_max_payload(MAX_PAYLOAD)
    }
}

/// A client-side UDP connection.
pub type Connection = datagram::Connection<UdpSocket>;
/// A server-side UDP connection (one peer of a [`Listener`]).
pub type ServerConnection = datagram::ServerConnection<UdpSocket>;

/// The base Chunnel of a UDP client: `connect_wrap(())` makes a socket connected to `addr`
/// (the kernel binds it to an ephemeral port, unless [`Connect::with_local_addr`] names the
/// local address).
#[derive(Clone, Debug)]
pub struct Connect {
    addr: SocketAddr,
    local: Option<SocketAddr>,
    cfg: Config,
}

impl Connect {
    /// Connects to `addr` with the default [`Config`].
    pub fn new(addr: SocketAddr) -> Self {
        Connect {
            addr,
            local: None,
            cfg: Config::default(),
        }
    }

    /// Binds the client socket to `local` (an address, a port, or both; port 0 lets the
    /// kernel pick one) before connecting, instead of an ephemeral port of the address
    /// `connect` chooses. `connect_wrap` then fails with [`Error::AddrInUse`] if another
    /// socket holds `local`, and with [`Error::AddrFamily`] if `local` and the server address
    /// are not both IPv4 or both IPv6. (The same builder as chunnel-uring's `Connect`.)
    pub fn with_local_addr(mut self, local: SocketAddr) -> Self {
        self.local = Some(local);
        self
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: Config) -> Self {
        self.cfg = cfg;
        self
    }

    /// The server address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Negotiate for Connect {
    fn id(&self) -> &'static str {
        "chunnel/udp/1"
    }
}

impl Chunnel<()> for Connect {
    type Connection = Connection;

    async fn connect_wrap(&mut self, (): ()) -> Result<Connection, Error> {
        let sock = match self.local {
            // No explicit bind: `connect` binds an ephemeral port itself (see
            // `sys::connected_udp`). A UDP connect sends nothing, so it completes at once.
            None => crate::sys::connected_udp(&self.addr),
            Some(local) => {
                if local.is_ipv4() != self.addr.is_ipv4() {
                    return Err(Error::AddrFamily {
                        local: local.to_string(),
                        remote: self.addr.to_string(),
                    });
                }
                let s = std::net::UdpSocket::bind(local)
                    .map_err(|e| Error::from_io("bind", local, e))?;
                s.set_nonblocking(true)
                    .and_then(|()| s.connect(self.addr))
                    .map(|()| s)
            }
        }
        .and_then(UdpSocket::from_std)
        .map_err(|e| Error::from_io("connect", self.addr, e))?;
        Ok(datagram::Connection::new(sock, self.addr, self.cfg.clone()))
    }
}

/// The bind config of a UDP server: [`Listen::listen`](chunnel::Listen::listen) binds `addr`
/// ([`Listener::bind_with`]). The server-side counterpart of [`Connect`], with the same id, so
/// `select(chunnel_uring::udp::Bind, udp::Bind)` listens on io_uring where the host allows it
/// and on this otherwise.
#[derive(Clone, Debug)]
pub struct Bind {
    addr: SocketAddr,
    cfg: Config,
}

impl Bind {
    /// Binds `addr` (port 0: the kernel picks one) with the default [`Config`].
    pub fn new(addr: SocketAddr) -> Self {
        Bind {
            addr,
            cfg: Config::default(),
        }
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: Config) -> Self {
        self.cfg = cfg;
        self
    }

    /// The address to bind.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Negotiate for Bind {
    fn id(&self) -> &'static str {
        "chunnel/udp/1"
    }
}

impl chunnel::Listen for Bind {
    type Listener = Listener;

    fn listen(&self) -> impl Future<Output = Result<Listener, Error>> + Send {
        Listener::bind_with(self.addr, self.cfg.clone())
    }
}

/// The receive buffer a UDP [`Listener`]'s socket asks for: 4 MiB.
pub const LISTENER_RECV_BUFFER: usize = 4 << 20;

/// A UDP server socket; see [`datagram`] for how peers are demultiplexed.
pub type Listener = datagram::Listener<UdpSocket>;
/// Reads a UDP [`Listener`]'s peer count from elsewhere ([`Listener::peer_counter`]).
pub type PeerCounter = datagram::PeerCounter<UdpSocket>;

impl Listener {
    /// Binds `addr` with the default [`Config`].
    pub async fn bind(addr: SocketAddr) -> Result<Self, Error> {
        Self::bind_with(addr, Config::default()).await
    }

    /// Binds `addr` with `cfg`. The socket asks for a receive buffer of
    /// [`LISTENER_RECV_BUFFER`] bytes (the kernel caps it at `net.core.rmem_max`), so a burst
    /// of new peers waits in the kernel instead of being dropped there.
    pub async fn bind_with(addr: SocketAddr, cfg: Config) -> Result<Self, Error> {
        let sock = UdpSocket::bind(addr)
            .await
            .map_err(|e| Error::from_io("bind", addr, e))?;
        let l = datagram::Listener::new(sock, cfg);
        l.set_recv_buffer(LISTENER_RECV_BUFFER)?;
        Ok(l)
    }

    /// Asks the kernel for a receive buffer of `bytes` for this listener's socket
    /// (`SO_RCVBUF`; the kernel doubles the figure for its bookkeeping and caps it at
    /// `net.core.rmem_max`). Returns the size the kernel granted, as it reports it.
    pub fn set_recv_buffer(&self, bytes: usize) -> Result<usize, Error> {
        use std::os::fd::AsRawFd;
        let fd = self.get_ref().as_raw_fd();
        let io = |e| Error::Io {
            op: "SO_RCVBUF",
            source: e,
        };
        let want = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
        let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `fd` is this listener's open socket; the option value is a c_int of the
        // length given.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&raw const want).cast(),
                len,
            )
        };
        if r != 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        let mut got: libc::c_int = 0;
        let mut got_len = len;
        // SAFETY: as above; `got` has room for the c_int the kernel writes.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&raw mut got).cast(),
                &mut got_len,
            )
        };
        if r != 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        Ok(usize::try_from(got).unwrap_or(0))
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.get_ref().local_addr().map_err(|e| Error::Io {
            op: "local_addr",
            source: e,
        })
    }
}
