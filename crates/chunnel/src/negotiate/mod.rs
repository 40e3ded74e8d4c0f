//! Negotiation metadata: what each Chunnel tells the negotiator about itself, and how a stack
//! of Chunnels and `Select`s flattens into the options a peer can pick from.
//!
//! The negotiation *protocol* lives elsewhere; this module holds the types it works on:
//!
//! * [`Negotiate`] is implemented by every leaf Chunnel: a stable id, its [`Capability`]s and
//!   an availability check.
//! * [`Offers`] is implemented by leaves (through [`Negotiate`]), by [`crate::Stack`] and by
//!   [`crate::Select`]: it enumerates every concrete stack a tree of selects allows
//!   ([`StackOption`]), in preference order, and applies a [`Pick`] — the compact nonce naming
//!   the chosen branch of every select on the chosen path.

use std::borrow::Cow;
use std::hash::{Hash, Hasher};

use crate::Error;
pub mod offer_tree;
pub use offer_tree::OfferTree;

pub(crate) mod types;
pub use types::{
    Capability, Choice, ChunnelInfo, End, Match, Mismatch, Pick, PickReader, Rule, StackOption,
    check_compatible, choose,
};

/// What a leaf Chunnel tells the negotiator about itself.
///
/// Every Chunnel implements this; the defaults describe a Chunnel with no capabilities that is
/// always available.
pub trait Negotiate {
    /// A stable, versioned identifier such as `"chunnel/noop/1"`.
    fn id(&self) -> &'static str;

    /// The capabilities the negotiator must match against the peer.
    fn capabilities(&self) -> Vec<Capability> {
        Vec::new()
    }

    /// Whether this Chunnel can work on this host right now (privileges, hardware, a
    /// co-located peer). A [`crate::Select`] skips a branch whose check fails.
    fn check_available(&self) -> Result<(), Error> {
        Ok(())
    }
}

/// A tree of Chunnels that can describe its concrete options and be told which one to build.
///
/// Implemented for every [`Negotiate`] leaf, for [`crate::Stack`] and for [`crate::Select`].
pub trait Offers {
    /// Every concrete stack this tree allows and this host can run, most preferred first
    /// (select branches whose availability check fails are left out).
    fn offers(&self) -> Vec<StackOption>;

    /// The structure of [`Offers::offers`], in space linear in the tree: what a negotiating
    /// client sends and a server searches ([`crate::offer_tree::choose_tree`]) without
    /// enumerating the options. Its options are exactly [`Offers::offers`].
    ///
    /// The default lists the offers themselves (correct for any tree, but as large as the
    /// product of its selects); leaves, [`crate::Select`], [`crate::Stack`] and the
    /// combinators of this crate describe their structure.
    fn offer_tree(&self) -> OfferTree {
        OfferTree::Options(self.offers())
    }

    /// Whether at least one concrete stack of this tree can work on this host.
    fn available(&self) -> Result<(), Error>;

