//! The crate's error type.

use std::time::Duration;

use rustls::{AlertDescription, CertificateError};

/// Which end of the connection found the problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DetectedBy {
    /// This end checked the peer and refused it.
    Local,
    /// The peer refused this end and said why in a TLS alert.
    Peer,
}

/// Errors of the secure datapaths.
///
/// Every handshake failure is one of these, carried in [`chunnel::Error::Layer`] (from
/// `connect_wrap` and [`crate::tls::Listener::accept_client`]) or, when it surfaces on a
/// live connection (a TLS 1.3 server refuses a client certificate after the client's
/// handshake has finished, so the client learns it on its first `recv`), inside
/// [`chunnel::Error::Io`]. [`Error::find`] finds it in either.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A certificate of the chain has expired (or is not valid yet).
    #[error("certificate of {peer} has expired or is not yet valid (detected by {by:?}): {detail}")]
    CertificateExpired {
        /// The peer's address.
        peer: String,
        /// Which end refused the certificate.
        by: DetectedBy,
        /// rustls's description.
        detail: String,
    },
    /// The server's certificate is not valid for the name the client asked for.
    #[error(
        "certificate of {peer} is not valid for the expected name (detected by {by:?}): {detail}"
    )]
    WrongName {
        /// The peer's address.
        peer: String,
        /// Which end refused the certificate.
        by: DetectedBy,
        /// The expected name and the names presented, as rustls reports them.
        detail: String,
    },
    /// The certificate chain does not lead to a trusted root (unknown or untrusted CA).
    #[error("certificate of {peer} is not issued by a trusted CA (detected by {by:?})")]
    UnknownCa {
        /// The peer's address.
        peer: String,
        /// Which end refused the certificate.
        by: DetectedBy,
    },
    /// The server requires a client certificate and the client sent none.
    #[error("the server requires a client certificate and {peer} sent none (detected by {by:?})")]
    MissingClientCertificate {
        /// The peer's address.
        peer: String,
        /// `Local` on the server; `Peer` on a client told so by the server.
        by: DetectedBy,
    },
    /// Another certificate problem (bad signature, wrong key usage, revoked...).
    #[error("certificate of {peer} refused (detected by {by:?}): {detail}")]
    BadCertificate {
        /// The peer's address.
        peer: String,
        /// Which end refused the certificate.
        by: DetectedBy,
        /// What was wrong.
        detail: String,
    },
    /// The handshake did not finish within the configured time (a peer that stalls, sends
    /// half a handshake, or nothing at all).
    #[error("TLS handshake with {peer} did not finish within {after:?}")]
    HandshakeTimeout {
        /// The peer's address.
        peer: String,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The peer sent bytes that are not TLS (garbage instead of a handshake, a plaintext
    /// protocol, or corrupt records).
    #[error("{peer} did not speak TLS: {detail}")]
    NotTls {
        /// The peer's address.
        peer: String,
        /// What rustls could not parse.
        detail: String,
    },
    /// The peer closed the TCP connection in the middle of the handshake.
    #[error("{peer} closed the connection during the TLS handshake")]
    HandshakeEof {
        /// The peer's address.
        peer: String,
    },
    /// An operating-system error during the handshake.
    #[error("i/o error during the TLS handshake with {peer}: {source}")]
    HandshakeIo {
        /// The peer's address.
        peer: String,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },
    /// Any other TLS failure (incompatible peer, decryption failure, misbehaving peer...).
    #[error("TLS with {peer} failed: {source}")]
    Tls {
        /// The peer's address.
        peer: String,
        /// rustls's error.
        #[source]
        source: rustls::Error,
    },
    /// A QUIC connection failed for a reason that is not one of the certificate variants
    /// above (the peer closed it with a transport error, the idle timeout elapsed, the peer
    /// violated the protocol...).
    #[cfg(feature = "quic")]
    #[error("QUIC connection with {peer} failed: {source}")]
    Quic {
        /// The peer's address.
        peer: String,
        /// quinn's error.
        #[source]
        source: quinn::ConnectionError,
    },
    /// A QUIC connection could not be started (bad server name, endpoint stopping...).
    #[cfg(feature = "quic")]
    #[error("cannot start a QUIC connection to {peer}: {source}")]
    QuicConnect {
        /// The peer's address.
        peer: String,
        /// quinn's error.
        #[source]
        source: quinn::ConnectError,
    },
    /// A QUIC connection in datagram mode, but DATAGRAM frames are not available: the peer
    /// did not advertise `max_datagram_frame_size` (`by: Peer`) or this end disabled them
    /// (`by: Local`).
    #[cfg(feature = "quic")]
    #[error("QUIC DATAGRAM frames are not available with {peer} (disabled by {by:?})")]
    DatagramsUnsupported {
        /// The peer's address.
        peer: String,
        /// Which end lacks datagram support.
        by: DetectedBy,
    },
    /// Negotiation with a [`crate::negotiated::Server`] failed: no option in common
    /// (`chunnel_negotiate::Error::Incompatible`, naming every mismatch), no answer, a
    /// malformed message...
    #[cfg(feature = "quic")]
    #[error("negotiation with {peer} failed: {source}")]
    Negotiation {
        /// The server's negotiation address (the client's; `client` on the server).
        peer: String,
        /// chunnel-negotiate's error.
        #[source]
        source: chunnel_negotiate::Error,
    },
    /// The negotiation transcript the two ends saw differs, or the server's account of it
    /// cannot be authenticated: an on-path attacker (or a fault) changed the hello or the
    /// accept. The connection is refused at both ends (docs/wire.md §16).
    #[cfg(feature = "quic")]
    #[error("downgrade detected with {peer} (by {by:?}): {tampered}: {detail}")]
    Downgrade {
        /// The peer's address.
        peer: String,
        /// `Local` on the end that found it (each end reports its own finding).
        by: DetectedBy,
        /// What was changed, as far as the transcripts tell.
        tampered: crate::negotiated::Tampered,
        /// The differences found (offers sent and received, picks sent and received).
        detail: String,
    },
    /// A client with [`crate::negotiated::Policy::SecureOnly`] was told to use plaintext.
    #[cfg(feature = "quic")]
    #[error("{peer} picked plaintext, which this client refuses (secure only)")]
    PlaintextRefused {
        /// The server's negotiation address.
        peer: String,
    },
    /// The picked datapath could not be set up (its own typed error is inside; see
    /// [`Error::find`]).
    #[cfg(feature = "quic")]
    #[error("the {transport} datapath failed: {source}")]
    Datapath {
        /// The picked transport.
        transport: crate::negotiated::Transport,
        /// The datapath's error.
        #[source]
        source: chunnel::Error,
    },
    /// Certificates, keys or names given to the configuration are unusable.
    #[error("bad TLS configuration: {what}")]
    Config {
        /// What was wrong.
        what: String,
    },
}

impl Error {
    /// The typed TLS error of `peer` for a rustls error.
    pub(crate) fn from_rustls(peer: &str, e: rustls::Error) -> Self {
        use DetectedBy::{Local, Peer};
        let peer = peer.to_string();
        match e {
            rustls::Error::InvalidCertificate(c) => match c {
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => Error::CertificateExpired {
                    peer,
                    by: Local,
                    detail: format!("{c:?}"),
                },
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => Error::WrongName {
                    peer,
                    by: Local,
                    detail: format!("{c:?}"),
                },
                CertificateError::UnknownIssuer => Error::UnknownCa { peer, by: Local },
                other => Error::BadCertificate {
                    peer,
                    by: Local,
                    detail: format!("{other:?}"),
                },
            },
            rustls::Error::NoCertificatesPresented => {
                Error::MissingClientCertificate { peer, by: Local }
            }
            rustls::Error::AlertReceived(a) => match a {
                AlertDescription::CertificateRequired => {
                    Error::MissingClientCertificate { peer, by: Peer }
                }
                AlertDescription::UnknownCA => Error::UnknownCa { peer, by: Peer },
                AlertDescription::CertificateExpired => Error::CertificateExpired {
                    peer,
                    by: Peer,
                    detail: "certificate_expired alert".into(),
                },
                AlertDescription::BadCertificate
                | AlertDescription::UnsupportedCertificate
                | AlertDescription::CertificateRevoked
                | AlertDescription::CertificateUnknown => Error::BadCertificate {
                    peer,
                    by: Peer,
                    detail: format!("{a:?} alert"),
                },
                other => Error::Tls {
                    peer,
                    source: rustls::Error::AlertReceived(other),
                },
            },
            rustls::Error::InvalidMessage(m) => Error::NotTls {
                peer,
                detail: format!("{m:?}"),
            },
            e @ (rustls::Error::InappropriateMessage { .. }
            | rustls::Error::InappropriateHandshakeMessage { .. }) => Error::NotTls {
                peer,
                detail: e.to_string(),
            },
            source => Error::Tls { peer, source },
        }
    }

    /// The typed TLS error of `peer` behind an I/O error from a TLS stream, if there is one.
    pub(crate) fn from_stream_io(peer: &str, e: &std::io::Error) -> Option<Self> {
        let inner = e.get_ref()?;
        if let Some(r) = inner.downcast_ref::<rustls::Error>() {
            return Some(Error::from_rustls(peer, r.clone()));
        }
        None
    }

    /// The typed error of `peer` for a failed QUIC connection: a TLS alert (sent by this end
    /// when it refused the peer, received when the peer refused this end) becomes the same
    /// certificate variant as over TCP; anything else is [`Error::Quic`].
    #[cfg(feature = "quic")]
    pub(crate) fn from_quic(peer: &str, e: quinn::ConnectionError) -> Self {
        use DetectedBy::{Local, Peer};
        use quinn::ConnectionError as C;
        let (by, code, reason) = match &e {
            C::TransportError(t) => (Local, u64::from(t.code), t.reason.clone()),
            C::ConnectionClosed(c) => (
                Peer,
                u64::from(c.error_code),
                String::from_utf8_lossy(&c.reason).into_owned(),
            ),
            _ => {
                return Error::Quic {
                    peer: peer.to_string(),
                    source: e,
                };
            }
        };
        // QUIC carries a TLS alert as the transport error code 0x100 + alert (RFC 9001 §4.8).
        let alert = match code.checked_sub(0x100) {
            Some(a) if a <= 0xff => AlertDescription::from(a as u8),
            _ => {
                return Error::Quic {
                    peer: peer.to_string(),
                    source: e,
                };
            }
        };
        let p = peer.to_string();
        // This end's rustls put its error's text in the reason; it names the name mismatch,
        // which shares the `bad_certificate` alert with other certificate errors.
        let wrong_name =
            reason.contains("NotValidForName") || reason.contains("not valid for name");
        match alert {
            AlertDescription::UnknownCA => Error::UnknownCa { peer: p, by },
            AlertDescription::CertificateExpired => Error::CertificateExpired {
                peer: p,
                by,
                detail: reason,
            },
            AlertDescription::CertificateRequired => {
                Error::MissingClientCertificate { peer: p, by }
            }
            AlertDescription::BadCertificate if by == Local && wrong_name => Error::WrongName {
                peer: p,
                by,
                detail: reason,
            },
            AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateUnknown => Error::BadCertificate {
                peer: p,
                by,
                detail: if reason.is_empty() {
                    format!("{alert:?} alert")
                } else {
                    reason
                },
            },
            _ => Error::Quic { peer: p, source: e },
        }
    }

    /// This error as a [`chunnel::Error::Layer`] of the datapath `layer` (its negotiation id).
    pub(crate) fn at(self, layer: &'static str) -> chunnel::Error {
        chunnel::Error::Layer {
            layer,
            source: Box::new(self),
        }
    }

    /// Finds this crate's error in a [`chunnel::Error`]: directly in
    /// [`chunnel::Error::Layer`], or inside the I/O error of [`chunnel::Error::Io`] (how a
    /// TLS failure on a live connection reaches `recv` and `send`), or anywhere in the
    /// `source` chain.
    pub fn find(e: &chunnel::Error) -> Option<&Error> {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = cur {
            if let Some(found) = err.downcast_ref::<Error>() {
                return Some(found);
            }
            if let Some(io) = err.downcast_ref::<std::io::Error>()
                && let Some(found) = io.get_ref().and_then(|i| i.downcast_ref::<Error>())
            {
                return Some(found);
            }
            cur = err.source();
        }
        None
    }
}

/// A [`chunnel::Error::Layer`] of the TLS datapath ([`crate::tls::ID`]); the QUIC datapath
/// names its own id.
impl From<Error> for chunnel::Error {
    fn from(e: Error) -> Self {
        e.at(crate::tls::ID)
    }
}
