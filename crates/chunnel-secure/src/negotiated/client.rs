//! The client: [`Client`] and its builder; negotiates, connects to the picked endpoint and
//! checks the server's BOUND (signed when a plaintext pick follows secure offers).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use chunnel::{Chunnel, ChunnelConnection, ConnectionExt, Offers};
use chunnel_negotiate::Transcript;
use rustls::SignatureScheme;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{ServerName, UnixTime};

use crate::{ClientConfig, DetectedBy, Error, TrustRoots, quic, tls};

use super::Transport;
use super::bind::{
    Bound, MAX_BOUND, Status, Tampered, compare, encode_bind, encode_rebind, signed_message,
    transcript_hash,
};
use super::connection::{Connection, Link};
use super::option::{Choice, choice, parse_server_stack};
use super::server::{BIND_TIMEOUT, SCHEMES};

/// Whether a client accepts a plaintext pick.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Plaintext is offered if listed; when the client also offered a secure option, a
    /// plaintext pick must come with the server's signature over the transcript.
    #[default]
    AllowPlaintext,
    /// Plaintext is never offered, and a pick of it is refused
    /// ([`Error::PlaintextRefused`]) before any connection is made.
    SecureOnly,
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    offers: Vec<Transport>,
    trust: Option<(TrustRoots, String)>,
    policy: Policy,
    negotiate: chunnel_negotiate::Config,
    remember: usize,
}

/// How long the handshake to a remembered endpoint may take before the client gives up on
/// it and negotiates afresh (a vanished QUIC endpoint would otherwise hold it for the idle
/// timeout). No early data is sent, so nothing has left when it gives up.
const REMEMBERED_DIAL: std::time::Duration = std::time::Duration::from_secs(3);

/// Servers whose last verified secure pick a [`Client`] remembers by default.
pub const REMEMBERED_SERVERS: usize = 1024;

impl ClientBuilder {
    /// How many servers' last verified secure pick to remember for reconnects without a
    /// negotiation round trip (docs/wire.md §16.5; default [`REMEMBERED_SERVERS`]; `0` turns
    /// it off: every connect negotiates).
    pub fn remember(mut self, servers: usize) -> Self {
        self.remember = servers;
        self
    }

    /// The roots the server's certificate must chain to and the name it must carry (for the
    /// secure transports, and for the signature on a plaintext pick). Required if a secure
    /// transport is offered.
    pub fn trust(mut self, roots: TrustRoots, server_name: &str) -> Self {
        self.trust = Some((roots, server_name.to_string()));
        self
    }

    /// The plaintext policy (default [`Policy::AllowPlaintext`]).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The negotiation settings (default: `chunnel_negotiate::Config::default()`).
    pub fn negotiate_config(mut self, cfg: chunnel_negotiate::Config) -> Self {
        self.negotiate = cfg;
        self
    }

    /// The client.
    pub fn build(self) -> Result<Client, Error> {
        let mut offers = Vec::new();
        for t in self.offers {
            let refused = t == Transport::Plain && self.policy == Policy::SecureOnly;
            if !offers.contains(&t) && !refused {
                offers.push(t);
            }
        }
        if offers.is_empty() {
            return Err(Error::Config {
                what: "the client offers no transport".into(),
            });
        }
        let secure = offers.iter().any(|t| t.is_secure());
        let trust = match (self.trust, secure) {
            (Some((roots, name)), _) => {
                let cfg = ClientConfig::builder(roots.clone(), &name).build()?;
                let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots.store().clone()),
                    Arc::new(rustls::crypto::ring::default_provider()),
                )
                .build()
                .map_err(|e| Error::Config {
                    what: format!("trust roots: {e}"),
                })?;
                let name = ServerName::try_from(name.clone()).map_err(|e| Error::Config {
                    what: format!("server name {name:?}: {e}"),
                })?;
                Some(Trust {
                    cfg,
                    verifier,
                    name,
                })
            }
            (None, true) => {
                return Err(Error::Config {
                    what: "offering a secure transport needs trust roots and a server name".into(),
                });
            }
            (None, false) => None,
        };
        Ok(Client {
            offers,
            trust,
            policy: self.policy,
            neg: chunnel_negotiate::Client::new(self.negotiate),
            quic_endpoints: Mutex::default(),
            memo: Mutex::new(Memos {
                cap: self.remember,
                ..Memos::default()
            }),
        })
    }
}

