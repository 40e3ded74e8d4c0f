//! The server side: [`Listener`], one bound socket shared by a connection per peer, the
//! state it shares with those connections, and `accept`.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;

use chunnel::Error;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::config::Config;
use super::datapath::DatagramIo;
use super::demux::{Demux, Peer, PeerMap, SessionOf};
use super::idle::IdleSweep;
use super::lock;
use super::reader::{ACCEPT_READER, CONN_READER, NO_READER, ReaderGuard};
use super::server::ServerConnection;
use super::stats::Stats;

/// State shared by a listener and its connections.
#[derive(Debug)]
pub(crate) struct Shared<S: DatagramIo> {
    pub(super) sock: S,
    pub(super) cfg: Config,
    pub(super) demux: Mutex<Demux<S::Addr>>,
    pub(super) rx: Mutex<S::RxState>,
    pub(super) accept_notify: Notify,
    pub(super) stats: Stats,
    /// Bytes queued for all peers ([`Config::queued_bytes`]).
    pub(super) queued_bytes: Arc<AtomicUsize>,
    /// How to recognise a datagram that starts a session
    /// ([`chunnel::Listener::recognise_sessions`]).
    pub(super) session_of: std::sync::OnceLock<SessionOf>,
    pub(super) listener_open: AtomicBool,
    /// Which task, if any, waits for the socket to become readable ([`NO_READER`],
    /// [`ACCEPT_READER`], [`CONN_READER`]). Only that task waits on the socket; the others
    /// wait on their own queue's notification (or for the reader role to fall vacant), so
    /// a datagram wakes one task, not every connection. A connection about to wait takes the
    /// reader role from `accept` (waking it through [`Shared::accept_waker`]) unless the datagrams
    /// coming in start new connections ([`Shared::fresh`]): the datagrams a connection reads
    /// for itself go straight into its slots, where those `accept` reads go through a queue
    /// and a wake-up of the connection's task. A looping `accept` keeps the reader role between
    /// calls ([`Shared::looping`]).
    pub(super) reader: AtomicU8,
    /// Whether the last datagram sorted started a new connection. While it did (a stream of
    /// new peers, each sending one request: short-lived clients), a connection about to wait
    /// leaves the reader role to `accept`, which those datagrams are for: a connection
    /// holding it would be woken for each of them only to queue it and wake `accept`.
    pub(super) fresh: AtomicBool,
    /// `accept` is called in a loop ([`chunnel::Listener::accepting_in_loop`]): it keeps the
    /// reader role between calls, and a connection holding the reader role hands it to
    /// `accept` once new peers are what comes in.
    pub(super) accept_in_loop: AtomicBool,
    /// Held while the reader checks that it still is the reader and registers its task in
    /// the socket's one receive-waker slot ([`DatagramIo::poll_recv_ready`]). A task that
    /// takes the reader role registers after it took it, so it registers after any task that
    /// still saw itself as the reader: the slot ends with the real reader's waker. (A lock
    /// and one slot rather than a readiness future per wait, which puts the waiter in a
    /// locked list and takes it out again: a few hundred instructions per wait, and its size
    /// in every receive future.)
    pub(super) read_register: Mutex<()>,
    /// Connections waiting for the reader role, oldest first (entries of connections that
    /// stopped waiting are skipped when met); `vacancy_waiters` connections still wait. A
    /// task giving up the reader role wakes the first through the connection's own wake-up, so a
    /// waiting receive holds one registration, not two.
    pub(super) vacancy: Mutex<VecDeque<std::sync::Weak<Peer<S::Addr>>>>,
    pub(super) vacancy_waiters: AtomicUsize,
    /// `accept` waiting for the reader role to change hands: to fall vacant while a connection
    /// holds it, or to be taken from `accept` by a connection. One task, woken through a
    /// plain waker slot: while a connection serves requests the reader role changes hands once per
    /// request, and `accept` re-registers after every such wake-up.
    pub(super) accept_waker: Mutex<Option<Waker>>,
    /// The origin of the connections' receive times (kept as nanoseconds since it).
    pub(super) epoch: Instant,
    pub(super) tx: S::TxState,
    pub(super) idle: Mutex<IdleSweep<S::Addr>>,
}

/// The server side of a datagram datapath: one bound socket, a connection per peer.
#[derive(Debug)]
pub struct Listener<S: DatagramIo> {
    pub(super) shared: Arc<Shared<S>>,
}

