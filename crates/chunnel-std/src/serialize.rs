//! Typed messages over byte connections: the serialization Chunnel.
//!
//! [`Serialize<T, F>`] turns a byte connection (`Data = Bytes`) into a typed one
//! (`Data = T`, any serde type), one message per value, in a [`Format`]:
//!
//! | format     | label         | trade-off                                                    |
//! |------------|---------------|--------------------------------------------------------------|
//! | [`Bincode`] | `"bincode"`  | compact and fast; **not** self-describing: both ends need the same type, and serde features that need `deserialize_any` (`#[serde(flatten)]`, untagged enums, `serde_json::Value`) do not decode |
//! | [`Json`]    | `"json"`     | self-describing, readable, tolerant of added fields; larger and slower; non-finite floats encode as `null` and then fail to decode |
//!
//! # Negotiation
//!
//! Both ends must use the same format, so each Chunnel carries the **exact** capability
//! `serialization = {<format label>}` (id [`ID`], shared by the formats: the capability
//! carries the configuration). Negotiation therefore never pairs two formats; a
//! `select(Serialize::bincode(), Serialize::json())` agrees on a format both ends have
//! (the server's preference order decides between common ones). The capability names the
//! format, not the type `T`: two ends that disagree on the schema negotiate fine and then
//! see decode errors.
//!
//! # Data path
//!
//! * Sending encodes each message into a per-thread scratch buffer and copies it into an
//!   exact-size [`Bytes`]: one allocation per message, the encoded buffer itself (the scratch
//!   is reused; it is released when a message made it grow past 64 KiB). A burst is passed
//!   down lazily, without collecting it. A message that fails to encode ends the burst there:
//!   the messages before it are sent, it and the ones after it are not, and `send` returns
//!   [`Error::Encode`] (converted to [`chunnel::Error::Layer`]).
//! * Receiving decodes each message straight from the received [`Bytes`] (no copy) into the
//!   caller's slots, at most [`RECV_BATCH`] messages per call. A message that does not decode
//!   (wrong format, garbage, trailing bytes) is dropped and reported as [`Error::Decode`]:
//!   at once if nothing good arrived with it, else by the next `recv`, so the good messages
//!   of the same batch are delivered first. The connection stays usable.
//! * Decoding is bounded: JSON by the message's length (and serde_json's nesting limit of
//!   128); bincode by the message's length (every element of a container consumes at least
//!   one byte, except zero-sized ones) and by a limit of [`BINCODE_LIMIT`] (16 MiB) on the
//!   bytes a single message may claim for strings and byte buffers.
//!
//! # Example
//!
//! ```
//! use chunnel::{Chunnel, ChunnelExt, ConnectionExt, Listener};
//! use chunnel_net::udp;
//! use chunnel_std::serialize::Serialize;
//!
//! #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
//! struct Ping {
//!     seq: u32,
//!     note: String,
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), chunnel::Error> {
//! let listener = udp::Listener::bind("127.0.0.1:0".parse().unwrap()).await?;
//! let addr = listener.local_addr()?;
//! let mut server = Serialize::<Ping, _>::bincode().serve(listener);
//!
//! let client = Serialize::<Ping, _>::bincode()
//!     .connect_wrap(udp::Connect::new(addr).connect_wrap(()).await?)
//!     .await?;
//! client.send_one(Ping { seq: 1, note: "hi".into() }).await?;
//!
//! let conn = server.accept().await?;
//! assert_eq!(conn.recv_one().await?, Ping { seq: 1, note: "hi".into() });
//! # Ok(()) }
//! ```

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use chunnel::{Capability, Chunnel, ChunnelConnection, Handover, Negotiate};
use serde::de::DeserializeOwned;

use crate::Error;

/// The stable negotiation id of the serialization Chunnel (every format).
pub const ID: &str = "chunnel-std/serialize/1";

/// The kind of the exact capability that names the format.
pub const CAPABILITY: &str = "serialization";

/// The most bytes one bincode message may claim while decoding (strings, byte buffers):
/// 16 MiB. Messages are also bounded by their own length.
pub const BINCODE_LIMIT: usize = 16 << 20;

/// The most messages one `recv` decodes (its receive buffer lives in the future, not on the
/// heap). Larger slot arrays are filled up to this many per call.
pub const RECV_BATCH: usize = 32;

/// A scratch buffer that grew past this is released after the message instead of kept.
const SCRATCH_KEEP: usize = 64 * 1024;

/// A wire format: how one value becomes one message and back.
///
/// Implemented by [`Bincode`] and [`Json`]; other formats may implement it too (pick a
/// unique [`Format::NAME`]: it is the negotiated label).
pub trait Format: Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// The format's label in the `serialization` capability and in errors.
    const NAME: &'static str;

    /// Appends the encoding of `value` to `out`.
    fn encode<T: serde::Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), Error>;

    /// Decodes one value from the whole of `bytes` (trailing bytes are an error). Must not
    /// panic, whatever `bytes` holds.
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Error>;

    /// Encodes `value` into an exact-size [`Bytes`] (one allocation; the encoding goes
    /// through a reused per-thread scratch buffer). This is what a connection sends.
    fn to_bytes<T: serde::Serialize + ?Sized>(value: &T) -> Result<Bytes, Error> {
        thread_local! {
            static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        let fresh = || {
            let mut buf = Vec::new();
            Self::encode(value, &mut buf)?;
            Ok(Bytes::from(buf))
        };
        SCRATCH
            .try_with(|s| {
                // Busy only if `encode` re-entered (a `Serialize` impl that sends).
                let Ok(mut buf) = s.try_borrow_mut() else {
                    return fresh();
                };
                buf.clear();
                let r = Self::encode(value, &mut buf).map(|()| Bytes::copy_from_slice(&buf));
                if buf.capacity() > SCRATCH_KEEP {
                    *buf = Vec::new();
                }
                r
            })
            .unwrap_or_else(|_| fresh()) // the thread is being torn down
    }
}

