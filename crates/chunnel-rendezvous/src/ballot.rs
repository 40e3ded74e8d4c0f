//! Direct ballots (docs/wire.md §15.4): a member sends its ballot on a transition as one UDP
//! datagram to the proposer's ballot box, instead of writing it to the store.
//!
//! A proposer with a ballot socket ([`crate::Config::with_direct_ballots`]) records a
//! [`BallotBox`] (its address and a fresh random 128-bit token) in the transition it proposes.
//! A member that sees it sends a [`DirectBallot`] carrying that token; the proposer counts the
//! ballots of the live members it knows and attests the yes ballots it counted when it
//! commits ([`crate::Store::finish_attested`]). Datagrams may be lost: the member resends until
//! it sees the outcome, and writes its ballot to the store after a fallback delay, so the store
//! path decides whenever the datagrams do not.
//!
//! [`DirectBallot::decode`] reads bytes from the network: it never panics and reports what is
//! wrong as [`Error::Ballot`] with a [`BallotFault`].

use crate::Error;
pub use crate::error::BallotFault;
pub use crate::store::BallotBox;
use crate::store::{Ballot, check_name};

/// The first two bytes of every ballot datagram (`"CB"`).
pub const MAGIC: [u8; 2] = *b"CB";
/// The datagram format version this crate writes and reads.
pub const VERSION: u8 = 1;
/// The longest refusal reason a datagram carries (longer ones are cut at a character boundary).
pub const MAX_REASON: usize = 256;
/// The longest ballot datagram: header, two names of 128 bytes and the longest reason.
pub const MAX_DATAGRAM: usize = 2 + 1 + 16 + 8 + 8 + 1 + 128 + 1 + 128 + 1 + 2 + MAX_REASON;

/// One member's ballot on one transition, as sent to the proposer's [`BallotBox`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectBallot {
    /// The transition's [`BallotBox::token`].
    pub token: u128,
    /// The group.
    pub group: String,
    /// The transition's id.
    pub id: u64,
    /// The epoch the transition starts from.
    pub from_epoch: u64,
    /// The voting member.
    pub member: String,
    /// Its ballot (a refusal's reason is at most [`MAX_REASON`] bytes).
    pub ballot: Ballot,
}

/// `s` cut to at most `max` bytes at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl DirectBallot {
    /// The datagram (docs/wire.md §15.4). Names longer than 128 bytes are cut (valid
    /// participants never have them), and so are reasons longer than [`MAX_REASON`].
    pub fn encode(&self) -> Vec<u8> {
        let group = cut(&self.group, 128);
        let member = cut(&self.member, 128);
        let mut out = Vec::with_capacity(40 + group.len() + member.len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.token.to_be_bytes());
        out.extend_from_slice(&self.id.to_be_bytes());
        out.extend_from_slice(&self.from_epoch.to_be_bytes());
        out.push(group.len() as u8);
        out.extend_from_slice(group.as_bytes());
        out.push(member.len() as u8);
        out.extend_from_slice(member.as_bytes());
        match &self.ballot {
            Ballot::Yes => out.push(0),
            Ballot::No(why) => {
                let why = cut(why, MAX_REASON);
                out.push(1);
                out.extend_from_slice(&(why.len() as u16).to_be_bytes());
                out.extend_from_slice(why.as_bytes());
            }
        }
        out
    }

    /// Reads a datagram; [`Error::Ballot`] says what is wrong with one that is not a ballot.
    pub fn decode(b: &[u8]) -> Result<DirectBallot, Error> {
        decode(b).map_err(Error::Ballot)
    }
}

