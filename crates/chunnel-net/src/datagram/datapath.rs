//! [`DatagramIo`]: what a datapath supplies to a datagram [`Listener`](super::Listener) —
//! receive a batch, send a burst — and its kernel implementation for tokio's UDP and Unix
//! datagram sockets.
//!
//! Everything else a listener does (the peer table, bounded per-peer queues, the accept
//! backlog, admission and eviction at the peer cap, the idle sweep, session recognition,
//! [`chunnel::PeerHandoff`], counters, which task reads) is the datapath-independent part in
//! this module's other files.

use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;
use std::io;
use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll};

use bytes::Bytes;
use chunnel::Error;
use tokio::io::Interest;

use super::config::Config;
use super::receive::RxScratch;
use super::send::{SpillPool, send_burst, try_send_now};
use super::socket::DgramSocket;
use crate::sys::MAX_BATCH;

/// The datapath under a datagram [`Listener`](super::Listener): one endpoint shared by every
/// server-side connection, which receives datagrams in batches (each with its sender's address)
/// and sends bursts to an address.
///
/// The listener reads **pull** style: whichever task needs data (a connection's `recv` or
/// `accept`) calls [`DatagramIo::recv_batch`] and sorts what it gets; at most one task at a
/// time waits in [`DatagramIo::poll_recv_ready`]. So a datapath brings no task of its own, and a
/// connection that reads its own datagrams gets them without a queue or a wake-up.
pub trait DatagramIo: Debug + Send + Sync + 'static {
    /// A peer's address: the key datagrams are demultiplexed by.
    type Addr: Clone + Eq + Hash + Debug + Send + Sync + 'static;
    /// Receive state (scratch buffers), used under the listener's receive lock only.
    type RxState: Debug + Send + 'static;
    /// Send state shared by the listener's connections.
    type TxState: Default + Debug + Send + Sync + 'static;

    /// The receive state a new listener starts with.
    fn rx_state(&self, cfg: &Config) -> Self::RxState;

    /// Polls for datagrams to receive, registering `cx` in the endpoint's one receive-waker
    /// slot (the task of the latest call is the one woken). `Ready` may be spurious: the
    /// caller then finds [`DatagramIo::recv_batch`] reporting `WouldBlock` and polls again.
    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;

    /// Receives one batch without waiting: calls `deliver(from, payload)` for each datagram of
    /// at most `cfg.max_payload` bytes and `oversize(from, prefix, len)` for each larger one
    /// (`prefix`: its first bytes, at most [`chunnel::Oversized::PREFIX`]). Returns how many
    /// datagrams it took from the endpoint; `WouldBlock` when there were none (which also
    /// clears the readiness [`DatagramIo::poll_recv_ready`] reported).
    fn recv_batch(
        &self,
        st: &mut Self::RxState,
        cfg: &Config,
        deliver: impl FnMut(Option<Self::Addr>, Bytes),
        oversize: impl FnMut(Option<Self::Addr>, &[u8], usize),
    ) -> io::Result<usize>;

    /// Sends `burst` to `dest`, each message after `header`, waiting for room as needed; fails
    /// with [`Error::Closed`] without sending if `closed` is set, and with
    /// [`Error::MessageTooLarge`] at the first message over `cfg.max_payload` (with the header).
    #[allow(clippy::too_many_arguments)]
    fn send_burst<'a, B>(
        &'a self,
        tx: &'a Self::TxState,
        cfg: &'a Config,
        dest: &'a Self::Addr,
        header: &'a [u8],
        burst: B,
        closed: &'a AtomicBool,
    ) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send;

    /// Sends one datagram (`header` then `msg`) to `dest` if that needs no wait; `None` if it
    /// would (the caller then uses [`DatagramIo::send_burst`]). By default always `None`.
    fn try_send_one(
        &self,
        cfg: &Config,
        dest: &Self::Addr,
        header: &[u8],
        msg: &Bytes,
    ) -> Option<Result<(), Error>> {
        let _ = (cfg, dest, header, msg);
        None
    }
}

/// Datagrams a datapath took from its endpoint and keeps until the listener sorts them: a
/// ready-made [`DatagramIo::RxState`] part for datapaths that fill a batch under their own lock
/// and hand it out after releasing it ([`RxBatch::hand_out`]). Its vectors keep their capacity.
#[derive(Debug)]
pub struct RxBatch<A> {
    got: Vec<(Option<A>, Bytes)>,
    /// Datagrams over `max_payload`: sender, first bytes, length.
    oversized: Vec<(Option<A>, Bytes, usize)>,
}

impl<A> Default for RxBatch<A> {
    fn default() -> Self {
        RxBatch {
            got: Vec::new(),
            oversized: Vec::new(),
        }
    }
}

impl<A> RxBatch<A> {
    /// Adds a datagram from `from`.
    pub fn push(&mut self, from: Option<A>, payload: Bytes) {
        self.got.push((from, payload));
    }

