//! Length-framed messages over a byte stream (TCP, Unix stream), shared by [`crate::tcp`] and
//! [`crate::uds`].
//!
//! Frame: a 4-byte big-endian length `n`, then `n` bytes of message. `n` above the
//! connection's `max_payload` is a protocol error: after delivering the frames before it, the
//! receiver reports [`Error::Malformed`] and every later `recv` fails with [`Error::Closed`],
//! since the stream cannot be resynchronised. Sending still works until the connection is
//! dropped or closed.

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use chunnel::{ChunnelConnection, Error, SendHeader};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

/// Bytes of the length prefix.
pub const HEADER_LEN: usize = 4;
/// Largest frame a stream connection carries by default (16 MiB).
pub const DEFAULT_MAX_PAYLOAD: usize = 16 * 1024 * 1024;
const READ_CHUNK: usize = 64 * 1024;

/// Settings of a stream datapath.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Largest message, in bytes (at most `u32::MAX`).
    pub max_payload: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_payload: DEFAULT_MAX_PAYLOAD,
        }
    }
}

impl Config {
    /// Sets [`Config::max_payload`].
    pub fn with_max_payload_bytes(mut self, n: usize) -> Self {
        self.max_payload = n.clamp(1, u32::MAX as usize);
        self
    }
}

struct ReadState<R> {
    io: R,
    buf: BytesMut,
    broken: Option<Error>,
}

struct WriteState<W> {
    io: W,
    /// Encoded frames not yet written (a cancelled `send` leaves its rest here; the next
    /// `send` writes it first, so frames are never interleaved or torn).
    buf: BytesMut,
    shut: bool,
}

/// A message connection over a byte stream.
pub struct Connection<R, W> {
    rd: Mutex<ReadState<R>>,
    wr: Mutex<WriteState<W>>,
    max_payload: usize,
    peer: String,
}

impl<R, W> fmt::Debug for Connection<R, W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("framed::Connection")
            .field("peer", &self.peer)
            .field("max_payload", &self.max_payload)
            .finish_non_exhaustive()
    }
}

impl<R, W> Connection<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    /// Frames messages over a byte stream given as its read and write halves (`peer` names
    /// the other end in errors). Any ordered reliable stream works: a TCP or Unix socket, or
    /// a TLS session over one (`chunnel-secure` builds its TLS datapath this way).
    pub fn new(rd: R, wr: W, cfg: &Config, peer: String) -> Self {
        Connection {
            rd: Mutex::new(ReadState {
                io: rd,
                buf: BytesMut::new(),
                broken: None,
            }),
            wr: Mutex::new(WriteState {
                io: wr,
                buf: BytesMut::new(),
                shut: false,
            }),
            max_payload: cfg.max_payload,
            peer,
        }
    }

    /// The peer's address, for messages.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Flushes what is pending and shuts the write direction: the peer's `recv` then fails with
    /// [`Error::PeerClosed`] after the messages already sent. Later sends fail with
    /// [`Error::Closed`]. Dropping the connection closes both directions.
    pub async fn close(&self) -> Result<(), Error> {
        let mut w = self.wr.lock().await;
        if w.shut {
            return Ok(());
        }
        w.shut = true;
        let WriteState { io, buf, .. } = &mut *w;
        while buf.has_remaining() {
            io.write_buf(buf)
                .await
                .map_err(|e| self.io_err("close", e))?;
        }
        io.shutdown().await.map_err(|e| self.io_err("close", e))
    }

    fn io_err(&self, op: &'static str, e: std::io::Error) -> Error {
        Error::from_io(op, &self.peer, e)
    }

    /// Moves complete frames from `buf` into `slots`.
    fn parse(&self, st: &mut ReadState<R>, slots: &mut [Option<Bytes>]) -> Result<usize, Error> {
        let mut n = 0;
        while n < slots.len() && st.buf.len() >= HEADER_LEN {
            let len = u32::from_be_bytes([st.buf[0], st.buf[1], st.buf[2], st.buf[3]]) as usize;
            if len > self.max_payload {
                if n > 0 {
                    // Deliver the good frames first; the next call reports the bad header.
                    break;
                }
                let e = Error::Malformed {
                    what: "frame length exceeds max_payload",
                };
                st.broken = Some(Error::Closed);
                return Err(e);
            }
            if st.buf.len() < HEADER_LEN + len {
                st.buf.reserve(HEADER_LEN + len - st.buf.len());
                break;
            }
            st.buf.advance(HEADER_LEN);
            slots[n] = Some(st.buf.split_to(len).freeze());
            n += 1;
        }
        Ok(n)
    }
}

