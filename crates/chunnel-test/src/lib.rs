//! # chunnel-test: the conformance suite
//!
//! Every datapath and every Chunnel that carries bytes runs [`run_all`] (or the single checks)
//! through a [`Datapath`] harness: a way to bind a fresh server and build clients for it.
//! [`Layered`] puts any byte-to-byte Chunnel on both ends of a datapath, so a new layer runs
//! the same suite over a real socket.
//!
//! The checks panic with a message naming the datapath and what went wrong, as test code
//! does. Every wait is bounded ([`WAIT`]), so a broken datapath fails instead of hanging.
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]

use std::future::Future;
use std::time::Duration;

pub mod alloc;
pub mod brokers;
pub mod fault;
pub mod flood;
pub mod kind;
pub mod netns;
pub mod services;
pub mod sim;
pub mod xor;
pub use fault::{FaultInjector, FaultStats, Faulty};
pub use xor::{Xor, XorConn, xor};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, ChunnelExt, Error, Listener};

/// The longest any single step of a check may take before it counts as a hang.
pub const WAIT: Duration = Duration::from_secs(10);

/// How to set up one datapath (or a stack over one) for the conformance checks.
pub trait Datapath: Send + Sync + 'static {
    /// The server side.
    type Listener: Listener<Connection = Self::Server> + Send + 'static;
    /// A server-side connection.
    type Server: ChunnelConnection<Data = Bytes> + 'static;
    /// The client side: a base Chunnel (or a stack over one).
    type Connect: Chunnel<(), Connection = Self::Client> + Clone + Send + Sync + 'static;
    /// A client-side connection.
    type Client: ChunnelConnection<Data = Bytes> + 'static;

    /// A name for messages.
    fn name(&self) -> String;

    /// The largest message the datapath carries.
    fn max_payload(&self) -> usize;

    /// Binds a fresh server, returning it and a Chunnel that connects clients to it.
    /// Server-side connections must end with an error within [`WAIT`] once their peer is gone
    /// (datagram datapaths: set a short idle timeout).
    fn bind(&self) -> impl Future<Output = Result<(Self::Listener, Self::Connect), Error>> + Send;
}

/// A datapath with the byte Chunnel `L` applied on both ends.
#[derive(Clone, Debug)]
pub struct Layered<D, L> {
    /// The datapath below.
    pub datapath: D,
    /// The layer applied on both ends.
    pub layer: L,
}

impl<D, L> Datapath for Layered<D, L>
where
    D: Datapath,
    L: Chunnel<D::Server> + Chunnel<D::Client> + chunnel::Offers + Clone + Send + Sync + 'static,
    <L as Chunnel<D::Server>>::Connection: ChunnelConnection<Data = Bytes> + 'static,
    <L as Chunnel<D::Client>>::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    type Listener = chunnel::Serve<D::Listener, L>;
    type Server = <L as Chunnel<D::Server>>::Connection;
    type Connect = chunnel::Stack<L, D::Connect>;
    type Client = <L as Chunnel<D::Client>>::Connection;

    fn name(&self) -> String {
        let ids: Vec<_> = self
            .layer
            .offers()
            .into_iter()
            .flat_map(|o| o.chunnels.into_iter().map(|c| c.id.into_owned()))
            .collect();
        format!("[{}] over {}", ids.join(", "), self.datapath.name())
    }

    fn max_payload(&self) -> usize {
        self.datapath.max_payload()
    }

    async fn bind(&self) -> Result<(Self::Listener, Self::Connect), Error> {
        let (l, c) = self.datapath.bind().await?;
        Ok((
            ChunnelExt::<D::Server>::serve(self.layer.clone(), l),
            chunnel::Stack::new(self.layer.clone(), c),
        ))
    }
}

async fn within<T>(what: &str, name: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, f).await {
        Ok(t) => t,
        Err(_) => panic!("{name}: {what} did not finish within {WAIT:?}"),
    }
}

