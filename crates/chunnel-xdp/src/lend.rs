//! Lent buffers on the AF_XDP client ([`crate::ClientConnection`]): [`XdpPayload`], a received
//! UDP payload viewed in its UMEM frame, and [`XdpBuf`], a free TX frame's payload region the
//! application writes before the connection emits it.

use bytes::Bytes;

use crate::xsk::{RxFrame, TxFrame};

/// A received message from [`chunnel::LendRecv::recv_lent`] on a
/// [`ClientConnection`](crate::ClientConnection): the UDP payload inside its UMEM frame (the
/// UMEM stays mapped while it lives, even after the connection is gone; the frame goes back
/// to the fill ring when it drops, on any thread), or a copy when the application held too
/// many frames.
pub struct XdpPayload(Inner);

enum Inner {
    Lent(RxFrame),
    Copied(Bytes),
}

impl XdpPayload {
    pub(crate) fn lent(f: RxFrame) -> Self {
        XdpPayload(Inner::Lent(f))
    }

    pub(crate) fn copied(b: Bytes) -> Self {
        XdpPayload(Inner::Copied(b))
    }

    /// Whether this payload views UMEM memory (else it is a copy).
    pub fn is_lent(&self) -> bool {
        matches!(self.0, Inner::Lent(_))
    }

    /// The bytes as [`Bytes`]: a copy (which frees the frame) when lent, as is when copied.
    pub fn into_bytes(self) -> Bytes {
        match self.0 {
            Inner::Lent(f) => Bytes::copy_from_slice(f.as_ref()),
            Inner::Copied(b) => b,
        }
    }
}

impl AsRef<[u8]> for XdpPayload {
    fn as_ref(&self) -> &[u8] {
        match &self.0 {
            Inner::Lent(f) => f.as_ref(),
            Inner::Copied(b) => b,
        }
    }
}

impl std::ops::Deref for XdpPayload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

impl chunnel::Payload for XdpPayload {}

impl std::fmt::Debug for XdpPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpPayload")
            .field("lent", &self.is_lent())
            .field("len", &self.as_ref().len())
            .finish()
    }
}

/// A buffer from [`chunnel::LendBuffer::lend`] on a
/// [`ClientConnection`](crate::ClientConnection): the payload region of a free TX frame of
/// the UMEM. [`chunnel::Emit::emit`] writes the Ethernet/IPv4/UDP headers in front of it and
/// puts the frame on the TX ring; the frame is free again once the kernel completed it.
/// Dropped unsent, it goes back to the pool.
pub struct XdpBuf(pub(crate) TxFrame);

impl AsMut<[u8]> for XdpBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self.0.as_mut()
    }
}

impl XdpBuf {
    /// The payload's length (what `lend` was asked for).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }
}

impl std::fmt::Debug for XdpBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpBuf")
            .field("len", &self.0.len())
            .finish()
    }
}
