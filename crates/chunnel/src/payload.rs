//! The byte payloads that datapaths carry, and how a datapath lends its own buffers.

use bytes::{Bytes, BytesMut};

/// Bytes carried by a byte-level datapath.
///
/// Each datapath chooses its own `Data` type. Kernel sockets use [`Bytes`] (received messages
/// are slices of one reused receive buffer, so receiving allocates nothing per message). A
/// datapath that owns memory the application can read directly — a shared-memory slot, an
/// AF_XDP UMEM frame — uses its own type that derefs to that memory and returns it to the
/// datapath on drop. Layers that only read or forward bytes are generic over `Payload`, so they
/// work over either without a copy.
pub trait Payload: AsRef<[u8]> + Send + 'static {
    /// The payload's length in bytes.
    fn len(&self) -> usize {
        self.as_ref().len()
    }

    /// True for an empty payload.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Payload for Bytes {}
impl Payload for BytesMut {}
impl Payload for Vec<u8> {}
impl Payload for &'static [u8] {}

/// A datapath that hands out writable buffers of its own for outgoing messages (INSANE's
/// `get_buffer`), so a layer that builds messages writes straight into the memory the
/// datapath sends from.
pub trait LendBuffer {
    /// The writable buffer type; turned into the connection's `Data` once filled.
    type Buf: AsMut<[u8]> + Send;

    /// A buffer of exactly `len` bytes, or `None` when the datapath has none free (or `len` is
    /// more than it carries). On `None` the caller falls back to the copying `send` of its own
    /// bytes rather than waiting: lending never stalls a sender.
    fn lend(&self, len: usize) -> Option<Self::Buf>;
}

/// Sends buffers a [`LendBuffer`] lent (INSANE's `emit`): the bytes the application wrote
/// into datapath memory leave from there, without a copy by the datapath.
///
/// Messages leave in the order their buffers were lent or sent: a lent buffer not yet emitted
/// may hold back later messages on an ordered datapath (shared memory) until it is emitted or
/// dropped. Dropping a lent buffer without emitting it gives it back unsent.
pub trait Emit: LendBuffer {
    /// Sends `bufs`, in order.
    fn emit<B>(&self, bufs: B) -> impl Future<Output = Result<(), crate::Error>> + Send
    where
        B: IntoIterator<Item = Self::Buf> + Send,
        B::IntoIter: Send;
}

/// A connection that can hand received messages to the application in the datapath's own
/// memory (INSANE's `consume`; dropping the payload is `release`), besides the copying
/// `ChunnelConnection::recv`.
///
/// When too much of the datapath's memory is held by the application, the datapath copies
/// instead of lending (so it never stalls waiting for the application to drop payloads); the
/// payload type covers both, and [`LendStats`] counts both.
pub trait LendRecv: Send + Sync {
    /// A received message: a view of datapath memory given back on drop, or a copy.
    type Lent: Payload;

    /// As `ChunnelConnection::recv`, with lent payloads.
    fn recv_lent<'a>(
        &'a self,
        slots: &'a mut [Option<Self::Lent>],
    ) -> impl Future<Output = Result<usize, crate::Error>> + Send + 'a;

    /// How many messages were lent and copied so far.
    fn lend_stats(&self) -> LendStats;
}

/// Messages a datapath lent or copied, per direction (counted since the connection was made).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LendStats {
    /// Received messages handed out as views of datapath memory.
    pub rx_lent: u64,
    /// Received messages copied out of datapath memory (the copying `recv`, or the low-buffer
    /// fallback of `recv_lent`).
    pub rx_copied: u64,
    /// Messages sent from buffers the datapath lent ([`Emit::emit`]).
    pub tx_lent: u64,
    /// Messages sent from the application's own memory (`ChunnelConnection::send`): each
    /// datapath says what that costs (shared memory copies them into the ring; io_uring
    /// passes the application's bytes to the kernel, which copies them as for any socket).
    pub tx_copied: u64,
}