impl<S: DatagramIo> Listener<S> {
    /// A listener on `sock` (a datapath's endpoint, bound already) with `cfg`.
    pub fn new(sock: S, cfg: Config) -> Self {
        let rx = Mutex::new(sock.rx_state(&cfg));
        Listener {
            shared: Arc::new(Shared {
                sock,
                cfg,
                demux: Mutex::new(Demux {
                    peers: PeerMap::new(),
                    backlog: VecDeque::new(),
                    silent: VecDeque::new(),
                }),
                rx,
                accept_notify: Notify::new(),
                stats: Stats::default(),
                queued_bytes: Arc::default(),
                session_of: std::sync::OnceLock::new(),
                listener_open: AtomicBool::new(true),
                reader: AtomicU8::new(NO_READER),
                fresh: AtomicBool::new(false),
                read_register: Mutex::new(()),
                accept_in_loop: AtomicBool::new(false),
                vacancy: Mutex::new(VecDeque::new()),
                vacancy_waiters: AtomicUsize::new(0),
                accept_waker: Mutex::new(None),
                epoch: Instant::now(),
                tx: S::TxState::default(),
                idle: Mutex::new(IdleSweep {
                    due: std::collections::BinaryHeap::new(),
                    task: None,
                }),
            }),
        }
    }

    /// The datapath's endpoint underneath (e.g. for its local address).
    pub fn get_ref(&self) -> &S {
        &self.shared.sock
    }

    /// Peers with live state on this listener (accepted or waiting to be accepted).
    pub fn peer_count(&self) -> usize {
        lock(&self.shared.demux).peers.len()
    }

    /// A handle that reads [`Listener::peer_count`] after the listener itself was moved
    /// away (into a serving loop, say).
    pub fn peer_counter(&self) -> PeerCounter<S> {
        PeerCounter(Arc::downgrade(&self.shared))
    }

    /// How received datagrams reached their connections so far: (read by the connection
    /// itself straight into its slots, sorted into a per-peer queue first). A connection that
    /// keeps calling `recv` reads its own datagrams; a queue means a task hop per datagram.
    pub fn delivery(&self) -> (u64, u64) {
        let s = &self.shared.stats;
        (
            s.direct.load(Ordering::Relaxed),
            s.queued.load(Ordering::Relaxed),
        )
    }

    /// Datagrams from known addresses that started another session than their address had
    /// ([`chunnel::Listener::recognise_sessions`]): each ended the old connection and started
    /// a new one.
    pub fn new_sessions(&self) -> u64 {
        self.shared.stats.new_sessions.load(Ordering::Relaxed)
    }

    /// Bytes of datagrams queued now for all peers (at most [`Config::queued_bytes`]).
    pub fn queued_bytes(&self) -> usize {
        self.shared.queued_bytes.load(Ordering::Relaxed)
    }

    /// Datagrams dropped so far: (over `max_payload`, peer queue full, backlog full).
    pub fn dropped(&self) -> (u64, u64, u64) {
        let s = &self.shared.stats;
        (
            s.dropped_oversize.load(Ordering::Relaxed),
            s.dropped_queue_full.load(Ordering::Relaxed),
            s.dropped_backlog_full.load(Ordering::Relaxed),
        )
    }

    /// What [`Config::max_peers`] did so far: (peers evicted to admit new ones: waiting for
    /// `accept`, or accepted and marked silent; datagrams from new peers dropped at the cap
    /// with no peer to evict).
    pub fn peer_cap_stats(&self) -> (u64, u64) {
        let s = &self.shared.stats;
        (
            s.evicted.load(Ordering::Relaxed),
            s.dropped_peer_cap.load(Ordering::Relaxed),
        )
    }
}

/// See [`Listener::peer_counter`].
#[derive(Debug)]
pub struct PeerCounter<S: DatagramIo>(std::sync::Weak<Shared<S>>);

impl<S: DatagramIo> Clone for PeerCounter<S> {
    fn clone(&self) -> Self {
        PeerCounter(self.0.clone())
    }
}

impl<S: DatagramIo> PeerCounter<S> {
    /// The listener's [`Listener::peer_count`] now; 0 once the listener and all of its
    /// connections are gone.
    pub fn count(&self) -> usize {
        self.0.upgrade().map_or(0, |sh| lock(&sh.demux).peers.len())
    }

