//! Lent memory: received messages handed out in place in the receive ring ([`ShmPayload`])
//! and send buffers reserved in the send ring ([`ShmBuf`]). Both give their ring space back on
//! drop, from any thread, and keep the mapping alive while they exist (a payload held after
//! its connection or its peer is gone stays valid).

use std::sync::Arc;

use bytes::Bytes;
use chunnel::Payload;
use chunnel::util::lock;

use crate::ring::Span;
use crate::shared::Shared;

/// A received message: a view of its record in the shared-memory receive ring (lent; the
/// record's space is freed when this is dropped) or a copy (when too much of the ring was
/// held). Derefs to the message bytes through `AsRef<[u8]>`, so layers generic over
/// [`Payload`] work on it unchanged.
pub struct ShmPayload(Repr);

enum Repr {
    Lent {
        sh: Arc<Shared>,
        /// Taken only by `drop`.
        span: Option<Span>,
    },
    Copied(Bytes),
}

impl ShmPayload {
    pub(crate) fn lent(sh: Arc<Shared>, span: Span) -> Self {
        ShmPayload(Repr::Lent {
            sh,
            span: Some(span),
        })
    }

    pub(crate) fn copied(b: Bytes) -> Self {
        ShmPayload(Repr::Copied(b))
    }

    /// Whether this is a view of the ring (false: a copy).
    pub fn is_lent(&self) -> bool {
        matches!(self.0, Repr::Lent { .. })
    }
}

impl AsRef<[u8]> for ShmPayload {
    fn as_ref(&self) -> &[u8] {
        match &self.0 {
            Repr::Lent {
                sh, span: Some(s), ..
            } => sh.region.span(s),
            Repr::Lent { span: None, .. } => &[],
            Repr::Copied(b) => b,
        }
    }
}

impl std::ops::Deref for ShmPayload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

impl Payload for ShmPayload {}

impl std::fmt::Debug for ShmPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmPayload")
            .field("lent", &self.is_lent())
            .field("len", &self.as_ref().len())
            .finish()
    }
}

impl Drop for ShmPayload {
    fn drop(&mut self) {
        if let Repr::Lent { sh, span } = &mut self.0
            && let Some(span) = span.take()
        {
            lock(&sh.rx).release(&sh.region, span);
        }
    }
}

/// A send buffer lent by [`crate::ShmConnection`] (`LendBuffer::lend`): a record's payload
/// area in the send ring. Fill it through `AsMut<[u8]>` and send it with `Emit::emit`;
/// dropped unsent, it leaves the ring as a record the receiver skips.
pub struct ShmBuf {
    sh: Arc<Shared>,
    /// Taken by `emit` or `drop`.
    span: Option<Span>,
}

impl ShmBuf {
    pub(crate) fn new(sh: Arc<Shared>, span: Span) -> Self {
        ShmBuf {
            sh,
            span: Some(span),
        }
    }

    /// The reservation, for `emit` on the connection that lent it (`None` for a buffer of
    /// another connection: it then goes back unsent as it drops).
    pub(crate) fn into_span(mut self, sh: &Arc<Shared>) -> Option<Span> {
        if Arc::ptr_eq(&self.sh, sh) {
            self.span.take()
        } else {
            None
        }
    }

    /// The buffer's length (what was asked of `lend`).
    pub fn len(&self) -> usize {
        self.span.as_ref().map_or(0, Span::len)
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl AsMut<[u8]> for ShmBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        match &mut self.span {
            Some(s) => self.sh.region.span_mut(s),
            None => &mut [],
        }
    }
}

impl AsRef<[u8]> for ShmBuf {
    fn as_ref(&self) -> &[u8] {
        match &self.span {
            Some(s) => self.sh.region.span(s),
            None => &[],
        }
    }
}

impl std::fmt::Debug for ShmBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmBuf").field("len", &self.len()).finish()
    }
}

impl Drop for ShmBuf {
    fn drop(&mut self) {
        if let Some(span) = self.span.take() {
            let mut tx = lock(&self.sh.tx);
            tx.finish(&self.sh.region, span, false);
            tx.publish(&self.sh.region);
        }
    }
}
