//! The binding messages (docs/wire.md §16): BIND and BOUND, the transcript hash and signed
//! message, and the comparison that names what was tampered with.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use chunnel_negotiate::Transcript;
use rustls::pki_types::CertificateDer;

use super::Transport;
use super::option::parse_server_stack;

/// BIND's type byte.
pub(super) const BIND: u8 = 0xb1;
/// BOUND's type byte.
pub(super) const BOUND: u8 = 0xb2;
/// REBIND's type byte (a reconnect on a remembered secure pick, docs/wire.md §16.5).
pub(super) const REBIND: u8 = 0xb3;
/// Largest hello a REBIND may carry.
pub(super) const MAX_REBIND_HELLO: usize = 16 * 1024;
const BIND_LEN: usize = 1 + 8 + 32;
/// Prefix of the transcript hash.
const HASH_CONTEXT: &[u8] = b"chunnel negotiation transcript v1\0";
/// Prefix of the signed message.
const SIGN_CONTEXT: &[u8] = b"chunnel negotiation transcript signature v1\0";
/// Largest BOUND a client reads (certificate chains included).
pub(super) const MAX_BOUND: usize = 64 * 1024;

/// What the server found when it compared transcripts (BOUND's status byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Status {
    Agreed = 0,
    Differ = 1,
    Unknown = 2,
    WrongEndpoint = 3,
    /// Answer to a REBIND: this server would not pick this endpoint's transport for the
    /// hello now; negotiate afresh (nothing behind the REBIND was delivered).
    Renegotiate = 4,
}

impl Status {
    pub(super) fn from_u8(b: u8) -> Option<Status> {
        [
            Status::Agreed,
            Status::Differ,
            Status::Unknown,
            Status::WrongEndpoint,
            Status::Renegotiate,
        ]
        .into_iter()
        .find(|s| *s as u8 == b)
    }
}

/// SHA-256 over the context, then the hello and the accept, each after its `u32` length.
pub(super) fn transcript_hash(t: &Transcript) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(HASH_CONTEXT);
    for part in [&t.hello, &t.accept] {
        ctx.update(&(part.len() as u32).to_be_bytes());
        ctx.update(part);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// The message a plaintext BOUND's signature covers.
pub(super) fn signed_message(hash: &[u8; 32], status: u8, conn_id: u64) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGN_CONTEXT.len() + 32 + 9);
    m.extend_from_slice(SIGN_CONTEXT);
    m.extend_from_slice(hash);
    m.push(status);
    m.extend_from_slice(&conn_id.to_be_bytes());
    m
}

pub(super) fn encode_bind(conn_id: u64, hash: &[u8; 32]) -> Bytes {
    let mut b = BytesMut::with_capacity(BIND_LEN);
    b.put_u8(BIND);
    b.put_u64(conn_id);
    b.put_slice(hash);
    b.freeze()
}

pub(super) fn decode_bind(m: &[u8]) -> Option<(u64, [u8; 32])> {
    if m.len() != BIND_LEN || m[0] != BIND {
        return None;
    }
    let id = u64::from_be_bytes(m[1..9].try_into().ok()?);
    let h: [u8; 32] = m[9..].try_into().ok()?;
    Some((id, h))
}

/// REBIND: the type byte, then the remembered HELLO after its `u32` length.
pub(super) fn encode_rebind(hello: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + hello.len());
    b.put_u8(REBIND);
    b.put_u32(hello.len() as u32);
    b.put_slice(hello);
    b.freeze()
}

/// The HELLO a REBIND carries (a slice of `m`); `None` if `m` is not exactly a REBIND.
pub(super) fn decode_rebind(m: &Bytes) -> Option<Bytes> {
    if m.len() < 5 || m[0] != REBIND {
        return None;
    }
    let n = u32::from_be_bytes(m[1..5].try_into().ok()?) as usize;
    if n == 0 || n > MAX_REBIND_HELLO || m.len() != 5 + n {
        return None;
    }
    Some(m.slice(5..))
}

