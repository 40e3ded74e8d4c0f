//! [`ServerConnection`]: a listener's connection to one peer, receiving from its queue or
//! reading the socket for everyone.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use chunnel::{ChunnelConnection, Error, SendHeader};

use super::datapath::DatagramIo;
use super::demux::{Demux, Peer, PeerQueue};
use super::listener::Shared;
use super::reader::{CONN_READER, ReaderGuard};
use super::receive::Direct;
use super::{conn_err, lock};

/// A server-side connection to one peer of a [`Listener`](super::Listener).
#[derive(Debug)]
pub struct ServerConnection<S: DatagramIo> {
    pub(super) shared: Arc<Shared<S>>,
    /// The peer's state on the listener, its address included.
    pub(super) peer: Arc<Peer<S::Addr>>,
}

impl<S: DatagramIo> ServerConnection<S> {
    /// Closes the connection and frees its state on the listener; later calls fail with
    /// [`Error::Closed`]. A datagram the same peer sends afterwards starts a new connection.
    pub fn close(&self) {
        let mut d = lock(&self.shared.demux);
        self.leave(&mut d);
        drop(d);
        self.peer.notify.notify_waiters();
    }

    /// Removes this peer from the listener (demux lock held).
    fn leave(&self, d: &mut Demux<S::Addr>) {
        d.leave(&self.peer);
    }

    /// The error of a closed connection: [`Error::PeerClosed`] the first time after the
    /// idle sweep closed it, [`Error::Closed`] otherwise.
    fn closed_error(&self) -> Error {
        if self.peer.idled.swap(false, Ordering::AcqRel) {
            Error::PeerClosed
        } else {
            Error::Closed
        }
    }

    fn drain(&self, slots: &mut [Option<Bytes>]) -> usize {
        let mut q = lock(&self.peer.queue);
        let mut n = 0;
        for s in slots.iter_mut() {
            match q.pop_front() {
                Some(m) => *s = Some(m),
                None => break,
            }
            n += 1;
        }
        n
    }
}

impl<S: DatagramIo> Drop for ServerConnection<S> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<S: DatagramIo> chunnel::PeerHandoff for ServerConnection<S> {
    fn hand_off(&self, first: Bytes) -> bool {
        let sh = &self.shared;
        let mut d = lock(&sh.demux);
        self.leave(&mut d);
        let admitted = sh.listener_open.load(Ordering::Acquire)
            && d.backlog.len() < sh.cfg.backlog
            && !d.peers.contains(&self.peer.addr);
        if admitted {
            let p = sh.new_peer(
                self.peer.addr.clone(),
                PeerQueue::one(first, &sh.queued_bytes),
            );
            d.peers.insert(p.clone());
            d.backlog.push_back(p);
            sh.accept_notify.notify_one();
        }
        drop(d);
        self.peer.notify.notify_waiters();
        admitted
    }

    /// As [`ServerConnection::close`]: the peer leaves the listener's table now.
    fn release(&self) {
        self.close();
    }

    fn take_oversized(&self) -> Option<chunnel::Oversized> {
        lock(&self.peer.queue).oversized.take().map(|b| *b)
    }

    /// A silent connection is listed; at [`Config::max_peers`](super::Config::max_peers), with no
    /// new peer waiting for `accept`, a new peer evicts the one marked longest ago.
    fn mark_silent(&self, silent: bool) {
        self.peer.silent.store(silent, Ordering::Release);
        if !silent {
            return; // its entry, if any, is skipped or pruned when met
        }
        let cap = self.shared.cfg.max_peers;
        let mut d = lock(&self.shared.demux);
        if self.peer.silent_listed.swap(true, Ordering::Relaxed) {
            return;
        }
        // Entries of connections gone, closed or no longer silent are dropped at twice the
        // cap (each live connection is listed at most once, so the list stays under it).
        if d.silent.len() >= cap.saturating_mul(2) {
            d.silent.retain(|w| {
                w.upgrade().is_some_and(|p| {
                    let keep =
                        p.silent.load(Ordering::Acquire) && !p.closed.load(Ordering::Acquire);
                    if !keep {
                        p.silent_listed.store(false, Ordering::Relaxed);
                    }
                    keep
                })
            });
        }
        d.silent.push_back(Arc::downgrade(&self.peer));
    }

