//! Datagram sockets as Chunnel connections: the client connection of kernel UDP and Unix
//! datagram sockets ([`crate::udp`], [`crate::uds`]), and the one datagram listener of every
//! datapath — kernel sockets, and any other that implements [`DatagramIo`] (io_uring in
//! `chunnel-uring`, AF_XDP in `chunnel-xdp`).
//!
//! * A **client** connection owns a connected socket and receives with `recvmmsg` straight
//!   into its own scratch buffer.
//! * A **listener** owns one bound socket shared by every server-side connection. Whichever
//!   task needs data (a connection's `recv` or the listener's `accept`) reads a batch and
//!   demultiplexes it by source address into bounded per-peer queues, waking their owners;
//!   there is no extra task or channel hop. A datagram from an unknown peer starts a new
//!   connection that `accept` hands out. Queues are bounded; a full queue drops datagrams
//!   (this is a best-effort datapath) and counts them.
//! * Dropping or closing a server-side connection removes its peer state; an idle timeout
//!   (default 60 s) ends connections whose peer went away without a word, since datagram
//!   sockets carry no close signal.
//! * The peers a listener keeps are capped ([`Config::max_peers`]): at the cap a new source
//!   evicts a peer nobody accepted yet or an accepted one marked silent, or is dropped and
//!   counted ([`Listener::peer_cap_stats`]).
//!
//! Files: `config` (settings), `datapath` ([`DatagramIo`], what a datapath supplies to a
//! listener: receive a batch, send a burst; its kernel implementation), `socket` (the kernel
//! socket trait), `client` (the client connection),
//! `listener` (the listener, its shared state, `accept`), `server` (a listener's connection),
//! `demux` (peer table, queues, backlog, admission and eviction), `reader` (which task reads
//! the socket), `receive` (scratch buffers and the pump), `send`, `idle` (the idle sweep) and
//! `stats`.

// `DgramSocket` is deliberately crate-private (a sealed trait): users name the concrete types
// (`udp::Connection`, `uds::DatagramListener`...), never the trait. The kernel receive and send
// state types are public only as `DatagramIo` associated types.
#![allow(private_bounds, private_interfaces)]

mod client;
mod config;
mod datapath;
mod demux;
mod idle;
mod listener;
mod reader;
mod receive;
mod send;
mod server;
mod socket;
mod stats;
#[cfg(test)]
mod tests;

use std::io;

use chunnel::Error;

use crate::sys;

pub use client::Connection;
pub use config::{Config, SILENT_GRACE};
pub use datapath::{DatagramIo, RxBatch};
pub use listener::{Listener, PeerCounter};
pub use receive::RxScratch;
pub use send::SpillPool;
pub use server::ServerConnection;

use chunnel::util::lock;

/// Maps an I/O error on an established connection.
fn conn_err(op: &'static str, peer: &(dyn std::fmt::Debug + Sync), e: io::Error) -> Error {
    match Error::from_io(op, format!("{peer:?}"), e) {
        // Mid-connection, "refused" means the peer's socket is gone.
        Error::ConnectionRefused { .. } => Error::PeerClosed,
        other => other,
    }
}

macro_rules! peer_addr {
    ($sock:ty, $addr:ty, $($conn:ident . $($field:ident).+),+) => {$(
        impl $conn<$sock> {
            /// The peer this connection talks to.
            pub fn peer_addr(&self) -> &$addr {
                &self.$($field).+
            }
        }
    )+};
}

peer_addr!(tokio::net::UdpSocket, std::net::SocketAddr, Connection.peer);
peer_addr!(tokio::net::UnixDatagram, sys::UnixAddr, Connection.peer);

impl<S: DatagramIo> ServerConnection<S> {
    /// The peer this connection talks to.
    pub fn peer_addr(&self) -> &S::Addr {
        &self.peer.addr
    }
}