/// A decoded BOUND.
#[derive(Debug, Default)]
pub(super) struct Bound {
    pub(super) status: u8,
    pub(super) view: Transcript,
    pub(super) scheme: u16,
    pub(super) chain: Vec<CertificateDer<'static>>,
    pub(super) signature: Bytes,
}

impl Bound {
    pub(super) fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(
            16 + self.view.hello.len()
                + self.view.accept.len()
                + self.chain.iter().map(|c| c.len() + 4).sum::<usize>()
                + self.signature.len(),
        );
        b.put_u8(BOUND);
        b.put_u8(self.status);
        for part in [&self.view.hello, &self.view.accept] {
            b.put_u32(part.len() as u32);
            b.put_slice(part);
        }
        b.put_u16(self.scheme);
        b.put_u16(self.chain.len() as u16);
        for c in &self.chain {
            b.put_u32(c.len() as u32);
            b.put_slice(c);
        }
        b.put_u16(self.signature.len() as u16);
        b.put_slice(&self.signature);
        b.freeze()
    }

    pub(super) fn decode(mut m: Bytes) -> Result<Bound, &'static str> {
        fn take(m: &mut Bytes, n: usize, what: &'static str) -> Result<Bytes, &'static str> {
            if m.remaining() < n {
                return Err(what);
            }
            Ok(m.split_to(n))
        }
        if take(&mut m, 1, "empty")?[0] != BOUND {
            return Err("not a BOUND message");
        }
        let status = take(&mut m, 1, "status")?[0];
        let part = |m: &mut Bytes, what| {
            let n = take(m, 4, what)?.get_u32() as usize;
            take(m, n, what)
        };
        let hello = part(&mut m, "hello")?;
        let accept = part(&mut m, "accept")?;
        let scheme = take(&mut m, 2, "scheme")?.get_u16();
        let n = take(&mut m, 2, "chain count")?.get_u16();
        let mut chain = Vec::new();
        for _ in 0..n {
            let c = part(&mut m, "certificate")?;
            chain.push(CertificateDer::from(c.to_vec()));
        }
        let sl = take(&mut m, 2, "signature length")?.get_u16() as usize;
        let signature = take(&mut m, sl, "signature")?;
        if m.has_remaining() {
            return Err("trailing bytes");
        }
        Ok(Bound {
            status,
            view: Transcript { hello, accept },
            scheme,
            chain,
            signature,
        })
    }
}

/// The fuzz target's entry (not a stable API): decodes `m` as a BIND, a REBIND and a BOUND
/// message (docs/wire.md §16); whatever decodes must re-encode to the same bytes.
#[doc(hidden)]
pub fn fuzz_decode(m: &[u8]) {
    if let Some(h) = decode_rebind(&Bytes::copy_from_slice(m)) {
        assert_eq!(
            &encode_rebind(&h)[..],
            m,
            "a REBIND that does not re-encode"
        );
    }
    if let Some((id, h)) = decode_bind(m) {
        assert_eq!(
            &encode_bind(id, &h)[..],
            m,
            "a BIND that does not re-encode"
        );
    }
    if let Ok(b) = Bound::decode(Bytes::copy_from_slice(m)) {
        assert_eq!(&b.encode()[..], m, "a BOUND that does not re-encode");
    }
}

/// What an attacker (or a fault) changed, as far as the two transcripts tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tampered {
    /// The HELLO the server received differs from the one the client sent (offers stripped
    /// or changed).
    Hello,
    /// The ACCEPT the client received differs from the one the server sent (pick changed).
    Accept,
    /// Both differ.
    HelloAndAccept,
    /// The server's account of the negotiation could not be authenticated: a plaintext pick
    /// whose answer is unsigned, signed by a key the client does not trust, or badly signed;
    /// or no answer the client can read.
    Unverified,
    /// The server has no record of this negotiation (or it expired).
    Unknown,
}

impl std::fmt::Display for Tampered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tampered::Hello => "the hello was changed",
            Tampered::Accept => "the accept was changed",
            Tampered::HelloAndAccept => "the hello and the accept were changed",
            Tampered::Unverified => "the negotiation could not be authenticated",
            Tampered::Unknown => "the server has no record of this negotiation",
        })
    }
}