    /// More than half of [`Config::max_peers`](super::Config::max_peers) in use.
    fn crowded(&self) -> bool {
        lock(&self.shared.demux).peers.len() > self.shared.cfg.max_peers / 2
    }

    fn take_queued(&self) -> Option<Bytes> {
        let m = lock(&self.peer.queue).pop_front()?;
        self.peer
            .last_rx
            .store(self.shared.nanos_now(), Ordering::Relaxed);
        Some(m)
    }
}

impl<S: DatagramIo> SendHeader for ServerConnection<S> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let sh = &self.shared;
        sh.sock.send_burst(
            &sh.tx,
            &sh.cfg,
            &self.peer.addr,
            header,
            burst,
            &self.peer.closed,
        )
    }

    fn try_send_with_header(&self, header: &[u8], msg: &Bytes) -> Option<Result<(), Error>> {
        if self.peer.closed.load(Ordering::Acquire) {
            return Some(Err(Error::Closed));
        }
        let sh = &self.shared;
        sh.sock.try_send_one(&sh.cfg, &self.peer.addr, header, msg)
    }
}

impl<S: DatagramIo> ChunnelConnection for ServerConnection<S> {
    type Data = Bytes;

    fn send<B>(&self, burst: B) -> impl Future<Output = Result<(), Error>> + Send
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let sh = &self.shared;
        sh.sock.send_burst(
            &sh.tx,
            &sh.cfg,
            &self.peer.addr,
            &[],
            burst,
            &self.peer.closed,
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
            // The reader role, once taken, is kept until this call returns (or handed to a
            // looping `accept` while new peers come in): woken for other connections' datagrams,
            // this one sorts them out and waits again, without handing the reader role to another
            // waiting connection (a wake-up of that one's task) and taking it back.
            let mut held = ReaderGuard::new(&self.shared);
            loop {
                let n = self.drain(slots);
                if n > 0 {
                    self.peer
                        .last_rx
                        .store(self.shared.nanos_now(), Ordering::Relaxed);
                    return Ok(n);
                }
                if self.peer.closed.load(Ordering::Acquire) {
                    return Err(self.closed_error());
                }
                // As in `accept`: another connection waiting on the socket reads for this one too.
                // One that finds `accept` there reads for itself (and then takes the reader role),
                // unless new peers are what comes in: then `accept` keeps reading for everyone.
                if held.holds() || self.shared.reader_role_open_to_conn() {
                    let me = Direct {
                        peer: &self.peer,
                        slots: &mut *slots,
                    };
                    match self.shared.pump_for(Some(me)) {
                        Ok((_, 0)) => {
                            // New peers coming in, for an `accept` that loops: the reader role goes
                            // to it, so their next datagrams wake it directly, not this task first.
                            if held.holds()
                                && !self.shared.conn_may_take_from_accept()
                                && self.shared.looping()
                            {
                                held.hand_to_accept();
                            }
                            continue;
                        }
                        Ok((_, direct)) => {
                            self.peer
                                .last_rx
                                .store(self.shared.nanos_now(), Ordering::Relaxed);
                            return Ok(direct);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                        Err(e) => return Err(conn_err("recv", &self.peer.addr, e)),
                    }
                }
                // About to wait: register for this connection's wake-ups first, then look once
                // more (a message queued, or a close, between the look above and now is seen
                // here; one after it wakes the registration). The idle sweep closes the
                // connection and wakes it the same way.
                let notified = self.peer.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if !lock(&self.peer.queue).is_empty() || self.peer.closed.load(Ordering::Acquire) {
                    continue;
                }
                self.shared
                    .wait_readable(CONN_READER, &mut held, Some(&self.peer), notified)
                    .await
                    .map_err(|e| conn_err("recv", &self.peer.addr, e))?;
                // Back without the reader role: this call may have taken the wake-up that a
                // vacant reader role sends one waiting connection.
                held.armed = !held.holds();
            }
        }
    }
}

/// No state to hand over. Received datagrams do wait in this connection's per-peer queue on
/// the listener, but a server connection is never itself a select branch (it comes from
/// `accept`, not from a Chunnel); under a reconfigurable select it sits below
/// [`chunnel::Shared`], so the queue outlives the switch and the new branch reads it. Exporting
/// the queue would only move it, needlessly, into the switch's carry-over queue.
impl<S: DatagramIo> chunnel::Handover for ServerConnection<S> {
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}