#[derive(Debug)]
struct Trust {
    cfg: ClientConfig,
    verifier: Arc<rustls::client::WebPkiServerVerifier>,
    name: ServerName<'static>,
}

/// The client side: negotiates with a [`Server`](super::Server), connects to the picked endpoint,
/// and checks the transcript before returning the connection.
#[derive(Debug)]
pub struct Client {
    offers: Vec<Transport>,
    trust: Option<Trust>,
    policy: Policy,
    neg: chunnel_negotiate::Client,
    /// The QUIC client endpoints (IPv4, IPv6), bound on the first QUIC pick of that family
    /// and shared by every later one (and by the connections they made).
    quic_endpoints: Mutex<[Option<quinn::Endpoint>; 2]>,
    /// The last verified secure pick per negotiation address (docs/wire.md §16.5).
    memo: Mutex<Memos>,
}

/// A verified secure pick: the transport, the endpoint connected to, and the hello whose
/// transcript the server confirmed.
#[derive(Clone, Debug)]
struct Memo {
    transport: Transport,
    endpoint: SocketAddr,
    hello: Bytes,
}

/// At most `cap` memos; the least recently stored goes first.
#[derive(Debug, Default)]
struct Memos {
    cap: usize,
    next: u64,
    map: HashMap<SocketAddr, (Memo, u64)>,
}

impl Memos {
    fn get(&self, addr: SocketAddr) -> Option<Memo> {
        self.map.get(&addr).map(|(m, _)| m.clone())
    }

    fn put(&mut self, addr: SocketAddr, memo: Memo) {
        if self.cap == 0 {
            return;
        }
        if !self.map.contains_key(&addr)
            && self.map.len() >= self.cap
            && let Some(oldest) = self
                .map
                .iter()
                .min_by_key(|(_, (_, n))| *n)
                .map(|(a, _)| *a)
        {
            self.map.remove(&oldest);
        }
        self.next += 1;
        self.map.insert(addr, (memo, self.next));
    }
}

/// How a reconnect on a remembered pick ended, when it did not give a connection.
enum Missed {
    /// Negotiate afresh: nothing of the first messages was delivered.
    Renegotiate,
    /// Give up with this error (the first messages may have been delivered).
    Failed(Error),
}

impl Client {
    /// A client offering `offers` (its preference, first preferred; repeats are ignored).
    pub fn builder(offers: impl IntoIterator<Item = Transport>) -> ClientBuilder {
        ClientBuilder {
            offers: offers.into_iter().collect(),
            trust: None,
            policy: Policy::default(),
            negotiate: chunnel_negotiate::Config::default(),
            remember: REMEMBERED_SERVERS,
        }
    }

    /// Forgets every remembered pick: the next connect to each server negotiates.
    pub fn forget_all(&self) {
        chunnel::util::lock(&self.memo).map.clear();
    }

    /// How many servers' picks are remembered now.
    pub fn remembered(&self) -> usize {
        chunnel::util::lock(&self.memo).map.len()
    }

    /// The transports this client offers, preferred first.
    pub fn offers(&self) -> &[Transport] {
        &self.offers
    }

    /// The offer tree of this client's hellos (what an on-path observer sees).
    pub fn offer_tree(&self) -> chunnel::OfferTree {
        self.choice().offer_tree()
    }

    fn choice(&self) -> Choice {
        let order: Vec<_> = self.offers.iter().map(|&t| (t, None)).collect();
        choice(&order)
    }