impl<R, W> chunnel::PeerHandoff for Connection<R, W> {
    /// A stream connection owns its transport: an address is never shared, so never needed.
    fn hand_off(&self, _first: Bytes) -> bool {
        false
    }
}

impl<R, W> SendHeader for Connection<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    /// Not cancel safe in the strict sense: a cancelled send may still deliver its burst
    /// (whole frames only) with the next `send` or `close`.
    async fn send_with_header<'a, B>(&'a self, header: &'a [u8], burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send + 'a,
        B::IntoIter: Send,
    {
        let max = self.max_payload.saturating_sub(header.len());
        let mut w = self.wr.lock().await;
        if w.shut {
            return Err(Error::Closed);
        }
        let mut too_large = None;
        for m in burst {
            if m.len() > max {
                too_large = Some(m.len());
                break;
            }
            w.buf.reserve(HEADER_LEN + header.len() + m.len());
            w.buf.put_u32((header.len() + m.len()) as u32);
            w.buf.put_slice(header);
            w.buf.put_slice(&m);
        }
        let WriteState { io, buf, .. } = &mut *w;
        while buf.has_remaining() {
            io.write_buf(buf)
                .await
                .map_err(|e| self.io_err("send", e))?;
        }
        match too_large {
            Some(len) => Err(Error::MessageTooLarge { len, max }),
            None => Ok(()),
        }
    }
}

impl<R, W> ChunnelConnection for Connection<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    type Data = Bytes;

    /// Not cancel safe in the strict sense: a cancelled send may still deliver its burst
    /// (whole frames only) with the next `send` or `close`.
    async fn send<B>(&self, burst: B) -> Result<(), Error>
    where
        B: IntoIterator<Item = Bytes> + Send,
        B::IntoIter: Send,
    {
        self.send_with_header(&[], burst).await
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<Bytes>]) -> Result<usize, Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        let mut st = self.rd.lock().await;
        loop {
            if let Some(e) = &st.broken {
                return Err(match e {
                    Error::PeerClosed => Error::PeerClosed,
                    _ => Error::Closed,
                });
            }
            let n = self.parse(&mut st, slots)?;
            if n > 0 {
                return Ok(n);
            }
            if st.buf.capacity() - st.buf.len() < READ_CHUNK / 4 {
                st.buf.reserve(READ_CHUNK);
            }
            let ReadState { io, buf, .. } = &mut *st;
            match io.read_buf(buf).await {
                Ok(0) => {
                    st.broken = Some(Error::PeerClosed);
                    return Err(Error::PeerClosed);
                }
                Ok(_) => {}
                Err(e) => {
                    let e = self.io_err("recv", e);
                    if e.is_closed() {
                        st.broken = Some(Error::PeerClosed);
                    }
                    return Err(e);
                }
            }
        }
    }
}

/// No state is handed over. This connection does buffer received bytes (its read buffer may
/// hold complete frames not yet delivered, and part of the next one), but under a
/// reconfigurable select it sits below [`chunnel::Shared`] and outlives the switch, so the new
/// branch reads them. When a stream connection is itself a select branch, the frames left in
/// the old connection's buffer are lost with it, like the bytes still in its kernel socket: a
/// lossless switch between two streams needs the peer to stop sending on the old one first
/// (a multilateral switch).
impl<R, W> chunnel::Handover for Connection<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    fn export(&self, _: &mut chunnel::Handoff<Self::Data>) {}
    fn import(&self, _: &mut chunnel::Handoff<Self::Data>) {}
}
