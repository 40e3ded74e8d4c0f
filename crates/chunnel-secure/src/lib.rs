//! # chunnel-secure: encrypted datapaths as Chunnels
//!
//! [`tls`]: TLS 1.3 over TCP with rustls and its ring provider. [`tls::Connect`] is a base
//! Chunnel (`Chunnel<()>`) and [`tls::Listener`] a `chunnel::Listener`, exactly like
//! `chunnel_net::tcp`'s, and their connections carry the same length-framed messages — inside
//! TLS. On the wire it is plain TLS 1.3: stock clients and servers interoperate.
//!
//! [`quic`] (feature `quic`, on by default): QUIC v1 with quinn, on the same certificates and
//! configurations. [`quic::Connect`] (`Chunnel<()>`) and [`quic::Listener`] carry messages in
//! one of two modes a stack states: [`quic::Mode::Stream`] (reliable, ordered, length-framed
//! on one bidirectional stream, id `chunnel/quic-stream/1`) or [`quic::Mode::Datagram`]
//! (unreliable, one message per QUIC DATAGRAM frame, id `chunnel/quic-dgram/1`). On the wire
//! it is plain QUIC: a plain quinn peer interoperates.
//!
//! [`negotiated`] (feature `quic`): QUIC, TLS over TCP or plaintext, negotiated between a
//! [`negotiated::Client`] and a [`negotiated::Server`] (the server's preference decides),
//! with the negotiation transcript bound to the picked datapath so that an on-path attacker
//! cannot downgrade it ([`Error::Downgrade`]; docs/wire.md §16).
//!
//! A short tour:
//!
//! * **Identity and trust** ([`Identity`], [`TrustRoots`]): a certificate chain and key from
//!   PEM files, PEM text or DER; trust roots from a PEM file or text, or (feature
//!   `platform-roots`, on by default) the operating system's store.
//! * **Configurations** ([`ClientConfig::builder`], [`ServerConfig::builder`]): the server
//!   name the client expects (sent as SNI when it is a DNS name), ALPN, mutual TLS
//!   ([`ServerConfigBuilder::client_auth`] + [`ClientConfigBuilder::client_identity`]), the
//!   handshake timeout ([`DEFAULT_HANDSHAKE_TIMEOUT`]: a peer that stalls mid-handshake fails
//!   with [`Error::HandshakeTimeout`]) and the largest message. TLS 1.3 only; session
//!   resumption on (see [`tls::Session::resumed`]).
//! * **Errors**: one [`Error`] enum with a variant per failure an operator must tell apart —
//!   [`Error::CertificateExpired`], [`Error::WrongName`], [`Error::UnknownCa`],
//!   [`Error::MissingClientCertificate`], [`Error::HandshakeTimeout`], [`Error::NotTls`]
//!   (garbage instead of a handshake) — converted into [`chunnel::Error::Layer`]; see
//!   [`Error::find`]. A client's failure never stops a [`tls::Listener`].
//! * **Negotiation**: both ends advertise the id [`tls::ID`] and the exact capability
//!   `secure` = `{tls13}` ([`tls::capability`]). QUIC adds `quic` = `{v1}` and `delivery` =
//!   `{ordered, reliable}` or `{unreliable}` ([`quic::Mode::capabilities`]), so a QUIC option
//!   never pairs with TLS over TCP nor one mode with the other.
//!
//! ## Feature flags
//!
//! * `platform-roots` (default): [`TrustRoots::platform`], the operating system's trust store.
//! * `quic` (default): the [`quic`] module and its error variants ([`Error::Quic`],
//!   [`Error::QuicConnect`], [`Error::DatagramsUnsupported`]); pulls in quinn (quinn,
//!   quinn-proto, quinn-udp and 12 small crates: about 8 s more of a cold debug build on two
//!   cores).
//!
//! ## Early data (0-RTT) is off
//!
//! Neither configuration enables TLS 1.3 early data (nor, therefore, QUIC 0-RTT), and this crate has no switch for it yet.
//! Early data is not protected against replay: an attacker who records a client's first
//! flight can send it to the server again, and the server would act on the application data
//! in it twice. An application that enables it on the rustls configuration
//! ([`ClientConfig::from_rustls`], [`ServerConfig::from_rustls`]) must only send idempotent
//! requests as early data.
//!
//! ## Example
//!
//! A server with a certificate made on the spot (rcgen), a client trusting it, one echo:
//!
//! ```
//! use chunnel::{Chunnel, ConnectionExt, Listener as _};
//! use chunnel_secure::{ClientConfig, Identity, ServerConfig, TrustRoots, tls};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cert = rcgen::generate_simple_self_signed(["localhost".to_string()])?;
//! let identity = Identity::from_pem(cert.cert.pem().as_bytes(), cert.signing_key.serialize_pem().as_bytes())?;
//! let roots = TrustRoots::from_pem(cert.cert.pem().as_bytes())?;
//!
//! let mut listener = tls::Listener::bind(
//!     "127.0.0.1:0".parse()?,
//!     ServerConfig::builder(identity).alpn(["echo/1"]).build()?,
//! ).await?;
//! let client_cfg = ClientConfig::builder(roots, "localhost").alpn(["echo/1"]).build()?;
//! let mut connect = tls::Connect::new(listener.local_addr()?, client_cfg);
//!
//! let (client, server) = tokio::join!(connect.connect_wrap(()), listener.accept());
//! let (client, server) = (client?, server?);
//! client.send_one("ping".into()).await?;
//! let got = server.recv_one().await?;
//! server.send_one(got).await?;
//! assert_eq!(client.recv_one().await?, "ping");
//! assert_eq!(client.session().alpn.as_deref(), Some(&b"echo/1"[..]));
//! # Ok(()) }
//! ```
// The crate docs link to items of optional features; without them those links cannot resolve.
#![forbid(unsafe_code)]
#![cfg_attr(
    not(all(feature = "quic", feature = "platform-roots")),
    allow(rustdoc::broken_intra_doc_links)
)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

mod config;
mod error;
mod handshakes;
#[cfg(feature = "quic")]
pub mod negotiated;
#[cfg(feature = "quic")]
pub mod quic;
pub mod tls;

pub use config::{
    ClientConfig, ClientConfigBuilder, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_HANDSHAKES, Identity,
    ServerConfig, ServerConfigBuilder, TrustRoots,
};
pub use error::{DetectedBy, Error};
#[cfg(feature = "quic")]
pub use quinn;
pub use rustls;
