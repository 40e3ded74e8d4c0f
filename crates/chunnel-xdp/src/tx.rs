//! The send path shared by the server's connections ([`crate::XdpIo`]) and the client
//! ([`crate::ClientConnection`]): a burst is written frame by frame into free TX chunks of
//! the UMEM (headers built around a copy of the payload), published with one producer update
//! per ring access, and the kernel is kicked until it took them (copy mode transmits a
//! bounded number of frames per system call). When the TX ring or its chunk pool is full the
//! sender yields, then sleeps briefly, until the kernel completed frames. A send returns once
//! the kernel took every frame of the burst off the ring (or after [`TX_PATIENCE`] of a
//! device refusing them: the next send's kick retries): copy mode transmits only from a
//! system call, so a frame a busy device left in the ring would otherwise wait there until the
//! next send, which a request/response peer never makes.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use chunnel::Error;
use chunnel::util::lock;

use crate::frame::{self, Endpoints};
use crate::xsk::{TxFrame, Xsk};

/// How long a send keeps kicking a device that leaves its frames in the TX ring.
pub(crate) const TX_PATIENCE: Duration = Duration::from_millis(100);

/// Kicks until the TX ring is empty, yielding between tries (then sleeping), for at most
/// [`TX_PATIENCE`].
async fn drain(xsk: &Mutex<Xsk>) -> Result<(), Error> {
    let mut tries = 0u32;
    let mut since = None;
    loop {
        {
            let mut x = lock(xsk);
            if !x.tx_pending() {
                return Ok(());
            }
            if tries > 0 {
                x.kick_tx();
                x.flush_tx();
                if !x.tx_pending() {
                    return Ok(());
                }
            }
        }
        tries += 1;
        let t0 = *since.get_or_insert_with(std::time::Instant::now);
        if t0.elapsed() >= TX_PATIENCE {
            return Ok(());
        }
        if tries > 10 {
            tokio::time::sleep(Duration::from_micros(50)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// Sends `burst` (each message after `header`) from `ep.src` to `ep.dst` through `xsk`;
/// fails with [`Error::MessageTooLarge`] at the first message over `max_payload` (or the
/// chunk size), having sent the ones before it. `ip_id` numbers the IPv4 headers; each of
/// `sent` counts the frames queued.
pub(crate) async fn send_frames<B>(
    xsk: &Mutex<Xsk>,
    ip_id: &AtomicU16,
    sent: &[&AtomicU64],
    max_payload: usize,
    ep: &Endpoints,
    header: &[u8],
    burst: B,
) -> Result<(), Error>
where
    B: IntoIterator<Item = Bytes>,
{
    let mut it = burst.into_iter().peekable();
    let mut spins = 0u32;
    loop {
        let mut err = None;
        let queued = {
            let mut x = lock(xsk);
            let max = max_payload.min(x.frame_size() - frame::HEADERS);
            let n = x.send_batch(|buf| {
                let m = it.peek()?;
                let len = header.len() + m.len();
                if len > max {
                    err = Some(Error::MessageTooLarge { len, max });
                    return None;
                }
                let id = ip_id.fetch_add(1, Ordering::Relaxed);
                let l = frame::build(buf, ep, id, &[header, m]);
                it.next();
                Some(l)
            });
            x.flush_tx();
            n
        };
        for c in sent {
            c.fetch_add(queued as u64, Ordering::Relaxed);
        }
        if let Some(e) = err {
            return Err(e);
        }
        if it.peek().is_none() {
            return drain(xsk).await;
        }
        // TX ring or pool full: let the kernel complete some frames.
        if queued == 0 {
            spins += 1;
            if spins > 10 {
                tokio::time::sleep(Duration::from_micros(100)).await;
            } else {
                tokio::task::yield_now().await;
            }
        } else {
            spins = 0;
        }
    }
}

/// Sends frames lent by `xsk` ([`Xsk::lend_tx`]), their payloads already written: the headers
/// are written in place around each payload and the frame goes on the TX ring without a copy.
/// Fails with an [`Error::Layer`] at the first frame another socket lent (having sent the
/// ones before it; that frame and the rest go back to their pools). As [`send_frames`] for
/// the rest.
pub(crate) async fn emit_frames<B>(
    xsk: &Mutex<Xsk>,
    ip_id: &AtomicU16,
    sent: &[&AtomicU64],
    ep: &Endpoints,
    frames: B,
) -> Result<(), Error>
where
    B: IntoIterator<Item = TxFrame>,
{
    let mut it = frames.into_iter().peekable();
    let mut spins = 0u32;
    loop {
        let mut foreign = false;
        let queued = {
            let mut x = lock(xsk);
            let umem = x.umem().clone();
            let n = x.post_tx(|| {
                if !it.peek()?.is_of(&umem) {
                    foreign = true;
                    return None;
                }
                let mut f = it.next()?;
                let id = ip_id.fetch_add(1, Ordering::Relaxed);
                let len = f.len();
                let flen = frame::headers(f.frame_mut(), ep, id, len);
                Some((f, flen))
            });
            x.flush_tx();
            n
        };
        for c in sent {
            c.fetch_add(queued as u64, Ordering::Relaxed);
        }
        if foreign {
            return Err(Error::Layer {
                layer: crate::ID,
                source: "emit: a buffer lent by another AF_XDP socket".into(),
            });
        }
        if it.peek().is_none() {
            return drain(xsk).await;
        }
        // TX ring full: let the kernel complete some frames.
        if queued == 0 {
            spins += 1;
            if spins > 10 {
                tokio::time::sleep(Duration::from_micros(100)).await;
            } else {
                tokio::task::yield_now().await;
            }
        } else {
            spins = 0;
        }
    }
}