/// bincode 2 through serde, with `bincode::config::standard()` (little endian, variable-length
/// integers) and a decoding limit of [`BINCODE_LIMIT`]. Compact, not self-describing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bincode;

/// The fixed bincode configuration of [`Bincode`].
fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<BINCODE_LIMIT>()
}

impl Format for Bincode {
    const NAME: &'static str = "bincode";

    fn encode<T: serde::Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), Error> {
        bincode::serde::encode_into_std_write(value, out, bincode_config())
            .map(drop)
            .map_err(|e| Error::Encode {
                format: Self::NAME,
                message: e.to_string(),
            })
    }

    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Error> {
        let fail = |message: String| Error::Decode {
            format: Self::NAME,
            message,
        };
        let (value, used) = bincode::serde::decode_from_slice(bytes, bincode_config())
            .map_err(|e| fail(format!("message of {} bytes: {e}", bytes.len())))?;
        if used != bytes.len() {
            return Err(fail(format!(
                "message of {} bytes has {} trailing bytes",
                bytes.len(),
                bytes.len() - used
            )));
        }
        Ok(value)
    }
}

/// JSON through serde_json. Self-describing and readable; larger and slower than
/// [`Bincode`]. Floats round-trip exactly (serde_json's `float_roundtrip`); non-finite
/// floats encode as `null`, which does not decode as a float.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Json;

impl Format for Json {
    const NAME: &'static str = "json";

    fn encode<T: serde::Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), Error> {
        serde_json::to_writer(out, value).map_err(|e| Error::Encode {
            format: Self::NAME,
            message: e.to_string(),
        })
    }

    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::Decode {
            format: Self::NAME,
            message: format!("message of {} bytes: {e}", bytes.len()),
        })
    }
}

/// The serialization Chunnel: over a byte connection, a connection of `T`s encoded in
/// format `F` (see the [module docs](self)).
///
/// Build it with [`Serialize::bincode`], [`Serialize::json`] or, for any format,
/// [`Serialize::new`]. It holds no state: cloning is free and one value may build any
/// number of connections.
pub struct Serialize<T, F> {
    _marker: PhantomData<fn() -> (T, F)>,
}