    /// Negotiates with the server whose negotiation address is `addr`, connects to the
    /// picked endpoint, and checks the transcript (see the [module docs](super)). No
    /// application byte can have been sent when this fails.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Connection, Error> {
        self.connect_with(addr, []).await
    }

    /// As [`connect`](Self::connect), and sends `first` (the application's first messages)
    /// as early as the binding allows, saving a round trip:
    ///
    /// * on a secure pick (QUIC, TLS) right behind the BIND, in the same write, without
    ///   waiting for the BOUND: they are encrypted to the server the channel authenticated,
    ///   which delivers them to its application only after it has checked the BIND (and
    ///   never if the check fails);
    /// * on a plaintext pick only after the BOUND has been checked, as if sent after
    ///   [`connect`](Self::connect) returned: nothing of `first` goes in the clear before the
    ///   transcript is verified.
    ///
    /// Either way it returns once the BOUND has been checked, so nothing the server sent is
    /// delivered before; on a [`Error::Downgrade`] the connection is dropped. An empty
    /// `first` is [`connect`](Self::connect).
    pub async fn connect_with(
        &self,
        addr: SocketAddr,
        first: impl IntoIterator<Item = Bytes>,
    ) -> Result<Connection, Error> {
        let first: Vec<Bytes> = first.into_iter().collect();
        let peer = addr.to_string();
        let memo = chunnel::util::lock(&self.memo).get(addr);
        if let Some(memo) = memo {
            match self.reconnect(&peer, &memo, &first).await {
                Ok(c) => return Ok(c),
                Err(missed) => {
                    chunnel::util::lock(&self.memo).map.remove(&addr);
                    if let Missed::Failed(e) = missed {
                        return Err(e);
                    }
                }
            }
        }
        let neg_err = |source| Error::Negotiation {
            peer: peer.clone(),
            source,
        };
        let base = chunnel_net::udp::Connect::new(addr)
            .connect_wrap(())
            .await
            .map_err(|e| neg_err(chunnel_negotiate::Error::Chunnel(e)))?;
        let n = match self.neg.connect(&peer, self.choice(), base).await {
            Ok(n) => n,
            // A pick we never offered: the accept was changed (or the server is broken).
            Err(chunnel_negotiate::Error::Wire(w))
                if w.0 == "the accept names a pick we did not offer" =>
            {
                return Err(Error::Downgrade {
                    peer,
                    by: DetectedBy::Local,
                    tampered: Tampered::Accept,
                    detail: w.0.into(),
                });
            }
            Err(e) => return Err(neg_err(e)),
        };
        let transcript = n.transcript().clone();
        let conn_id = n.conn_id();
        let server_stack = Arc::clone(&n.info().server_stack);
        // The negotiation's own connection is not used further.
        drop(n);
        let bad_accept = |detail: String| Error::Downgrade {
            peer: peer.clone(),
            by: DetectedBy::Local,
            tampered: Tampered::Accept,
            detail,
        };
        let Some((transport, mut ep)) = parse_server_stack(&server_stack) else {
            return Err(bad_accept(
                "the accept names no endpoint this client knows".into(),
            ));
        };
        if transport == Transport::Plain && self.policy == Policy::SecureOnly {
            return Err(Error::PlaintextRefused { peer });
        }
        if !self.offers.contains(&transport) {
            return Err(bad_accept(format!(
                "the accept picks {transport}, which this client did not offer"
            )));
        }
        if transcript.hello.is_empty() || transcript.accept.is_empty() {
            return Err(Error::Downgrade {
                peer,
                by: DetectedBy::Local,
                tampered: Tampered::Unverified,
                detail: "the negotiation's transcript was not recorded".into(),
            });
        }
        // A server bound to the unspecified address advertises it; its endpoints are then
        // reached at the address negotiated with.
        if ep.ip().is_unspecified() {
            ep.set_ip(addr.ip());
        }
        if transport.is_secure() && self.trust.is_none() {
            return Err(bad_accept(format!(
                "the accept picks {transport}, which this client did not offer"
            )));
        }
        let conn = self.dial(transport, ep).await?;
        let conn = self.check(&peer, conn, conn_id, &transcript, first).await?;
        if transport.is_secure() {
            chunnel::util::lock(&self.memo).put(
                addr,
                Memo {
                    transport,
                    endpoint: ep,
                    hello: transcript.hello.clone(),
                },
            );
        }
        Ok(conn)
    }

    /// Connects to `ep` on `transport` (the datapath handshake; nothing else is sent).
    async fn dial(&self, transport: Transport, ep: SocketAddr) -> Result<Connection, Error> {
        let bad = || Error::Config {
            what: format!("{transport} needs trust roots and a server name"),
        };
        Ok(Connection::new(match (transport, &self.trust) {
            (Transport::Quic, Some(t)) => Link::Quic(
                quic::Connect::new(ep, t.cfg.clone(), quic::Mode::Stream)
                    .with_endpoint(self.quic_endpoint(ep).map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?)
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (Transport::Tls, Some(t)) => Link::Tls(
                tls::Connect::new(ep, t.cfg.clone())
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (Transport::Plain, _) => Link::Plain(
                chunnel_net::tcp::Connect::new(ep)
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (_, None) => return Err(bad()),
        }))
    }

    /// A reconnect on a remembered secure pick (docs/wire.md §16.5): straight to the
    /// endpoint, REBIND and the first messages in one write, then the BOUND.
    async fn reconnect(
        &self,
        peer: &str,
        memo: &Memo,
        first: &[Bytes],
    ) -> Result<Connection, Missed> {
        // A handshake that fails has sent nothing: negotiate afresh.
        let conn = tokio::time::timeout(REMEMBERED_DIAL, self.dial(memo.transport, memo.endpoint))
            .await
            .map_err(|_| Missed::Renegotiate)?
            .map_err(|_| Missed::Renegotiate)?;
        let down = |detail: String| {
            Missed::Failed(Error::Downgrade {
                peer: peer.to_string(),
                by: DetectedBy::Local,
                tampered: Tampered::Unverified,
                detail,
            })
        };
        let exchange = async {
            conn.send(std::iter::once(encode_rebind(&memo.hello)).chain(first.iter().cloned()))
                .await?;
            conn.recv_one().await
        };
        let answer = match tokio::time::timeout(BIND_TIMEOUT, exchange).await {
            Ok(Ok(m)) if m.len() <= MAX_BOUND => m,
            Ok(Ok(_)) => return Err(down("BOUND too large".into())),
            Ok(Err(e)) => return Err(down(format!("no answer to the REBIND: {e}"))),
            Err(_) => {
                return Err(down(format!(
                    "no answer to the REBIND within {BIND_TIMEOUT:?}"
                )));
            }
        };
        let bound = Bound::decode(answer).map_err(|e| down(format!("malformed BOUND: {e}")))?;
        if bound.view.hello != memo.hello || !bound.view.accept.is_empty() {
            return Err(down("the BOUND does not answer this REBIND".into()));
        }
        match Status::from_u8(bound.status) {
            Some(Status::Agreed) => Ok(conn),
            Some(Status::Renegotiate) => Err(Missed::Renegotiate),
            other => Err(down(format!("the server refused the REBIND ({other:?})"))),
        }
    }

    /// The shared QUIC client endpoint for connections to `to`'s address family, bound now
    /// if this is the first.
    fn quic_endpoint(&self, to: SocketAddr) -> Result<quinn::Endpoint, chunnel::Error> {
        let mut eps = chunnel::util::lock(&self.quic_endpoints);
        let (slot, local): (usize, SocketAddr) = match to {
            SocketAddr::V4(_) => (0, (std::net::Ipv4Addr::UNSPECIFIED, 0).into()),
            SocketAddr::V6(_) => (1, (std::net::Ipv6Addr::UNSPECIFIED, 0).into()),
        };
        if let Some(ep) = &eps[slot] {
            return Ok(ep.clone());
        }
        let ep = quinn::Endpoint::client(local)
            .map_err(|e| chunnel::Error::from_io("bind", local, e))?;
        eps[slot] = Some(ep.clone());
        Ok(ep)
    }

    /// The BIND / BOUND exchange on the new datapath (docs/wire.md §16), with the
    /// application's `first` messages right behind the BIND on a secure pick, after the
    /// checked BOUND on plaintext.
    async fn check(
        &self,
        peer: &str,
        conn: Connection,
        conn_id: u64,
        mine: &Transcript,
        first: Vec<Bytes>,
    ) -> Result<Connection, Error> {
        let transport = conn.transport();
        let down = |tampered, detail: String| Error::Downgrade {
            peer: peer.to_string(),
            by: DetectedBy::Local,
            tampered,
            detail,
        };
        let hash = transcript_hash(mine);
        let bind = encode_bind(conn_id, &hash);
        let secure = transport.is_secure();
        let exchange = async {
            if secure {
                // One write: the BIND, then the application's first messages.
                conn.send(std::iter::once(bind).chain(first.iter().cloned()))
                    .await?;
            } else {
                conn.send_one(bind).await?;
            }
            conn.recv_one().await
        };
        let answer = match tokio::time::timeout(BIND_TIMEOUT, exchange).await {
            Ok(Ok(m)) if m.len() <= MAX_BOUND => m,
            Ok(Ok(_)) => return Err(down(Tampered::Unverified, "BOUND too large".into())),
            Ok(Err(e)) => {
                return Err(down(
                    Tampered::Unverified,
                    format!("no answer to the BIND on {transport}: {e}"),
                ));
            }
            Err(_) => {
                return Err(down(
                    Tampered::Unverified,
                    format!("no answer to the BIND within {BIND_TIMEOUT:?}"),
                ));
            }
        };
        let bound = Bound::decode(answer)
            .map_err(|e| down(Tampered::Unverified, format!("malformed BOUND: {e}")))?;
        // Over plaintext, the answer counts only if the server's key signed it — required
        // when this client offered a secure option (it has something to lose).
        let offered_secure = self.offers.iter().any(|t| t.is_secure());
        if transport == Transport::Plain && offered_secure {
            self.verify_signature(&bound, conn_id)
                .map_err(|d| down(Tampered::Unverified, d))?;
        }
        if let Some((what, detail)) = compare(mine, &bound.view) {
            return Err(down(
                if bound.status == Status::Unknown as u8 {
                    Tampered::Unknown
                } else {
                    what
                },
                detail,
            ));
        }
        match Status::from_u8(bound.status) {
            Some(Status::Agreed) => {
                if !secure && !first.is_empty() {
                    // Plaintext: the application's messages only now, after the check.
                    conn.send(first).await.map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?;
                }
                Ok(conn)
            }
            other => Err(down(
                Tampered::Unverified,
                format!("the server refused the binding ({other:?})"),
            )),
        }
    }

    /// Checks a plaintext BOUND's certificate chain and signature.
    fn verify_signature(&self, bound: &Bound, conn_id: u64) -> Result<(), String> {
        let Some(trust) = &self.trust else {
            return Err("no trust roots to check the server's signature with".into());
        };
        let Some((leaf, intermediates)) = bound.chain.split_first() else {
            return Err("plaintext pick without the server's signature".into());
        };
        trust
            .verifier
            .verify_server_cert(leaf, intermediates, &trust.name, &[], UnixTime::now())
            .map_err(|e| format!("the signing certificate is refused: {e}"))?;
        let scheme = SignatureScheme::from(bound.scheme);
        if !SCHEMES.contains(&scheme) {
            return Err(format!("unsupported signature scheme {scheme:?}"));
        }
        let algs = rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(s, _)| *s == scheme)
            .map(|(_, a)| *a)
            .unwrap_or(&[]);
        let cert = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| format!("the signing certificate cannot be parsed: {e}"))?;
        let msg = signed_message(&transcript_hash(&bound.view), bound.status, conn_id);
        if algs
            .iter()
            .any(|alg| cert.verify_signature(*alg, &msg, &bound.signature).is_ok())
        {
            Ok(())
        } else {
            Err("bad signature over the server's transcript".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remembered_table_is_bounded_and_forgets_the_oldest() {
        let memo = |port| Memo {
            transport: Transport::Quic,
            endpoint: SocketAddr::from(([127, 0, 0, 1], port)),
            hello: Bytes::from_static(b"\x01h"),
        };
        let addr = |i: u16| SocketAddr::from(([127, 0, 0, 1], i));
        let mut m = Memos {
            cap: 3,
            ..Memos::default()
        };
        for i in 1..=3 {
            m.put(addr(i), memo(i));
        }
        // Storing 1 again makes 2 the oldest.
        m.put(addr(1), memo(10));
        m.put(addr(4), memo(4));
        assert_eq!(m.map.len(), 3);
        assert!(m.get(addr(2)).is_none());
        assert_eq!(m.get(addr(1)).unwrap().endpoint.port(), 10);
        assert!(m.get(addr(3)).is_some() && m.get(addr(4)).is_some());
        let mut off = Memos::default();
        off.put(addr(1), memo(1));
        assert!(off.map.is_empty());
    }
}
