//! The client: [`Client`] and its builder; negotiates, connects to the picked endpoint and
//! checks the server's BOUND (signed when a plaintext pick follows secure offers).

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
    Bound, MAX_BOUND, Status, Tampered, compare, encode_bind, signed_message, transcript_hash,
};
use super::connection::Connection;
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
}

impl ClientBuilder {
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
}

impl Client {
    /// A client offering `offers` (its preference, first preferred; repeats are ignored).
    pub fn builder(offers: impl IntoIterator<Item = Transport>) -> ClientBuilder {
        ClientBuilder {
            offers: offers.into_iter().collect(),
            trust: None,
            policy: Policy::default(),
            negotiate: chunnel_negotiate::Config::default(),
        }
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
        let conn = match (transport, &self.trust) {
            (Transport::Quic, Some(t)) => Connection::Quic(
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
            (Transport::Tls, Some(t)) => Connection::Tls(
                tls::Connect::new(ep, t.cfg.clone())
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (Transport::Plain, _) => Connection::Plain(
                chunnel_net::tcp::Connect::new(ep)
                    .connect_wrap(())
                    .await
                    .map_err(|e| Error::Datapath {
                        transport,
                        source: e,
                    })?,
            ),
            (_, None) => {
                return Err(bad_accept(format!(
                    "the accept picks {transport}, which this client did not offer"
                )));
            }
        };
        self.check(&peer, conn, conn_id, &transcript, first).await
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