impl<T, F: Format> Serialize<T, F> {
    /// The Chunnel for format `F`.
    pub fn new() -> Self {
        Serialize {
            _marker: PhantomData,
        }
    }

    /// The format's label (`"bincode"`, `"json"`).
    pub fn format(&self) -> &'static str {
        F::NAME
    }
}

impl<T> Serialize<T, Bincode> {
    /// Compact [`Bincode`] encoding.
    pub fn bincode() -> Self {
        Serialize::new()
    }
}

impl<T> Serialize<T, Json> {
    /// Self-describing [`Json`] encoding.
    pub fn json() -> Self {
        Serialize::new()
    }
}

impl<T, F: Format> Default for Serialize<T, F> {
    fn default() -> Self {
        Serialize::new()
    }
}

impl<T, F> Clone for Serialize<T, F> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T, F> Copy for Serialize<T, F> {}

impl<T, F: Format> fmt::Debug for Serialize<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Serialize")
            .field("type", &std::any::type_name::<T>())
            .field("format", &F::NAME)
            .finish()
    }
}

impl<T, F: Format> Negotiate for Serialize<T, F> {
    fn id(&self) -> &'static str {
        ID
    }

    fn capabilities(&self) -> Vec<Capability> {
        // Both ends must speak the same format: exact match.
        vec![Capability::exact(CAPABILITY, [F::NAME])]
    }
}

impl<C, T, F> Chunnel<C> for Serialize<T, F>
where
    C: ChunnelConnection<Data = Bytes>,
    T: serde::Serialize + DeserializeOwned + Send + Sync + 'static,
    F: Format,
{
    type Connection = SerializeConn<C, T, F>;

    async fn connect_wrap(&mut self, inner: C) -> Result<Self::Connection, chunnel::Error> {
        Ok(SerializeConn {
            inner,
            has_pending: AtomicBool::new(false),
            pending: Mutex::new(None),
            spare: Mutex::new(None),
            _marker: PhantomData,
        })
    }
}

/// A [`Serialize`] connection: `T`s in format `F` over the byte connection `C`.
///
/// Errors: [`Error::Encode`] from `send`, [`Error::Decode`] from `recv` (both as
/// [`chunnel::Error::Layer`] with layer `"chunnel-std/serialize"`; downcast the source to
/// [`crate::Error`]). `recv` is cancel safe: nothing is awaited once the inner `recv` returned.
pub struct SerializeConn<C, T, F> {
    inner: C,
    /// Fast path: whether `pending` holds an error.
    has_pending: AtomicBool,
    /// A decode error of a batch that also had good messages, reported by the next `recv`.
    pending: Mutex<Option<Error>>,
    /// The array the inner connection receives into, kept between calls: a fresh one per
    /// call would be 1 KiB to zero and 32 slots to drop for every message. Taken by one `recv` at
    /// a time (a concurrent one makes its own) and put back empty, also when the call is
    /// cancelled.
    spare: Mutex<Option<Box<RawSlots>>>,
    _marker: PhantomData<fn() -> (T, F)>,
}

type RawSlots = [Option<Bytes>];

/// A receive array taken from [`SerializeConn::spare`]; goes back on drop.
struct Borrowed<'a> {
    home: &'a Mutex<Option<Box<RawSlots>>>,
    raw: Option<Box<RawSlots>>,
}

impl Borrowed<'_> {
    fn slots(&mut self) -> &mut RawSlots {
        // Built on the heap (a `Box::new` of an array is zeroed on the stack first).
        self.raw
            .get_or_insert_with(|| (0..RECV_BATCH).map(|_| None).collect())
    }
}

impl Drop for Borrowed<'_> {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            // Every message was taken out (or none came: the inner `recv` fills slots only
            // when it returns them).
            debug_assert!(raw.iter().all(Option::is_none));
            let mut home = self.home.lock().unwrap_or_else(|p| p.into_inner());
            if home.is_none() {
                *home = Some(raw);
            }
        }
    }
}

impl<C, T, F> SerializeConn<C, T, F> {
    /// The byte connection below.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }

    /// The byte connection below (a decode error not reported yet is dropped).
    pub fn into_inner(self) -> C {
        self.inner
    }

