//! [`Connection`]: a negotiated connection over the datapath the server picked.

use bytes::Bytes;
use chunnel::ChunnelConnection;

use crate::{quic, tls};

use super::Transport;

/// A negotiated connection: the datapath the server picked.
#[derive(Debug)]
pub enum Connection {
    /// QUIC (stream mode).
    Quic(quic::Connection),
    /// TLS 1.3 over TCP.
    Tls(tls::Connection),
    /// Plaintext TCP.
    Plain(chunnel_net::tcp::Connection),
}

impl Connection {
    /// The transport this connection runs on.
    pub fn transport(&self) -> Transport {
        match self {
            Connection::Quic(_) => Transport::Quic,
            Connection::Tls(_) => Transport::Tls,
            Connection::Plain(_) => Transport::Plain,
        }
    }
}

impl ChunnelConnection for Connection {
    type Data = Bytes;

    #[allow(clippy::manual_async_fn)]
    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), chunnel::Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        async move {
            match self {
                Connection::Quic(c) => c.send(burst).await,
                Connection::Tls(c) => c.send(burst).await,
                Connection::Plain(c) => c.send(burst).await,
            }
        }
    }

    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, chunnel::Error>> + Send + 'a {
        async move {
            match self {
                Connection::Quic(c) => c.recv(slots).await,
                Connection::Tls(c) => c.recv(slots).await,
                Connection::Plain(c) => c.recv(slots).await,
            }
        }
    }
}
