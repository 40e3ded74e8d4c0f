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

    /// A buffer able to hold at least `len` bytes, or `None` when the datapath has none free
    /// (the caller may then wait on `send`, which releases buffers as they leave).
    fn lend(&self, len: usize) -> Option<Self::Buf>;
}
