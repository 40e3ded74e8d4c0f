//! In-process snapshots: every live metered connection's counters, readable without a
//! recorder (for a control endpoint or a test).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// The counters of one metered connection (relaxed atomics: each is exact, a [`read`]
/// of all four is not one instant).
///
/// [`read`]: ConnStats::read
#[derive(Debug)]
pub struct ConnStats {
    conn: u64,
    stack: Arc<str>,
    layer: Arc<str>,
    pub(crate) sent_msgs: AtomicU64,
    pub(crate) sent_bytes: AtomicU64,
    pub(crate) recv_msgs: AtomicU64,
    pub(crate) recv_bytes: AtomicU64,
}

impl ConnStats {
    /// The connection's number (unique in the process; the `conn` label).
    pub fn conn(&self) -> u64 {
        self.conn
    }

    /// The counters now.
    pub fn read(&self) -> ConnSnapshot {
        ConnSnapshot {
            conn: self.conn,
            stack: self.stack.clone(),
            layer: self.layer.clone(),
            sent_msgs: self.sent_msgs.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
            recv_msgs: self.recv_msgs.load(Ordering::Relaxed),
            recv_bytes: self.recv_bytes.load(Ordering::Relaxed),
        }
    }
}

/// One metered connection's counters at one time.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnSnapshot {
    /// The connection's number.
    pub conn: u64,
    /// The stack's name ([`Metered::new`](crate::Metered::new)).
    pub stack: Arc<str>,
    /// The meter's place in the stack ([`Metered::layer`](crate::Metered::layer)).
    pub layer: Arc<str>,
    /// Messages sent down through the meter.
    pub sent_msgs: u64,
    /// Their bytes.
    pub sent_bytes: u64,
    /// Messages received up through the meter.
    pub recv_msgs: u64,
    /// Their bytes.
    pub recv_bytes: u64,
}

/// Live connections, held weakly; dead entries are removed when the list would grow.
static LIVE: Mutex<Vec<Weak<ConnStats>>> = Mutex::new(Vec::new());
static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

fn live() -> std::sync::MutexGuard<'static, Vec<Weak<ConnStats>>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn register(stack: Arc<str>, layer: Arc<str>) -> Arc<ConnStats> {
    let s = Arc::new(ConnStats {
        conn: NEXT_CONN.fetch_add(1, Ordering::Relaxed),
        stack,
        layer,
        sent_msgs: AtomicU64::new(0),
        sent_bytes: AtomicU64::new(0),
        recv_msgs: AtomicU64::new(0),
        recv_bytes: AtomicU64::new(0),
    });
    let mut l = live();
    // Bounded by the live connections: prune before the vector would reallocate, so its
    // length stays at most twice the number alive.
    if l.len() == l.capacity() {
        l.retain(|w| w.strong_count() > 0);
    }
    l.push(Arc::downgrade(&s));
    s
}

/// The counters of every live metered connection in this process, oldest first.
///
/// ```
/// use chunnel::{Layer, LayerState};
/// use chunnel_metrics::Metered;
///
/// let mut m: Metered = Metered::new("doc-snapshot");
/// let state = m.state().unwrap();
/// state.on_send(bytes::Bytes::from_static(b"hello"));
/// let mine: Vec<_> = chunnel_metrics::snapshot()
///     .into_iter()
///     .filter(|c| &*c.stack == "doc-snapshot")
///     .collect();
/// assert_eq!((mine[0].sent_msgs, mine[0].sent_bytes), (1, 5));
/// ```
pub fn snapshot() -> Vec<ConnSnapshot> {
    let strong: Vec<Arc<ConnStats>> = {
        let mut l = live();
        l.retain(|w| w.strong_count() > 0);
        l.iter().filter_map(Weak::upgrade).collect()
    };
    strong.iter().map(|s| s.read()).collect()
}
