//! Sending: one datagram at once if the socket takes it, or a burst in `sendmmsg` batches
//! that waits for writability, parking the messages it took in a pooled spill vector.

use std::future::Future;
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use chunnel::Error;
use tokio::io::Interest;

use crate::sys::{self, DgramAddr, MAX_BATCH};

use super::config::Config;
use super::socket::DgramSocket;
use super::{conn_err, lock};

/// A kernel socket's send state ([`DatagramIo::TxState`](super::DatagramIo::TxState)): spare
/// vectors for a send that has to wait for writability with messages it already took from its
/// burst, which parks them in one of these, so neither the messages nor a
/// batch-sized array live in the send future. Reused, so a blocked send does not allocate
/// once the pool is warm.
#[derive(Debug, Default)]
pub struct SpillPool(Mutex<Vec<Vec<Bytes>>>);

/// Spare vectors kept per socket (one per send blocked at the same time, beyond which they
/// are freed).
const SPILL_POOL: usize = 8;

/// Messages of a burst taken from its iterator but not sent yet, kept across a wait.
struct Spill<'a> {
    pool: &'a SpillPool,
    v: Option<Vec<Bytes>>,
    /// A one-message burst kept across a wait (no vector needed).
    one: Option<Bytes>,
}

impl Spill<'_> {
    fn keep(&mut self, msgs: impl Iterator<Item = Bytes>) {
        let pool = self.pool;
        let v = self.v.get_or_insert_with(|| {
            lock(&pool.0)
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(MAX_BATCH))
        });
        v.extend(msgs);
    }
}

impl Drop for Spill<'_> {
    fn drop(&mut self) {
        if let Some(mut v) = self.v.take() {
            v.clear();
            let mut pool = lock(&self.pool.0);
            if pool.len() < SPILL_POOL {
                pool.push(v);
            }
        }
    }
}

/// One datagram (`header` then `msg`) sent if the socket takes it at once; `None` if it
/// would block (the caller waits with [`send_burst`]).
pub(super) fn try_send_now<S: DgramSocket>(
    sock: &S,
    cfg: &Config,
    dest: Option<&S::Addr>,
    peer: &(dyn std::fmt::Debug + Sync),
    header: &[u8],
    msg: &Bytes,
) -> Option<Result<(), Error>> {
    let max = cfg.max_payload.saturating_sub(header.len());
    if msg.len() > max {
        return Some(Err(Error::MessageTooLarge {
            len: msg.len(),
            max,
        }));
    }
    let fd = sock.as_raw_fd();
    let raw = dest.map(DgramAddr::to_raw);
    match sock.try_send_with(|| sys::send_one(fd, header, msg, raw.as_ref())) {
        Ok(_) => Some(Ok(())),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
        Err(e) => Some(Err(conn_err("send", peer, e))),
    }
}

/// Sends a burst in batches of `sendmmsg`, waiting for writability as needed.
///
/// The batch arrays live in [`send_step`]'s stack frame, not in this future: a future is
/// copied when a task is spawned and when it finishes, and 64-entry arrays made it ~4.8 KB.
///
/// `closed`, if given, is looked at first (the connection's closed flag). Written as a function
/// returning an `async move` block, not as an `async fn`, which would keep each argument
/// twice in the future (as an upvar and as a local).
#[allow(clippy::too_many_arguments)]
// Not an `async fn`: it would keep its arguments twice in the future.
#[allow(clippy::manual_async_fn)]
pub(super) fn send_burst<'a, S: DgramSocket, B>(
    sock: &'a S,
    cfg: &'a Config,
    dest: Option<&'a S::Addr>,
    peer: &'a (dyn std::fmt::Debug + Sync),
    header: &'a [u8],
    burst: B,
    pool: &'a SpillPool,
    closed: Option<&'a AtomicBool>,
) -> impl Future<Output = Result<(), Error>> + Send
where
    B: IntoIterator<Item = Bytes> + Send,
    B::IntoIter: Send,
{
    async move {
        if closed.is_some_and(|c| c.load(Ordering::Acquire)) {
            return Err(Error::Closed);
        }
        let max = cfg.max_payload.saturating_sub(header.len());
        let mut it = burst.into_iter();
        let mut spill = Spill {
            pool,
            v: None,
            one: None,
        };
        let mut too_large = None;
        loop {
            match send_step(
                sock,
                cfg,
                dest,
                header,
                max,
                &mut it,
                &mut spill,
                &mut too_large,
            ) {
                Ok(true) => break,
                // Boxed: waiting for room is the rare case, and tokio's readiness future inline
                // made every send's future (which is copied when it is created, at each layer)
                // a few hundred bytes larger.
                Ok(false) => Box::pin(sock.ready(Interest::WRITABLE))
                    .await
                    .map(drop)
                    .map_err(|e| conn_err("send", peer, e))?,
                Err(e) => return Err(conn_err("send", peer, e)),
            }
        }
        match too_large {
            Some(len) => Err(Error::MessageTooLarge { len, max }),
            None => Ok(()),
        }
    }
}

