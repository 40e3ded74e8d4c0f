//! What happens to each message that arrives on an established negotiated connection, as a
//! pure function: [`classify`] looks at the bytes and this end's [`SideState`] and returns an
//! [`Inbound`] that says what to do. It reads no clock, sends nothing and takes no lock; the
//! receive path of [`crate::Tagged`] calls it once per message and applies the answer (strips
//! the tag, answers a retransmitted hello, hands a new client's hello to the listener, ends
//! the connection, feeds the reconfiguration machine).
//!
//! The rules (docs/wire.md §7, §9):
//!
//! | tag           | client side                          | server side                    |
//! |---------------|--------------------------------------|--------------------------------|
//! | `DATA`        | data after the tag                   | data after the tag             |
//! | `ACCEPT_DATA` | data after the accept, if well formed | ignored                        |
//! | `HELLO`       | ignored                              | own id: answer again; another id: a new client |
//! | `CLOSE`       | own id: the peer ends it             | own id: the peer ends it       |
//! | `PREPARE`..=`DONE` | to the reconfiguration machine, if enabled | the same          |
//! | anything else | ignored                              | ignored                        |

use crate::wire::{Accept, Hello, Tag, split_accept_data};

/// Which end of the connection this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The end that sent the hello.
    Client,
    /// The end that accepted it (and answers its retransmissions).
    Server,
}

/// What [`classify`] needs to know about this end. Cheap to build: the receive path makes one
/// per batch of messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideState {
    /// Client or server.
    pub role: Role,
    /// The connection's id (the client's hello's).
    pub conn_id: u64,
    /// Multilateral reconfiguration runs on this connection ([`crate::commit::Coordinator`]).
    pub reconfig: bool,
}

/// What to do with one inbound message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inbound {
    /// Deliver the message from this offset on (past the tag, or past a coalesced accept).
    Data(usize),
    /// Server side: a retransmission of the accepted hello. Send the answer again.
    AnswerHello,
    /// Server side: a hello with another connection id. A new client reuses this peer's
    /// address: hand the hello to the listener as a new connection, and this one ends.
    NewClient,
    /// The peer ends this connection (a CLOSE with its id): deliver what came before it,
    /// nothing after.
    Close,
    /// A reconfiguration message for the two-phase-commit machine ([`crate::commit`]).
    Control,
    /// Not for this connection: dropped and counted ([`crate::Tagged::ignored`]).
    Ignore(Ignored),
}

/// Why a message was ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ignored {
    /// No bytes at all (not even a tag).
    Empty,
    /// A tag this end does not expect after the handshake (an `ACCEPT` or `REJECT`, a
    /// server's `ACCEPT_DATA`, a client's `HELLO`, a reserved or unknown tag).
    Unexpected,
    /// An `ACCEPT_DATA` whose accept does not decode.
    MalformedAccept,
    /// A `HELLO` too short to carry a connection id.
    MalformedHello,
    /// A `CLOSE` that is malformed, of another version, or for another connection.
    OtherClose,
    /// A reconfiguration message while reconfiguration is not enabled.
    NoReconfig,
}

/// Classifies `msg` (tag included), received on an established connection. Never panics.
///
/// `DATA` is decided by its first comparison, before anything else is looked at: the data
/// path costs one tag check.
#[inline]
pub fn classify(msg: &[u8], side: &SideState) -> Inbound {
    match msg.first().copied() {
        Some(t) if t == Tag::Data as u8 => Inbound::Data(1),
        None => Inbound::Ignore(Ignored::Empty),
        Some(t) => classify_other(t, msg, side),
    }
}

