//! The short way in: negotiated connections over kernel UDP from an address and a stack.
//!
//! * [`connect`]: resolves an address, opens a UDP socket to it and negotiates `stack` with
//!   the server there ([`Client::connect`] over [`udp::Connect`], with [`Config::default`]).
//!   [`Connector`] does the same with a [`Config`] of its own and remembers picks for 0-RTT
//!   ([`Connector::connect_0rtt`]).
//! * [`bind`]: binds a UDP address and serves `stack` on it ([`listen`] over
//!   [`udp::Listener`]); [`Server::accept`] yields the negotiated connections.
//! * [`Conn`] and [`ServerConn`] name the connections by their stack alone, and
//!   [`NegotiatedConn`] is the one bound a helper generic over negotiated connections needs.

use std::net::SocketAddr;

use chunnel::{Chunnel, ChunnelConnection, Offers};
use chunnel_net::udp;
use tokio::net::ToSocketAddrs;

use crate::{Client, Config, Error, Info, Negotiated, NegotiatedListener, Tagged, listen};

/// The negotiated connection [`connect`] returns for the client stack `S`: the stack's
/// connection over kernel UDP, without naming the layers below it.
pub type Conn<S> = Negotiated<<S as Chunnel<Tagged<udp::Connection>>>::Connection>;

/// The negotiated connection [`Server::accept`] yields for the server stack `S`.
pub type ServerConn<S> = Negotiated<<S as Chunnel<Tagged<udp::ServerConnection>>>::Connection>;

/// A negotiated connection of any stack, over any datapath: a [`ChunnelConnection`] (so
/// [`chunnel::ConnectionExt`] applies) that also tells what negotiation decided. The one
/// bound a helper generic over negotiated connections needs, whatever their stacks.
///
/// Implemented by every [`Negotiated`] connection whose stack's connection is `'static`.
///
/// ```
/// use bytes::Bytes;
/// use chunnel::{select, ConnectionExt, Identity, Noop};
/// use chunnel_negotiate::{bind, connect, Error, NegotiatedConn};
///
/// /// Sends `m` and waits for the peer to send it back, on any negotiated connection.
/// async fn echo_once(conn: &impl NegotiatedConn<Data = Bytes>, m: Bytes) -> Result<(), Error> {
///     conn.send_one(m.clone()).await?;
///     assert_eq!(conn.recv_one().await?, m);
///     println!("echoed on connection {:x}, pick {:?}", conn.conn_id(), conn.info().client_pick);
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Error> {
/// let mut server = bind("127.0.0.1:0", select(Noop, Identity)).await?;
/// let addr = server.local_addr();
/// tokio::spawn(async move {
///     while let Ok(conn) = server.accept().await {
///         tokio::spawn(async move {
///             while let Ok(m) = conn.recv_one().await {
///                 let _ = conn.send_one(m).await;
///             }
///         });
///     }
/// });
/// // Two stacks, two connection types; one helper for both.
/// let plain = connect(addr, Identity).await?;
/// let either = connect(addr, select(Noop, Identity)).await?;
/// echo_once(&plain, "hi".into()).await?;
/// echo_once(&either, "hello".into()).await?;
/// # Ok(()) }
/// ```
pub trait NegotiatedConn: ChunnelConnection + 'static {
    /// What negotiation decided ([`Negotiated::info`]).
    fn info(&self) -> &Info;

    /// The connection's id ([`Negotiated::conn_id`]).
    fn conn_id(&self) -> u64;

    /// Ends the connection and tells the peer ([`Negotiated::close`]).
    fn close(&self) -> impl Future<Output = Result<(), Error>> + Send;
}

impl<C: ChunnelConnection + 'static> NegotiatedConn for Negotiated<C> {
    fn info(&self) -> &Info {
        Negotiated::info(self)
    }

    fn conn_id(&self) -> u64 {
        Negotiated::conn_id(self)
    }

    fn close(&self) -> impl Future<Output = Result<(), Error>> + Send {
        Negotiated::close(self)
    }
}

/// Resolves `addr` to its first socket address; a name that does not resolve, or a string
/// that is no address, is [`Error::Address`].
async fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr, Error> {
    tokio::net::lookup_host(addr)
        .await
        .map_err(Error::Address)?
        .next()
        .ok_or_else(|| {
            Error::Address(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the name resolved to no address",
            ))
        })
}

/// Connects to the negotiating server at `addr` over kernel UDP and negotiates `stack` with
/// it (1 RTT; [`Config::default`]). `addr` is a [`SocketAddr`], a `"host:port"` string or a
/// `(host, port)` pair; a name is resolved and its first address used.
///
/// Fails with [`Error::Address`] if `addr` does not resolve, [`Error::Incompatible`] if no
/// option of `stack` fits the server's, [`Error::Timeout`] if nothing answers the hellos
/// (about 13 s with the default [`Timing`](crate::proto::Timing); [`Connector::new`] takes
/// a shorter one), and `Error::Chunnel(ConnectionRefused)` if the host reports that nothing
/// listens there.
pub async fn connect<S>(addr: impl ToSocketAddrs, stack: S) -> Result<Conn<S>, Error>
where
    S: Chunnel<Tagged<udp::Connection>> + Offers + Send,
{
    Connector::default().connect(addr, stack).await
}