fn decode(b: &[u8]) -> Result<DirectBallot, BallotFault> {
    let mut r = b;
    let mut take = |n: usize| -> Result<&[u8], BallotFault> {
        if r.len() < n {
            return Err(BallotFault::Truncated);
        }
        let (head, rest) = r.split_at(n);
        r = rest;
        Ok(head)
    };
    if take(2)? != MAGIC {
        return Err(BallotFault::Magic);
    }
    let version = take(1)?[0];
    if version != VERSION {
        return Err(BallotFault::Version(version));
    }
    let token = u128::from_be_bytes(take(16)?.try_into().map_err(|_| BallotFault::Truncated)?);
    let id = u64::from_be_bytes(take(8)?.try_into().map_err(|_| BallotFault::Truncated)?);
    let from_epoch = u64::from_be_bytes(take(8)?.try_into().map_err(|_| BallotFault::Truncated)?);
    let mut name = || -> Result<String, BallotFault> {
        let len = usize::from(take(1)?[0]);
        let s = std::str::from_utf8(take(len)?).map_err(|_| BallotFault::Name)?;
        check_name("name", s).map_err(|_| BallotFault::Name)?;
        Ok(s.to_owned())
    };
    let group = name()?;
    let member = name()?;
    let ballot = match take(1)?[0] {
        0 => Ballot::Yes,
        1 => {
            let len = take(2)?;
            let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
            if len > MAX_REASON {
                return Err(BallotFault::Reason);
            }
            let why = std::str::from_utf8(take(len)?).map_err(|_| BallotFault::Reason)?;
            Ballot::No(why.to_owned())
        }
        t => return Err(BallotFault::Tag(t)),
    };
    if !r.is_empty() {
        return Err(BallotFault::Trailing);
    }
    Ok(DirectBallot {
        token,
        group,
        id,
        from_epoch,
        member,
        ballot,
    })
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use proptest::prelude::*;

    use super::*;

    fn name() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9_.:-]{1,128}"
    }

    fn ballot() -> impl Strategy<Value = DirectBallot> {
        (
            any::<u128>(),
            name(),
            any::<u64>(),
            any::<u64>(),
            name(),
            proptest::option::of("\\PC{0,64}"),
        )
            .prop_map(|(token, group, id, from_epoch, member, no)| DirectBallot {
                token,
                group,
                id,
                from_epoch,
                member,
                ballot: no.map_or(Ballot::Yes, |why| {
                    Ballot::No(cut(&why, MAX_REASON).to_owned())
                }),
            })
    }

    proptest! {
        #[test]
        fn every_ballot_round_trips(b in ballot()) {
            let bytes = b.encode();
            prop_assert!(bytes.len() <= MAX_DATAGRAM);
            prop_assert_eq!(DirectBallot::decode(&bytes).unwrap(), b);
        }

        #[test]
        fn any_bytes_decode_to_a_ballot_or_an_error_and_ballots_are_canonical(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            if let Ok(b) = DirectBallot::decode(&bytes) {
                prop_assert_eq!(b.encode(), bytes);
            }
        }

        #[test]
        fn every_strict_prefix_is_truncated(b in ballot(), cut_at in any::<prop::sample::Index>()) {
            let bytes = b.encode();
            let n = cut_at.index(bytes.len());
            prop_assert!(matches!(
                DirectBallot::decode(&bytes[..n]),
                Err(Error::Ballot(BallotFault::Truncated | BallotFault::Magic))
            ));
        }

        #[test]
        fn ballot_boxes_round_trip(token in any::<u128>(), ip in any::<[u8; 4]>(), port in any::<u16>()) {
            let addr = SocketAddr::from((ip, port));
            let b = BallotBox { addr, token };
            prop_assert_eq!(BallotBox::decode(&b.encode()).unwrap(), b);
        }
    }

    #[test]
    fn faults_are_named() {
        let b = DirectBallot {
            token: 7,
            group: "g".into(),
            id: 1,
            from_epoch: 2,
            member: "m".into(),
            ballot: Ballot::No("why".into()),
        };
        let good = b.encode();
        let fault = |bytes: &[u8]| match DirectBallot::decode(bytes) {
            Err(Error::Ballot(f)) => f,
            other => panic!("{other:?}"),
        };
        let mut bad = good.clone();
        bad[0] = b'X';
        assert_eq!(fault(&bad), BallotFault::Magic);
        let mut bad = good.clone();
        bad[2] = 9;
        assert_eq!(fault(&bad), BallotFault::Version(9));
        let mut bad = good.clone();
        bad.push(0);
        assert_eq!(fault(&bad), BallotFault::Trailing);
        // The tag follows the names: 35 header bytes, 1 + 1 for "g", 1 + 1 for "m".
        let mut bad = good.clone();
        bad[39] = 5;
        assert_eq!(fault(&bad), BallotFault::Tag(5));
        let mut bad = good.clone();
        bad[36] = b'/';
        assert_eq!(fault(&bad), BallotFault::Name);
        let mut bad = good;
        bad[42] = 0xff;
        assert_eq!(fault(&bad), BallotFault::Reason);
        // A reason over the limit is cut when encoded, refused when decoded.
        let long = DirectBallot {
            ballot: Ballot::No("é".repeat(200)),
            ..b
        };
        let bytes = long.encode();
        assert!(matches!(
            DirectBallot::decode(&bytes).unwrap().ballot,
            Ballot::No(why) if why.len() == MAX_REASON
        ));
        let mut over = bytes[..40].to_vec();
        over.extend_from_slice(&300u16.to_be_bytes());
        over.extend(std::iter::repeat_n(b'a', 300));
        assert_eq!(fault(&over), BallotFault::Reason);
        assert!(BallotBox::decode("00@1.2.3.4:5").is_err());
        assert!(BallotBox::decode(&format!("{:032x}@nowhere", 1u128)).is_err());
    }
}
