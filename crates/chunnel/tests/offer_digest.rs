//! Offer digests (`offers_digest`, which a client uses to reuse its encoded hello) name their
//! offers: over a family of trees, equal digests mean equal offers.

use chunnel::negotiate::{Capability, Negotiate, Offers, PickReader, StackOption, offers_digest};
use chunnel::{Error, Identity, select, stack};

/// A leaf whose capability label and availability the test sets.
#[derive(Clone)]
struct Leaf {
    id: &'static str,
    label: &'static str,
    up: bool,
}

impl Negotiate for Leaf {
    fn id(&self) -> &'static str {
        self.id
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::exact("serialize", [self.label])]
    }
    fn check_available(&self) -> Result<(), Error> {
        if self.up {
            Ok(())
        } else {
            Err(Error::BadPick { what: "down" })
        }
    }
}

fn leaf(id: &'static str, label: &'static str, up: bool) -> Leaf {
    Leaf { id, label, up }
}

/// The default digest, from the offers themselves (as a tree without its own feed).
struct ByOffers<'a>(&'a dyn Offers);

impl Offers for ByOffers<'_> {
    fn offers(&self) -> Vec<StackOption> {
        self.0.offers()
    }
    fn available(&self) -> Result<(), Error> {
        self.0.available()
    }
    fn apply_pick(&mut self, _: &mut PickReader<'_>) -> Result<(), Error> {
        Ok(())
    }
}

/// Over a family of trees (leaves up or down, labels, nesting, stacks, the identity),
/// two trees with the same digest have the same offers (equal offers may still differ in
/// digest: `stack![a, Identity]` offers what `a` does); the default digest, made from
/// the offers, is equal exactly when they are.
#[test]
fn offer_digests_name_their_offers() {
    let (a, a2, a_down) = (
        leaf("a", "json", true),
        leaf("a", "bin", true),
        leaf("a", "json", false),
    );
    let (b, c) = (leaf("b", "json", true), leaf("c", "json", true));
    let trees: Vec<(&str, Box<dyn Offers>)> = vec![
        ("a", Box::new(a.clone())),
        ("a2", Box::new(a2.clone())),
        ("a_down", Box::new(a_down.clone())),
        ("identity", Box::new(Identity)),
        ("sel(a,b)", Box::new(select(a.clone(), b.clone()))),
        ("sel(b,a)", Box::new(select(b.clone(), a.clone()))),
        ("sel(a2,b)", Box::new(select(a2.clone(), b.clone()))),
        ("sel(a_down,b)", Box::new(select(a_down.clone(), b.clone()))),
        (
            "sel(a,sel(b,c))",
            Box::new(select(a.clone(), select(b.clone(), c.clone()))),
        ),
        (
            "sel(sel(a,b),c)",
            Box::new(select(select(a.clone(), b.clone()), c.clone())),
        ),
        ("sel(a,identity)", Box::new(select(a.clone(), Identity))),
        ("stack(a,b)", Box::new(stack![a.clone(), b.clone()])),
        ("stack(b,a)", Box::new(stack![b.clone(), a.clone()])),
        (
            "stack(sel(a,b),c)",
            Box::new(stack![select(a.clone(), b.clone()), c.clone()]),
        ),
        ("stack(a,identity)", Box::new(stack![a.clone(), Identity])),
        ("same sel(a,b)", Box::new(select(a.clone(), b.clone()))),
    ];
    for (n1, t1) in &trees {
        let d1 = offers_digest(t1.as_ref());
        for (n2, t2) in &trees {
            let same_offers = t1.offers() == t2.offers();
            let d2 = offers_digest(t2.as_ref());
            // Sound: a digest names its offers (a client reusing its hello on an equal
            // digest sends what it would have built).
            assert!(
                d1 != d2 || same_offers,
                "{n1} vs {n2}: same digest, other offers"
            );
            let default_same =
                offers_digest(&ByOffers(t1.as_ref())) == offers_digest(&ByOffers(t2.as_ref()));
            assert_eq!(default_same, same_offers, "{n1} vs {n2}: default digest");
        }
    }
    // The same tree built twice has one digest (the reuse happens at all).
    assert_eq!(
        offers_digest(&select(a.clone(), b.clone())),
        offers_digest(&select(a.clone(), b.clone()))
    );
}