    /// Fixes every select on the path named by `pick`. `connect_wrap` then builds exactly
    /// that stack.
    fn apply_pick(&mut self, pick: &mut PickReader<'_>) -> Result<(), Error>;

    /// Feeds `h` what [`Offers::offers`] is made of, without making the offers: trees that
    /// feed the same bytes offer the same options. A negotiating client keeps the digest
    /// with the hello it encoded, and reuses that hello for as long as its stack's digest
    /// is unchanged (a reconnect then builds no offer list).
    ///
    /// The default feeds the offers themselves (correct for any tree, but it makes them);
    /// leaves, [`crate::Select`] and [`crate::Stack`] feed their parts. What is fed must be
    /// self-delimiting, so that the feeds of a combinator's parts cannot run into each other.
    fn hash_offers(&self, h: &mut dyn Hasher) {
        let offers = self.offers();
        h.write_u8(DIGEST_OFFERS);
        h.write_usize(offers.len());
        for o in &offers {
            o.hash(&mut &mut *h);
        }
    }

    /// Applies a whole pick. The pick is checked against [`Offers::offer_tree`] first, so a
    /// pick that names no offered option changes nothing (no select is fixed, no leaf is
    /// told).
    fn apply(&mut self, pick: &Pick) -> Result<(), Error> {
        if self.offer_tree().option(pick).is_none() {
            return Err(Error::BadPick {
                what: "the pick names no option this stack offers",
            });
        }
        let mut r = pick.reader();
        self.apply_pick(&mut r)?;
        r.finish()
    }
}

/// The first byte of each kind of [`Offers::hash_offers`] feed.
pub(crate) const DIGEST_OFFERS: u8 = 0;
pub(crate) const DIGEST_UNAVAILABLE: u8 = 1;
pub(crate) const DIGEST_LEAF: u8 = 2;
pub(crate) const DIGEST_NO_LAYER: u8 = 3;
pub(crate) const DIGEST_SELECT: u8 = 4;
pub(crate) const DIGEST_STACK: u8 = 5;

/// The [`Offers::hash_offers`] digest of a tree, as one number: 64-bit FNV-1a, the same in
/// every process. The input is the local stack's own description (not a peer's), so a
/// simple, fast hash serves; a reconnect computes it once.
pub fn offers_digest<O: Offers + ?Sized>(tree: &O) -> u64 {
    let mut h = Fnv1a(0xcbf2_9ce4_8422_2325);
    tree.hash_offers(&mut h);
    h.finish()
}

/// 64-bit FNV-1a.
struct Fnv1a(u64);

impl Hasher for Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl<T: Negotiate> Offers for T {
    fn hash_offers(&self, h: &mut dyn Hasher) {
        // What `offers` below makes: nothing, or one option of this one Chunnel.
        if self.check_available().is_err() {
            h.write_u8(DIGEST_UNAVAILABLE);
            return;
        }
        h.write_u8(DIGEST_LEAF);
        self.id().hash(&mut &mut *h);
        self.capabilities().hash(&mut &mut *h);
    }

    fn offer_tree(&self) -> OfferTree {
        if self.check_available().is_err() {
            return OfferTree::Options(Vec::new());
        }
        OfferTree::Leaf(ChunnelInfo {
            id: Cow::Borrowed(self.id()),
            capabilities: self.capabilities(),
        })
    }

    fn offers(&self) -> Vec<StackOption> {
        if self.check_available().is_err() {
            return Vec::new();
        }
        vec![StackOption {
            chunnels: vec![ChunnelInfo {
                id: Cow::Borrowed(self.id()),
                capabilities: self.capabilities(),
            }],
            pick: Pick::default(),
        }]
    }

    fn available(&self) -> Result<(), Error> {
        self.check_available()
    }

    fn apply_pick(&mut self, _pick: &mut PickReader<'_>) -> Result<(), Error> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(p: &Pick) -> u64 {
        use std::hash::{BuildHasher, BuildHasherDefault};
        BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(p)
    }

    #[test]
    fn picks_compare_by_decisions_inline_or_shared() {
        for n in [0, 1, Pick::INLINE - 1, Pick::INLINE, Pick::INLINE + 1, 40] {
            let v: Vec<u8> = (0..n).map(|i| (i % 2) as u8).collect();
            let a = Pick::from_branches(v.clone());
            assert_eq!(a.branches(), &v[..]);
            let half = n / 2;
            let b = Pick::concat(&[&v[..half], &v[half..]]);
            assert_eq!(a, b);
            assert_eq!(hash(&a), hash(&b));
            assert_eq!(a.clone().branches(), &v[..]);
            let mut r = a.reader();
            for &d in &v {
                assert_eq!(r.next_branch().unwrap(), d);
            }
            r.finish().unwrap();
            if n > 0 {
                let mut w = v.clone();
                w[n - 1] ^= 1;
                assert_ne!(a, Pick::from_branches(w));
            }
        }
        assert_eq!(Pick::default().branches(), &[] as &[u8]);
        assert_ne!(Pick::from_slice(&[0]), Pick::from_slice(&[0, 0]));
    }
}