/// The transports a hello offers, in its order (for error messages).
fn hello_offers(hello: &[u8]) -> String {
    let Some(body) = hello.get(1..) else {
        return "?".into();
    };
    match chunnel_negotiate::wire::Hello::decode(body) {
        Ok(h) => {
            let names: Vec<String> = h
                .offers
                .options()
                .iter()
                .map(|o| {
                    o.chunnels
                        .first()
                        .and_then(|c| Transport::from_id(&c.id))
                        .map_or_else(|| "?".to_string(), |t| t.to_string())
                })
                .collect();
            format!("[{}]", names.join(", "))
        }
        Err(_) => "(undecodable)".into(),
    }
}

/// The transport an accept picks and its endpoint (for error messages).
fn accept_pick(accept: &[u8]) -> String {
    accept
        .get(1..)
        .and_then(|b| chunnel_negotiate::wire::Accept::decode(b).ok())
        .and_then(|a| parse_server_stack(&a.server_stack))
        .map_or_else(|| "(undecodable)".into(), |(t, a)| format!("{t} at {a}"))
}

/// Compares the client's transcript with the server's view of it.
pub(super) fn compare(mine: &Transcript, theirs: &Transcript) -> Option<(Tampered, String)> {
    let hello = mine.hello != theirs.hello;
    let accept = mine.accept != theirs.accept;
    let mut detail = Vec::new();
    if hello {
        detail.push(format!(
            "hello: client offered {}, server received {}",
            hello_offers(&mine.hello),
            hello_offers(&theirs.hello)
        ));
    }
    if accept {
        detail.push(format!(
            "accept: server picked {}, client received {}",
            accept_pick(&theirs.accept),
            accept_pick(&mine.accept)
        ));
    }
    let what = match (hello, accept) {
        (false, false) => return None,
        (true, false) => Tampered::Hello,
        (false, true) => Tampered::Accept,
        (true, true) => Tampered::HelloAndAccept,
    };
    Some((what, detail.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_and_bound_round_trip() {
        let h = [7u8; 32];
        assert_eq!(decode_bind(&encode_bind(42, &h)), Some((42, h)));
        assert_eq!(decode_bind(&encode_bind(42, &h)[..40]), None);
        let b = Bound {
            status: 1,
            view: Transcript {
                hello: Bytes::from_static(b"\x01hello"),
                accept: Bytes::from_static(b"\x02accept"),
            },
            scheme: 0x0403,
            chain: vec![CertificateDer::from(vec![1, 2, 3])],
            signature: Bytes::from_static(b"sig"),
        };
        let d = Bound::decode(b.encode()).unwrap();
        assert_eq!((d.status, &d.view, d.scheme), (1, &b.view, 0x0403));
        assert_eq!(d.chain, b.chain);
        assert_eq!(d.signature, b.signature);
        // Every truncation is refused, never a panic.
        let e = b.encode();
        for n in 0..e.len() {
            assert!(Bound::decode(e.slice(..n)).is_err());
        }
    }

    #[test]
    fn rebind_round_trip() {
        let r = encode_rebind(b"\x01hello");
        assert_eq!(decode_rebind(&r).as_deref(), Some(&b"\x01hello"[..]));
        for n in 0..r.len() {
            assert_eq!(decode_rebind(&r.slice(..n)), None);
        }
        let mut long = r.to_vec();
        long.push(0);
        assert_eq!(decode_rebind(&Bytes::from(long)), None);
        assert_eq!(decode_rebind(&encode_rebind(b"")), None);
        assert_eq!(Status::from_u8(4), Some(Status::Renegotiate));
    }

    #[test]
    fn the_hash_separates_hello_from_accept() {
        let t = |h: &'static [u8], a: &'static [u8]| Transcript {
            hello: Bytes::from_static(h),
            accept: Bytes::from_static(a),
        };
        assert_ne!(
            transcript_hash(&t(b"ab", b"c")),
            transcript_hash(&t(b"a", b"bc"))
        );
    }
}
