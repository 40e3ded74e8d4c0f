//! [`Tagged`]: the connection a negotiated stack is built on. It puts the `DATA` tag in
//! front of every message (without copying it, through [`SendHeader`]), strips it on
//! receive, and handles the control messages that can still arrive after the handshake (a
//! retransmitted hello is answered with the cached accept; a duplicate accept is ignored).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::{Buf, Bytes};
use chunnel::{ChunnelConnection, Error, PeerHandoff, SendHeader};

use crate::wire::{Hello, Tag};

const DATA: &[u8] = &[Tag::Data as u8];

/// The base connection of a negotiated stack; cheap to clone (shared).
#[derive(Debug)]
pub struct Tagged<C> {
    shared: Arc<Shared<C>>,
}

impl<C> Clone for Tagged<C> {
    fn clone(&self) -> Self {
        Tagged {
            shared: Arc::clone(&self.shared),
        }
    }
}

#[derive(Debug)]
struct Shared<C> {
    inner: C,
    /// Server side: the hello's conn_id and the encoded accept, re-sent to retransmissions.
    answer: Option<(u64, Bytes)>,
    reply_due: AtomicBool,
    capturing: AtomicBool,
    captured: Mutex<Vec<Bytes>>,
    has_pending: AtomicBool,
    pending: Mutex<VecDeque<Bytes>>,
    ignored: AtomicU64,
    /// A new client took over this peer address (server side); the connection is over.
    superseded: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<C> Tagged<C> {
    fn with(inner: C, answer: Option<(u64, Bytes)>) -> Self {
        Tagged {
            shared: Arc::new(Shared {
                inner,
                answer,
                reply_due: AtomicBool::new(false),
                capturing: AtomicBool::new(false),
                captured: Mutex::new(Vec::new()),
                has_pending: AtomicBool::new(false),
                pending: Mutex::new(VecDeque::new()),
                ignored: AtomicU64::new(0),
                superseded: AtomicBool::new(false),
            }),
        }
    }

    /// A client's tagged connection.
    pub(crate) fn client(inner: C) -> Self {
        Self::with(inner, None)
    }

    /// A server's tagged connection that answers hellos with `conn_id` by `response`.
    pub(crate) fn server(inner: C, conn_id: u64, response: Bytes) -> Self {
        Self::with(inner, Some((conn_id, response)))
    }

    /// The base connection.
    pub fn get_ref(&self) -> &C {
        &self.shared.inner
    }

    /// Messages dropped because they were not data for this connection (stale control
    /// messages, unknown tags, empty messages).
    pub fn ignored(&self) -> u64 {
        self.shared.ignored.load(Ordering::Relaxed)
    }

    /// Queues messages (tag already stripped) to be received before anything else.
    pub(crate) fn push_pending(&self, msgs: impl IntoIterator<Item = Bytes>) {
        let mut q = lock(&self.shared.pending);
        q.extend(msgs);
        self.shared
            .has_pending
            .store(!q.is_empty(), Ordering::Release);
    }

    /// While capturing, `send` collects messages instead of sending them (0-RTT: they ride
    /// in the hello).
    pub(crate) fn start_capture(&self) {
        self.shared.capturing.store(true, Ordering::Release);
    }

    /// Stops capturing and returns what was captured.
    pub(crate) fn take_capture(&self) -> Vec<Bytes> {
        self.shared.capturing.store(false, Ordering::Release);
        std::mem::take(&mut *lock(&self.shared.captured))
    }
}

impl<C: SendHeader + PeerHandoff> ChunnelConnection for Tagged<C> {
    type Data = Bytes;

    #[inline]
    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let sh = &*self.shared;
        if sh.capturing.load(Ordering::Acquire) {
            lock(&sh.captured).extend(burst);
            return Ok(());
        }
        sh.inner.send_with_header(DATA, burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let sh = &*self.shared;
        loop {
            if sh.superseded.load(Ordering::Acquire) {
                return Err(Error::PeerClosed);
            }
            // Answer a retransmitted hello here, before taking any data, so cancelling this
            // future never loses a received message.
            if sh.reply_due.swap(false, Ordering::AcqRel)
                && let Some((_, r)) = &sh.answer
            {
                sh.inner.send_with_header(&[], [r.clone()]).await?;
            }
            if sh.has_pending.load(Ordering::Acquire) {
                let mut q = lock(&sh.pending);
                let mut n = 0;
                for s in slots.iter_mut() {
                    match q.pop_front() {
                        Some(m) => {
                            *s = Some(m);
                            n += 1;
                        }
                        None => break,
                    }
                }
                sh.has_pending.store(!q.is_empty(), Ordering::Release);
                if n > 0 {
                    return Ok(n);
                }
            }
            let n = sh.inner.recv(slots).await?;
            let mut kept = 0;
            for i in 0..n.min(slots.len()) {
                let Some(mut m) = slots[i].take() else {
                    continue;
                };
                match m.first().copied() {
                    Some(t) if t == Tag::Data as u8 => {
                        m.advance(1);
                        slots[kept] = Some(m);
                        kept += 1;
                    }
                    // Server side: a retransmission of the accepted hello is answered again;
                    // a hello with another connection id means a new client reuses this
                    // peer's address, so it is handed to the listener as a new connection and
                    // this one ends (after the data already taken).
                    Some(t) if t == Tag::Hello as u8 && sh.answer.is_some() => {
                        match (&sh.answer, Hello::peek_conn_id(&m[1..])) {
                            (Some((id, _)), Ok(c)) if c == *id => {
                                sh.reply_due.store(true, Ordering::Release);
                            }
                            (_, Ok(_)) if sh.inner.hand_off(m) => {
                                sh.superseded.store(true, Ordering::Release);
                            }
                            _ => {
                                sh.ignored.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    _ => {
                        sh.ignored.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if kept > 0 {
                return Ok(kept);
            }
        }
    }
}

impl<C: SendHeader + PeerHandoff> SendHeader for Tagged<C> {
    // Layers above may tag too; their header goes after ours. Only the headers are copied,
    // into a stack buffer when short (no allocation), never the payload.
    async fn send_with_header<'a, B>(&'a self, header: &'a [u8], burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let sh = &*self.shared;
        if sh.capturing.load(Ordering::Acquire) {
            // Rare (0-RTT early data of a tagging layer): copy header and payload once.
            let mut q = lock(&sh.captured);
            q.extend(
                burst
                    .into_iter()
                    .map(|m| Bytes::from([header, &m[..]].concat())),
            );
            return Ok(());
        }
        let mut short = [0u8; 32];
        let long;
        let h: &[u8] = if header.len() < short.len() {
            short[..1].copy_from_slice(DATA);
            short[1..=header.len()].copy_from_slice(header);
            &short[..=header.len()]
        } else {
            long = [DATA, header].concat();
            &long
        };
        sh.inner.send_with_header(h, burst).await
    }
}