/// Connects with a [`Config`] of its own, and remembers each server's last pick so the next
/// connection to it can send data in its first flight ([`Connector::connect_0rtt`]). Keep
/// one for many connections.
#[derive(Debug, Default)]
pub struct Connector {
    client: Client,
}

impl Connector {
    /// A connector with `cfg`.
    pub fn new(cfg: Config) -> Self {
        Connector {
            client: Client::new(cfg),
        }
    }

    /// The [`Client`] underneath (for [`Client::remembered`], [`Client::forget_all`]); its
    /// picks are remembered under the server's resolved address, as `ip:port`.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// As [`connect`], with this connector's [`Config`]; the pick is remembered for 0-RTT.
    pub async fn connect<S>(&self, addr: impl ToSocketAddrs, stack: S) -> Result<Conn<S>, Error>
    where
        S: Chunnel<Tagged<udp::Connection>> + Offers + Send,
    {
        let addr = resolve(addr).await?;
        let base = udp::Connect::new(addr).connect_wrap(()).await?;
        let name = addr.to_string();
        self.client
            .connect(&name, stack, base)
            .await
            .map_err(|e| refused(e, addr))
    }

    /// 0-RTT ([`Client::connect_0rtt`]): if a pick for `addr` is remembered from an earlier
    /// connection of this connector, builds that stack at once and sends `early` inside the
    /// hello; otherwise connects in 1 RTT and then sends `early`.
    pub async fn connect_0rtt<S, I>(
        &self,
        addr: impl ToSocketAddrs,
        stack: S,
        early: I,
    ) -> Result<Conn<S>, Error>
    where
        S: Chunnel<Tagged<udp::Connection>> + Offers + Clone + Send,
        I: IntoIterator<Item = <S::Connection as ChunnelConnection>::Data>,
        <S::Connection as ChunnelConnection>::Data: Clone,
    {
        let addr = resolve(addr).await?;
        let base = udp::Connect::new(addr).connect_wrap(()).await?;
        let name = addr.to_string();
        self.client
            .connect_0rtt(&name, stack, base, early)
            .await
            .map_err(|e| refused(e, addr))
    }
}

/// During the handshake, a UDP socket's "peer closed" is the host's refusal (an ICMP port
/// unreachable: nothing listens at `addr`); it is reported as such.
fn refused(e: Error, addr: SocketAddr) -> Error {
    match e {
        Error::Chunnel(chunnel::Error::PeerClosed) => {
            Error::Chunnel(chunnel::Error::ConnectionRefused {
                addr: addr.to_string(),
            })
        }
        e => e,
    }
}

/// Binds `addr` over kernel UDP and serves `stack` there: every client negotiates its own
/// copy of it ([`listen`], [`Config::default`]). Port 0 binds a free port
/// ([`Server::local_addr`] tells which). Must be called within a tokio runtime.
///
/// Fails with [`Error::Address`] if `addr` does not resolve, and with
/// `Error::Chunnel(AddrInUse)` if another socket holds it.
pub async fn bind<S>(addr: impl ToSocketAddrs, stack: S) -> Result<Server<S>, Error>
where
    S: Chunnel<Tagged<udp::ServerConnection>> + Offers + Clone + Send + Sync + 'static,
    S::Connection: 'static,
{
    bind_with(addr, stack, Config::default()).await
}

/// As [`bind`], with `cfg`.
pub async fn bind_with<S>(
    addr: impl ToSocketAddrs,
    stack: S,
    cfg: Config,
) -> Result<Server<S>, Error>
where
    S: Chunnel<Tagged<udp::ServerConnection>> + Offers + Clone + Send + Sync + 'static,
    S::Connection: 'static,
{
    let addr = resolve(addr).await?;
    let listener = udp::Listener::bind(addr).await?;
    let local_addr = listener.local_addr()?;
    Ok(Server {
        listener: listen(stack, listener, cfg),
        local_addr,
    })
}

/// A UDP server whose connections are negotiated ([`bind`]); it serves until dropped.
pub struct Server<S>
where
    S: Chunnel<Tagged<udp::ServerConnection>>,
{
    listener: NegotiatedListener<S::Connection>,
    local_addr: SocketAddr,
}

impl<S> std::fmt::Debug for Server<S>
where
    S: Chunnel<Tagged<udp::ServerConnection>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl<S> Server<S>
where
    S: Chunnel<Tagged<udp::ServerConnection>>,
{
    /// The next negotiated connection, or one client's failure (incompatible offers, a
    /// malformed hello, no hello in time), after which the server keeps serving; see
    /// [`NegotiatedListener::accept`].
    pub async fn accept(&mut self) -> Result<ServerConn<S>, Error> {
        self.listener.accept().await
    }

    /// The address the server is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The negotiated listener underneath.
    pub fn listener(&mut self) -> &mut NegotiatedListener<S::Connection> {
        &mut self.listener
    }
}