/// Sends what it can of a burst without waiting: first the messages `spill` kept, then
/// more from `it`, in batches of `cfg.batch`. Returns `Ok(true)` when the burst is done (or
/// stopped at a message over `max`, recorded in `too_large`), `Ok(false)` when the socket is
/// full (the unsent messages are in `spill`).
#[allow(clippy::too_many_arguments)]
fn send_step<S: DgramSocket>(
    sock: &S,
    cfg: &Config,
    dest: Option<&S::Addr>,
    header: &[u8],
    max: usize,
    it: &mut impl Iterator<Item = Bytes>,
    spill: &mut Spill<'_>,
    too_large: &mut Option<usize>,
) -> io::Result<bool> {
    let fd = sock.as_raw_fd();
    // Encoded here, in this frame, rather than by the caller: a kernel address (~136 bytes)
    // held across the caller's await would be carried by every send future.
    let raw = dest.map(DgramAddr::to_raw);
    let dest = raw.as_ref();
    // A burst of one message (a request, a reply) is the common case: it is sent from a
    // one-entry array, without setting up (and dropping) the 64 entries of a full batch.
    let mut first = None;
    if cfg.batch >= 2 && spill.v.as_ref().is_none_or(Vec::is_empty) && too_large.is_none() {
        // A message kept by an earlier step goes first (it was already checked against `max`).
        let next = match spill.one.take() {
            Some(m) => Some(m),
            None => it.next(),
        };
        match next {
            None => return Ok(true),
            Some(m) if m.len() > max => {
                *too_large = Some(m.len());
                return Ok(true);
            }
            Some(m) => match it.next() {
                None => {
                    let one = [Some(m)];
                    return match sock.try_send_with(|| sys::send_batch(fd, header, &one, dest)) {
                        Ok(_) => Ok(true),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            let [one] = one;
                            spill.one = one;
                            Ok(false)
                        }
                        Err(e) => Err(e),
                    };
                }
                Some(second) => first = Some([m, second]),
            },
        }
    }
    let mut batch: [Option<Bytes>; MAX_BATCH] = [const { None }; MAX_BATCH];
    loop {
        let mut n = 0;
        if let Some([a, b]) = first.take() {
            batch[0] = Some(a);
            n = 1;
            // The second may be over `max`: checked like any other.
            if b.len() > max {
                *too_large = Some(b.len());
            } else {
                batch[1] = Some(b);
                n = 2;
            }
        }
        if let Some(v) = spill.v.as_mut() {
            // At most one batch's remainder was kept.
            for m in v.drain(..) {
                batch[n] = Some(m);
                n += 1;
            }
        }
        let mut more = too_large.is_none();
        while more && n < cfg.batch {
            match it.next() {
                Some(m) if m.len() > max => {
                    *too_large = Some(m.len());
                    more = false;
                }
                Some(m) => {
                    batch[n] = Some(m);
                    n += 1;
                }
                None => more = false,
            }
        }
        let mut sent = 0;
        while sent < n {
            match sock.try_send_with(|| sys::send_batch(fd, header, &batch[sent..n], dest)) {
                Ok(k) => sent += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    spill.keep(batch[sent..n].iter_mut().filter_map(Option::take));
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
        if !more {
            return Ok(true);
        }
    }
}