    /// Adds a datagram over `max_payload` from `from`: its first bytes (at most
    /// [`chunnel::Oversized::PREFIX`] are kept) and its length.
    pub fn push_oversized(&mut self, from: Option<A>, prefix: &[u8], len: usize) {
        let prefix = &prefix[..prefix.len().min(chunnel::Oversized::PREFIX)];
        self.oversized
            .push((from, Bytes::copy_from_slice(prefix), len));
    }

    /// Whether no datagram is kept.
    pub fn is_empty(&self) -> bool {
        self.got.is_empty() && self.oversized.is_empty()
    }

    /// Exchanges the contents with `other` (an empty batch, to fill the other outside a lock).
    pub fn swap(&mut self, other: &mut Self) {
        std::mem::swap(self, other);
    }

    /// Hands every datagram kept to the listener's `recv_batch` callbacks, oversized ones first;
    /// returns how many there were.
    pub fn hand_out(
        &mut self,
        mut deliver: impl FnMut(Option<A>, Bytes),
        mut oversize: impl FnMut(Option<A>, &[u8], usize),
    ) -> usize {
        let n = self.got.len() + self.oversized.len();
        for (from, prefix, len) in self.oversized.drain(..) {
            oversize(from, &prefix, len);
        }
        for (from, m) in self.got.drain(..) {
            deliver(from, m);
        }
        n
    }
}

/// Declares a datapath's listener type: a newtype around
/// [`datagram::Listener<$io>`](crate::datagram::Listener) that derefs to it (its peer count and
/// counters) and is a [`chunnel::Listener`] handing out
/// [`datagram::ServerConnection<$io>`](crate::datagram::ServerConnection), so the datapath's
/// crate can give it constructors and methods of its own. Written
/// `chunnel_net::datagram_listener! { /// docs  pub struct Listener(RingIo); }`, and built with
/// `Listener(chunnel_net::datagram::Listener::new(io, cfg))` in the declaring module.
#[macro_export]
macro_rules! datagram_listener {
    ($(#[$meta:meta])* $vis:vis struct $name:ident($io:ty);) => {
        $(#[$meta])*
        #[derive(Debug)]
        $vis struct $name($crate::datagram::Listener<$io>);

        impl ::std::ops::Deref for $name {
            type Target = $crate::datagram::Listener<$io>;
            fn deref(&self) -> &Self::Target {
                &self.0
            }
        }

        impl ::chunnel::Listener for $name {
            type Connection = $crate::datagram::ServerConnection<$io>;

            fn accept(
                &mut self,
            ) -> impl ::std::future::Future<
                Output = ::std::result::Result<Self::Connection, ::chunnel::Error>,
            > + Send {
                ::chunnel::Listener::accept(&mut self.0)
            }

            fn accepting_in_loop(&mut self) {
                ::chunnel::Listener::accepting_in_loop(&mut self.0);
            }

            fn recognise_sessions(&mut self, session_of: fn(&[u8]) -> Option<u64>) {
                ::chunnel::Listener::recognise_sessions(&mut self.0, session_of);
            }
        }
    };
}

/// Kernel sockets: `recvmmsg` into the listener's scratch, `sendmmsg` from the caller's
/// `Bytes`.
macro_rules! kernel_io {
    ($($sock:ty => $addr:ty),+) => {$(
        impl DatagramIo for $sock {
            type Addr = $addr;
            type RxState = RxScratch;
            type TxState = SpillPool;

            fn rx_state(&self, _: &Config) -> RxScratch {
                // A whole batch first: clients may have queued up before the first `accept`.
                RxScratch::new(MAX_BATCH)
            }

            fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                DgramSocket::poll_read_ready(self, cx)
            }

            fn recv_batch(
                &self,
                st: &mut RxScratch,
                cfg: &Config,
                deliver: impl FnMut(Option<Self::Addr>, Bytes),
                oversize: impl FnMut(Option<Self::Addr>, &[u8], usize),
            ) -> io::Result<usize> {
                let fd = std::os::fd::AsRawFd::as_raw_fd(self);
                self.try_io_with(Interest::READABLE, || {
                    st.read(fd, cfg, cfg.batch, true, deliver, oversize)
                })
            }

            fn send_burst<'a, B>(
                &'a self,
                tx: &'a SpillPool,
                cfg: &'a Config,
                dest: &'a Self::Addr,
                header: &'a [u8],
                burst: B,
                closed: &'a AtomicBool,
            ) -> impl Future<Output = Result<(), Error>> + Send
            where
                B: IntoIterator<Item = Bytes> + Send,
                B::IntoIter: Send,
            {
                send_burst(self, cfg, Some(dest), dest, header, burst, tx, Some(closed))
            }

            fn try_send_one(
                &self,
                cfg: &Config,
                dest: &Self::Addr,
                header: &[u8],
                msg: &Bytes,
            ) -> Option<Result<(), Error>> {
                try_send_now(self, cfg, Some(dest), dest, header, msg)
            }
        }
    )+};
}

kernel_io!(
    tokio::net::UdpSocket => std::net::SocketAddr,
    tokio::net::UnixDatagram => crate::sys::UnixAddr
);
