//! [`Metered`]: a layer that counts the messages and bytes passing through it.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use chunnel::negotiate::{PickReader, StackOption};
use chunnel::{Error, Identity, Layer, LayerState, OfferTree, Offers};
use metrics::{Counter, Label, Recorder};

use crate::names;
use crate::snapshot::{self, ConnStats};

/// How many bytes a message counts for in `chunnel_bytes_total`.
pub trait Measure {
    /// The message's length in bytes.
    fn byte_len(&self) -> usize;
}

impl Measure for Bytes {
    #[inline]
    fn byte_len(&self) -> usize {
        self.len()
    }
}

impl Measure for Vec<u8> {
    #[inline]
    fn byte_len(&self) -> usize {
        self.len()
    }
}

impl Measure for bytes::BytesMut {
    #[inline]
    fn byte_len(&self) -> usize {
        self.len()
    }
}

/// Datagrams with their peer's address (a listener's raw form): the payload's length.
impl<A> Measure for (A, Bytes) {
    #[inline]
    fn byte_len(&self) -> usize {
        self.1.len()
    }
}

/// A layer that counts what passes through it, per direction: messages
/// (`chunnel_messages_total`) and bytes (`chunnel_bytes_total`), labelled with the stack's
/// name, the layer's name (where in the stack it sits) and, unless turned off, the
/// connection's number. Use it as `chunnel::Layered(Metered::new(..))`.
///
/// It is no layer to negotiation (it offers nothing, like [`Identity`]): a metered end talks
/// to an unmetered one. Each connection registers its metric handles once, when it is built
/// (with the global recorder, or the one given by [`Self::with_recorder`]), and appears in
/// [`snapshot()`](crate::snapshot()) while it lives; a message then costs two relaxed atomic
/// additions for the snapshot and two counter increments through the recorder's handles
/// (nothing when no recorder is installed), with no allocation.
pub struct Metered<D = Bytes> {
    stack: Arc<str>,
    layer: Arc<str>,
    per_connection: bool,
    recorder: Option<Arc<dyn Recorder + Send + Sync>>,
    _data: PhantomData<fn() -> D>,
}

impl<D> Clone for Metered<D> {
    fn clone(&self) -> Self {
        Self {
            stack: self.stack.clone(),
            layer: self.layer.clone(),
            per_connection: self.per_connection,
            recorder: self.recorder.clone(),
            _data: PhantomData,
        }
    }
}

impl<D> std::fmt::Debug for Metered<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metered")
            .field("stack", &self.stack)
            .field("layer", &self.layer)
            .field("per_connection", &self.per_connection)
            .field("own_recorder", &self.recorder.is_some())
            .finish()
    }
}

impl<D> Metered<D> {
    /// Counts the connections of the stack named `stack` (label `stack`); the layer label is
    /// `"top"` until [`Self::layer`] names it.
    pub fn new(stack: impl Into<Arc<str>>) -> Self {
        Self {
            stack: stack.into(),
            layer: Arc::from("top"),
            per_connection: true,
            recorder: None,
            _data: PhantomData,
        }
    }

    /// Names the place in the stack this meter sits (label `layer`, e.g. the layer below it).
    pub fn layer(mut self, layer: impl Into<Arc<str>>) -> Self {
        self.layer = layer.into();
        self
    }

    /// With `false`, the exported series carry no `conn` label: every connection of the stack
    /// adds to one series per layer and direction (bounded cardinality for servers with many
    /// short connections). Snapshots stay per connection.
    pub fn per_connection(mut self, on: bool) -> Self {
        self.per_connection = on;
        self
    }

    /// Registers the handles with `recorder` instead of the global one (tests, benchmarks,
    /// or several exporters in one process).
    pub fn with_recorder(mut self, recorder: Arc<dyn Recorder + Send + Sync>) -> Self {
        self.recorder = Some(recorder);
        self
    }

    fn handles(&self, conn: u64) -> Handles {
        let make = || {
            let mut labels = vec![
                Label::new("stack", self.stack.to_string()),
                Label::new("layer", self.layer.to_string()),
            ];
            if self.per_connection {
                labels.push(Label::new("conn", conn.to_string()));
            }
            let with = |dir: &'static str| {
                let mut l = labels.clone();
                l.push(Label::new("direction", dir));
                l
            };
            names::describe();
            Handles {
                sent_msgs: metrics::counter!(names::MESSAGES, with("sent")),
                sent_bytes: metrics::counter!(names::BYTES, with("sent")),
                recv_msgs: metrics::counter!(names::MESSAGES, with("received")),
                recv_bytes: metrics::counter!(names::BYTES, with("received")),
            }
        };
        match &self.recorder {
            Some(r) => metrics::with_local_recorder(&**r, make),
            None => make(),
        }
    }
}

struct Handles {
    sent_msgs: Counter,
    sent_bytes: Counter,
    recv_msgs: Counter,
    recv_bytes: Counter,
}

/// The state of one metered connection (see [`Metered`]).
pub struct MeteredState<D> {
    stats: Arc<ConnStats>,
    h: Handles,
    _data: PhantomData<fn() -> D>,
}

impl<D> std::fmt::Debug for MeteredState<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredState")
            .field("stats", &self.stats.read())
            .finish_non_exhaustive()
    }
}

impl<D> MeteredState<D> {
    /// This connection's counters.
    pub fn stats(&self) -> &Arc<ConnStats> {
        &self.stats
    }
}

impl<D: Measure + Send> Layer for Metered<D> {
    type State = MeteredState<D>;

    fn state(&mut self) -> Result<Self::State, Error> {
        let stats = snapshot::register(self.stack.clone(), self.layer.clone());
        let h = self.handles(stats.conn());
        Ok(MeteredState {
            stats,
            h,
            _data: PhantomData,
        })
    }
}

#[inline]
fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

impl<D: Measure + Send> LayerState for MeteredState<D> {
    type Data = D;

    #[inline]
    fn on_send(&self, m: D) -> D {
        let len = m.byte_len() as u64;
        add(&self.stats.sent_msgs, 1);
        add(&self.stats.sent_bytes, len);
        self.h.sent_msgs.increment(1);
        self.h.sent_bytes.increment(len);
        m
    }

    #[inline]
    fn on_recv(&self, batch: &mut [Option<D>]) -> Result<usize, Error> {
        let bytes: u64 = batch.iter().flatten().map(|m| m.byte_len() as u64).sum();
        let n = batch.len() as u64;
        add(&self.stats.recv_msgs, n);
        add(&self.stats.recv_bytes, bytes);
        self.h.recv_msgs.increment(n);
        self.h.recv_bytes.increment(bytes);
        Ok(batch.len())
    }
}

/// A meter is no layer to negotiation: it offers what [`Identity`] offers (nothing).
impl<D> Offers for Metered<D> {
    fn hash_offers(&self, h: &mut dyn std::hash::Hasher) {
        Identity.hash_offers(h)
    }

    fn offer_tree(&self) -> OfferTree {
        Identity.offer_tree()
    }

    fn offers(&self) -> Vec<StackOption> {
        Identity.offers()
    }

    fn available(&self) -> Result<(), Error> {
        Ok(())
    }

    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error> {
        Identity.apply_pick(pick)
    }
}
