//! A fault-injecting Chunnel for tests: drops messages deterministically (every n-th sent
//! and/or every n-th received) and records the first byte and length of every message that
//! crosses it, so tests can count datagrams on the wire.
//!
//! This kernel has no netem (see PLATFORM.md), so loss is injected in user space, between a
//! datapath and the layers above it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use chunnel::{Chunnel, ChunnelConnection, Error, Negotiate, SendHeader};

/// Counters and a log shared between a [`FaultInjector`] and the connections it made.
#[derive(Debug, Default)]
pub struct FaultStats {
    sent: AtomicU64,
    received: AtomicU64,
    dropped_sent: AtomicU64,
    dropped_received: AtomicU64,
    log: Mutex<Vec<Seen>>,
}

/// One message that crossed the injector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// `true` if sent by this end, `false` if received.
    pub outgoing: bool,
    /// Its first byte (header included), if any.
    pub first: Option<u8>,
    /// Its length in bytes (header included).
    pub len: usize,
    /// Whether the injector dropped it.
    pub dropped: bool,
    /// The whole message (header included).
    pub bytes: Bytes,
}

impl FaultStats {
    /// Messages offered for sending (dropped ones included).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
    /// Messages received from below (dropped ones included).
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
    /// Sent messages dropped.
    pub fn dropped_sent(&self) -> u64 {
        self.dropped_sent.load(Ordering::Relaxed)
    }
    /// Received messages dropped.
    pub fn dropped_received(&self) -> u64 {
        self.dropped_received.load(Ordering::Relaxed)
    }
    /// Every message seen, in order.
    pub fn log(&self) -> Vec<Seen> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    fn record(&self, outgoing: bool, bytes: Bytes, dropped: bool) {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Seen {
                outgoing,
                first: bytes.first().copied(),
                len: bytes.len(),
                dropped,
                bytes,
            });
    }
}

/// Drops every `drop_every_send`-th message sent and every `drop_every_recv`-th received
/// (0 = never). Counting is shared by every connection the injector makes.
#[derive(Clone, Debug, Default)]
pub struct FaultInjector {
    /// Drop every n-th sent message (0: none).
    pub drop_every_send: u64,
    /// Drop every n-th received message (0: none).
    pub drop_every_recv: u64,
    /// Shared counters and log.
    pub stats: Arc<FaultStats>,
}

impl FaultInjector {
    /// An injector dropping every `n`-th message in both directions.
    pub fn drop_every(n: u64) -> Self {
        FaultInjector {
            drop_every_send: n,
            drop_every_recv: n,
            stats: Arc::default(),
        }
    }

    /// An injector that only counts and logs.
    pub fn counting() -> Self {
        FaultInjector::default()
    }
}

impl Negotiate for FaultInjector {
    fn id(&self) -> &'static str {
        "chunnel-test/fault/1"
    }
}

impl<C: SendHeader> Chunnel<C> for FaultInjector {
    type Connection = Faulty<C>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Faulty<C>, Error> {
        Ok(Faulty {
            inner,
            cfg: self.clone(),
        })
    }
}

/// A connection through a [`FaultInjector`].
#[derive(Debug)]
pub struct Faulty<C> {
    inner: C,
    cfg: FaultInjector,
}

fn hit(counter: &AtomicU64, every: u64) -> bool {
    let k = counter.fetch_add(1, Ordering::Relaxed) + 1;
    every != 0 && k.is_multiple_of(every)
}

impl<C: SendHeader> Faulty<C> {
    fn filter_out(&self, header: &[u8], burst: impl IntoIterator<Item = Bytes>) -> Vec<Bytes> {
        let st = &self.cfg.stats;
        let mut keep = Vec::new();
        for m in burst {
            let drop = hit(&st.sent, self.cfg.drop_every_send);
            let mut whole = header.to_vec();
            whole.extend_from_slice(&m);
            st.record(true, Bytes::from(whole), drop);
            if drop {
                st.dropped_sent.fetch_add(1, Ordering::Relaxed);
            } else {
                keep.push(m);
            }
        }
        keep
    }
}

impl<C: SendHeader> ChunnelConnection for Faulty<C> {
    type Data = Bytes;

    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        let keep = self.filter_out(&[], burst);
        self.inner.send(keep).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        let st = &self.cfg.stats;
        loop {
            let n = self.inner.recv(slots).await?;
            let mut kept = 0;
            for i in 0..n {
                let Some(m) = slots[i].take() else { continue };
                let drop = hit(&st.received, self.cfg.drop_every_recv);
                st.record(false, m.clone(), drop);
                if drop {
                    st.dropped_received.fetch_add(1, Ordering::Relaxed);
                } else {
                    slots[kept] = Some(m);
                    kept += 1;
                }
            }
            if kept > 0 || n == 0 {
                return Ok(kept);
            }
        }
    }
}

impl<C: chunnel::PeerHandoff> chunnel::PeerHandoff for Faulty<C> {
    fn hand_off(&self, first: Bytes) -> bool {
        self.inner.hand_off(first)
    }
}

impl<C: SendHeader> SendHeader for Faulty<C> {
    fn send_with_header<'a, B>(
        &'a self,
        header: &'a [u8],
        burst: B,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let keep = self.filter_out(header, burst);
        self.inner.send_with_header(header, keep)
    }
}
