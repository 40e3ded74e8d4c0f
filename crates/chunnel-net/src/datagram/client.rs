//! The client side: [`Connection`], a socket connected to one peer, which receives with
//! `recvmmsg` straight into its own scratch buffer.

use std::future::Future;
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use chunnel::{ChunnelConnection, Error, SendHeader};
use tokio::io::Interest;

use super::config::Config;
use super::receive::RxScratch;
use super::send::{SpillPool, send_burst, try_send_now};
use super::socket::DgramSocket;
use super::stats::Stats;
use super::{conn_err, lock};

/// The client side: a socket connected to one peer.
#[derive(Debug)]
pub struct Connection<S: DgramSocket> {
    sock: S,
    pub(super) peer: S::Addr,
    cfg: Config,
    rx: Mutex<RxScratch>,
    stats: Stats,
    closed: AtomicBool,
    spill: SpillPool,
}

impl<S: DgramSocket> Connection<S> {
    pub(crate) fn new(sock: S, peer: S::Addr, cfg: Config) -> Self {
        Connection {
            sock,
            peer,
            cfg,
            rx: Mutex::new(RxScratch::new(1)),
            stats: Stats::default(),
            closed: AtomicBool::new(false),
            spill: SpillPool::default(),
        }
    }

    /// The socket underneath.
    pub fn get_ref(&self) -> &S {
        &self.sock
    }

    /// Incoming datagrams dropped because they exceeded `max_payload`.
    pub fn dropped_oversize(&self) -> u64 {
        self.stats.dropped_oversize.load(Ordering::Relaxed)
    }

    /// Closes the connection: later calls fail with [`Error::Closed`]. The socket itself is
    /// released when the connection is dropped.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }
}

impl<S: DgramSocket> chunnel::PeerHandoff for Connection<S> {
    /// A client socket is connected to one peer: there is nothing to hand off to.
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }

    /// As [`Connection::close`].
    fn release(&self) {
        self.close();
    }
}

impl<S: DgramSocket> SendHeader for Connection<S> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        send_burst(
            &self.sock,
            &self.cfg,
            None,
            &self.peer,
            header,
            burst,
            &self.spill,
            Some(&self.closed),
        )
    }

    fn try_send_with_header(&self, header: &[u8], msg: &Bytes) -> Option<Result<(), Error>> {
        if let Err(e) = self.check_open() {
            return Some(Err(e));
        }
        try_send_now(&self.sock, &self.cfg, None, &self.peer, header, msg)
    }
}

impl<S: DgramSocket> ChunnelConnection for Connection<S> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        send_burst(
            &self.sock,
            &self.cfg,
            None,
            &self.peer,
            &[],
            burst,
            &self.spill,
            Some(&self.closed),
        )
    }

    // Not an `async fn`: it would keep its arguments twice in the future.
    #[allow(clippy::manual_async_fn)]
    fn recv<'a>(
        &'a self,
        slots: &'a mut [Option<Bytes>],
    ) -> impl Future<Output = Result<usize, Error>> + Send + 'a {
        async move {
            if slots.is_empty() {
                return Ok(0);
            }
            loop {
                self.check_open()?;
                let res = {
                    let mut rx = lock(&self.rx);
                    let fd = self.sock.as_raw_fd();
                    let mut filled = 0;
                    self.sock
                        .try_io_with(Interest::READABLE, || {
                            rx.read::<S::Addr>(
                                fd,
                                &self.cfg,
                                slots.len(),
                                false,
                                |_, m| {
                                    slots[filled] = Some(m);
                                    filled += 1;
                                },
                                // Dropped and counted.
                                |_, _, _| {
                                    self.stats.drop_oversize();
                                },
                            )
                        })
                        .map(|_| filled)
                };
                match res {
                    Ok(0) => continue, // only oversize datagrams: read again
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // A connected socket learns that its peer is gone from an ICMP error,
                        // which shows up as `EPOLLERR`, not as readability. One wait for both
                        // (one waiter registered with the reactor, not two).
                        let ready = self
                            .sock
                            .ready(Interest::READABLE | Interest::ERROR)
                            .await
                            .map_err(|e| conn_err("recv", &self.peer, e))?;
                        if ready.is_error() {
                            let pending = self.sock.try_io_with(Interest::ERROR, || {
                                match self.sock.take_error() {
                                    Ok(Some(e)) => Ok(e),
                                    Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
                                    Err(e) => Ok(e),
                                }
                            });
                            if let Ok(e) = pending {
                                return Err(conn_err("recv", &self.peer, e));
                            }
                        }
                    }
                    Err(e) => return Err(conn_err("recv", &self.peer, e)),
                }
            }
        }
    }
}

/// No state to hand over: a client connection delivers every datagram it reads in the same
/// `recv` call (its scratch area is sized to the caller's slots), so nothing received waits in
/// it between calls. Below [`chunnel::Shared`] it outlives a switch anyway; as a branch of a
/// reconfigurable select, datagrams still in the old socket's kernel queue go with that socket.
impl<S: DgramSocket> chunnel::Handover for Connection<S> {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}