/// [`classify`] for every tag but `DATA`; kept out of line, off the data path.
#[inline(never)]
fn classify_other(tag: u8, msg: &[u8], side: &SideState) -> Inbound {
    match (tag, side.role) {
        // Client side: an accept with the server's first reply that arrives after the
        // handshake ended on another copy of the accept (a retransmission's answer overtook
        // it). The server sends it once, so the reply is new.
        (t, Role::Client) if t == Tag::AcceptData as u8 => match split_accept_data(msg) {
            Ok((body, at)) if Accept::decode(body).is_ok() => Inbound::Data(at),
            _ => Inbound::Ignore(Ignored::MalformedAccept),
        },
        (t, Role::Server) if t == Tag::Hello as u8 => match Hello::peek_conn_id(&msg[1..]) {
            Ok(c) if c == side.conn_id => Inbound::AnswerHello,
            Ok(_) => Inbound::NewClient,
            Err(_) => Inbound::Ignore(Ignored::MalformedHello),
        },
        (t, _) if t == Tag::Close as u8 => {
            if crate::proto::close_ends(msg, side.conn_id) {
                Inbound::Close
            } else {
                Inbound::Ignore(Ignored::OtherClose)
            }
        }
        (t, _) if (Tag::Prepare as u8..=Tag::Done as u8).contains(&t) => {
            if side.reconfig {
                Inbound::Control
            } else {
                Inbound::Ignore(Ignored::NoReconfig)
            }
        }
        _ => Inbound::Ignore(Ignored::Unexpected),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Close, VERSION};
    use chunnel::Pick;
    use proptest::prelude::*;

    const CLIENT: SideState = SideState {
        role: Role::Client,
        conn_id: 7,
        reconfig: false,
    };
    const SERVER: SideState = SideState {
        role: Role::Server,
        conn_id: 7,
        reconfig: false,
    };

    fn hello(conn_id: u64) -> Vec<u8> {
        // Version, flags, then the id: all `peek_conn_id` reads.
        let mut m = vec![Tag::Hello as u8, VERSION, 0];
        m.extend_from_slice(&conn_id.to_be_bytes());
        m
    }

    #[test]
    fn data_is_delivered_past_its_tag_at_either_end() {
        for side in [CLIENT, SERVER] {
            assert_eq!(classify(&[0, 1, 2], &side), Inbound::Data(1));
            assert_eq!(classify(&[0], &side), Inbound::Data(1));
        }
    }

    #[test]
    fn empty_and_unknown_messages_are_ignored() {
        for side in [CLIENT, SERVER] {
            assert_eq!(classify(&[], &side), Inbound::Ignore(Ignored::Empty));
            for t in [Tag::Accept as u8, Tag::Reject as u8, 0x06, 0x1f, 0xff] {
                assert_eq!(
                    classify(&[t, 1, 2, 3], &side),
                    Inbound::Ignore(Ignored::Unexpected),
                    "tag {t:#x}"
                );
            }
        }
    }

    #[test]
    fn a_server_answers_its_own_hello_and_hands_on_another() {
        assert_eq!(classify(&hello(7), &SERVER), Inbound::AnswerHello);
        assert_eq!(classify(&hello(8), &SERVER), Inbound::NewClient);
        assert_eq!(
            classify(&hello(7)[..5], &SERVER),
            Inbound::Ignore(Ignored::MalformedHello)
        );
        // A client never answers hellos.
        assert_eq!(
            classify(&hello(7), &CLIENT),
            Inbound::Ignore(Ignored::Unexpected)
        );
    }

    #[test]
    fn a_close_ends_only_its_own_connection() {
        let close = |conn_id| {
            Close {
                version: VERSION,
                conn_id,
            }
            .encode()
        };
        for side in [CLIENT, SERVER] {
            assert_eq!(classify(&close(7), &side), Inbound::Close);
            assert_eq!(
                classify(&close(8), &side),
                Inbound::Ignore(Ignored::OtherClose)
            );
            assert_eq!(
                classify(&[Tag::Close as u8], &side),
                Inbound::Ignore(Ignored::OtherClose)
            );
        }
    }

    #[test]
    fn a_client_takes_the_reply_out_of_a_late_accept_with_data() {
        let accept = crate::wire::Accept {
            version: VERSION,
            conn_id: 7,
            zero_rtt: crate::wire::ZeroRtt::Accepted,
            client_pick: Pick::from_branches(vec![0]),
            server_pick: Pick::from_branches(vec![0]),
            server_stack: std::sync::Arc::from(Vec::new()),
        };
        let (_, header) = accept.encode_with_data_header();
        let coalesced = [&header.unwrap()[..], b"reply"].concat();
        let Inbound::Data(at) = classify(&coalesced, &CLIENT) else {
            panic!("not data: {:?}", classify(&coalesced, &CLIENT));
        };
        assert_eq!(&coalesced[at..], b"reply");
        assert_eq!(
            classify(&coalesced, &SERVER),
            Inbound::Ignore(Ignored::Unexpected)
        );
        let mut broken = coalesced.to_vec();
        broken.truncate(4);
        assert_eq!(
            classify(&broken, &CLIENT),
            Inbound::Ignore(Ignored::MalformedAccept)
        );
    }

    #[test]
    fn reconfiguration_messages_go_to_the_machine_only_when_enabled() {
        for t in Tag::Prepare as u8..=Tag::Done as u8 {
            let on = SideState {
                reconfig: true,
                ..CLIENT
            };
            assert_eq!(classify(&[t, 1], &on), Inbound::Control);
            assert_eq!(
                classify(&[t, 1], &SERVER),
                Inbound::Ignore(Ignored::NoReconfig)
            );
        }
    }

    proptest! {
        #[test]
        fn never_panics_and_data_is_in_bounds(
            msg in proptest::collection::vec(any::<u8>(), 0..64),
            server in any::<bool>(),
            reconfig in any::<bool>(),
            conn_id in any::<u64>(),
        ) {
            let side = SideState {
                role: if server { Role::Server } else { Role::Client },
                conn_id,
                reconfig,
            };
            match classify(&msg, &side) {
                Inbound::Data(at) => prop_assert!(at >= 1 && at <= msg.len()),
                Inbound::AnswerHello | Inbound::NewClient => prop_assert!(server),
                _ => {}
            }
        }
    }
}