/// Receives exactly `n` messages (possibly over several `recv` calls).
pub async fn recv_n<C: ChunnelConnection<Data = Bytes>>(
    conn: &C,
    n: usize,
) -> Result<Vec<Bytes>, Error> {
    let mut out = Vec::with_capacity(n);
    let mut slots = vec![None; 64];
    while out.len() < n {
        let want = (n - out.len()).min(slots.len());
        let k = conn.recv(&mut slots[..want]).await?;
        assert!(k >= 1 && k <= want, "recv returned {k} for {want} slots");
        for s in &mut slots[..k] {
            out.push(s.take().expect("recv reported a slot it did not fill"));
        }
    }
    Ok(out)
}

/// Spawns an echo server: every accepted connection gets a task that sends back what it
/// receives, until the connection fails. Returns the handle of the accept loop.
pub fn spawn_echo<L>(mut listener: L) -> tokio::task::JoinHandle<()>
where
    L: Listener + 'static,
    L::Connection: ChunnelConnection<Data = Bytes> + 'static,
{
    tokio::spawn(async move {
        while let Ok(conn) = listener.accept().await {
            tokio::spawn(async move {
                let mut slots = vec![None; 64];
                loop {
                    let Ok(n) = conn.recv(&mut slots).await else {
                        return;
                    };
                    let burst: Vec<Bytes> =
                        slots[..n].iter_mut().filter_map(Option::take).collect();
                    if conn.send(burst).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

fn numbered(i: usize, len: usize) -> Bytes {
    let mut v = vec![(i % 251) as u8; len];
    let tag = (i as u32).to_be_bytes();
    let k = tag.len().min(len);
    v[..k].copy_from_slice(&tag[..k]);
    Bytes::from(v)
}

/// A burst of 32 distinct messages is echoed back whole and in order.
pub async fn batch_echo<D: Datapath>(d: &D) {
    let name = d.name();
    let (l, mut c) = d.bind().await.expect("bind");
    let echo = spawn_echo(l);
    let conn = within("connect", &name, c.connect_wrap(()))
        .await
        .expect("connect");
    let burst: Vec<Bytes> = (0..32).map(|i| numbered(i, 100 + i)).collect();
    within("send", &name, conn.send(burst.clone()))
        .await
        .expect("send");
    let got = within("recv", &name, recv_n(&conn, burst.len()))
        .await
        .expect("recv");
    assert_eq!(got, burst, "{name}: echoed burst differs");
    echo.abort();
}

/// An empty message and a message of exactly `max_payload` bytes both arrive intact.
pub async fn empty_and_max<D: Datapath>(d: &D) {
    let name = d.name();
    let (l, mut c) = d.bind().await.expect("bind");
    let echo = spawn_echo(l);
    let conn = within("connect", &name, c.connect_wrap(()))
        .await
        .expect("connect");
    for msg in [Bytes::new(), numbered(7, d.max_payload()), Bytes::new()] {
        within("send", &name, conn.send([msg.clone()]))
            .await
            .expect("send");
        let got = within("recv", &name, recv_n(&conn, 1)).await.expect("recv");
        assert_eq!(got[0].len(), msg.len(), "{name}: length changed");
        assert!(
            got[0] == msg,
            "{name}: content of a {}-byte message changed",
            msg.len()
        );
    }
    echo.abort();
}

/// A message one byte over the maximum fails with `MessageTooLarge`, and the connection
/// keeps working afterwards.
pub async fn oversize_rejected<D: Datapath>(d: &D) {
    let name = d.name();
    let max = d.max_payload();
    let (l, mut c) = d.bind().await.expect("bind");
    let echo = spawn_echo(l);
    let conn = within("connect", &name, c.connect_wrap(()))
        .await
        .expect("connect");
    match within("send", &name, conn.send([Bytes::from(vec![1u8; max + 1])])).await {
        Err(Error::MessageTooLarge { len, max: m }) => {
            assert_eq!((len, m), (max + 1, max), "{name}: wrong sizes in the error")
        }
        other => panic!("{name}: oversize send gave {other:?}, not MessageTooLarge"),
    }
    let ok = numbered(1, 10);
    within("send", &name, conn.send([ok.clone()]))
        .await
        .expect("send after oversize");
    let got = within("recv", &name, recv_n(&conn, 1))
        .await
        .expect("recv after oversize");
    assert_eq!(
        got,
        vec![ok],
        "{name}: connection broken after an oversize send"
    );
    echo.abort();
}

/// `clients` connections at once, each exchanging `msgs` messages, each getting only its own.
pub async fn many_concurrent<D: Datapath>(d: &D, clients: usize, msgs: usize) {
    let name = d.name();
    let (l, c) = d.bind().await.expect("bind");
    let echo = spawn_echo(l);
    let mut tasks = Vec::new();
    for k in 0..clients {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let conn = c.connect_wrap(()).await?;
            for i in 0..msgs {
                let m = numbered(k * 1_000_000 + i, 64);
                conn.send([m.clone()]).await?;
                let got = recv_n(&conn, 1).await?;
                assert_eq!(got[0], m, "client {k} got another client's message");
            }
            Ok::<_, Error>(())
        }));
    }
    for (k, t) in tasks.into_iter().enumerate() {
        within("client", &name, t)
            .await
            .expect("client task panicked")
            .unwrap_or_else(|e| panic!("{name}: client {k} failed: {e}"));
    }
    echo.abort();
}

/// The server goes away mid-stream: the client's next exchange fails with an error (not a
/// hang, not a panic), and it is a "peer gone" kind of error.
pub async fn server_disappears<D: Datapath>(d: &D) {
    let name = d.name();
    let (mut l, mut c) = d.bind().await.expect("bind");
    let conn = within("connect", &name, c.connect_wrap(()))
        .await
        .expect("connect");
    conn.send([numbered(1, 8)]).await.expect("first send");
    let server = within("accept", &name, l.accept()).await.expect("accept");
    let got = within("server recv", &name, recv_n(&server, 1))
        .await
        .expect("server recv");
    assert_eq!(got.len(), 1);
    drop(server);
    drop(l);
    // Give the kernel a moment to tear the socket down, then try to talk.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let res = within("exchange with a dead server", &name, async {
        conn.send([numbered(2, 8)]).await?;
        recv_n(&conn, 1).await
    })
    .await;
    match res {
        Err(e) if e.is_closed() || matches!(e, Error::ConnectionRefused { .. }) => {}
        other => panic!("{name}: talking to a dead server gave {other:?}"),
    }
}

/// The client goes away mid-stream: the server-side connection ends with an error within
/// [`WAIT`] (streams see EOF; datagram servers time the peer out).
pub async fn client_disappears<D: Datapath>(d: &D) {
    let name = d.name();
    let (mut l, mut c) = d.bind().await.expect("bind");
    let conn = within("connect", &name, c.connect_wrap(()))
        .await
        .expect("connect");
    conn.send([numbered(1, 8)]).await.expect("send");
    let server = within("accept", &name, l.accept()).await.expect("accept");
    recv_n(&server, 1).await.expect("server recv");
    drop(conn);
    match within("server recv after client left", &name, recv_n(&server, 1)).await {
        Err(e) if e.is_closed() => {}
        other => panic!("{name}: server recv after the client left gave {other:?}"),
    }
}

/// Compile-time check that the datapath's connections and their futures can cross threads.
pub fn send_sync<D: Datapath>() {
    fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<D::Client>();
    is_send_sync::<D::Server>();
    is_send_sync::<D::Connect>();
}

/// Runs every check in turn.
pub async fn run_all<D: Datapath>(d: &D) {
    send_sync::<D>();
    batch_echo(d).await;
    empty_and_max(d).await;
    oversize_rejected(d).await;
    many_concurrent(d, 50, 20).await;
    server_disappears(d).await;
    client_disappears(d).await;
}
