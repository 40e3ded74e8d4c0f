//! Kernel TCP: length-framed messages over a stream (see [`crate::framed`]).
//!
//! ```
//! use chunnel::{Chunnel, ConnectionExt, Listener as _};
//! use chunnel_net::tcp;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let mut listener = tcp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let client = tcp::Connect::new(listener.local_addr()?).connect_wrap(()).await?;
//! let server = listener.accept().await?;
//! client.send_one("ping".into()).await?;
//! assert_eq!(server.recv_one().await?, "ping");
//! # Ok(()) }
//! ```

use std::net::SocketAddr;

use chunnel::{Chunnel, Error, Negotiate};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

pub use crate::framed::Config;

/// A TCP connection carrying length-framed messages (client and server side alike).
pub type Connection = crate::framed::Connection<OwnedReadHalf, OwnedWriteHalf>;

fn wrap(stream: TcpStream, cfg: &Config, peer: SocketAddr) -> Result<Connection, Error> {
    stream.set_nodelay(true).map_err(|e| Error::Io {
        op: "set_nodelay",
        source: e,
    })?;
    let (r, w) = stream.into_split();
    Ok(Connection::new(r, w, cfg, peer.to_string()))
}

/// The base Chunnel of a TCP client: `connect_wrap(())` opens a connection to `addr`.
#[derive(Clone, Debug)]
pub struct Connect {
    addr: SocketAddr,
    cfg: Config,
}

impl Connect {
    /// Connects to `addr` with the default [`Config`].
    pub fn new(addr: SocketAddr) -> Self {
        Connect {
            addr,
            cfg: Config::default(),
        }
    }

    /// Uses `cfg` instead of the default.
    pub fn with_config(mut self, cfg: Config) -> Self {
        self.cfg = cfg;
        self
    }
}

impl Negotiate for Connect {
    fn id(&self) -> &'static str {
        "chunnel/tcp/1"
    }
}

impl Chunnel<()> for Connect {
    type Connection = Connection;

    async fn connect_wrap(&mut self, (): ()) -> Result<Connection, Error> {
        let s = TcpStream::connect(self.addr)
            .await
            .map_err(|e| Error::from_io("connect", self.addr, e))?;
        wrap(s, &self.cfg, self.addr)
    }
}

/// The bind config of a TCP server: [`Listen::listen`](chunnel::Listen::listen) binds `addr`
/// ([`Listener::bind_with`]). The server-side counterpart of [`Connect`], with the same id.
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
}

impl Negotiate for Bind {
    fn id(&self) -> &'static str {
        "chunnel/tcp/1"
    }
}

impl chunnel::Listen for Bind {
    type Listener = Listener;

    fn listen(&self) -> impl Future<Output = Result<Listener, Error>> + Send {
        Listener::bind_with(self.addr, self.cfg.clone())
    }
}

/// A TCP server socket handing out one [`Connection`] per accepted stream.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    cfg: Config,
}

impl Listener {
    /// Binds `addr` with the default [`Config`].
    pub async fn bind(addr: SocketAddr) -> Result<Self, Error> {
        Self::bind_with(addr, Config::default()).await
    }

    /// Binds `addr` with `cfg`.
    pub async fn bind_with(addr: SocketAddr, cfg: Config) -> Result<Self, Error> {
        let inner = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::from_io("bind", addr, e))?;
        Ok(Listener { inner, cfg })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.inner.local_addr().map_err(|e| Error::Io {
            op: "local_addr",
            source: e,
        })
    }
}

impl chunnel::Listener for Listener {
    type Connection = Connection;

    async fn accept(&mut self) -> Result<Connection, Error> {
        loop {
            match self.inner.accept().await {
                Ok((s, peer)) => return wrap(s, &self.cfg, peer),
                // A peer that reset before we accepted it must not stop the listener.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    return Err(Error::Io {
                        op: "accept",
                        source: e,
                    });
                }
            }
        }
    }
}