    /// The listener's [`Listener::peer_cap_stats`] now; (0, 0) once the listener and all of
    /// its connections are gone.
    pub fn peer_cap_stats(&self) -> (u64, u64) {
        self.0.upgrade().map_or((0, 0), |sh| {
            (
                sh.stats.evicted.load(Ordering::Relaxed),
                sh.stats.dropped_peer_cap.load(Ordering::Relaxed),
            )
        })
    }
}

impl<S: DatagramIo> Drop for Listener<S> {
    fn drop(&mut self) {
        // Connections already accepted keep working; new peers are no longer admitted, and
        // peers nobody accepted are forgotten.
        // Closed before the reader role is given up (see `ReaderGuard::hand_to_accept`).
        self.shared.listener_open.store(false, Ordering::SeqCst);
        {
            let mut d = lock(&self.shared.demux);
            let pending: Vec<_> = d.backlog.drain(..).collect();
            for p in pending {
                d.peers.remove(&p.addr);
            }
        }
        // The reader role `accept` kept between calls (or was handed) is given up as any
        // reader gives it up (the listener is closed: `looping` is false now): a waiting connection
        // takes it. Nothing if `accept` does not hold it.
        self.shared.release_reader(ACCEPT_READER);
        if self.shared.accept_in_loop.load(Ordering::Relaxed) {
            // Connections that left the reading to the looping `accept` wait on their own
            // wake-up only (see `wait_readable`): all are woken to take over.
            let peers: Vec<_> = lock(&self.shared.demux).peers.values().cloned().collect();
            for p in peers {
                p.notify.notify_waiters();
            }
        }
    }
}

impl<S: DatagramIo> chunnel::Listener for Listener<S> {
    type Connection = ServerConnection<S>;

    async fn accept(&mut self) -> Result<ServerConnection<S>, Error> {
        let sh = &self.shared;
        // Registered once and kept until it fires: this task is woken whenever the reader
        // role falls vacant (once per datagram a connection reads), and registering again on
        // every such wake-up would be most of what the wake-up costs.
        let notified = sh.accept_notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // The reader role, once taken, is kept until this call returns; in a loop, until
        // the next call (unless a connection took it meanwhile): see `wait_readable`.
        let mut held = ReaderGuard::new(sh);
        loop {
            let next = lock(&sh.demux).backlog.pop_front();
            if let Some(peer) = next {
                if let Some(t) = sh.cfg.idle_timeout {
                    sh.watch_idle(&peer, t);
                }
                // A looping `accept` keeps the reader role (the guard's drop leaves it): the next
                // call takes it up again.
                return Ok(ServerConnection {
                    shared: sh.clone(),
                    peer,
                });
            }
            // While a connection waits on the socket it reads (and sorts new peers into the
            // backlog) for everyone: reading here too would only cost a system call on every
            // wake-up (the reader role falling vacant wakes this task once per datagram
            // the reader takes). Once the reader role is free, `wait_readable` takes it; tokio's
            // readiness is only cleared by a read that would block, so nothing is missed.
            // A connection may have taken the reader role from us (see `wait_readable`).
            if held.holds() && sh.reader.load(Ordering::SeqCst) != ACCEPT_READER {
                held.release();
            }
            if held.holds() || sh.reader.load(Ordering::Acquire) != CONN_READER {
                match sh.pump() {
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    // An error for one peer (e.g. a refused earlier send) must not stop the
                    // listener: it is consumed and the loop goes on.
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => continue,
                    Err(e) => {
                        return Err(Error::Io {
                            op: "accept",
                            source: e,
                        });
                    }
                }
            }
            let fired = sh
                .wait_readable(ACCEPT_READER, &mut held, None, notified.as_mut())
                .await
                .map_err(|e| Error::Io {
                    op: "accept",
                    source: e,
                })?;
            if fired.is_some() {
                notified.set(sh.accept_notify.notified());
                notified.as_mut().enable();
            }
        }
    }

    fn recognise_sessions(&mut self, session_of: fn(&[u8]) -> Option<u64>) {
        let _ = self.shared.session_of.set(session_of);
    }

    fn accepting_in_loop(&mut self) {
        self.shared.accept_in_loop.store(true, Ordering::Relaxed);
    }
}