    fn take_pending(&self) -> Option<Error> {
        if !self.has_pending.swap(false, Ordering::Acquire) {
            return None;
        }
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn set_pending(&self, e: Error) {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        // One report per bad batch; a later one (concurrent receivers) replaces it.
        *p = Some(e);
        self.has_pending.store(true, Ordering::Release);
    }
}

impl<C: fmt::Debug, T, F: Format> fmt::Debug for SerializeConn<C, T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SerializeConn")
            .field("type", &std::any::type_name::<T>())
            .field("format", &F::NAME)
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<C, T, F> ChunnelConnection for SerializeConn<C, T, F>
where
    C: ChunnelConnection<Data = Bytes>,
    T: serde::Serialize + DeserializeOwned + Send + Sync + 'static,
    F: Format,
{
    type Data = T;

    async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
    where
        B: IntoIterator<Item = T> + Send,
        B::IntoIter: Send,
    {
        // The first encode error; the burst ends at that message.
        let failed: Mutex<Option<Error>> = Mutex::new(None);
        let encoded = burst.into_iter().map_while(|m| match F::to_bytes(&m) {
            Ok(b) => Some(b),
            Err(e) => {
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                None
            }
        });
        let sent = self.inner.send(encoded).await;
        let failed = failed.into_inner().unwrap_or_else(|p| p.into_inner());
        // An error of the inner send concerns messages before the bad one: it comes first.
        sent?;
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    async fn recv<'a>(&'a self, slots: &'a mut [Option<T>]) -> Result<usize, chunnel::Error> {
        if slots.is_empty() {
            return Ok(0);
        }
        if let Some(e) = self.take_pending() {
            return Err(e.into());
        }
        let want = slots.len().min(RECV_BATCH);
        let mut borrowed = Borrowed {
            home: &self.spare,
            raw: self.spare.lock().unwrap_or_else(|p| p.into_inner()).take(),
        };
        let raw = borrowed.slots();
        loop {
            // Cancel safe: nothing is awaited after the inner recv returned.
            let n = self.inner.recv(&mut raw[..want]).await?;
            let mut good = 0;
            let mut bad = 0;
            let mut first_error = None;
            for m in raw[..n].iter_mut() {
                let Some(m) = m.take() else { continue };
                match F::decode::<T>(&m) {
                    Ok(v) => {
                        slots[good] = Some(v);
                        good += 1;
                    }
                    Err(e) => {
                        bad += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            if let Some(mut e) = first_error {
                if bad > 1
                    && let Error::Decode { message, .. } = &mut e
                {
                    use std::fmt::Write as _;
                    let _ = write!(message, " (and {} more of the same batch)", bad - 1);
                }
                if good == 0 {
                    return Err(e.into());
                }
                self.set_pending(e);
            }
            if good > 0 {
                return Ok(good);
            }
        }
    }
}

/// No state to hand over: a serialization connection buffers nothing between calls (a
/// pending decode error is not carried over).
impl<C, T, F> Handover for SerializeConn<C, T, F>
where
    C: ChunnelConnection<Data = Bytes>,
    T: serde::Serialize + DeserializeOwned + Send + Sync + 'static,
    F: Format,
{
    fn export(&self, _: &mut chunnel::Handoff<T>) {}
    fn import(&self, _: &mut chunnel::Handoff<T>) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_is_exact_and_names_the_format() {
        let b = Serialize::<u32, _>::bincode().capabilities();
        let j = Serialize::<u32, _>::json().capabilities();
        assert_eq!(b, [Capability::exact("serialization", ["bincode"])]);
        assert_eq!(j, [Capability::exact("serialization", ["json"])]);
        assert!(!b[0].compatible(&j[0]));
        assert_eq!(Serialize::<u32, Json>::new().id(), ID);
    }

    #[test]
    fn trailing_bytes_do_not_decode() {
        let mut m = Bincode::to_bytes(&7u32).unwrap().to_vec();
        m.push(0);
        assert!(matches!(
            Bincode::decode::<u32>(&m),
            Err(Error::Decode {
                format: "bincode",
                ..
            })
        ));
        assert!(Json::decode::<u32>(b"7 8").is_err());
        assert_eq!(Json::decode::<u32>(b"7").unwrap(), 7);
    }

    /// An in-memory byte connection: what is sent is received, in one batch.
    #[derive(Debug, Default)]
    struct Loopback(Mutex<std::collections::VecDeque<Bytes>>);

    impl ChunnelConnection for Loopback {
        type Data = Bytes;

        async fn send<B>(&self, burst: B) -> Result<(), chunnel::Error>
        where
            B: IntoIterator<Item = Bytes> + Send,
            B::IntoIter: Send,
        {
            self.0.lock().unwrap().extend(burst);
            Ok(())
        }

        async fn recv<'a>(
            &'a self,
            slots: &'a mut [Option<Bytes>],
        ) -> Result<usize, chunnel::Error> {
            let mut q = self.0.lock().unwrap();
            if q.is_empty() {
                return Err(chunnel::Error::Closed); // would wait forever
            }
            let n = q.len().min(slots.len());
            for (s, m) in slots.iter_mut().zip(q.drain(..n)) {
                *s = Some(m);
            }
            Ok(n)
        }
    }

    fn is_decode_error(r: Result<usize, chunnel::Error>, more: bool) -> bool {
        let Err(chunnel::Error::Layer { source, .. }) = r else {
            return false;
        };
        matches!(
            source.downcast_ref::<Error>(),
            Some(Error::Decode { message, .. }) if message.contains("more of the same batch") == more
        )
    }

    #[tokio::test]
    async fn bad_messages_of_a_batch_are_reported_after_the_good_ones() {
        let conn = Serialize::<String, _>::json()
            .connect_wrap(Loopback::default())
            .await
            .unwrap();
        let wire = |m: &[u8]| {
            conn.get_ref()
                .0
                .lock()
                .unwrap()
                .push_back(Bytes::copy_from_slice(m))
        };
        wire(b"\"one\"");
        wire(b"garbage");
        wire(b"\"two\"");
        wire(b"[1]");
        let mut slots = vec![None; 8];
        assert_eq!(conn.recv(&mut slots).await.unwrap(), 2);
        assert_eq!(slots[..2], [Some("one".into()), Some("two".into())]);
        // The two bad ones: one error, naming the second.
        assert!(is_decode_error(conn.recv(&mut slots).await, true));
        // Only bad ones: the error at once.
        wire(b"{");
        assert!(is_decode_error(conn.recv(&mut slots).await, false));
        // Still usable; the batch is capped at RECV_BATCH.
        conn.send((0..RECV_BATCH + 1).map(|i| i.to_string()))
            .await
            .unwrap();
        assert_eq!(conn.recv(&mut vec![None; 100]).await.unwrap(), RECV_BATCH);
        assert_eq!(conn.recv(&mut slots).await.unwrap(), 1);
        assert_eq!(slots[0].as_deref(), Some("32"));
        assert_eq!(conn.recv(&mut []).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn an_encode_error_ends_the_burst_there() {
        // JSON map keys must be strings (or numbers): a byte-vector key does not encode.
        let conn = Serialize::<std::collections::BTreeMap<Vec<u8>, u8>, _>::json()
            .connect_wrap(Loopback::default())
            .await
            .unwrap();
        let ok = std::collections::BTreeMap::new();
        let bad = std::collections::BTreeMap::from([(vec![1u8], 1u8)]);
        let r = conn.send([ok.clone(), bad, ok.clone()]).await;
        let Err(chunnel::Error::Layer { source, .. }) = r else {
            panic!("{r:?}")
        };
        assert!(matches!(
            source.downcast_ref::<Error>(),
            Some(Error::Encode { format: "json", .. })
        ));
        assert_eq!(
            conn.get_ref().0.lock().unwrap().len(),
            1,
            "only the first was sent"
        );
    }

    #[test]
    fn to_bytes_is_exact_size() {
        let b = Json::to_bytes(&vec!["a"; 1000]).unwrap();
        assert_eq!(b.len(), 1000 * 4 + 1);
        assert_eq!(Json::decode::<Vec<String>>(&b).unwrap().len(), 1000);
    }
}
